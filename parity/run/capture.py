"""Capture: run a subject with hooks, stream every recorded tensor into a golden bundle.

Steps: make the inputs on the CPU (and the state, where the subject makes it); build the module
for ``impl`` on ``device`` (where the subject builds on a device, there); store its weights from
the module itself, one tensor at a time (or, with ``weights_from``, name the checkpoint files
that hold them: :mod:`parity.bundle.weights`); run it once without hooks and once with (the
recorded run), and insist that the two final outputs are bitwise equal, so recording cannot have
changed what it measures; optionally a high-precision reference, recorded under the same layer
names as ``kind="reference"``: of the whole model (``reference_scope="model"``: impl
``reference`` in fp64 on the CPU, or fp32 on the device, a second model) or of each module on its
own inputs during the recorded run (``"module"``, fp64 or fp32 on the device that ran the forward:
:mod:`parity.run.module_reference`); write all of it shard by shard; commit the bundle atomically.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from parity.base import dtypes
from parity.base.errors import UsageError
from parity.base.text import plural, write_line
from parity.bundle.shards import DEFAULT_SHARD_BYTES
from parity.bundle import weights as checkpoint_weights
from parity.bundle.writer import BundleWriter
from parity.run.repeats import RepeatTracker, capture_record, check_runs
from parity.run import platform
from parity.run.module_reference import ModuleReference
from parity.run.recorder import RecordedTensor, Recorder, flatten
from parity.run.resources import Meter, Phases
from parity.run.runtime import Progress, check_device, check_triton_mode, cores_left_for, launch_configs
from parity.run.seeds import DRAW_KINDS, SEED_ARG, draw_name, seed_values
from parity.run.subjects import SubjectRunner, load_subject

REFERENCE_CHOICES = ("fp64", "fp32", "none")
# Whole-model reference (a second model, from the subject's inputs) or each module's own
# (replayed on its recorded inputs during the recorded run).
REFERENCE_SCOPES = ("model", "module")


class CaptureError(UsageError):
    """The subject cannot be captured faithfully (e.g. recording changed its outputs)."""


@dataclasses.dataclass(frozen=True)
class CaptureResult:
    path: Path
    layers: int  # recorded layer calls (outputs)
    tensors: int  # tensors stored, every kind
    bytes: int  # bytes of shards written
    hooks_check: dict[str, Any]
    reference: str | None
    repeat: dict[str, Any] | None = None  # capture --repeat N: the manifest's capture.repeat
    # What the capture cost: parity.run.resources.summary (also the manifest's capture.resources).
    resources: dict[str, Any] | None = None


def _reference_plan(reference: str | None, device: torch.device,
                    scope: str = "model") -> tuple[torch.device, torch.dtype] | None:
    if scope not in REFERENCE_SCOPES:
        raise UsageError(f"unknown --reference-scope {scope!r}; choose from {', '.join(REFERENCE_SCOPES)}")
    if reference in (None, "none"):
        return None
    if reference not in REFERENCE_CHOICES:
        raise UsageError(f"unknown --reference {reference!r}; choose from {', '.join(REFERENCE_CHOICES)}")
    if scope == "module":
        # On the device that ran the forward: each module's high-precision copy is made beside it.
        return device, torch.float64 if reference == "fp64" else torch.float32
    if reference == "fp64":
        # fp64 on the CPU: the same high-precision arithmetic on every capture host.
        return torch.device("cpu"), torch.float64
    if reference == "fp32":
        return device, torch.float32
    raise UsageError(f"unknown --reference {reference!r}; choose from {', '.join(REFERENCE_CHOICES)}")


def _cpu_tensors(result: Any) -> list[tuple[str, torch.Tensor]]:
    _, tensors = flatten(result)
    return [(path, tensor.detach().to("cpu", copy=True)) for path, tensor in tensors]


def _first_difference(off: list[tuple[str, torch.Tensor]], on: list[tuple[str, torch.Tensor]]) -> str | None:
    """Where two runs' outputs differ bit for bit (NaN payloads and signed zeros included)."""
    if [path for path, _ in off] != [path for path, _ in on]:
        return "the structure of the output"
    for (path, a), (_, b) in zip(off, on):
        where = path or "<output>"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where} ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})"
        bytes_a = a.contiguous().reshape(-1).view(torch.uint8)
        bytes_b = b.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(bytes_a, bytes_b):
            return where
    return None


def _reference_info(precision: str, scope: str, impl: str, device: torch.device, dtype: torch.dtype,
                    writer: BundleWriter) -> dict[str, Any]:
    outputs, references = writer.names("output"), writer.names("reference")
    return {"precision": precision, "scope": scope, "impl": impl, "device": str(device),
            "dtype": dtypes.dtype_text(dtype), "outputs_without_reference": sorted(outputs - references)}


def stderr_progress(message: str) -> None:
    write_line(sys.stderr, f"parity capture: {message}")


def capture(
    subject: SubjectRunner | str,
    out: str | os.PathLike,
    *,
    subject_args: Mapping[str, Any] | None = None,
    impl: str = "reference",
    device: torch.device | str = "cpu",
    layers: Sequence[str] | None = None,
    record_inputs: bool = False,
    reference: str | None = "fp64",
    kernel_configs: Mapping[str, Any] | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
    durable: bool = True,
    reference_scope: str = "model",
    weights_from: Sequence[str | os.PathLike] | None = None,
    repeat: int = 1,
    seeds: int = 1,
) -> CaptureResult:
    """Capture ``subject`` (a SubjectRunner, or a spec with ``subject_args``) into a bundle at ``out``.

    ``layers``: fnmatch globs over module paths (default: every module that produces tensors).
    ``record_inputs``: also store each recorded module's inputs, so compare can replay one layer.
    ``reference``: ``"fp64"`` (impl reference, fp64, CPU), ``"fp32"`` (impl reference, fp32,
    ``device``) or ``None``/``"none"``. ``kernel_configs``: launch configs to record next to the
    ones the modules report. ``durable=False`` skips the fsync of every shard and the manifest
    (:class:`~parity.bundle.BundleWriter`). ``reference_scope``: ``"model"`` (a whole-model
    reference run, above) or ``"module"`` (each recorded module replayed on its own inputs in
    ``reference``'s precision on ``device``: :mod:`parity.run.module_reference`).
    ``weights_from``: safetensors files or directories that hold the model's weights; the bundle
    then names them with their BLAKE3 instead of storing the weights (each weight is checked equal
    to the file's first; what no file holds is stored). Raises UsageError for bad arguments and
    CaptureError when the hooks-on run differs from the hooks-off run; on any error nothing is
    left at ``out``.

    ``repeat``: run the recorded forward this many times and record in the manifest
    (``capture.repeat``) whether every recorded output was bitwise equal run to run
    (:mod:`parity.run.repeats`; it keeps a CPU copy of the first run's outputs meanwhile). A
    subject that is not deterministic is then captured (its first run is the golden) instead of
    refused by the hooks check, since its hooks-off and hooks-on runs cannot be bitwise equal either.

    ``seeds``: record the input draws of that many seeds (the subject's ``seed`` argument and the
    ones after it) through the same model, each with its outputs and (model-scope) references
    (:mod:`parity.run.seeds`); a subject without a ``seed`` argument is a UsageError.

    The result's ``resources`` (and the manifest's ``capture.resources``) say what the capture
    cost: :mod:`parity.run.resources`.
    """
    repeat = check_runs(repeat)
    runner = subject if isinstance(subject, SubjectRunner) else load_subject(subject, subject_args)
    runner.check_impl(impl)
    seed_list = seed_values(runner.args, seeds, runner.spec)
    if seed_list and reference_scope == "module":
        raise UsageError("--seeds records whole-model references only; drop --reference-scope module")
    device = check_device(device)
    check_triton_mode(impl, device)
    plan = _reference_plan(reference, device, reference_scope)
    if plan is not None:
        runner.check_impl(runner.reference_impl)
    meter = Meter(device)
    phases = Phases()
    checkpoint = checkpoint_weights.locate(weights_from) if weights_from else None
    say = Progress(progress)
    importing = platform.prefetch_imports()  # overlaps the runs; the fingerprint is taken after them

    # The checkpoint's digests are recorded, not checked against anything: nothing needs them
    # before the manifest is written, so they are taken on a thread of their own while the model
    # is built, run and written (the commit waits for them; a failure there fails the capture).
    with BundleWriter(out, force=force, shard_bytes=shard_bytes, progress=say.emit, durable=durable) as writer, \
            (checkpoint_weights.BackgroundDigests(checkpoint) if checkpoint is not None
             else contextlib.nullcontext()) as digests:
        made = runner.made_state()
        with phases("build"):
            module = runner.build(impl, state=made, device=device)
        # The stored state is what the module holds (views of its own tensors: no second copy);
        # a subject's made state is freed once loaded, unless the whole-model reference needs it.
        state = {name: tensor.detach() for name, tensor in module.state_dict().items()}
        del made
        tracker = RepeatTracker(repeat) if repeat > 1 else None

        def store(record: RecordedTensor) -> None:
            if tracker is not None and record.kind == "output":
                tracker.baseline(record.name, record.tensor)
            # The recorder hands over the module's own tensor (copy=False); the writer copies it
            # once, into its shard arena, before this returns (on a GPU: where the host waits for
            # the work queued before it).
            with phases("copy_to_writer"):
                writer.add(record.kind, record.name, record.tensor, layer=record.layer, module=record.module,
                           call_index=record.call_index, path=record.path, copy=True,
                           device=str(record.tensor.device))
            say.tick(lambda: f"recorded so far: {plural(len(recorder.calls), 'layer call')}, "
                             f"{plural(recorder.tensor_count, 'tensor')} ({recorder.byte_count / 2**20:.1f} MiB)")

        recorder = Recorder(module, store, layers=layers, record_inputs=record_inputs, copy=False)  # checks the globs
        inputs = runner.make_inputs()
        say(f"{runner.name}: {plural(len(recorder.modules), 'module')} selected; inputs made on the CPU")
        for name, tensor in inputs.tensors.items():
            writer.add("input", name, tensor)
        weights_info = None
        stored_state = state
        if checkpoint is not None:
            say(f"{runner.name}: checking the weights against {len(checkpoint.files)} checkpoint file(s)")
            with phases("weights_check"):
                weights_info, stored_names = checkpoint_weights.by_reference(checkpoint, state)
            stored_state = {name: state[name] for name in stored_names}
        for name, tensor in stored_state.items():  # one at a time into the writer's ring
            writer.add("state", name, tensor)
        del stored_state
        module_reference = None
        if plan is not None and reference_scope == "module":
            ref_device, ref_dtype = plan
            module_reference = ModuleReference(module, runner.build_sharing(runner.reference_impl, module), store,
                                               dtype=ref_dtype, layers=layers)

        device_inputs = inputs.to(device)
        say(f"{runner.name}: impl {impl} on {device}: run without hooks")
        with phases("forward"):
            hooks_off = _cpu_tensors(runner.run(module, device_inputs))
        say(f"{runner.name}: impl {impl} on {device}: recorded run"
            + (f", each module replayed in {reference} on {device}" if module_reference is not None else ""))
        with phases("recorded_run"), recorder, \
                (module_reference if module_reference is not None else contextlib.nullcontext()):
            hooks_on = _cpu_tensors(runner.run(module, device_inputs))
        if module_reference is not None:
            module_reference.check()
        determinism = None
        if tracker is not None:
            for number in range(2, repeat + 1):
                say(f"{runner.name}: repeat run {number} of {repeat}: bitwise against the recorded run")
                tracker.start_run()
                with Recorder(module, lambda record: tracker.observe(record.name, record.tensor), layers=layers,
                              copy=False):
                    runner.run(module, device_inputs)
            determinism = tracker.report()
            say(f"{runner.name}: {determinism.summary()}")
        difference = _first_difference(hooks_off, hooks_on)
        hooks_check = {"bitwise_equal": difference is None, "tensors_compared": len(hooks_off),
                       "first_difference": difference}
        if difference is not None and determinism is not None and not determinism.bitwise_equal:
            # Repeated runs with the same hooks already differ: the hooks-off run cannot be
            # expected to match bitwise, so the difference is the subject's, not the recording's.
            hooks_check["explained_by"] = "the subject is not deterministic run to run (capture --repeat)"
        elif difference is not None:
            raise CaptureError(
                f"subject {runner.name}: the recorded run's output differs from the run without hooks at "
                f"{difference}; recording changed the result or the subject is not deterministic run to run"
            )
        if not recorder.calls:
            raise UsageError(f"subject {runner.name}: the selected layers produced no tensors; nothing to capture")

        def store_draw(seed: int) -> Callable[[RecordedTensor], None]:
            def store(record: RecordedTensor) -> None:
                writer.add(DRAW_KINDS[record.kind], draw_name(seed, record.name), record.tensor,
                           layer=draw_name(seed, record.layer), module=record.module, call_index=record.call_index,
                           path=record.path, copy=True, device=str(record.tensor.device))
            return store

        draws: list[tuple[int, Any]] = []  # (seed, its inputs on the CPU) of every later draw
        for seed in seed_list[1:]:
            draw = load_subject(runner.spec, {**runner.args, SEED_ARG: seed}).make_inputs()
            say(f"{runner.name}: draw of seed {seed}: impl {impl} on {device}")
            for name, tensor in draw.tensors.items():
                writer.add(DRAW_KINDS["input"], draw_name(seed, name), tensor)
            with Recorder(module, store_draw(seed), layers=layers, copy=False):
                runner.run(module, draw.to(device))
            draws.append((seed, draw))
        calls = [call.to_json() for call in recorder.calls]
        # What the module reports about its launches is all capture needs of it from here on: free
        # it (host or device memory) before the reference module is built.
        used_configs = launch_configs(module)
        reference_calls: list[dict[str, Any]] = []
        reference_info = None
        if module_reference is not None:
            reference_calls = [call.to_json() for call in module_reference.calls]
            reference_info = _reference_info(reference, "module", runner.reference_impl, device, plan[1], writer)
            reference_info["peak_copy_bytes"] = module_reference.peak_copy_bytes
            phases.add("reference_replay", module_reference.seconds)
            del module_reference
        if plan is None or reference_scope == "module":
            del state
        del module, recorder, device_inputs

        if plan is not None and reference_scope == "model":
            ref_device, ref_dtype = plan
            say(f"{runner.name}: reference run: impl {runner.reference_impl} in {reference} on {ref_device}")
            ref_module = runner.build(runner.reference_impl, state=state, device=ref_device, dtype=ref_dtype)
            recorder = Recorder(ref_module, store, layers=layers, kind="reference", copy=False)
            # The writer hashes and writes what the run records meanwhile: on a many-core host,
            # torch's threads leave it some cores (the run's own outputs are not the golden).
            threads = writer.busy_threads if ref_device.type == "cpu" else 0
            with phases("reference"), recorder, cores_left_for(threads):
                runner.run(ref_module, inputs.to(ref_device, ref_dtype))
            for seed, draw in draws:
                with Recorder(ref_module, store_draw(seed), layers=layers, kind="reference", copy=False), \
                        cores_left_for(threads):
                    runner.run(ref_module, draw.to(ref_device, ref_dtype))
            reference_calls = [call.to_json() for call in recorder.calls]
            reference_info = _reference_info(reference, "model", runner.reference_impl, ref_device, ref_dtype, writer)
            del ref_module, recorder, state

        importing.join()
        with phases("writing"):  # what the shards' writing still took once the runs were done
            writer.finish_shards()
        if digests is not None:
            with phases("digests_wait"):  # what the digests' thread still took once the shards were written
                weights_info["files"] = checkpoint_weights.file_entries(digests.result())
            phases.add("digests", digests.seconds)
        # Measured once every shard is on disk: the manifest, a few KiB, is all that is left to write.
        resources = meter.summary(tensors=len(writer.entries), nbytes=writer.bytes_written, direction="written",
                                  phases=phases)
        manifest = {
            "subject": runner.describe(),
            "impl": impl,
            "device": str(device),
            "capture": {
                "layers": list(layers) if layers is not None else None,
                "record_inputs": record_inputs,
                "reference": reference_info,
                "shard_bytes": shard_bytes,
                "durable": durable,
                **({"repeat": capture_record(determinism)} if determinism is not None else {}),
                "resources": resources,
            },
            "platform": platform.fingerprint(device),
            "kernel_configs": {"used": used_configs, "provided": dict(kernel_configs) if kernel_configs else None},
            "hooks_check": hooks_check,
            **({"weights": weights_info} if weights_info is not None else {}),
            **({"seeds": {"arg": SEED_ARG, "values": seed_list, "inputs_meta": [draw.meta for _, draw in draws]}}
               if seed_list else {}),
            "inputs_meta": inputs.meta,
            "layers": calls,
            "reference_layers": reference_calls,
        }
        path = writer.commit(manifest)
        result = CaptureResult(path=path, layers=len(calls), tensors=len(writer.entries),
                               bytes=writer.bytes_written, hooks_check=hooks_check,
                               reference=reference if plan is not None else None, resources=resources,
                               repeat=capture_record(determinism) if determinism is not None else None)
    return result

