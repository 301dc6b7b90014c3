"""Placements on a 1-D mesh and rebuilding full tensors from the ranks' pieces (pure, one process)."""
import pytest
import torch

from parity.distributed.placement import (
    PARTIAL,
    REPLICATE,
    PlacementMap,
    parse_placement,
    placement_from_json,
    rebuild,
    shard,
    style_output_placement,
    unwrap_dtensor,
)
from parity.base.errors import BundleError, UsageError


def _pieces(full: torch.Tensor, world: int, dim: int) -> list[torch.Tensor]:
    return [piece.clone() for piece in torch.chunk(full, world, dim=dim)] + \
        [full.narrow(dim, 0, 0).clone()] * (world - len(torch.chunk(full, world, dim=dim)))


@pytest.mark.parametrize("text, expected", [
    ("shard(-1)", shard(-1)), ("Shard(2)", shard(2)), (" shard( 0 ) ", shard(0)), ("replicate", REPLICATE),
    ("Replicate()", REPLICATE), ("partial", PARTIAL), ("partial(sum)", PARTIAL),
])
def test_parse_placement(text, expected):
    assert parse_placement(text) == expected


@pytest.mark.parametrize("text, message", [
    ("shard", "placement: shard needs an integer dim, as in shard(-1); got 'shard'"),
    ("shard(x)", "placement: shard needs an integer dim, as in shard(-1); got 'shard(x)'"),
    ("partial(max)", "placement: only partial(sum) is supported, got 'partial(max)'"),
    ("replicate(1)", "placement: replicate takes no argument, got 'replicate(1)'"),
    ("colwise", "placement: 'colwise' is not a placement; use shard(DIM), replicate or partial"),
    ("", "placement: '' is not a placement; use shard(DIM), replicate or partial"),
    ("shard(0)\nreplicate", None),  # a line break in the input is not echoed as a second line
])
def test_bad_placement_is_one_line_usage_error(text, message):
    with pytest.raises(UsageError) as err:
        parse_placement(text)
    if message is not None:
        assert str(err.value) == message
    assert "\n" not in str(err.value) and str(err.value).startswith("placement: ")


def test_placement_json_round_trip_and_damage():
    for placement in (shard(3), shard(-1), REPLICATE, PARTIAL):  # a negative dim counts from the end
        assert placement_from_json(placement.to_json(), "x") == placement
    for bad in ({"kind": "shard"}, {"kind": "shard", "dim": -65}, {"kind": "shard", "dim": True},
                {"kind": "replicate", "dim": 0}, {"kind": "gather"}, [], None):
        with pytest.raises(BundleError):
            placement_from_json(bad, "placements")


@pytest.mark.parametrize("world, size", [(2, 6), (4, 66), (4, 5), (3, 7)])  # 66/4: 17,17,17,15; 5/4: 2,2,1,0
def test_rebuild_shards_uneven_as_dtensor_makes_them(world, size):
    full = torch.randn(3, size, 2, generator=torch.Generator().manual_seed(size))
    pieces = _pieces(full, world, 1)
    assert len(pieces) == world
    loaded = []

    def load(rank):
        loaded.append(rank)
        return pieces[rank]

    rebuilt = rebuild("t", shard(1), [tuple(p.shape) for p in pieces], full.dtype, load)
    assert torch.equal(rebuilt.tensor, full)
    assert loaded == list(range(world))  # one piece at a time, in rank order
    assert rebuilt.disagreements == []


def test_rebuild_partial_sums_in_the_accumulation_dtype():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(64, generator=gen).to(torch.bfloat16) for _ in range(4)]
    rebuilt = rebuild("t", PARTIAL, [(64,)] * 4, torch.bfloat16, lambda rank: parts[rank])
    expected = sum(part.float() for part in parts).to(torch.bfloat16)
    assert rebuilt.tensor.dtype == torch.bfloat16
    assert torch.equal(rebuilt.tensor, expected)


def test_rebuild_replicate_names_the_rank_that_disagrees():
    base = torch.arange(8, dtype=torch.float32)
    copies = [base.clone(), base.clone(), base.clone(), base.clone()]
    copies[2][5] += 0.5
    rebuilt = rebuild("t", REPLICATE, [(8,)] * 4, torch.float32, lambda rank: copies[rank])
    assert torch.equal(rebuilt.tensor, base)
    assert [(d.rank, d.max_abs) for d in rebuilt.disagreements] == [(2, 0.5)]
    assert "rank 2" in rebuilt.disagreements[0].text


def test_rebuild_replicate_compares_bits_nan_and_signed_zero():
    a = torch.tensor([float("nan"), 0.0])
    b = torch.tensor([float("nan"), -0.0])
    rebuilt = rebuild("t", REPLICATE, [(2,), (2,)], torch.float32, lambda rank: (a, b)[rank])
    assert [d.rank for d in rebuilt.disagreements] == [1]


def test_rebuild_refuses_pieces_that_do_not_fit():
    with pytest.raises(BundleError, match="rank 1"):
        rebuild("t", shard(0), [(4, 3), (4, 2)], torch.float32, lambda rank: torch.zeros(1))
    with pytest.raises(BundleError, match="rank 1"):
        rebuild("t", PARTIAL, [(4,), (5,)], torch.float32, lambda rank: torch.zeros(1))


def test_placement_map_last_rule_wins_and_matches_names():
    rules = PlacementMap.parse(["layers.*.mlp.*=shard(-1)", "layers.*.mlp.down_proj=partial", "*/1=replicate"])
    assert rules.lookup("layers.0.mlp.up_proj", "layers.0.mlp.up_proj").placement == shard(-1)
    assert rules.lookup("layers.3.mlp.down_proj", "layers.3.mlp.down_proj").placement == PARTIAL
    assert rules.lookup("layers.0.attn", "layers.0.attn/1").placement == REPLICATE
    assert rules.lookup("embed", "embed") is None
    with pytest.raises(UsageError, match="GLOB=PLACEMENT"):
        PlacementMap.parse(["layers.0"])


def test_placements_of_parallel_styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert style_output_placement(ColwiseParallel()) == shard(-1)
    assert style_output_placement(RowwiseParallel()) == REPLICATE
    assert style_output_placement(ColwiseParallel(output_layouts=Replicate())) == REPLICATE
    assert style_output_placement(RowwiseParallel(output_layouts=Shard(1))) == shard(1)
    assert style_output_placement(ColwiseParallel(use_local_output=False)) is None  # DTensors carry their own
    plan = PlacementMap.from_plan({"a.q": ColwiseParallel(), "a.o": RowwiseParallel()})
    assert [(r.pattern, r.placement, r.source) for r in plan.rules] == [("a.q", shard(-1), "plan"),
                                                                        ("a.o", REPLICATE, "plan")]


def test_plain_tensor_has_no_placement():
    tensor = torch.ones(2)
    local, placement = unwrap_dtensor(tensor)
    assert local is tensor and placement is None


class _Pieces:
    """``load(rank)`` for :func:`rebuild` that hands out fresh copies and measures, at every call,
    how many earlier pieces are still alive (held by the rebuild) and how many bytes they hold."""

    def __init__(self, pieces):
        self.pieces = pieces
        self.handed: list = []
        self.held_at_call: list[tuple[int, int]] = []  # (pieces alive, bytes) when each piece is asked for

    def alive(self) -> list[torch.Tensor]:
        return [t for t in (ref() for ref in self.handed) if t is not None]

    def __call__(self, rank):
        import weakref

        live = self.alive()
        self.held_at_call.append((len(live), sum(t.numel() * t.element_size() for t in live)))
        del live
        piece = self.pieces[rank].clone()
        self.handed.append(weakref.ref(piece))
        return piece


@pytest.mark.parametrize("placement, dtype", [(shard(1), torch.float32), (PARTIAL, torch.float32),
                                              (PARTIAL, torch.bfloat16), (REPLICATE, torch.float32)])
def test_rebuild_holds_one_full_tensor_and_one_piece_at_a_time(placement, dtype):
    world = 4
    full = torch.randn(8, 66, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
    if placement.kind == "shard":
        pieces = list(torch.chunk(full, world, dim=1))
    elif placement.kind == "partial":
        pieces = [full / world] * world
    else:
        pieces = [full] * world
    load = _Pieces(pieces)
    rebuilt = rebuild("t", placement, [tuple(p.shape) for p in pieces], dtype, load)
    assert len(load.held_at_call) == world
    if placement.kind == "replicate":
        # rank 0's copy is the result; every other copy is dropped before the next is read
        assert [count for count, _ in load.held_at_call] == [0, 1, 1, 1]
        assert load.alive() == [rebuilt.tensor]
    else:
        # the output (or its accumulator) is built in place: no earlier piece is alive when one is read
        assert load.held_at_call == [(0, 0)] * world
        assert load.alive() == []
    assert rebuilt.tensor.shape == full.shape


def test_torch_placements_map_to_ours():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from parity.distributed.placement import from_torch

    assert from_torch(Shard(1), what="t") == shard(1)
    assert from_torch(Replicate(), what="t") == REPLICATE
    assert from_torch(Partial(), what="t") == PARTIAL
    with pytest.raises(UsageError, match="reduce op 'max'; only sum"):
        from_torch(Partial("max"), what="t")
