"""Element masks inside partial blocks (document ids, key padding, bit-packed masks), their layout
builders, and the bottom-right causal default: each layout equals, element for element, the dense
mask of the equivalent FlexAttention mask_mod evaluated by brute force, and the Triton kernel
matches the fp64 reference on it in fp16, bf16 and fp32 (the flash-attention rule of
parity.kernels.testing, NaN-poisoned outputs). On CPU the kernel runs through the interpreter;
the ``gpu`` tests repeat every mask kind at larger sizes on a GPU."""
import dataclasses
import math
from typing import Callable

import pytest
import torch

from parity.base import dtypes
from parity.run import platform
from parity.kernels import (
    BlockLayout,
    LayoutError,
    block_sparse_attention,
    causal_layout,
    document_layout,
    layout_from_dense_mask,
    layout_from_mask_mod,
    padding_layout,
    prefix_lm_layout,
    sink_layout,
    sliding_window_layout,
    varlen_layout,
)
from bench import benchmark
from parity.kernels.layout import pack_mask_bits, unpack_mask_bits
from parity.kernels.testing import random_qkv
from test_kernels_attention import _check_variants, run_and_check

DTYPES = {name: dtypes.torch_dtype(name) for name in dtypes.KERNEL_DTYPES}


# ---- FlexAttention-style mask_mods, written independently of kernels/layout.py ------------------
def documents_mod(lens_q, lens_k=None, causal=True):
    """Documents end to end (one list of lengths, or one per batch element); causal bottom-right
    within each document, in document coordinates."""
    lens_q = torch.atleast_2d(torch.tensor(lens_q))
    lens_k = lens_q if lens_k is None else torch.atleast_2d(torch.tensor(lens_k))
    ends_q, ends_k = lens_q.cumsum(-1), lens_k.cumsum(-1)

    def mask_mod(b, h, q, k):
        row = b % lens_q.shape[0]  # one packing serves every batch element
        doc_q = (q[..., None] >= ends_q[row]).sum(-1)  # documents that end at or before q
        doc_k = (k[..., None] >= ends_k[row]).sum(-1)
        vis = doc_q == doc_k
        if causal:
            q_local = q - (ends_q - lens_q)[row, doc_q]
            k_local = k - (ends_k - lens_k)[row, doc_k]
            vis = vis & (k_local <= q_local + lens_k[row, doc_q] - lens_q[row, doc_q])
        return vis

    return mask_mod


def padding_mod(seq_q, seq_k, lengths, side, causal=True, align="bottom_right"):
    lengths = torch.tensor(lengths)
    offset = seq_k - seq_q if align == "bottom_right" else 0

    def mask_mod(b, h, q, k):
        start = torch.zeros_like(lengths) if side == "right" else seq_k - lengths
        end = lengths if side == "right" else torch.full_like(lengths, seq_k)
        vis = (k >= start[b]) & (k < end[b])
        return vis & (k <= q + offset) if causal else vis

    return mask_mod


def causal_mod(seq_q, seq_k, align="bottom_right"):
    offset = seq_k - seq_q if align == "bottom_right" else 0
    return lambda b, h, q, k: k <= q + offset


def prefix_lm_mod(prefix):
    return lambda b, h, q, k: (k <= q) | (k < prefix)


def dilated_mod(b, h, q, k):
    return (k % 3 == 0) & (k <= q)


def random_mask(batch, heads, seq_q, seq_k, seed, density=0.3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, heads, seq_q, seq_k, generator=gen) < density


def dense_mod(mask):
    return lambda b, h, q, k: mask[b, h, q, k]


def brute_force(mask_mod, batch, heads, seq_q, seq_k) -> torch.Tensor:
    """The mask_mod at every (b, h, q, k): bool [batch, heads, seq_q, seq_k]."""
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    q = torch.arange(seq_q).view(1, 1, -1, 1)
    k = torch.arange(seq_k).view(1, 1, 1, -1)
    return mask_mod(b, h, q, k).expand(batch, heads, seq_q, seq_k)


# ---- the cases ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MaskCase:
    """A layout builder call, the problem it runs on, and the equivalent mask_mod."""

    build: Callable[[], BlockLayout]
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    mask_mod: Callable
    elements: tuple[str, ...]  # the element masks the layout must carry


_RANDOM = random_mask(2, 4, 70, 90, seed=11)
_DOCS = [37, 90, 129]

CASES = {
    # 3 documents of odd lengths packed in one row; causal within documents
    "documents-37-90-129": MaskCase(lambda: document_layout(_DOCS, block_m=64, block_n=64), 1, 2, 1, 256, 256,
                                    documents_mod(_DOCS), ("q_doc", "k_doc")),
    # one packing per batch element, an empty document, GQA 4:2
    "documents-per-batch": MaskCase(
        lambda: document_layout([[20, 0, 77], [50, 40, 7]], block_m=32, block_n=32), 2, 4, 2, 97, 97,
        documents_mod([[20, 0, 77], [50, 40, 7]]), ("q_doc", "k_doc")),
    # per-document query lengths shorter than key lengths (chunked prefill): diagonals differ
    "varlen-kv-longer": MaskCase(lambda: varlen_layout([0, 10, 30, 60], [0, 40, 65, 95], block_m=32, block_n=32),
                                 1, 2, 2, 60, 95, documents_mod([10, 20, 30], [40, 25, 30]), ("mask_bits",)),
    "padding-right": MaskCase(lambda: padding_layout(96, 96, [96, 61, 17], side="right", block_m=32, block_n=32),
                              3, 2, 1, 96, 96, padding_mod(96, 96, [96, 61, 17], "right"), ("k_start", "k_end")),
    "padding-left": MaskCase(lambda: padding_layout(96, 96, [96, 40, 1], side="left", block_m=32, block_n=32),
                             3, 2, 2, 96, 96, padding_mod(96, 96, [96, 40, 1], "left"), ("k_start", "k_end")),
    "padding-left-decode": MaskCase(lambda: padding_layout(1, 150, [150, 33], side="left", block_m=16, block_n=64),
                                    2, 4, 1, 1, 150, padding_mod(1, 150, [150, 33], "left"), ("k_start", "k_end")),
    "prefix-lm-23": MaskCase(lambda: prefix_lm_layout(100, 23, block_m=32, block_n=32), 1, 2, 1, 100, 100,
                             prefix_lm_mod(23), ("mask_bits",)),
    "dilated-k%3-causal": MaskCase(lambda: layout_from_mask_mod(dilated_mod, None, None, 100, 100, block_m=32,
                                                                block_n=64), 1, 2, 1, 100, 100, dilated_mod,
                                   ("mask_bits",)),
    "random-bool-gqa": MaskCase(lambda: layout_from_dense_mask(_RANDOM, block_m=32, block_n=32), 2, 4, 2, 70, 90,
                                dense_mod(_RANDOM), ("mask_bits",)),
    "causal-bottom-right": MaskCase(lambda: causal_layout(40, 100, block_m=32, block_n=32), 1, 2, 1, 40, 100,
                                    causal_mod(40, 100), ()),
    "causal-top-left": MaskCase(lambda: causal_layout(40, 100, block_m=32, block_n=32, align="top_left"),
                                1, 2, 1, 40, 100, causal_mod(40, 100, "top_left"), ()),
    "causal-bottom-right-sq>sk": MaskCase(lambda: causal_layout(100, 40, block_m=32, block_n=32), 1, 2, 1, 100, 40,
                                          causal_mod(100, 40), ()),
    "decode-sq1": MaskCase(lambda: causal_layout(1, 77, block_m=16, block_n=32), 2, 2, 1, 1, 77,
                           lambda b, h, q, k: k >= 0, ()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_is_exactly_the_mask_mod(name):
    """The FlexAttention-equivalent check: the layout's element visibility is the mask_mod's."""
    case = CASES[name]
    layout = case.build()
    assert layout.element_masks == case.elements
    dense = layout.dense_mask().expand(case.batch, case.heads_q, case.seq_q, case.seq_k)
    expected = brute_force(case.mask_mod, case.batch, case.heads_q, case.seq_q, case.seq_k)
    differ = int((dense != expected).sum())
    assert differ == 0, f"{differ} of {expected.numel()} elements differ from the mask_mod"
    # The same mask through the generic builder is the same visibility too.
    again = layout_from_mask_mod(case.mask_mod, case.batch, case.heads_q, case.seq_q, case.seq_k,
                                 block_m=layout.block_m, block_n=layout.block_n)
    assert torch.equal(again.dense_mask().expand_as(expected), expected)


@pytest.mark.parametrize("name", list(CASES))
def test_full_blocks_need_no_element_mask(name):
    """Builders classify a block as full only where every element is visible."""
    case = CASES[name]
    layout = case.build()
    classes = layout.block_classes()
    q_block = torch.arange(layout.seq_q) // layout.block_m
    k_block = torch.arange(layout.seq_k) // layout.block_n
    full = (classes[..., q_block, :][..., k_block] == 2).expand(case.batch, case.heads_q, -1, -1)
    expected = brute_force(case.mask_mod, case.batch, case.heads_q, case.seq_q, case.seq_k)
    assert expected[full].all()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name, dtype, device):
    case = CASES[name]
    layout = case.build()
    run_and_check(case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k, 32, DTYPES[dtype], layout,
                  device, seed=3)


def test_decode_step_sees_every_key(device):
    """Sq = 1 with the default alignment: the output is softmax over the whole cache."""
    layout = causal_layout(1, 77, block_m=16, block_n=32)
    assert layout.mask.offset == 76 and bool(layout.dense_mask().all())
    q, k, v = random_qkv(1, 2, 2, 1, 77, 32, torch.float32, 0, device)
    out = block_sparse_attention(q, k, v, layout)
    dense = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * 32 ** -0.5, dim=-1) @ v.double()
    assert float((out.double() - dense).abs().max()) < 1e-5


def test_each_element_mask_changes_the_output(device):
    """The cases are not vacuous: without its element mask a layout's kernel output moves."""
    for name in ("documents-37-90-129", "padding-left", "prefix-lm-23"):
        case = CASES[name]
        layout = case.build()
        stripped = dataclasses.replace(layout, **{field: None for field in layout.element_masks})
        q, k, v = random_qkv(case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k, 32, torch.float32, 1,
                             device)
        moved = (block_sparse_attention(q, k, v, layout) - block_sparse_attention(q, k, v, stripped)).abs().max()
        assert float(moved) > 0.1, name


@pytest.mark.skipif(platform.gpu_available(), reason="interpreter tiles: test_gpu_launch_variants_with_masks "
                    "checks the GPU at its pinned tiles (as tests/test_kernels_attention.py does)")
@pytest.mark.parametrize("kind", ["documents", "padding", "bits"])
def test_launch_variants_with_element_masks(kind, device):
    """One loop or two, tiles of the layout block or of a quarter of it (a 64-key layout block as
    four 16-key tiles: bit words split across tiles): the same bits, each passing the reference."""
    from parity.kernels.attention import launch_config

    layout = {
        "documents": lambda: document_layout([37, 50, 41], block_m=64, block_n=64),
        "padding": lambda: padding_layout(128, 128, [70], side="left", block_m=64, block_n=64),
        "bits": lambda: prefix_lm_layout(128, 23, block_m=64, block_n=64),
    }[kind]()
    q, k, v = random_qkv(1, 2, 1, 128, 128, 32, torch.bfloat16, 2, device)
    base = dataclasses.replace(launch_config(q.device, 32, q.dtype), block_m=32)
    _check_variants(layout, q, k, v, base, block_ns=(64, 16))


# ---- bottom-right default ------------------------------------------------------------------------
@pytest.mark.parametrize("builder", ["causal", "window", "sink"])
def test_alignment_defaults_to_bottom_right(builder):
    build = {
        "causal": lambda **kw: causal_layout(40, 100, block_m=16, block_n=16, **kw),
        "window": lambda **kw: sliding_window_layout(40, 100, 30, block_m=16, block_n=16, **kw),
        "sink": lambda **kw: sink_layout(40, 100, 30, 1, block_m=16, block_n=16, **kw),
    }[builder]
    assert build().mask.offset == 60
    assert build(align="top_left").mask.offset == 0
    assert build(offset=-5).mask.offset == -5  # an explicit diagonal wins
    assert build().dense_mask()[0, 0, -1, -1]  # the last query sees the last key
    with pytest.raises(LayoutError, match="align must be one of bottom_right, top_left"):
        build(align="diagonal")


def test_decode_sees_the_window_and_the_sinks():
    layout = sink_layout(1, 300, 40, 1, block_m=16, block_n=16)
    row = layout.dense_mask()[0, 0, 0]
    assert row[:16].all() and row[260:].all() and not row[16:260].any()


# ---- builders ------------------------------------------------------------------------------------
def test_element_masks_are_kept_only_as_needed():
    blocky = torch.zeros(1, 1, 64, 70, dtype=torch.bool)
    blocky[..., :32, :32] = True
    blocky[..., 32:, 32:] = True
    layout = layout_from_dense_mask(blocky, block_m=16, block_n=16)
    assert layout.element_masks == ()  # block-aligned up to the sequence end: no bits
    assert torch.equal(layout.dense_mask(), blocky)
    batch_only = random_mask(3, 1, 40, 40, seed=1)
    per_batch = layout_from_dense_mask(batch_only, block_m=16, block_n=16)
    assert per_batch.mask_bits.shape == (3, 1, 40, 2) and per_batch.batch_heads == (3, 1)
    # a mask_mod that ignores b and h builds a layout broadcast over both
    assert layout_from_mask_mod(dilated_mod, 4, 8, 64, 64, block_m=16, block_n=16).broadcast_batch_heads == (1, 1)


def test_document_layout_shapes_and_kinds():
    layout = document_layout(_DOCS, block_m=64, block_n=64)
    assert (layout.q_doc.shape, layout.k_doc.shape, layout.q_doc.dtype) == ((1, 256), (1, 256), torch.int32)
    assert layout.q_doc[0, [0, 36, 37, 126, 127, 255]].tolist() == [0, 0, 1, 1, 2, 2]
    assert layout.mask.causal and layout.mask.offset == 0 and layout.kind == "document"
    assert varlen_layout([0, 37, 127, 256], block_m=64, block_n=64).kind == "varlen"
    # documents skip the tiles between them: 10 of the 16 tiles of a causal 4x4 grid are computed,
    # of which only those touching a document hold visible elements
    assert layout.density() < causal_layout(256, 256, block_m=64, block_n=64).density()
    noncausal = document_layout(_DOCS, block_m=64, block_n=64, causal=False)
    expected = brute_force(documents_mod(_DOCS, causal=False), 1, 1, 256, 256)
    assert torch.equal(noncausal.dense_mask(), expected)


def test_padding_with_no_real_key_gives_empty_rows(device):
    layout = padding_layout(32, 32, [32, 0], side="right", causal=False, block_m=16, block_n=16)
    q, k, v = random_qkv(2, 2, 2, 32, 32, 32, torch.float16, 0, device)
    out, lse = block_sparse_attention(q, k, v, layout, return_lse=True, out=torch.full_like(q, float("nan")))
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.all(torch.isfinite(lse[0]))


@pytest.mark.parametrize("prefix", [0, 1, 23, 64, 100])
def test_prefix_lm_at_any_prefix(prefix):
    layout = prefix_lm_layout(100, prefix, block_m=16, block_n=16)
    assert torch.equal(layout.dense_mask()[0, 0], brute_force(prefix_lm_mod(prefix), 1, 1, 100, 100)[0, 0])
    per_batch = prefix_lm_layout(50, [3, 40], block_m=16, block_n=16)
    expected = torch.stack([brute_force(prefix_lm_mod(p), 1, 1, 50, 50)[0] for p in (3, 40)])
    assert torch.equal(per_batch.dense_mask(), expected)


def test_bit_packing_round_trips_every_bit_position():
    mask = random_mask(2, 3, 5, 97, seed=4, density=0.5)
    mask[..., 31] = True  # bit 31: a negative int32 word
    words = pack_mask_bits(mask)
    assert words.dtype == torch.int32 and words.shape == (2, 3, 5, 4) and (words < 0).any()
    assert torch.equal(unpack_mask_bits(words, 97), mask)


@pytest.mark.parametrize("name", ["documents-per-batch", "padding-left", "random-bool-gqa"])
def test_dense_mask_rows_are_slices_of_the_whole(name):
    """The reference asks for the mask chunk by chunk of query rows."""
    layout = CASES[name].build()
    whole = layout.dense_mask()
    for start in range(0, layout.seq_q, 7):
        assert torch.equal(layout.dense_mask(start, min(start + 7, layout.seq_q)), whole[:, :, start:start + 7])


@pytest.mark.parametrize("bad,message", [
    (lambda: document_layout([3, 4], [3, 4, 5]), "as many documents"),
    (lambda: document_layout([[3, 4], [3, 5]]), "sum to one positive length"),
    (lambda: document_layout([-1, 4]), "must be >= 0"),
    (lambda: varlen_layout([1, 5, 9]), "start at 0"),
    (lambda: padding_layout(8, 8, [9], block_m=16, block_n=16), r"values in \[0, 8\]"),
    (lambda: padding_layout(8, 8, [4], side="middle"), "side must be"),
    (lambda: prefix_lm_layout(8, 9), r"ints in \[0, 8\]"),
    (lambda: layout_from_dense_mask(torch.ones(1, 4, 4)), "must be a torch.bool"),
    (lambda: layout_from_dense_mask(torch.ones(4, 4, 4, dtype=torch.bool)), r"shape \[B or 1"),
    (lambda: layout_from_mask_mod(lambda b, h, q, k: (k <= q).int(), 1, 1, 8, 8), "bool tensor"),
    (lambda: layout_from_mask_mod(lambda b, h, q, k: torch.ones(3, 1, 1, 1, dtype=torch.bool), 2, 1, 8, 8),
     "not broadcastable"),
], ids=["doc-count", "doc-sums", "doc-negative", "cu-start", "pad-range", "pad-side", "prefix-range",
        "dense-dtype", "dense-rank", "maskmod-dtype", "maskmod-shape"])
def test_builders_reject_bad_arguments(bad, message):
    with pytest.raises(LayoutError, match=message):
        bad()


# ---- serialization and validation ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["documents-per-batch", "padding-left", "prefix-lm-23", "random-bool-gqa"])
def test_layout_round_trips_through_its_tensors(name):
    layout = CASES[name].build()
    tensors = layout.to_tensors()
    assert set(CASES[name].elements) <= set(tensors)
    assert all(tensors[field].dtype == torch.int32 for field in layout.element_masks)
    again = BlockLayout.from_tensors(tensors, layout.meta)
    assert again.meta == layout.meta and again.meta["element_masks"] == list(CASES[name].elements)
    assert torch.equal(again.dense_mask(), layout.dense_mask())
    moved = layout.to("meta")
    assert all(getattr(moved, field).device.type == "meta" for field in layout.element_masks)


def test_meta_of_a_layout_without_element_masks_is_unchanged():
    assert set(causal_layout(64, 64, block_m=16, block_n=16).meta) == {
        "seq_q", "seq_k", "block_m", "block_n", "kind", "mask"}


def _replace(layout, **changes):
    return dataclasses.replace(layout, **changes).validate()


def test_malformed_element_masks_are_rejected():
    docs = CASES["documents-37-90-129"].build()
    pad = CASES["padding-right"].build()
    bits = CASES["prefix-lm-23"].build()
    with pytest.raises(LayoutError, match="q_doc must be int32, got torch.int64"):
        _replace(docs, q_doc=docs.q_doc.long())
    with pytest.raises(LayoutError, match=r"k_doc must have shape \[1, 256\]"):
        _replace(docs, k_doc=docs.k_doc[:, :100])
    with pytest.raises(LayoutError, match="q_doc and k_doc must be given together"):
        _replace(docs, k_doc=None)
    with pytest.raises(LayoutError, match="document ids >= 0"):
        _replace(docs, q_doc=docs.q_doc - 1)
    with pytest.raises(LayoutError, match="0 <= k_start <= k_end <= 96"):
        _replace(pad, k_end=pad.k_end + 1)
    with pytest.raises(LayoutError, match="0 <= k_start <= k_end"):
        _replace(pad, k_start=pad.k_end + 1)
    with pytest.raises(LayoutError, match=r"layout batch dims \[3, 2, 3\] must each be 1 or one common size"):
        _replace(pad, q_doc=torch.zeros(2, 96, dtype=torch.int32), k_doc=torch.zeros(2, 96, dtype=torch.int32))
    with pytest.raises(LayoutError, match=r"mask_bits must have shape \[Bm, Hm, 100, 4\]"):
        _replace(bits, mask_bits=bits.mask_bits[..., :3])
    past_end = bits.mask_bits.clone()
    past_end[0, 0, 5, 3] |= 1 << 10  # key 106 of 100
    with pytest.raises(LayoutError, match="past seq_k=100"):
        _replace(bits, mask_bits=past_end)


def test_bundle_tensors_must_match_the_metadata():
    layout = CASES["padding-left"].build()
    tensors, meta = layout.to_tensors(), layout.meta
    with pytest.raises(LayoutError, match="do not match the metadata"):
        BlockLayout.from_tensors({name: t for name, t in tensors.items() if name != "k_end"}, meta)
    with pytest.raises(LayoutError, match="do not match the metadata"):
        BlockLayout.from_tensors(tensors, {**meta, "element_masks": ["k_start", "k_end", "mask_bits"]})
    with pytest.raises(LayoutError, match="do not match the metadata"):
        BlockLayout.from_tensors(tensors, {key: value for key, value in meta.items() if key != "element_masks"})
    with pytest.raises(LayoutError, match="element_masks must be a list"):
        BlockLayout.from_tensors(tensors, {**meta, "element_masks": "k_start"})
    with pytest.raises(LayoutError, match="unknown layout tensors: extra"):
        BlockLayout.from_tensors({**tensors, "extra": tensors["k_start"]}, meta)
    with pytest.raises(LayoutError, match="k_start must be int32, got torch.int64"):
        BlockLayout.from_tensors({**tensors, "k_start": tensors["k_start"].long()}, meta)


def test_launcher_checks_element_mask_batch_against_q():
    layout = CASES["padding-right"].build()  # 3 batch entries
    q, k, v = random_qkv(2, 2, 1, 96, 96, 32, torch.float16, 0)
    with pytest.raises(LayoutError, match="batch/head dims 3x1 must be 1 or match q's 2x2"):
        block_sparse_attention(q, k, v, layout)


# ---- the benchmark's FlexAttention mask_mods -----------------------------------------------------
@pytest.mark.parametrize("seq", [1024, 4099])
def test_benchmark_mask_mods_are_the_layouts(seq):
    """The benchmark gives FlexAttention these mask_mods and the parity kernel these layouts:
    element for element the same mask (at 4099 on query-row slices: 256 rows around each document
    and padding boundary and the first and last rows). The benchmark's 16384 uses the same
    formulas (building those layouts takes seconds on the CPU)."""
    for name in benchmark.MASK_CASES:
        case = benchmark.mask_case(name, seq)
        layout = case.layout
        batch = case.batch
        bounds = [0, seq - 1] + torch.tensor(benchmark.document_lengths(seq)).cumsum(0).tolist()[:-1] \
            + benchmark.padding_lengths(seq)
        starts = sorted({min(max(0, b - 128), seq - 256) for b in bounds}) if seq > 1024 else [0]
        rows = 256 if seq > 1024 else seq
        for start in starts:
            q = torch.arange(start, start + rows).view(1, 1, -1, 1)
            b = torch.arange(batch).view(-1, 1, 1, 1)
            k = torch.arange(seq).view(1, 1, 1, -1)
            expected = case.mask_mod(b, torch.zeros(1, 1, 1, 1, dtype=torch.long), q, k).expand(batch, 1, rows, seq)
            got = layout.dense_mask(start, start + rows).expand(batch, 1, rows, seq)
            assert torch.equal(got, expected), f"{name} rows {start}..{start + rows}"
    assert sum(benchmark.document_lengths(16384)) == 16384 and len(benchmark.document_lengths(16384)) == 8
    assert benchmark.padding_lengths(16384) == [16384, 12288, 9216, 5120]


def test_benchmark_masks_flag(tmp_path, capsys):
    assert benchmark.parse_masks("document, padding") == ["document", "padding"]
    assert benchmark.parse_masks("all") == list(benchmark.MASK_CASES)
    assert benchmark.main(["--masks", "nope"]) == 2
    assert "bad --masks 'nope'" in capsys.readouterr().err
    result = {"rows": [], "mask_rows": [
        {"seq": 16384, "impl": "parity triton", "mask": "document8", "batch": 1, "density": 0.09, "ms": 0.5,
         "spread": 0.02, "eff_tflops": 300.0, "rel_l2_vs_fp32_ref": 2e-3, "rel_l2_parity_vs_flex": 1e-3},
        {"seq": 16384, "impl": "FlexAttention", "mask": "document8", "batch": 1, "density": 0.09, "ms": 0.6,
         "spread": 0.01, "eff_tflops": 250.0, "rel_l2_vs_fp32_ref": 2.1e-3},
    ]}
    path = tmp_path / "masks.json"
    path.write_text(__import__("json").dumps(result))
    assert benchmark.main(["--markdown", str(path)]) == 0
    text = capsys.readouterr().out
    assert ("| 16384 | document8 | 1 | 0.090 | 0.5 (2.0%) | 300 | 0.6 (1.0%) | 250 | 1.20 | "
            "2.00e-03 / 2.10e-03 | 1.00e-03 |") in text


# ---- GPU: every mask kind at larger sizes, fp16 / bf16 / fp32 -------------------------------------
_GPU_RANDOM = random_mask(2, 4, 700, 900, seed=5)
GPU_CASES = {
    "documents": (lambda: document_layout([371, 900, 1290, 7, 480]), 2, 8, 2),
    "varlen-kv-longer": (lambda: varlen_layout([0, 100, 612, 1000], [0, 700, 1300, 2000]), 1, 8, 8),
    "padding-right": (lambda: padding_layout(2048, 2048, [2048, 1500, 999, 1], side="right"), 4, 4, 2),
    "padding-left-decode": (lambda: padding_layout(1, 4099, [4099, 2000, 17, 4000], side="left"), 4, 8, 2),
    "prefix-lm-23": (lambda: prefix_lm_layout(2048, 23), 2, 4, 4),
    "dilated": (lambda: layout_from_mask_mod(dilated_mod, None, None, 1024, 1024), 1, 4, 2),
    "random-bool": (lambda: layout_from_dense_mask(_GPU_RANDOM), 2, 4, 2),
    "causal-bottom-right": (lambda: causal_layout(300, 2048), 2, 4, 2),
    "causal-top-left": (lambda: causal_layout(300, 2048, align="top_left"), 2, 4, 2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_masks(name, dtype):
    device = torch.device("cuda")
    build, batch, heads_q, heads_kv = GPU_CASES[name]
    layout = build().to(device)
    run_and_check(batch, heads_q, heads_kv, layout.seq_q, layout.seq_k, 128, DTYPES[dtype], layout, device, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["documents", "prefix-lm-23"])
def test_gpu_launch_variants_with_masks(name):
    """The tiles the launcher pins for this layout (element-mask layouts have their own rows) and
    half of them, 2 and 3 stages, one loop or two: same bits."""
    from parity.kernels.attention import launch_config

    device = torch.device("cuda")
    build, batch, heads_q, heads_kv = GPU_CASES[name]
    layout = build().to(device)
    q, k, v = random_qkv(batch, heads_q, heads_kv, layout.seq_q, layout.seq_k, 128, torch.bfloat16, 4, device)
    base = launch_config(device, 128, torch.bfloat16, layout=layout)
    _check_variants(layout, q, k, v, base, block_ns=(base.block_n, base.block_n // 2), stages=(2, 3))


# ---- layouts with element masks travel in bundles ------------------------------------------------
def test_mask_cases_capture_and_compare_through_a_bundle(tmp_path, device):
    """The ``masks`` case set captured with the reference and compared with the Triton kernel:
    the element-mask tensors go through the bundle and come back as the same layouts."""
    from parity.bundle.reader import open_bundle
    from parity.run.capture import capture
    from parity.judge.compare import compare_bundle
    from parity.run.subjects.attention import CASE_SETS

    capture("attention", tmp_path / "masks", subject_args={"cases": "masks"}, impl="reference", device="cpu")
    layouts = open_bundle(tmp_path / "masks").inputs_meta["layouts"]
    assert {tuple(meta["element_masks"]) for meta in layouts.values()} == {
        ("q_doc", "k_doc"), ("k_start", "k_end"), ("mask_bits",)}
    report = compare_bundle(tmp_path / "masks", impl="triton", device=device)
    assert report.passed, [layer.name for layer in report.layers]
    assert len(report.layers) == 2 * len(CASE_SETS["masks"])  # out and LSE of every case


def test_tile_order_runs_the_heaviest_query_tiles_first():
    """Documents put the heaviest tile at the end of the longest document, not at the end of the
    row: the launcher passes this order so that the longest tiles start first. A causal layout's
    order is the kernel's default, last to first (so it never needs one)."""
    layout = document_layout([300, 40, 150], block_m=64, block_n=64)
    order = layout.tile_order(32).tolist()
    assert sorted(order) == list(range(math.ceil(490 / 32)))
    work = (layout.kv_num_blocks + layout.full_kv_num_blocks).sum(dim=(0, 1)).repeat_interleave(2)
    assert [int(work[t]) for t in order] == sorted((int(w) for w in work[: len(order)]), reverse=True)
    assert order[0] in (8, 9)  # the end of the 300-token document, not the last tile (15)
    causal = causal_layout(300, 300, block_m=64, block_n=64).tile_order(64).tolist()
    assert causal == list(range(5))[::-1]
