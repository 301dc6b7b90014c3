"""Capture under torch.distributed: every rank records its shards into its own bundle, rank 0 commits the set.

Run on every rank of a process group (``torchrun ... -m parity capture``, or
:func:`capture_rank_set` from code already inside a group). Each rank:

1. makes the subject's inputs and full state on the CPU (deterministic, so every rank has the
   same), builds the module on its device and loads the state, then lets the subject split it
   over the 1-D mesh: the subject's optional ``parallelize(module, mesh)`` (``parallelize_module``
   with ``ColwiseParallel``/``RowwiseParallel`` styles, or a manual Megatron-style split) returns the
   plan it applied, if any, so plain outputs of planned modules are placed automatically;
2. runs the module without hooks and with them and insists that its final outputs are bitwise
   equal (the observer-effect check, on every rank: the collectives run in both);
3. records, with forward hooks registered after the parallel styles' own, each module's output
   as a user of the module sees it, after the module's collectives: a DTensor is stored as its
   local shard with its placement, a plain tensor with the placement of the user's map, the plan,
   or Replicate (:mod:`parity.distributed.placement`); each tensor's device is recorded too;
4. optionally the high-precision reference (fp64 or fp32, on the rank's device) under the same
   names: a second model with the same split run after the recorded run (``reference_scope=
   "model"``), or each recorded module replayed on its own inputs during the recorded run
   (``"module"``, :mod:`parity.run.module_reference`): the reference implementation built on the
   meta device, split by the subject's ``parallelize`` there, then given the live model's own
   (local or DTensor) weights, so a replay runs the split's collectives as the live module
   does, on every rank in the same order;
5. commits its bundle (rank 0's also holds the inputs and the state, once: the full state, or with
   ``weights_from`` what no checkpoint file holds plus the files' names and BLAKE3,
   :mod:`parity.bundle.weights`); then rank 0 checks that every rank placed every tensor alike and
   commits the set (:mod:`parity.distributed.rankset`).

After each step the ranks agree (:meth:`parity.distributed.group.Group.agree`): one rank's error stops
every rank with a line naming it, and nothing is committed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parity.run import platform
from parity.bundle import weights as checkpoint_weights
from parity.bundle.writer import DEFAULT_SHARD_BYTES, BundleWriter
from parity.base.errors import ParityError, SubjectError, UsageError
from parity.base.text import write_line
from parity.bundle.manifest import DIGEST_FIELD
from parity.bundle.reader import open_bundle
from parity.run.module_reference import ModuleReference
from parity.run.recorder import RecordedTensor, Recorder, flatten
from parity.run.resources import Meter
from parity.run.runtime import Progress, launch_configs
from parity.run.subjects import Inputs, SubjectRunner, load_subject
from . import rankset
from .group import Group, join
from .placement import REPLICATE, Placement, PlacementMap, placement_from_json, unwrap_dtensor

REFERENCE_CHOICES = ("fp64", "fp32", "none")
REFERENCE_SCOPES = ("model", "module")


class CaptureError(UsageError):
    """A rank cannot be captured faithfully (recording changed its outputs, placements disagree)."""


@dataclasses.dataclass(frozen=True)
class RankSetResult:
    path: Path
    rank: int
    world_size: int
    tensors: int  # tensors this rank stored
    bytes: int  # bytes this rank wrote
    placements: dict[str, Placement]
    resources: dict[str, Any] | None = None  # this rank's cost (parity.run.resources.summary)


def apply_parallel(runner: SubjectRunner, module: nn.Module, mesh: Any) -> PlacementMap:
    """Let the subject split ``module`` over ``mesh``; the placements its plan implies (plan rules)
    plus the subject's own ``placements`` map (``{glob: "shard(-1)"}``, for manual splits)."""
    rules = PlacementMap()
    declared = getattr(runner.subject, "placements", None)
    if declared:
        if not isinstance(declared, Mapping):
            raise UsageError(f"subject {runner.name}: placements must be a mapping of module glob to placement")
        rules = PlacementMap.parse(declared, flag=f"subject {runner.name} placements")
    parallelize = getattr(runner.subject, "parallelize", None)
    if not callable(parallelize):
        return rules
    try:
        plan = parallelize(module, mesh)
    except ParityError:
        raise
    except Exception as err:  # the subject's own code: exit 3 naming the stage, like build
        raise SubjectError(runner.spec, "parallelize", err) from err
    if plan is None:
        return rules
    if not isinstance(plan, Mapping):
        raise UsageError(f"subject {runner.name}: parallelize() must return its plan (a mapping) or None")
    return PlacementMap.from_plan(plan) + rules


def _final_outputs(result: Any) -> list[tuple[str, torch.Tensor]]:
    _, tensors = flatten(result)
    return [(path, unwrap_dtensor(tensor)[0].detach().to("cpu", copy=True)) for path, tensor in tensors]


def _first_difference(off: list[tuple[str, torch.Tensor]], on: list[tuple[str, torch.Tensor]]) -> str | None:
    if [path for path, _ in off] != [path for path, _ in on]:
        return "the structure of the output"
    for (path, a), (_, b) in zip(off, on):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)):
            return path or "<output>"
    return None


class _Store:
    """The recorder's callback: unwraps DTensors, places plain tensors, writes to this rank's bundle."""

    def __init__(self, writer: BundleWriter, rules: PlacementMap, say: Progress):
        self.writer = writer
        self.rules = rules
        self.say = say
        self.placements: dict[str, Placement] = {}
        self.counts: dict[str, int] = {}  # tensors recorded so far, by kind

    def __call__(self, record: RecordedTensor) -> None:
        what = f"tensor '{record.name}'"
        local, placement = unwrap_dtensor(record.tensor, what=what)
        if placement is None:
            rule = self.rules.lookup(record.module, record.name)
            placement = (rule.placement if rule is not None else REPLICATE).normalized(local.ndim, what=what)
        if record.kind == "output":
            self.placements[record.name] = placement
        elif record.kind == "reference" and self.placements.get(record.name, placement) != placement:
            raise CaptureError(f"{what}: the reference run placed it {placement.text}, the recorded run "
                               f"{self.placements[record.name].text}")
        self.writer.add(record.kind, record.name, local, layer=record.layer, module=record.module,
                        call_index=record.call_index, path=record.path, copy=True, device=str(local.device))
        self.counts[record.kind] = self.counts.get(record.kind, 0) + 1
        self.say.tick(lambda: self.recorded(record.kind))

    def recorded(self, kind: str) -> str:
        """The progress line of how many ``kind`` tensors (output, reference) this rank recorded so far."""
        count = self.counts.get(kind, 0)
        return f"recorded {count} {kind} tensor{'' if count == 1 else 's'}"


def record_ranks(
    group: Group,
    runner: SubjectRunner,
    out: str | os.PathLike,
    *,
    impl: str,
    state: Mapping[str, torch.Tensor],
    inputs: Inputs,
    store_subject: bool,
    layers: Sequence[str] | None = None,
    reference: str | None = "fp64",
    placements: PlacementMap | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    durable: bool = True,
    progress: Callable[[str], None] | None = None,
    extra_fields: Mapping[str, Any] | None = None,
    reference_scope: str = "model",
    weights_info: Mapping[str, Any] | None = None,
) -> RankSetResult:
    """Every rank: run ``runner`` split over the group, record this rank's tensors into
    ``out/rank-NNNNN``; rank 0 commits the set at ``out``. ``state`` and ``inputs`` are the full
    ones (the same on every rank); ``store_subject``: rank 0 stores them (a capture; a compare's
    scratch set does not). ``reference_scope``: the module docstring's step 4. ``weights_info``:
    the manifest's ``weights`` object (:func:`parity.bundle.weights.by_reference`), for rank 0's
    bundle, which then stores only the state tensors no checkpoint file holds. Returns on every
    rank once the set is committed."""
    rank, world = group.rank, group.world_size
    say = Progress(progress)
    meter = Meter(group.device)
    device = group.device
    user_rules = placements or PlacementMap()
    if reference not in (None, *REFERENCE_CHOICES):
        raise UsageError(f"unknown --reference {reference!r}; choose from {', '.join(REFERENCE_CHOICES)}")
    ref_dtype = {"fp64": torch.float64, "fp32": torch.float32}.get(reference or "none")
    if reference_scope not in REFERENCE_SCOPES:
        raise UsageError(f"unknown --reference-scope {reference_scope!r}; choose from {', '.join(REFERENCE_SCOPES)}")
    per_module = ref_dtype is not None and reference_scope == "module"
    referenced = {name for name, _, _ in weights_info["tensors"]} if weights_info is not None else set()

    error: BaseException | None = None
    try:
        if rank == 0:
            rankset.prepare(out, world_size=world, force=force)
    except ParityError as err:
        error = err
    group.agree(error, "preparing the output directory")
    set_id = group.broadcast(secrets.token_hex(16), step="drawing the set id")
    mesh = group.mesh()
    root = Path(out)

    result = digest = None
    # Leaving the block without a commit (this rank's error, or another's: RankFailed) deletes
    # what this rank wrote; the set has no top manifest then.
    with BundleWriter(root / rankset.rank_dir(rank), force=force, shard_bytes=shard_bytes,
                      durable=durable) as writer:
        error = None
        hooks_check: dict[str, Any] = {}
        reference_calls: list[dict[str, Any]] = []
        reference_info = None
        store = _Store(writer, PlacementMap(), say)
        try:
            writer.open()
            module = runner.build(impl, state=state, device=device)
            store.rules = apply_parallel(runner, module, mesh) + user_rules
            recorder = Recorder(module, store, layers=layers, copy=False)
            if rank == 0 and store_subject:
                for name, tensor in inputs.tensors.items():
                    writer.add("input", name, tensor)
                for name, tensor in state.items():
                    if name not in referenced:  # a checkpoint file holds the others
                        writer.add("state", name, tensor)
            module_reference = None
            if per_module:
                shared = runner.build_sharing(runner.reference_impl, module,
                                              prepare=lambda meta: apply_parallel(runner, meta, mesh))
                module_reference = ModuleReference(module, shared, store, dtype=ref_dtype, layers=layers)
            device_inputs = inputs.to(device)
            say(f"rank {rank}/{world}: impl {impl} on {device}: run without hooks")
            off = _final_outputs(runner.run(module, device_inputs))
            say(f"rank {rank}/{world}: recorded run"
                + (f", each module replayed in {reference} on {device}" if per_module else ""))
            with recorder, (module_reference if module_reference is not None else contextlib.nullcontext()):
                on = _final_outputs(runner.run(module, device_inputs))
            if module_reference is not None:
                module_reference.check()
            say(store.recorded("output"))
            difference = _first_difference(off, on)
            hooks_check = {"bitwise_equal": difference is None, "tensors_compared": len(off),
                           "first_difference": difference}
            if difference is not None:
                raise CaptureError(f"subject {runner.name}: on rank {rank} the recorded run's output differs from the "
                                   f"run without hooks at {difference}; recording changed the result or the subject "
                                   "is not deterministic run to run")
            if not recorder.calls:
                raise UsageError(f"subject {runner.name}: the selected layers produced no tensors; nothing to capture")
            calls = [call.to_json() for call in recorder.calls]
            used_configs = launch_configs(module)
            if module_reference is not None:
                say(store.recorded("reference"))
                reference_calls = [call.to_json() for call in module_reference.calls]
                reference_info = _reference_info(reference, "module", runner.reference_impl, device, ref_dtype,
                                                 writer)
                reference_info["peak_copy_bytes"] = module_reference.peak_copy_bytes
            del module, recorder, device_inputs, module_reference
        except ParityError as err:
            error = err
        group.agree(error, "the recorded run")

        error = None
        try:
            if ref_dtype is not None and not per_module:
                say(f"rank {rank}/{world}: reference run in {reference} on {device}")
                ref_module = runner.build(runner.reference_impl, state=state, device=device, dtype=ref_dtype)
                apply_parallel(runner, ref_module, mesh)
                ref_recorder = Recorder(ref_module, store, layers=layers, kind="reference", copy=False)
                with ref_recorder:
                    runner.run(ref_module, inputs.to(device, ref_dtype))
                say(store.recorded("reference"))
                reference_calls = [call.to_json() for call in ref_recorder.calls]
                reference_info = _reference_info(reference, "model", runner.reference_impl, device, ref_dtype, writer)
                del ref_module, ref_recorder
            writer.finish_shards()  # this rank's cost, measured with every shard on disk
            resources = meter.summary(tensors=len(writer.entries), nbytes=writer.bytes_written, direction="written")
            fields = {
                "subject": runner.describe(),
                "impl": impl,
                "device": str(device),
                "capture": {"layers": list(layers) if layers is not None else None, "record_inputs": False,
                            "reference": reference_info, "shard_bytes": shard_bytes, "durable": durable,
                            "resources": resources},
                "platform": platform.fingerprint(device),
                "kernel_configs": {"used": used_configs, "provided": None},
                "hooks_check": hooks_check,
                "inputs_meta": inputs.meta if rank == 0 and store_subject else {},
                "layers": calls,
                "reference_layers": reference_calls,
                **rankset.bundle_fields(set_id, rank, world),
                **({"weights": dict(weights_info)} if weights_info is not None and rank == 0 and store_subject
                   else {}),
                **dict(extra_fields or {}),
            }
            path = writer.commit(fields)
            digest = _manifest_digest(path)
            result = RankSetResult(path=root, rank=rank, world_size=world, tensors=len(writer.entries),
                                   bytes=writer.bytes_written, placements=dict(store.placements), resources=resources)
        except ParityError as err:
            error = err
        group.agree(error, "writing the rank bundles")

    assert result is not None
    report = group.gather({"rank": rank, "bundle": rankset.rank_dir(rank), DIGEST_FIELD: digest,
                           "placements": {name: placement.to_json() for name, placement in result.placements.items()}},
                          step="gathering the rank bundles")
    error = None
    try:
        if rank == 0:
            merged = _merge_placements(report)
            rankset.commit(root, set_id=set_id, world_size=world,
                           mesh={"shape": [world], "dim_names": ["tp"], "device_type": device.type},
                           backend=group.backend,
                           ranks=[{"rank": item["rank"], "bundle": item["bundle"], DIGEST_FIELD: item[DIGEST_FIELD]}
                                  for item in report],
                           placements=merged, placement_rules=store.rules.to_json())
            say(f"committed rank set {root}: {world} ranks, {len(merged)} tensors")
    except ParityError as err:
        error = err
    group.agree(error, "committing the rank set")
    return result


def _reference_info(precision: str, scope: str, impl: str, device: torch.device, dtype: torch.dtype,
                    writer: BundleWriter) -> dict[str, Any]:
    outputs, references = writer.names("output"), writer.names("reference")
    return {"precision": precision, "scope": scope, "impl": impl, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "outputs_without_reference": sorted(outputs - references)}


def _manifest_digest(path: Path) -> str:

    return str(open_bundle(path, rank_of_a_set=True).manifest[DIGEST_FIELD])


def _merge_placements(report: list[dict[str, Any]]) -> dict[str, Placement]:
    """One placement per tensor; a CaptureError where two ranks placed a tensor differently."""

    first = {name: placement_from_json(value, name) for name, value in report[0]["placements"].items()}
    for item in report[1:]:
        for name, value in item["placements"].items():
            placement = placement_from_json(value, name)
            if first.get(name) != placement:
                shown = first[name].text if name in first else "nothing"
                raise CaptureError(f"tensor '{name}' is placed {placement.text} on rank {item['rank']} but {shown} on "
                                   "rank 0; every rank must record the same tensors with the same placement")
    return first


def capture_rank_set(
    subject: SubjectRunner | str,
    out: str | os.PathLike,
    *,
    subject_args: Mapping[str, Any] | None = None,
    impl: str = "reference",
    device: torch.device | str | None = None,
    layers: Sequence[str] | None = None,
    reference: str | None = "fp64",
    placements: PlacementMap | Sequence[str] | Mapping[str, str] | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    durable: bool = True,
    progress: Callable[[str], None] | None = None,
    group: Group | None = None,
    reference_scope: str = "model",
    weights_from: Sequence[str | os.PathLike] | None = None,
) -> RankSetResult:
    """Capture ``subject`` on every rank of the process group into the rank set ``out``.

    Call it on every rank (inside an initialised group, or under torchrun: ``group`` defaults to
    :func:`parity.distributed.group.join` on ``device``). ``placements``: the user's placement map
    (``["layers.*.mlp.up_proj=shard(-1)"]`` or ``{glob: placement}``) for plain tensors of a manual
    split. ``reference_scope`` and ``weights_from`` are :func:`parity.run.capture.capture`'s: rank 0
    names the checkpoint files (their BLAKE3 taken, each weight checked bitwise against them) in
    its bundle. The other arguments are also capture's. UsageError (on every rank, naming the rank
    that failed) for bad arguments or a failed rank; nothing is committed then.
    """
    group = group or join(device)
    rules = placements if isinstance(placements, PlacementMap) else PlacementMap.parse(placements or [])
    error: BaseException | None = None
    runner = state = inputs = weights_info = None
    try:
        runner = subject if isinstance(subject, SubjectRunner) else load_subject(subject, subject_args)
        runner.check_impl(impl)
        if reference not in (None, "none"):
            runner.check_impl(runner.reference_impl)
        inputs = runner.make_inputs()
        state = runner.make_state(impl)
        if weights_from and group.rank == 0:  # the rank that stores the state names the files instead
            weights_info, _ = checkpoint_weights.by_reference(checkpoint_weights.describe(weights_from), state)
    except ParityError as err:
        error = err
    group.agree(error, "making the subject")
    assert runner is not None and state is not None and inputs is not None
    return record_ranks(group, runner, out, impl=impl, state=state, inputs=inputs, store_subject=True, layers=layers,
                        reference=None if reference == "none" else reference, placements=rules, force=force,
                        shard_bytes=shard_bytes, durable=durable, progress=progress, reference_scope=reference_scope,
                        weights_info=weights_info)


def stderr_progress(rank: int, world: int) -> Callable[[str], None]:
    """Progress lines on stderr headed by the rank, each written in one call (ranks share the stream)."""
    def say(message: str) -> None:
        write_line(sys.stderr, f"parity capture [rank {rank}/{world}]: {message}")

    return say
