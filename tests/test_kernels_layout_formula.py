"""Layouts classified from their formula are exactly the layouts an element-by-element
classification gives: the same counts, indices (values, order, width), element-mask tensors,
mask spec, kind and block classes, for causal, sliding window, sink, key padding, documents,
varlen, prefix-LM and dense masks, at Sq != Sk, lengths that are not multiples of the block, both
alignments and explicit diagonals, windows smaller and larger than a block, empty rows and
Sq = 1. The oracle is ``_classify`` (every element of the mask evaluated, tile by tile) followed
by a sort-based packing of the classes, written here independently of the builders' packing.
"""
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from parity.kernels import layout as layouts
from parity.kernels.layout import MaskSpec, _classify, pack_mask_bits
from parity.testing.strategies import parity_settings

# Each drawn case classifies at most 300 x 300 elements: milliseconds. Four times the profile's examples.
SETTINGS = parity_settings(max_examples=4 * parity_settings().max_examples, deadline=None)
BLOCKS = (16, 32, 64)


# ---- the oracle ---------------------------------------------------------------------------------
def _pack(classes: torch.Tensor, cls: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and sorted indices of the tiles of class ``cls`` (stable sort), at least one slot."""
    selected = classes == cls
    counts = selected.sum(-1).to(torch.int32)
    order = torch.sort((~selected).to(torch.int8), dim=-1, stable=True).indices
    width = max(1, int(counts.max()) if counts.numel() else 1)
    indices = order[..., :width].to(torch.int32)
    indices = torch.where(torch.arange(width) < counts[..., None], indices, torch.zeros_like(indices))
    return counts, indices


def oracle_classes(visible: torch.Tensor, block_m: int, block_n: int, *, keep_bits: bool = False):
    """Element-by-element classification of a dense visibility bool [B', H', Sq, Sk]."""
    seq_q, seq_k = visible.shape[2:]
    return _classify(lambda q0, q1: visible[:, :, q0:q1], seq_q, seq_k, block_m, block_n, keep_bits=keep_bits)


def assert_same_layout(layout, classes: torch.Tensor, *, mask: MaskSpec, kind: str, **element_masks):
    """``layout`` is exactly the layout of ``classes`` with these mask spec, kind and element masks."""
    assert layout.mask == mask and layout.kind == kind
    assert layout.block_classes().cpu().tolist() == classes.tolist()
    for (cname, iname), cls in ((("kv_num_blocks", "kv_indices"), 1), (("full_kv_num_blocks", "full_kv_indices"), 2)):
        counts, indices = _pack(classes, cls)
        got_counts, got_indices = getattr(layout, cname), getattr(layout, iname)
        assert got_counts.dtype == got_indices.dtype == torch.int32, (cname, got_counts.dtype)
        assert got_counts.is_contiguous() and got_indices.is_contiguous()
        assert torch.equal(got_counts.cpu(), counts), cname
        assert torch.equal(got_indices.cpu(), indices), iname
    assert layout.element_masks == tuple(name for name in layouts._ELEMENT_FIELDS if name in element_masks)
    for name, expected in element_masks.items():
        got = getattr(layout, name)
        assert got.dtype == expected.dtype == torch.int32 and torch.equal(got.cpu(), expected), name


def _positions(seq_q: int, seq_k: int):
    return torch.arange(seq_q)[:, None], torch.arange(seq_k)[None, :]


# ---- one check per builder ----------------------------------------------------------------------
def check_predicate(builder: str, seq_q, seq_k, block_m, block_n, *, window=0, sink_blocks=0, align="bottom_right",
                    offset=None):
    blocks = {"block_m": block_m, "block_n": block_n, "align": align, "offset": offset}
    if builder == "causal":
        layout = layouts.causal_layout(seq_q, seq_k, **blocks)
        kind = "causal"
    elif builder == "window":
        layout = layouts.sliding_window_layout(seq_q, seq_k, window, **blocks)
        kind = f"window{window}"
    else:
        layout = layouts.sink_layout(seq_q, seq_k, window, sink_blocks, **blocks)
        kind = f"window{window}-sink{sink_blocks}"
    diagonal = offset if offset is not None else (seq_k - seq_q if align == "bottom_right" else 0)
    mask = MaskSpec(causal=True, window=window if builder != "causal" else 0,
                    sink_tokens=sink_blocks * block_n if builder == "sink" else 0, offset=diagonal)
    q, k = _positions(seq_q, seq_k)
    visible = mask.visible(q, k, seq_k)[None, None]
    assert_same_layout(layout, oracle_classes(visible, block_m, block_n).classes, mask=mask, kind=kind)


def check_padding(seq_q, seq_k, lengths, side, causal, align, block_m, block_n):
    """``padding_layout`` against key ranges written out (visibility [B, 1, Sq, Sk])."""
    layout = layouts.padding_layout(seq_q, seq_k, lengths, side=side, causal=causal, align=align,
                                    block_m=block_m, block_n=block_n)
    lengths = torch.tensor(lengths)
    start = torch.zeros_like(lengths) if side == "right" else seq_k - lengths
    end = lengths if side == "right" else torch.full_like(lengths, seq_k)
    q, k = _positions(seq_q, seq_k)
    visible = ((k >= start[:, None, None]) & (k < end[:, None, None])).expand(-1, seq_q, -1)
    mask = MaskSpec()
    if causal:
        mask = MaskSpec(causal=True, offset=seq_k - seq_q if align == "bottom_right" else 0)
        visible = visible & (k <= q + mask.offset)
    assert_same_layout(layout, oracle_classes(visible[:, None], block_m, block_n).classes, mask=mask,
                       kind=f"padding-{side}", k_start=start.to(torch.int32), k_end=end.to(torch.int32))


def check_documents(lens_q, lens_k, causal, block_m, block_n):
    """``document_layout`` (one packing, or one per batch row) against documents written out."""
    rows_q = [lens_q] if isinstance(lens_q[0], int) else lens_q
    rows_k = rows_q if lens_k is None else ([lens_k] if isinstance(lens_k[0], int) else lens_k)
    batch = max(len(rows_q), len(rows_k))
    rows_q, rows_k = rows_q * (batch // len(rows_q)), rows_k * (batch // len(rows_k))
    layout = layouts.document_layout(lens_q, lens_k, causal=causal, block_m=block_m, block_n=block_n)
    ids = [torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in rows_q]
    kids = [torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in rows_k]
    q_doc, k_doc = torch.stack(ids).to(torch.int32), torch.stack(kids).to(torch.int32)
    seq_q, seq_k = q_doc.shape[1], k_doc.shape[1]
    # query q of document d sees key k of d when k - start_k(d) <= q - start_q(d) + len_k(d) - len_q(d)
    ends_q, ends_k = torch.tensor(rows_q).cumsum(1), torch.tensor(rows_k).cumsum(1)
    q, k = _positions(seq_q, seq_k)
    diagonal = (ends_k - ends_q).gather(1, q_doc.long())[:, :, None]
    visible = (q_doc[:, :, None] == k_doc[:, None, :]) & (~torch.tensor(causal) | (k <= q + diagonal))
    live = [(a > 0 and b > 0) for row_q, row_k in zip(rows_q, rows_k) for a, b in zip(row_q, row_k)]
    diagonals = (ends_k - ends_q).flatten()[torch.tensor(live)].unique()
    if not causal or diagonals.numel() <= 1:
        mask = MaskSpec(causal=causal, offset=int(diagonals[0]) if causal and diagonals.numel() else 0)
        assert_same_layout(layout, oracle_classes(visible[:, None], block_m, block_n).classes, mask=mask,
                           kind="document", q_doc=q_doc, k_doc=k_doc)
    else:  # per-document diagonals: carried as bits
        classified = oracle_classes(visible[:, None], block_m, block_n, keep_bits=True)
        extra = {"mask_bits": classified.bits} if classified.bits_needed else {}
        assert_same_layout(layout, classified.classes, mask=MaskSpec(), kind="document", **extra)


def check_prefix(seq, prefix, block_m, block_n):
    layout = layouts.prefix_lm_layout(seq, prefix, block_m=block_m, block_n=block_n)
    prefixes = torch.tensor([prefix] if isinstance(prefix, int) else prefix)
    q, k = _positions(seq, seq)
    visible = ((k <= q)[None] | (k < prefixes[:, None, None]))[:, None]
    _check_bits_layout(layout, visible, block_m, block_n,
                       f"prefixlm{int(prefixes[0])}" if prefixes.numel() == 1 else "prefixlm")


def check_dense(visible, block_m, block_n):
    layout = layouts.layout_from_dense_mask(visible, block_m=block_m, block_n=block_n)
    _check_bits_layout(layout, visible if visible.dim() == 4 else visible[None, None], block_m, block_n, "densemask")


def _check_bits_layout(layout, visible, block_m, block_n, kind):
    classified = oracle_classes(visible, block_m, block_n, keep_bits=True)
    classes = classified.classes
    extra = {}
    if classified.bits_needed:
        extra["mask_bits"] = classified.bits
        assert torch.equal(classified.bits, pack_mask_bits(visible))
    elif bool((classes == classes[:1, :1]).all()):
        classes = classes[:1, :1]
    assert_same_layout(layout, classes, mask=MaskSpec(), kind=kind, **extra)


# ---- pinned edge cases --------------------------------------------------------------------------
@pytest.mark.parametrize("builder", ["causal", "window", "sink"])
@pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (1, 77), (1, 4096), (40, 100), (100, 40), (128, 128), (129, 255),
                                         (300, 17)])
@pytest.mark.parametrize("blocks", [(16, 16), (16, 64), (64, 16), (128, 128)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_predicate_layouts_match_the_element_classification(builder, seq_q, seq_k, blocks, align):
    for window in ((0,) if builder == "causal" else (1, 5, 16, 17, 64, 200, 5000)):
        check_predicate(builder, seq_q, seq_k, *blocks, window=window, sink_blocks=2 if builder == "sink" else 0,
                        align=align)


@pytest.mark.parametrize("offset", [-300, -41, -1, 0, 3, 64, 500])
def test_explicit_diagonals_with_empty_rows(offset):
    for builder, window in (("causal", 0), ("window", 7), ("sink", 40)):
        check_predicate(builder, 100, 37, 32, 16, window=window, sink_blocks=1, offset=offset)
        check_predicate(builder, 37, 150, 16, 32, window=window, sink_blocks=3, offset=offset)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("causal", [True, False])
def test_padding_layouts_match(side, causal):
    check_padding(96, 96, [96, 61, 17, 0, 1], side, causal, "bottom_right", 32, 32)
    check_padding(1, 150, [150, 33, 0], side, causal, "bottom_right", 16, 64)
    check_padding(70, 130, [130, 64, 63, 65], side, causal, "top_left", 16, 64)
    check_padding(130, 70, [70, 5], side, causal, "bottom_right", 64, 16)


def test_document_layouts_match():
    check_documents([37, 90, 129], None, True, 64, 64)
    check_documents([[20, 0, 77], [50, 40, 7]], None, True, 32, 32)
    check_documents([[20, 0, 77], [50, 40, 7]], None, False, 16, 32)
    check_documents([0, 5, 0, 0, 60, 1, 0], None, True, 16, 16)  # empty documents anywhere
    check_documents([10, 20, 30], [40, 25, 30], True, 32, 32)  # diagonals differ: bits
    check_documents([10, 20, 30], [15, 25, 35], True, 16, 32)  # one diagonal (5) for every document
    check_documents([10, 0, 30], [15, 7, 35], True, 16, 16)  # a document with keys only
    check_documents([4, 3], [0, 9], True, 16, 16)  # a document with no key: its rows are empty
    layout = layouts.varlen_layout([0, 37, 127, 256], block_m=64, block_n=64)
    assert layout.kind == "varlen"


@pytest.mark.parametrize("prefix", [0, 1, 23, 64, 99, 100, [3, 40, 100]])
def test_prefix_lm_layouts_match(prefix):
    check_prefix(100, prefix, 16, 16)
    check_prefix(100, prefix, 32, 64)


def test_dense_mask_layouts_match():
    gen = torch.Generator().manual_seed(3)
    check_dense(torch.rand(2, 3, 70, 90, generator=gen) < 0.3, 32, 32)
    blocky = torch.zeros(1, 1, 64, 70, dtype=torch.bool)
    blocky[..., :32, :32] = True
    blocky[..., 32:, 32:] = True
    check_dense(blocky, 16, 16)  # block-aligned up to the sequence end: no bits
    check_dense(torch.ones(40, 33, dtype=torch.bool).tril(), 16, 16)
    check_dense(torch.zeros(1, 1, 5, 5, dtype=torch.bool), 16, 16)  # nothing visible
    same = (torch.rand(1, 1, 50, 50, generator=gen) < 0.5).expand(3, 2, 50, 50)  # broadcast view
    check_dense(same, 16, 16)


# ---- drawn cases --------------------------------------------------------------------------------
@st.composite
def predicate_cases(draw):
    builder = draw(st.sampled_from(["causal", "window", "sink"]))
    return dict(builder=builder, seq_q=draw(st.integers(1, 300)), seq_k=draw(st.integers(1, 300)),
                block_m=draw(st.sampled_from(BLOCKS)), block_n=draw(st.sampled_from(BLOCKS)),
                window=0 if builder == "causal" else draw(st.integers(1, 400)),
                sink_blocks=draw(st.integers(0, 4)) if builder == "sink" else 0,
                align=draw(st.sampled_from(["bottom_right", "top_left"])),
                offset=draw(st.one_of(st.none(), st.integers(-320, 320))))


@SETTINGS
@given(case=predicate_cases())
@example(case=dict(builder="window", seq_q=1, seq_k=300, block_m=16, block_n=64, window=1, sink_blocks=0,
                   align="bottom_right", offset=None))
@example(case=dict(builder="sink", seq_q=300, seq_k=1, block_m=64, block_n=16, window=400, sink_blocks=4,
                   align="top_left", offset=-320))
def test_drawn_predicate_layouts_match(case):
    check_predicate(case.pop("builder"), **case)


@st.composite
def element_cases(draw):
    kind = draw(st.sampled_from(["padding", "documents", "prefix", "dense"]))
    block_m, block_n = draw(st.sampled_from(BLOCKS)), draw(st.sampled_from(BLOCKS))
    if kind == "padding":
        seq_q, seq_k = draw(st.integers(1, 200)), draw(st.integers(1, 200))
        lengths = draw(st.lists(st.integers(0, seq_k), min_size=1, max_size=4))
        return kind, (seq_q, seq_k, lengths, draw(st.sampled_from(["left", "right"])), draw(st.booleans()),
                      draw(st.sampled_from(["bottom_right", "top_left"])), block_m, block_n)
    if kind == "documents":
        docs = draw(st.integers(1, 6))
        rows = draw(st.integers(1, 3))
        lens_q = [draw(st.lists(st.integers(0, 60), min_size=docs, max_size=docs)) for _ in range(rows)]
        # every packing of one batch sums to the same length: pad each row's last document
        total = max(1, max(sum(row) for row in lens_q))
        lens_q = [row[:-1] + [row[-1] + total - sum(row)] for row in lens_q]
        lens_k = None
        if draw(st.booleans()):  # keys per document differ from queries, by one shift or by document
            shift = draw(st.integers(0, 30))
            lens_k = [[n + (shift if i == 0 or draw(st.booleans()) else 0) for i, n in enumerate(row)]
                      for row in lens_q]
            ktotal = max(sum(row) for row in lens_k)
            lens_k = [row[:-1] + [row[-1] + ktotal - sum(row)] for row in lens_k]
        return kind, (lens_q, lens_k, draw(st.booleans()), block_m, block_n)
    if kind == "prefix":
        seq = draw(st.integers(1, 200))
        prefix = draw(st.one_of(st.integers(0, seq), st.lists(st.integers(0, seq), min_size=1, max_size=3)))
        return kind, (seq, prefix, block_m, block_n)
    seq_q, seq_k = draw(st.integers(1, 150)), draw(st.integers(1, 150))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)), seq_q, seq_k)
    return kind, (shape, draw(st.floats(0.0, 1.0)), draw(st.integers(0, 2**16)), draw(st.booleans()),
                  block_m, block_n)


@SETTINGS
@given(case=element_cases())
def test_drawn_element_layouts_match(case):
    kind, args = case
    if kind == "padding":
        check_padding(*args)
    elif kind == "documents":
        check_documents(*args)
    elif kind == "prefix":
        check_prefix(*args)
    else:
        shape, density, seed, causal, block_m, block_n = args
        visible = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density
        if causal:  # whole tiles on and off, as real masks have them
            visible = visible | torch.ones(shape[2:], dtype=torch.bool).tril()
        check_dense(visible, block_m, block_n)


def test_the_oracle_can_fail():
    """A layout one tile off is told apart: the comparison reads what it claims to."""
    layout = layouts.causal_layout(100, 100, block_m=32, block_n=32)
    q, k = _positions(100, 100)
    classes = oracle_classes((k <= q)[None, None], 32, 32).classes.clone()
    classes[0, 0, 3, 0] = 1  # a full tile called partial
    with pytest.raises(AssertionError):
        assert_same_layout(layout, classes, mask=layout.mask, kind="causal")
    assert math.isfinite(layout.density())


@pytest.mark.gpu
@pytest.mark.parametrize("build", ["causal decode", "causal 4k", "window 16k"])
def test_gpu_predicate_layouts_are_made_without_waiting_for_the_gpu(build):
    """A model makes its mask-less layout in the first layer of each forward, behind the work
    already queued: the builder must not synchronize with the GPU (it reads the index lists' width
    on the host, so it makes them on the CPU and copies them without waiting), and the layout on
    the GPU is the CPU's, value for value."""
    assert torch.cuda.is_available()
    make = {"causal decode": lambda device: layouts.causal_layout(1, 4099, block_m=64, block_n=64, device=device),
            "causal 4k": lambda device: layouts.causal_layout(4096, 4096, block_m=64, block_n=64, device=device),
            "window 16k": lambda device: layouts.sliding_window_layout(16384, 16384, 4096, block_m=64, block_n=64,
                                                                       device=device)}[build]
    torch.cuda._sleep(50_000_000)  # work queued ahead, as a forward's embedding
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = make("cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    on_cpu = make(None)
    for name, tensor in on_cpu.to_tensors().items():
        assert torch.equal(on_gpu.to_tensors()[name], tensor), name


@pytest.mark.parametrize("seed", range(4))
def test_small_grids_pack_as_the_tensor_ops_do(seed, monkeypatch):
    """A CPU class grid of at most ``_SMALL_GRID`` tiles is packed from Python lists (a decode
    step's layout in about half the time); the tensors equal the tensor-op packing's and the
    oracle's: values, dtype, shape and contiguity, with empty lists, empty rows of query blocks
    and widths of one."""
    gen = torch.Generator().manual_seed(1000 + seed)
    for _ in range(60):
        shape = [int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 3, (1,), generator=gen)),
                 int(torch.randint(0, 6, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))]
        classes = torch.randint(0, 3, shape, generator=gen).to(torch.int8)
        if seed == 0:
            classes[..., : shape[-1] // 2] = layouts.SKIP  # rows with few or no selected blocks
        small = layouts._pack_small(classes)
        monkeypatch.setattr(layouts, "_SMALL_GRID", -1)
        tensor_ops = layouts._pack_classes(classes)
        monkeypatch.undo()
        expected = (*_pack(classes, layouts.PARTIAL), *_pack(classes, layouts.FULL))
        for got, ops, oracle in zip(small, tensor_ops, expected):
            assert got.dtype == ops.dtype == torch.int32
            assert got.shape == ops.shape == oracle.shape and got.is_contiguous() == ops.is_contiguous()
            assert torch.equal(got, ops) and torch.equal(got, oracle)


# ---- a decode step's layout kept while its tiles stay (layout.with_keys) ------------------------
_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


@pytest.mark.parametrize("seq_q, block_n, window", [(1, 16, 0), (1, 32, 0), (4, 16, 0), (1, 16, 5), (3, 16, 40),
                                                    (1, 64, 100)])
def test_with_keys_moves_a_decode_layout_only_while_its_tiles_stay(seq_q, block_n, window):
    """A decode loop from 1 to 200 keys, bottom-right: each step's layout is the previous one
    moved (``with_keys``: its tensors, the new key length and diagonal) where that gives exactly
    the builder's tensors for the new step, and None where the builder's differ; None about twice
    per key block (one fills, one starts), so the moves cover nearly every step."""
    def build(seq_k):
        if window:
            return layouts.sliding_window_layout(seq_q, seq_k, window, block_m=64, block_n=block_n)
        return layouts.causal_layout(seq_q, seq_k, block_m=64, block_n=block_n)

    previous, rebuilt = build(1), 0
    for seq_k in range(2, 201):
        fresh = build(seq_k)
        moved = layouts.with_keys(previous, seq_k, seq_k - seq_q)
        same = all(torch.equal(getattr(previous, name), getattr(fresh, name)) for name in _TENSORS)
        if moved is None:
            assert not same, f"{seq_k} keys: the tiles stayed, yet the layout was not moved"
            rebuilt += 1
            previous = fresh
            continue
        assert same, f"{seq_k} keys: moved over tensors the builder would not make"
        assert (moved.seq_k, moved.mask, moved.kind) == (fresh.seq_k, fresh.mask, fresh.kind)
        assert all(getattr(moved, name) is getattr(previous, name) for name in _TENSORS)
        previous = moved
    assert rebuilt <= (4 if window else 2) * math.ceil(200 / block_n) + 2


def test_with_keys_tile_formula_matches_the_classification():
    """``_one_block_tiles`` (the integers ``with_keys`` compares) gives every tile's class as the
    builders' classification does, over every key length to 110, diagonals bottom-right, top-left,
    past the keys and before them, windows from 1 to past the keys."""
    from parity.kernels.layout import FULL, PARTIAL, SKIP, _one_block_tiles, _spec_classes

    checked = 0
    for seq_q in (1, 2, 5, 16):
        for block_n in (16, 32):
            for window in (0, 1, 2, 5, 17, 40):
                for seq_k in range(1, 111):
                    for offset in {seq_k - seq_q, 0, 3, -2, seq_k + 5, seq_k - seq_q - 7}:
                        mask = MaskSpec(causal=True, window=window, offset=offset)
                        expected = _spec_classes(mask, seq_q, seq_k, 16, block_n)[0].tolist()
                        tiles, (v0, v1), (f0, f1) = _one_block_tiles(mask, seq_q, seq_k, block_n)
                        got = [FULL if f0 <= j < f1 else PARTIAL if v0 <= j < v1 else SKIP for j in range(tiles)]
                        assert got == expected, (seq_q, block_n, window, seq_k, offset)
                        checked += 1
    assert checked > 30_000


def test_with_keys_refuses_what_it_cannot_prove():
    """Layouts whose tiles do not follow from the integers: more than one query block, sinks,
    element masks, lists per head, a non-causal layout; and a non-integer key length."""
    assert layouts.with_keys(layouts.causal_layout(100, 200, block_m=64, block_n=64), 201, 101) is None
    assert layouts.with_keys(layouts.sink_layout(1, 200, 64, block_m=64, block_n=64), 201, 200) is None
    assert layouts.with_keys(layouts.padding_layout(1, 200, torch.tensor([150]), side="left", causal=True,
                                                    block_m=64, block_n=64), 201, 200) is None
    assert layouts.with_keys(layouts.random_layout(1, 200, 0.5, 0, heads=2, block_m=64, block_n=64), 201, 200) is None
    full = torch.ones(1, 4, dtype=torch.bool)
    assert layouts.with_keys(layouts.layout_from_block_mask(full, 1, 200, block_m=64, block_n=64), 201, 200) is None
    causal = layouts.causal_layout(1, 200, block_m=64, block_n=64)
    assert layouts.with_keys(causal, 201.0, 200) is None and layouts.with_keys(causal, True, 200) is None
    assert layouts.with_keys(causal, 201, 200).seq_k == 201
