"""The bare Triton kernel: forward block-sparse flash attention (online softmax in base 2).

One program computes BLOCK_M query rows of one (batch, query head). It visits the key blocks its
query block lists in the layout: full blocks first (no element mask), then partial blocks (the
MaskSpec predicate is evaluated in registers, ANDed with the layout's element masks: document
ids, key padding range, bit-packed mask), in two loops or, with ONE_LOOP, in one. Each element
mask is behind a constexpr flag (HAS_DOC, HAS_PAD, HAS_BITS) and its tensors are passed as None
when absent, so a layout without them compiles to the same code as before they existed. With
SELECT_LOADED (set on AMD) reads a tile's block index from both block lists and selects the
value, where Triton 3.6's AMD backend aborts on a load through a selected pointer. Launch it
through ``kernels.attention``.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _round_to_bf16(x):
    # Interpreter mode only: Triton's interpreter converts fp32 -> bf16 by truncation, not
    # round-to-nearest-even (parity/NUMERICS.md, measured on 3.6.0 and 3.9.0). Round with integer
    # operations instead and keep the value in fp32: add 0x7FFF plus the lowest kept bit, then
    # clear the 16 low bits. Inputs are finite probabilities in [0, 1], so no NaN handling.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = (bits >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_rows(ptrs, cols, offs_d, seq_k, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    # One K or V tile through its [BLOCK_N, BLOCK_D] pointers; cols: [BLOCK_N] key positions.
    if MASKED:
        # Partial blocks may run past seq_k (the layout makes the tail block partial).
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=cols[:, None] < seq_k, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(cols[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        # Full blocks lie inside seq_k (BlockLayout.validate enforces it).
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile  # [BLOCK_N, BLOCK_D]


@triton.jit
def _load_kv_tiles(k_ptrs0, v_ptrs0, k_desc, v_desc, kv_row0, start_n, cols, offs_d, stride_kn, stride_vn, seq_k,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                   EMULATE_BF16: tl.constexpr, USE_TMA: tl.constexpr):
    # The K and V tiles [BLOCK_N, BLOCK_D] at key position start_n. The per-element pointer
    # tensors are built once per program; a tile is a scalar offset. (Not two _load_kv_tile
    # calls: both pointers before either load is the order the measured sm_80 and gfx942 code has.)
    if USE_TMA:
        # NVIDIA Hopper: the tensor-memory accelerator copies the tile; rows past seq_k are
        # zero-filled by the descriptor's bounds, as the masked pointer loads are. kv_row0: the
        # (batch, kv head)'s first row in a host-made descriptor over all rows, else 0.
        k = k_desc.load([kv_row0 + start_n, 0])
        v = v_desc.load([kv_row0 + start_n, 0])
    else:
        k_ptrs = k_ptrs0 + start_n.to(tl.int64) * stride_kn  # [BLOCK_N, BLOCK_D]
        v_ptrs = v_ptrs0 + start_n.to(tl.int64) * stride_vn  # [BLOCK_N, BLOCK_D]
        k = _load_rows(k_ptrs, cols, offs_d, seq_k, HEAD_DIM, BLOCK_D, MASKED)
        v = _load_rows(v_ptrs, cols, offs_d, seq_k, HEAD_DIM, BLOCK_D, MASKED)
    if EMULATE_BF16:
        # Interpreter mode only: its bf16 tl.dot multiplies raw bit patterns (parity/NUMERICS.md).
        # Products of two bf16 values are exact in fp32, so an fp32 dot on upcast tiles is the
        # same mathematics as a bf16 matrix unit accumulating in fp32.
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _apply_mask(qk, start_n, cols, offs_m, seq_q, seq_k, causal_offset, window, sink_tokens,
                q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs,
                IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOC: tl.constexpr,
                HAS_PAD: tl.constexpr, HAS_BITS: tl.constexpr):
    # The partial block's element mask, evaluated in registers: the MaskSpec predicate AND the
    # layout's element masks (kernels/layout.py); hidden scores -> -inf.
    # qk: [BLOCK_M, BLOCK_N]; offs_m: [BLOCK_M] query rows; cols: [BLOCK_N] key positions.
    visible = cols[None, :] < seq_k  # [1, BLOCK_N], broadcast to [BLOCK_M, BLOCK_N] below
    if IS_CAUSAL:
        visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
    if HAS_WINDOW:
        in_window = cols[None, :] > offs_m[:, None] + causal_offset - window
        visible = visible & (in_window | (cols[None, :] < sink_tokens))
    if HAS_DOC:
        # q_doc: this program's [BLOCK_M] query document ids, loaded once; keys past seq_k are
        # already hidden, so their id is irrelevant.
        k_doc = tl.load(k_doc_ptr + cols, mask=cols < seq_k, other=-1)  # [BLOCK_N]
        visible = visible & (q_doc[:, None] == k_doc[None, :])
    if HAS_PAD:
        visible = visible & (cols[None, :] >= k_lo) & (cols[None, :] < k_hi)
    if HAS_BITS:
        # bits_ptrs: [BLOCK_M, 1] pointers to each query row's words. A tile of BLOCK_N keys
        # covers ceil(BLOCK_N / 32) words: load each as a [BLOCK_M, 1] column and select it per
        # key, instead of a [BLOCK_M, BLOCK_N] gather (its 64-bit pointers spilled 132
        # registers at 128x64 on sm_90, compile-only). A word index past the row's last word is
        # clamped to it: its keys are past seq_k and hidden above. The shift is arithmetic, but
        # bit (k % 32) still ends lowest.
        first_word = start_n // 32
        last_word = (seq_k - 1) // 32
        row_in = offs_m[:, None] < seq_q
        word = tl.zeros(qk.shape, dtype=tl.int32)  # [BLOCK_M, BLOCK_N]
        for j in tl.static_range((qk.shape[1] + 31) // 32):
            word_j = tl.load(bits_ptrs + tl.minimum(first_word + j, last_word), mask=row_in, other=0)  # [BLOCK_M, 1]
            word = tl.where((cols[None, :] // 32) == first_word + j, word_j, word)
        visible = visible & (((word >> (cols[None, :] % 32)) & 1) != 0)
    return tl.where(visible, qk, float("-inf"))  # [BLOCK_M, BLOCK_N]


@triton.jit
def _mask_scores(qk, partial, start_n, cols, offs_m, seq_q, seq_k, causal_offset, window, sink_tokens,
                 q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs, MASKED: tl.constexpr, RUNTIME_MASK: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PAD: tl.constexpr,
                 HAS_BITS: tl.constexpr):
    # The element mask of a partial tile: always (MASKED), where the runtime ``partial`` says so
    # (RUNTIME_MASK: one loop over full and partial tiles), or never (a full tile).
    if MASKED:
        qk = _apply_mask(qk, start_n, cols, offs_m, seq_q, seq_k, causal_offset, window, sink_tokens,
                         q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs,
                         IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_DOC=HAS_DOC, HAS_PAD=HAS_PAD,
                         HAS_BITS=HAS_BITS)
    elif RUNTIME_MASK:
        if partial:
            qk = _apply_mask(qk, start_n, cols, offs_m, seq_q, seq_k, causal_offset, window, sink_tokens,
                             q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs,
                             IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_DOC=HAS_DOC, HAS_PAD=HAS_PAD,
                             HAS_BITS=HAS_BITS)
    return qk


@triton.jit
def _eager_update(qk, m_i, l_i, qk_scale, MAY_HIDE: tl.constexpr):
    # The online softmax's step for one tile's raw scores qk [BLOCK_M, BLOCK_N]: the new running
    # max m_new, p = exp2(qk * scale - m_new), the factor alpha that rescales what was summed
    # before, and the new running sum. Returns (p fp32, alpha, l_i, m_new).
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
    if MAY_HIDE:
        # A row that has seen no visible key keeps m = -inf; subtract 0 instead so that
        # exp2(-inf - m) is 0 rather than exp2(-inf + inf) = NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(qk * qk_scale - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.math.exp2(m_i - m_sub)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, 1)  # [BLOCK_M]
    return p, alpha, l_i, m_new


@triton.jit
def _p_operand(p, dtype, EMULATE_BF16: tl.constexpr):
    # p as the P @ V product's operand: V's element type ``dtype`` (16-bit, or fp32 for fp32), or
    # under the interpreter fp32 rounded as bf16 would be (its own cast truncates).
    if EMULATE_BF16:
        p = _round_to_bf16(p)
    else:
        p = p.to(dtype)
    return p


@triton.jit
def _attend_block(
    acc, l_i, m_i, q, k_ptrs0, v_ptrs0, k_desc, v_desc, kv_row0, start_n, offs_m, offs_n, offs_d,
    stride_kn, stride_vn,
    seq_q, seq_k, causal_offset, window, sink_tokens, q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs, qk_scale,
    partial, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
    RUNTIME_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_DOC: tl.constexpr, HAS_PAD: tl.constexpr, HAS_BITS: tl.constexpr,
    EMULATE_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    # MASKED (constexpr): this block is partial. RUNTIME_MASK (constexpr): the caller's single
    # loop visits full and partial blocks alike and ``partial`` (a runtime scalar) says which;
    # loads are then bounds-masked always (a no-op for full blocks) and only the element mask
    # sits behind the branch, so the loads stay where the software pipeliner can overlap them.
    # acc: [BLOCK_M, BLOCK_D] fp32; l_i, m_i: [BLOCK_M] fp32; q: [BLOCK_M, BLOCK_D].
    cols = start_n + offs_n  # [BLOCK_N]
    k, v = _load_kv_tiles(k_ptrs0, v_ptrs0, k_desc, v_desc, kv_row0, start_n, cols, offs_d, stride_kn, stride_vn, seq_k,
                          HEAD_DIM, BLOCK_D, MASKED or RUNTIME_MASK, EMULATE_BF16, USE_TMA)
    # Raw scores; the scale is folded into the exponent's FMA below (qk * scale - m), one
    # operation per element instead of a multiply and a subtract (sm_scale > 0, checked by the
    # launcher, so the row max commutes with the scaling).
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    qk = _mask_scores(qk, partial, start_n, cols, offs_m, seq_q, seq_k, causal_offset, window, sink_tokens,
                      q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs, MASKED, RUNTIME_MASK,
                      IS_CAUSAL, HAS_WINDOW, HAS_DOC, HAS_PAD, HAS_BITS)
    p, alpha, l_i, m_new = _eager_update(qk, m_i, l_i, qk_scale, MASKED or RUNTIME_MASK)
    acc = acc * alpha[:, None]  # [BLOCK_M, BLOCK_D]
    p = _p_operand(p, v.dtype, EMULATE_BF16)
    # acc += p @ v: [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_D] -> [BLOCK_M, BLOCK_D]
    acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _tile_at(t, full_count, full_idx_base, part_idx_base, SUB: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
             BLOCK_N: tl.constexpr, SELECT_LOADED: tl.constexpr):
    # The one loop's t-th key tile: full blocks first, then partial ones (the order of the two
    # loops), SUB tiles per layout block. Returns (its first key position, whether it is partial).
    blk = t // SUB
    partial = blk >= full_count
    if SELECT_LOADED:
        # AMD: read the block index from both lists (the other masked off) and select the value.
        # Triton 3.6's conversion to AMD buffer loads aborts on a load through a selected pointer
        # (an AxisInfo assertion, compile-only, kernels/BENCHMARK.md); 3.9 compiles either form.
        idx = tl.where(partial, tl.load(part_idx_base + (blk - full_count), mask=partial, other=0),
                       tl.load(full_idx_base + blk, mask=blk < full_count, other=0))
    else:
        idx = tl.load(tl.where(partial, part_idx_base + (blk - full_count), full_idx_base + blk))
    return idx * SPARSE_BLOCK_N + (t % SUB) * BLOCK_N, partial


@triton.jit
def _element_mask_state(off_b, offs_m, rows_in, bits_head, seq_k, Q_DOC, K_DOC, stride_qdb, stride_kdb,
                        K_START, K_END, stride_pb, MASK_BITS, stride_mbb, stride_mbh, stride_mbm,
                        HAS_DOC: tl.constexpr, HAS_PAD: tl.constexpr, HAS_BITS: tl.constexpr):
    # One program's element-mask state for _apply_mask, shared by the prefill and decode kernels.
    # Absent masks are None and their branches are not compiled; present ones broadcast over batch
    # and heads through zero strides. offs_m: [BLOCK_M] query positions; rows_in: [BLOCK_M] which
    # of them to load document ids for; bits_head: the query head of the rows' mask words (a
    # scalar, or [BLOCK_M, 1] where the tile's rows span heads).
    # (A jit function cannot return None: an absent mask's pointer is returned as an unused 0.)
    q_doc = 0
    k_doc_ptr = 0
    k_lo = 0
    k_hi = seq_k
    bits_ptrs = 0
    if HAS_DOC:
        q_doc = tl.load(Q_DOC + off_b * stride_qdb + offs_m, mask=rows_in, other=-1)  # [BLOCK_M]
        k_doc_ptr = K_DOC + off_b * stride_kdb
    if HAS_PAD:
        k_lo = tl.load(K_START + off_b * stride_pb)
        k_hi = tl.load(K_END + off_b * stride_pb)
    if HAS_BITS:
        # [BLOCK_M, 1]: each query row's first mask word
        bits_ptrs = (MASK_BITS + off_b.to(tl.int64) * stride_mbb + bits_head.to(tl.int64) * stride_mbh
                     + offs_m[:, None].to(tl.int64) * stride_mbm)
    return q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs


@triton.jit
def block_sparse_attn_fwd(
    Q, K, V, Out, Lse,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,
    qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh,
    stride_cb, stride_ch, stride_cm,
    stride_ib, stride_ih, stride_im,
    stride_fcb, stride_fch, stride_fcm,
    stride_fib, stride_fih, stride_fim,
    heads_q, gqa_group, seq_q, seq_k,
    causal_offset, window, sink_tokens,
    Q_DOC, K_DOC, stride_qdb, stride_kdb,
    K_START, K_END, stride_pb,
    MASK_BITS, stride_mbb, stride_mbh, stride_mbm,
    Q_ORDER,
    K_DESC, V_DESC,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_DOC: tl.constexpr, HAS_PAD: tl.constexpr, HAS_BITS: tl.constexpr, HAS_ORDER: tl.constexpr,
    RETURN_LSE: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ONE_LOOP: tl.constexpr, SELECT_LOADED: tl.constexpr, HOST_TMA: tl.constexpr,
):
    # 1-D grid of B * Hq * num_m_tiles programs. The query tiles of one (batch, head) are
    # adjacent, so the programs resident at once share a few heads' K/V, which stay in L2 (on the
    # H200 this beat heads-fastest order by 5-27%, kernels/BENCHMARK.md). Within a head the
    # tiles run last to first: the heaviest causal tiles start first (load balance). Where work
    # is not monotone in the tile index (documents, arbitrary masks), Q_ORDER lists the tiles
    # heaviest first instead (kernels.layout.BlockLayout.tile_order).
    num_m_tiles = tl.cdiv(seq_q, BLOCK_M)
    pid = tl.program_id(0)
    off_bh = pid // num_m_tiles
    if HAS_ORDER:
        start_m = tl.load(Q_ORDER + pid % num_m_tiles)
    else:
        start_m = num_m_tiles - 1 - pid % num_m_tiles
    off_b = off_bh // heads_q
    off_h = off_bh % heads_q
    off_hkv = off_h // gqa_group
    q_block = (start_m * BLOCK_M) // SPARSE_BLOCK_M

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N] key offsets within a tile
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D] head-dim lanes (BLOCK_D >= HEAD_DIM, a power of 2)

    # [BLOCK_M, BLOCK_D]
    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
              + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    if BLOCK_D == HEAD_DIM:
        q = tl.load(q_ptrs, mask=offs_m[:, None] < seq_q, other=0.0)  # [BLOCK_M, BLOCK_D]
    else:
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if EMULATE_BF16:
        q = q.to(tl.float32)
    # [BLOCK_N, BLOCK_D] pointers to the first key tile's rows; each tile adds a scalar offset.
    k_ptrs0 = (K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
               + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
    v_ptrs0 = (V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
               + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)
    if USE_TMA and HOST_TMA:
        # Descriptors the launcher made once per call over all [B * Hkv * seq_k, D] rows of K and
        # V (launch.host_tma_fits: seq_k is a multiple of BLOCK_N, so no tile crosses a head,
        # and the rows are evenly strided); this program's rows start at kv_row0.
        k_desc = K_DESC
        v_desc = V_DESC
        kv_row0 = (off_b * (heads_q // gqa_group) + off_hkv) * seq_k
    elif USE_TMA:
        # Device-side descriptors over this (batch, kv head)'s [seq_k, D] slice (the launcher
        # checks contiguity and 16-byte alignment and installs Triton's scratch allocator).
        k_desc = tl.make_tensor_descriptor(
            K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh,
            shape=[seq_k, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(
            V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh,
            shape=[seq_k, HEAD_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
        kv_row0 = 0
    else:
        k_desc = k_ptrs0
        v_desc = v_ptrs0
        kv_row0 = 0

    # Element masks (partial blocks only).
    q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs = _element_mask_state(
        off_b, offs_m, offs_m < seq_q, off_h, seq_k, Q_DOC, K_DOC, stride_qdb, stride_kdb, K_START, K_END,
        stride_pb, MASK_BITS, stride_mbb, stride_mbh, stride_mbm, HAS_DOC, HAS_PAD, HAS_BITS)

    # Online softmax state, in log2 units of the scaled scores.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M] running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running row sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D] unnormalized output

    # Layout tensors broadcast over batch/head through zero strides. Each layout block is
    # SUB = SPARSE_BLOCK_N // BLOCK_N tiles; the loops run over tiles (one flat loop per block
    # list), so that the software pipeliner sees one tile per iteration whatever BLOCK_N is.
    SUB: tl.constexpr = SPARSE_BLOCK_N // BLOCK_N
    full_count = tl.load(FULL_NUM + off_b * stride_fcb + off_h * stride_fch + q_block * stride_fcm)
    full_idx_base = FULL_IDX + off_b * stride_fib + off_h * stride_fih + q_block * stride_fim
    part_count = tl.load(KV_NUM + off_b * stride_cb + off_h * stride_ch + q_block * stride_cm)
    part_idx_base = KV_IDX + off_b * stride_ib + off_h * stride_ih + q_block * stride_im
    if ONE_LOOP:
        # Full blocks then partial blocks (the same order as the two loops below) in one loop:
        # one pipeline prologue and drain per query tile instead of two.
        for t in range((full_count + part_count) * SUB):
            start_n, partial = _tile_at(t, full_count, full_idx_base, part_idx_base, SUB, SPARSE_BLOCK_N, BLOCK_N,
                                        SELECT_LOADED)
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_ptrs0, v_ptrs0, k_desc, v_desc, kv_row0, start_n, offs_m, offs_n, offs_d,
                stride_kn, stride_vn, seq_q, seq_k, causal_offset, window, sink_tokens,
                q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs, qk_scale,
                # full and partial blocks alike; the runtime ``partial`` picks the element mask
                partial=partial, MASKED=False, RUNTIME_MASK=True,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_DOC=HAS_DOC, HAS_PAD=HAS_PAD, HAS_BITS=HAS_BITS,
                EMULATE_BF16=EMULATE_BF16, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
            )
    else:
        for t in range(full_count * SUB):
            start_n = tl.load(full_idx_base + t // SUB) * SPARSE_BLOCK_N + (t % SUB) * BLOCK_N
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_ptrs0, v_ptrs0, k_desc, v_desc, kv_row0, start_n, offs_m, offs_n, offs_d,
                stride_kn, stride_vn, seq_q, seq_k, causal_offset, window, sink_tokens,
                q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs, qk_scale,
                # full blocks: no element mask, no bounds on the loads
                partial=False, MASKED=False, RUNTIME_MASK=False,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_DOC=HAS_DOC, HAS_PAD=HAS_PAD, HAS_BITS=HAS_BITS,
                EMULATE_BF16=EMULATE_BF16, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
            )
        for t in range(part_count * SUB):
            start_n = tl.load(part_idx_base + t // SUB) * SPARSE_BLOCK_N + (t % SUB) * BLOCK_N
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_ptrs0, v_ptrs0, k_desc, v_desc, kv_row0, start_n, offs_m, offs_n, offs_d,
                stride_kn, stride_vn, seq_q, seq_k, causal_offset, window, sink_tokens,
                q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs, qk_scale,
                # partial blocks: element mask and bounds-checked loads, chosen at compile time
                partial=True, MASKED=True, RUNTIME_MASK=False,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_DOC=HAS_DOC, HAS_PAD=HAS_PAD, HAS_BITS=HAS_BITS,
                EMULATE_BF16=EMULATE_BF16, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
            )

    # Rows that saw no key have l = 0 and acc = 0: output 0, LSE -inf (the project's convention).
    empty = l_i == 0.0  # [BLOCK_M]
    l_safe = tl.where(empty, 1.0, l_i)  # [BLOCK_M]
    out = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    o_ptrs = (Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    if BLOCK_D == HEAD_DIM:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < seq_q)
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM))
    if RETURN_LSE:
        # m is in log2 units of the scaled scores: natural-log LSE = (m + log2 l) * ln 2.
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # [BLOCK_M]
        l_ptrs = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m
        tl.store(l_ptrs, lse, mask=offs_m < seq_q)


# ---- decode: split-KV (flash-decoding) for short query lengths ----------------------------------
@triton.jit
def _group_rows(pid_bg, head_groups, seq_q, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    # The tile of one (batch, head group) program, shared by the split kernel and the combine:
    # row r is query head head0 + r // seq_q at position r % seq_q. Returns (off_b, off_g, rows,
    # row_ok, row_head, offs_m), the last four [BLOCK_M].
    off_b = pid_bg // head_groups
    off_g = pid_bg % head_groups
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M] tile rows
    row_ok = rows < GROUP * seq_q  # rows past the group's are padding (tl.dot needs M >= 16)
    row_head = off_g * GROUP + tl.minimum(rows // seq_q, GROUP - 1)  # [BLOCK_M], clamped in range
    offs_m = rows % seq_q  # [BLOCK_M] query positions, what the mask predicates see
    return off_b, off_g, rows, row_ok, row_head, offs_m


@triton.jit
def _store_rows(Out, Lse, off_b, row_head, offs_m, offs_d, out, lse2, store_ok, row_ok,
                stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, RETURN_LSE: tl.constexpr):
    # The final output tile [BLOCK_M, BLOCK_D] (fp32, cast to Out's type) and, with RETURN_LSE,
    # the natural-log LSE from lse2 [BLOCK_M], base 2 of the scaled scores (-inf: no key seen).
    o_ptrs = (Out + off_b.to(tl.int64) * stride_ob + row_head[:, None].to(tl.int64) * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=store_ok)
    if RETURN_LSE:
        l_ptrs = Lse + off_b.to(tl.int64) * stride_lb + row_head.to(tl.int64) * stride_lh + offs_m
        tl.store(l_ptrs, lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def _merge_splits(po_base, pl_base, stride_pos, stride_pls, tile_offs, rows, store_ok, row_ok, num_splits,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MERGE_UNROLL: tl.constexpr, MERGE_SPLITS: tl.constexpr,
                  BYPASS_L1: tl.constexpr):
    # The splits' partial outputs of one group's rows merged: the softmax-weighted mean, weights
    # 2^(lse_s - max lse). Splits that saw no key have lse -inf, weight 0; a row no split saw
    # gives 0 and lse -inf. One program merges a group's splits, so the reads must be in flight
    # together, not one L2 round trip per split: the loop body reads MERGE_UNROLL splits'
    # [BLOCK_M, BLOCK_D] tiles, unrolled (independent loads; ptxas still places some after the
    # previous split's sums, whatever their order in the source: the sm_90 SASS of the combine
    # kernel at 66 splits waits on loaded data 4 times per iteration with 4-row tiles).
    # A [chunk, BLOCK_M, BLOCK_D] tile per iteration instead, reduced over its first axis, made
    # a B1/4k decode call 94 us on an H100 (10 with the old per-row combine kernel): every
    # iteration's cross-warp reduction went through shared memory behind four barriers. The sums
    # run split by split in index order, so the fused path and the combine kernel, which both call
    # this, give the same bits, run after run. BYPASS_L1: the partials were written by other
    # programs of this launch, on other multiprocessors; the loads go to L2 (``.cg``), never to a
    # line this one's L1 may hold from before (the arrival counter's acquire orders them after the
    # writes). po_base, pl_base: the group's split 0; tile_offs: [BLOCK_M, BLOCK_D] offsets within
    # a split. Returns (out [BLOCK_M, BLOCK_D] fp32, lse2 [BLOCK_M], base 2).
    if MERGE_SPLITS > 0:
        # Pass 1 (the rows' max LSE) in one load: every split's LSEs as one [MERGE_SPLITS, BLOCK_M]
        # tile (MERGE_SPLITS >= num_splits, a power of two), reduced over the splits once. A max
        # is exact in any order, so this gives the loop's bits with one L2 round trip instead of
        # num_splits / MERGE_UNROLL dependent ones; its one cross-warp reduction is outside any loop.
        splits = tl.arange(0, MERGE_SPLITS)
        tile_ok = (splits[:, None] < num_splits) & row_ok[None, :]  # [MERGE_SPLITS, BLOCK_M]
        tile_ptrs = pl_base + splits[:, None] * stride_pls + rows[None, :]
        if BYPASS_L1:
            lse_all = tl.load(tile_ptrs, mask=tile_ok, other=float("-inf"), cache_modifier=".cg")
        else:
            lse_all = tl.load(tile_ptrs, mask=tile_ok, other=float("-inf"))
        m = tl.max(lse_all, axis=0)  # [BLOCK_M]
    else:
        # More splits than one tile holds (``decode.merge_splits``): the max split by split.
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s0 in range(0, num_splits, MERGE_UNROLL):
            for i in tl.static_range(MERGE_UNROLL):
                # a tensor, not a scalar: under the interpreter a Python bool in a mask breaks it
                l_ok = row_ok & (tl.zeros([BLOCK_M], dtype=tl.int32) + (s0 + i) < num_splits)
                if BYPASS_L1:
                    lse_s = tl.load(pl_base + (s0 + i) * stride_pls + rows, mask=l_ok, other=float("-inf"),
                                    cache_modifier=".cg")
                else:
                    lse_s = tl.load(pl_base + (s0 + i) * stride_pls + rows, mask=l_ok, other=float("-inf"))
                m = tl.maximum(m, lse_s)
    m_sub = tl.where(m == float("-inf"), 0.0, m)  # [BLOCK_M]; exp2(-inf - 0) = 0, not NaN
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, MERGE_UNROLL):
        for i in tl.static_range(MERGE_UNROLL):
            s_ok = tl.zeros([BLOCK_M], dtype=tl.int32) + (s0 + i) < num_splits  # [BLOCK_M]
            l_ptrs = pl_base + (s0 + i) * stride_pls + rows
            p_ptrs = po_base + (s0 + i) * stride_pos + tile_offs  # < 2^31: splits x rows x D
            if BYPASS_L1:
                lse_s = tl.load(l_ptrs, mask=row_ok & s_ok, other=float("-inf"), cache_modifier=".cg")
                part = tl.load(p_ptrs, mask=store_ok & s_ok[:, None], other=0.0, cache_modifier=".cg")
            else:
                lse_s = tl.load(l_ptrs, mask=row_ok & s_ok, other=float("-inf"))
                part = tl.load(p_ptrs, mask=store_ok & s_ok[:, None], other=0.0)
            weight = tl.math.exp2(lse_s - m_sub)  # [BLOCK_M]
            denom = denom + weight
            acc = acc + part * weight[:, None]
    empty = denom == 0.0
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_sub + tl.math.log2(tl.where(empty, 1.0, denom)))
    return out, lse2


@triton.jit
def block_sparse_decode_fwd(
    Q, K, V, Out, Lse, PartOut, PartLse, Counter,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,
    qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh,
    stride_pob, stride_poh, stride_pos, stride_por,
    stride_plb, stride_plh, stride_pls,
    stride_cb, stride_ch, stride_ib, stride_ih,
    stride_fcb, stride_fch, stride_fib, stride_fih,
    head_groups, gqa_group, seq_q, seq_k,
    causal_offset, window, sink_tokens,
    Q_DOC, K_DOC, stride_qdb, stride_kdb,
    K_START, K_END, stride_pb,
    MASK_BITS, stride_mbb, stride_mbh, stride_mbm,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_DOC: tl.constexpr, HAS_PAD: tl.constexpr, HAS_BITS: tl.constexpr,
    RETURN_LSE: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, EMULATE_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SELECT_LOADED: tl.constexpr, FENCE_LANES: tl.constexpr,
    MERGE_UNROLL: tl.constexpr, MERGE_SPLITS: tl.constexpr, MERGE_M: tl.constexpr,
):
    # Grid (num_splits, B * head_groups). One program: GROUP query heads that share one K/V head
    # (a GQA group, or one head where the layout differs between heads), all seq_q (<= the layout's
    # query block) query rows of them, and one contiguous share of the key tiles the layout lists
    # for query block 0 (full blocks, then partial ones). Row r of the tile is query head
    # head0 + r // seq_q at position r % seq_q, so the group's K/V is read once for all of them.
    # With SPLIT the program writes its normalized partial output and base-2 LSE; without (one
    # split) it writes the final output directly. With SPLIT and FUSED the last program of a group
    # to finish merges the partials itself (below); SPLIT alone leaves that to ``decode_combine``.
    split = tl.program_id(0)
    num_splits = tl.num_programs(0)
    pid_bg = tl.program_id(1)
    off_b, off_g, rows, row_ok, row_head, offs_m = _group_rows(pid_bg, head_groups, seq_q, BLOCK_M, GROUP)
    head0 = off_g * GROUP
    off_hkv = head0 // gqa_group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + row_head[:, None].to(tl.int64) * stride_qh
              + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if EMULATE_BF16:
        q = q.to(tl.float32)
    k_ptrs0 = (K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
               + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
    v_ptrs0 = (V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
               + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)

    # Element masks: offs_m = rows % seq_q, so every row's document id is in range.
    q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs = _element_mask_state(
        off_b, offs_m, offs_m < seq_q, row_head[:, None], seq_k, Q_DOC, K_DOC, stride_qdb, stride_kdb,
        K_START, K_END, stride_pb, MASK_BITS, stride_mbb, stride_mbh, stride_mbm, HAS_DOC, HAS_PAD, HAS_BITS)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Query block 0's lists (the launcher takes this path only when seq_q fits one query block);
    # the layout's head dim is 1 or Hq, and GROUP > 1 only where it is 1 (the group shares them).
    SUB: tl.constexpr = SPARSE_BLOCK_N // BLOCK_N
    full_count = tl.load(FULL_NUM + off_b * stride_fcb + head0 * stride_fch)
    full_idx_base = FULL_IDX + off_b * stride_fib + head0 * stride_fih
    part_count = tl.load(KV_NUM + off_b * stride_cb + head0 * stride_ch)
    part_idx_base = KV_IDX + off_b * stride_ib + head0 * stride_ih
    total = (full_count + part_count) * SUB
    per_split = tl.cdiv(total, num_splits)
    first = split * per_split
    last = tl.minimum(first + per_split, total)
    for t in range(first, last):
        start_n, partial = _tile_at(t, full_count, full_idx_base, part_idx_base, SUB, SPARSE_BLOCK_N, BLOCK_N,
                                    SELECT_LOADED)
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, k_ptrs0, v_ptrs0, k_ptrs0, v_ptrs0, 0, start_n, offs_m, offs_n, offs_d,
            stride_kn, stride_vn, seq_q, seq_k, causal_offset, window, sink_tokens,
            q_doc, k_doc_ptr, k_lo, k_hi, bits_ptrs, qk_scale,
            partial=partial, MASKED=False, RUNTIME_MASK=True,
            HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_DOC=HAS_DOC, HAS_PAD=HAS_PAD, HAS_BITS=HAS_BITS,
            EMULATE_BF16=EMULATE_BF16, DOT_PRECISION=DOT_PRECISION, USE_TMA=False,
        )

    # A split (or a whole row) that saw no key: output 0, LSE -inf (the project's convention).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))  # base 2, scaled scores
    store_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        po_base = PartOut + off_b.to(tl.int64) * stride_pob + off_g.to(tl.int64) * stride_poh
        pl_base = PartLse + off_b.to(tl.int64) * stride_plb + off_g.to(tl.int64) * stride_plh
        tile_offs = rows[:, None] * stride_por + offs_d[None, :]  # [BLOCK_M, BLOCK_D] within a split
        tl.store(po_base + split.to(tl.int64) * stride_pos + tile_offs, out, mask=store_ok)
        tl.store(pl_base + split * stride_pls + rows, lse2, mask=row_ok)
        if FUSED:
            # "The last split combines". First every thread releases its own partial stores at GPU
            # scope (an atomic adding 0, release, in each of the FENCE_LANES threads: the fence
            # HIP's grid sync makes in every thread; on NVIDIA one thread's release after the
            # barrier would cover the others' stores, PTX's release being cumulative, but an AMD
            # barrier does not wait for the other waves' stores to complete). Then the barrier,
            # and the arrival: one atomic per program, acq_rel at GPU scope; for the program that
            # sees num_splits - 1 arrivals before its own, its acquire makes every other split's
            # stores visible. No program waits on another, so no schedule can deadlock. The
            # merging program puts the counter back to 0 (nothing else touches it after the last
            # arrival): the next launch on the stream finds it clean (kernels/decode.py).
            no_increment = tl.zeros([FENCE_LANES], dtype=tl.int32)
            tl.atomic_add(Counter + pid_bg + no_increment, no_increment, sem="release", scope="gpu")
            tl.debug_barrier()
            arrived = tl.atomic_add(Counter + pid_bg, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                # The merge's own tile: the group's real rows padded to MERGE_M, not to BLOCK_M
                # (tl.dot's 16): fewer registers and loads per split (the same bits: each element's
                # sum is the same operations in the same order).
                _, _, m_rows, m_row_ok, m_row_head, m_offs_m = _group_rows(pid_bg, head_groups, seq_q, MERGE_M, GROUP)
                m_store_ok = m_row_ok[:, None] & d_ok[None, :]
                m_tile_offs = m_rows[:, None] * stride_por + offs_d[None, :]
                m_out, m_lse2 = _merge_splits(po_base, pl_base, stride_pos, stride_pls, m_tile_offs, m_rows,
                                              m_store_ok, m_row_ok, num_splits, MERGE_M, BLOCK_D, MERGE_UNROLL,
                                              MERGE_SPLITS, BYPASS_L1=True)
                _store_rows(Out, Lse, off_b, m_row_head, m_offs_m, offs_d, m_out, m_lse2, m_store_ok, m_row_ok,
                            stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, RETURN_LSE)
                tl.atomic_xchg(Counter + pid_bg, 0, sem="relaxed", scope="gpu")
    else:
        _store_rows(Out, Lse, off_b, row_head, offs_m, offs_d, out, lse2, store_ok, row_ok,
                    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, RETURN_LSE)


@triton.jit
def decode_combine(
    PartOut, PartLse, Out, Lse,
    stride_pob, stride_poh, stride_pos, stride_por,
    stride_plb, stride_plh, stride_pls,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh,
    num_splits, head_groups, seq_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
    RETURN_LSE: tl.constexpr, MERGE_UNROLL: tl.constexpr, MERGE_SPLITS: tl.constexpr,
):
    # The split kernel's merge as a kernel of its own (``DecodeConfig.fused_combine=False``): one
    # program per (batch, head group), grid (B * head_groups,), the same tile (BLOCK_M: the fused
    # kernel's MERGE_M) and the same ``_merge_splits`` as the fused path's last program, so both
    # give the same bits.
    pid_bg = tl.program_id(0)
    off_b, off_g, rows, row_ok, row_head, offs_m = _group_rows(pid_bg, head_groups, seq_q, BLOCK_M, GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    store_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    po_base = PartOut + off_b.to(tl.int64) * stride_pob + off_g.to(tl.int64) * stride_poh
    pl_base = PartLse + off_b.to(tl.int64) * stride_plb + off_g.to(tl.int64) * stride_plh
    tile_offs = rows[:, None] * stride_por + offs_d[None, :]
    out, lse2 = _merge_splits(po_base, pl_base, stride_pos, stride_pls, tile_offs, rows, store_ok, row_ok, num_splits,
                              BLOCK_M, BLOCK_D, MERGE_UNROLL, MERGE_SPLITS, BYPASS_L1=False)
    _store_rows(Out, Lse, off_b, row_head, offs_m, offs_d, out, lse2, store_ok, row_ok,
                stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, RETURN_LSE)
