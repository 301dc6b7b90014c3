"""More than one input draw in one bundle (``capture --seeds N``): which seeds, where each draw is stored.

A subject that takes a ``seed`` argument draws its inputs from it. ``--seeds N`` records the
draws of N seeds, the subject's own ``seed`` and the N - 1 after it (``s, s+1, ..., s+N-1``: fixed
before anything runs, so no draw is chosen by what the code under test does with it). The model
is one: its weights are those of the first draw's subject, stored once; the later draws change
the inputs only.

Layout (additive; schema version 6, :data:`SEEDS_VERSION`). The first draw is the bundle as
always: its ``input``, ``output`` and ``reference`` entries and ``inputs_meta``, so everything
that reads one draw reads it unchanged. Every later draw's tensors are entries of the kinds
``draw_input``, ``draw_output`` and ``draw_reference``, named ``"<seed>|<name>"`` (their layer
``"<seed>|<layer>"``), and the manifest's ``seeds`` object lists them::

    "seeds": {"arg": "seed", "values": [0, 1, 2], "inputs_meta": [{...}, {...}]}

(``inputs_meta`` of each later draw, in order). Older parity refuses version 6 rather than
judging the first draw alone as if it were all. :class:`DrawView` presents one later draw as a
bundle of its own (the first draw's state and layer calls, that draw's inputs, goldens and
references), so compare judges it with the same engine.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from parity.base.errors import UsageError
from parity.bundle.manifest import Entry

SEED_ARG = "seed"
# The kind of a later draw's entry, by the kind the first draw's counterpart has.
DRAW_KINDS = {"input": "draw_input", "output": "draw_output", "reference": "draw_reference"}
SEPARATOR = "|"
MAX_SEEDS = 1000  # a draw is a whole forward and its tensors: beyond this a count is a typo


def draw_name(seed: int, name: str) -> str:
    return f"{seed}{SEPARATOR}{name}"


def seed_values(subject_args: Mapping[str, Any], count: int, subject: str) -> list[int]:
    """The seeds of ``count`` draws: the subject's ``seed`` argument and the ones after it (empty
    for one draw, which is the bundle as always)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"--seeds must be a whole number of draws >= 1, got {count!r}")
    if count > MAX_SEEDS:
        raise UsageError(f"--seeds {count}: at most {MAX_SEEDS} draws in one bundle")
    if count == 1:
        return []  # one draw: the bundle as always, no seeds field
    base = subject_args.get(SEED_ARG)
    if isinstance(base, bool) or not isinstance(base, int):
        raise UsageError(f"--seeds needs a subject that takes an integer '{SEED_ARG}' argument; subject {subject} "
                         f"has {'none' if base is None else repr(base)}"
                         + (" (attention cases carry their own seeds: list them in --set cases=...)"
                            if subject == "attention" else ""))
    return [base + number for number in range(count)]


def seeds_info(manifest_seeds: Any) -> list[int]:
    """The seeds a bundle's manifest lists (one, unnamed, for a bundle of one draw)."""
    if not isinstance(manifest_seeds, dict):
        return []
    return list(manifest_seeds.get("values") or [])


class DrawView:
    """One later draw of a bundle, read as a bundle: the draw's own ``input``, ``output`` and
    ``reference`` entries under their first-draw names, everything else (state, layer calls,
    platform) the bundle's own."""

    def __init__(self, bundle: Any, seed: int, inputs_meta: Mapping[str, Any]):
        self._bundle = bundle
        self.seed = seed
        self._inputs_meta = dict(inputs_meta)
        prefix = draw_name(seed, "")
        self._entries: dict[str, list[Entry]] = {}
        self._index: dict[tuple[str, str], Entry] = {}
        self._stored: dict[tuple[str, str], Entry] = {}  # the renamed entry's own, as the bundle lists it
        for kind, stored_kind in DRAW_KINDS.items():
            renamed = []
            for entry in bundle.entries_of(stored_kind):
                if not entry.name.startswith(prefix):
                    continue
                layer = entry.layer[len(prefix):] if entry.layer and entry.layer.startswith(prefix) else entry.layer
                view = dataclasses.replace(entry, kind=kind, name=entry.name[len(prefix):], layer=layer)
                renamed.append(view)
                self._index[(kind, view.name)] = view
                self._stored[(kind, view.name)] = entry
            self._entries[kind] = renamed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bundle, name)

    @property
    def inputs_meta(self) -> dict[str, Any]:
        return dict(self._inputs_meta)

    def entries_of(self, kind: str) -> list[Entry]:
        return list(self._entries[kind]) if kind in self._entries else self._bundle.entries_of(kind)

    def has(self, name: str, kind: str = "output") -> bool:
        return (kind, name) in self._index if kind in self._entries else self._bundle.has(name, kind)

    def entry(self, name: str, kind: str = "output") -> Entry:
        if kind not in self._entries:
            return self._bundle.entry(name, kind)
        try:
            return self._index[(kind, name)]
        except KeyError:
            return self._bundle.entry(draw_name(self.seed, name), DRAW_KINDS[kind])  # its one-line BundleError

    def load(self, entry: Entry | str, kind: str = "output", *, device: torch.device | str | None = None) -> torch.Tensor:
        if isinstance(entry, str):
            entry = self.entry(entry, kind)
        stored = self._stored.get((entry.kind, entry.name), entry)
        return self._bundle.load(stored, stored.kind, device=device)

    def tensors(self, kind: str, *, device=None) -> dict[str, torch.Tensor]:
        return {entry.name: self.load(entry, device=device) for entry in self.entries_of(kind)}


def draw_views(bundle: Any) -> list[DrawView]:
    """A view of every later draw the bundle holds, in the order of its ``seeds.values``."""
    raw = getattr(bundle, "seeds", None)
    if not isinstance(raw, dict):
        return []
    values = list(raw.get("values") or [])
    metas = list(raw.get("inputs_meta") or [])
    return [DrawView(bundle, seed, metas[number] if number < len(metas) else {})
            for number, seed in enumerate(values[1:])]
