"""The harness's own benchmark: capture and compare against raw baselines, at 1x, 2x and 4x sizes.

Kept beside the tests, outside the installed package: users never import it. Long because the
workers, the baselines, the settle and RSS sampling and the report are one measurement procedure,
read together (BENCHMARK.md beside this file).

``python bench/harness/harness_benchmark.py`` builds a synthetic user subject (a stack of fp32 blocks, each a
LayerNorm, a Linear and a GELU with a residual: four recorded modules per block, plus the root),
captures it with parity, compares it with parity, and runs the same work the raw way:

- compare: parity's ``compare_bundle`` (impl ``reference`` against its own golden, the default
  rule, so every tensor is also compared with its fp64 reference on both sides) against *the
  forward + a raw ``safe_open`` read of every tensor compare reads + bare cosine / max abs /
  rel L2 of the same three pairs per tensor* (``compare-raw``), and against the forward + read
  alone (``read-raw``).
- capture: parity's ``capture`` (fp64 reference) against *the forward passes it needs (without
  hooks, with hooks copying every output, the fp64 reference run) + a raw
  ``safetensors.torch.save_file`` of the same bytes, shard by shard* (``capture-raw``). Like for
  like: the default capture, which fsyncs every shard before the manifest names it, against the
  baseline with an fsync after each ``save_file``; ``capture --no-fsync`` against the baseline
  without.
- write: ``BundleWriter`` (one BLAKE3 digest per byte: each tensor's and each shard header's) in
  bytes per second against ``save_file`` of the same tensors in the same shards, like for like:
  with an fsync per shard against ``save_file`` + fsync, and ``durable=False`` against plain
  ``save_file`` (the page cache). Each row also keeps the durable writer's ratio to the page cache.

Every parity measurement runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is its own;
the baselines share one subprocess per size. Times are wall seconds of the measured work (after
imports), medians over ``--repeats``; CPU seconds (user + system) are reported beside them,
because on a shared machine the wall time is noisy. Every measurement and every timed write
starts from the same state, outside the clock: what an earlier run wrote where it writes removed,
dirty pages written back, and on a VM guest with free page reporting the freed memory handed back
to the host (``--settle``; a write that overlaps the hand-back is several times slower, whoever
writes). Nothing here asserts a timing: the ratios
and the targets go into ``bench/harness/BENCHMARK.md`` with the command that reproduced them.

``--small`` is the CI preset (tiny sizes, about 10 s). ``--device cuda`` runs the forwards and
the metrics on the GPU (the fp64 reference of a capture is a CPU run, as in parity itself).
``--profile`` prints where the time goes instead (cProfile of compare and capture, and rates
of the primitives: sha256, BLAKE3, fp32 -> fp64 conversion, fresh allocations, pread, write, fsync).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parity.bundle import checksums

SPEC = "harness_benchmark:make_subject"
# The result's JSON format; its schema is the lab's (bench/formats.py).
FORMAT, VERSION = "parity-harness-benchmark-report", 2
PROG = "python bench/harness/harness_benchmark.py"
_RESULT_MARK = "PARITY-BENCH-RESULT "

# The hand-run size: 24 blocks of width 1024 over 1536 tokens; 97 recorded fp32 tensors of 6 MiB,
# with their fp64 references and the weights a 1.9 GiB bundle of 8 shards (the subject:
# 24 fp32 layers, 97 compared tensors, 1.75 GB).
FULL = {"layers": 24, "width": 1024, "tokens": 1536}
SMALL = {"layers": 2, "width": 64, "tokens": 64}

TARGETS = {
    "compare": "parity <= 2.0 x (forward + raw read + bare metrics)",
    "capture": "parity <= 1.3 x (forwards + raw save_file + reference run), each with fsync or each without",
    "write": "BundleWriter >= 0.8 x raw save_file rate, each with fsync or each without",
    "memory": "peak RSS - model bytes independent of the bundle size",
}


# ---------------------------------------------------------------------------------------------
# The synthetic subject


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.fc(self.norm(x)))


class Stack(nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


class StackSubject:
    """``layers`` fp32 blocks of ``width`` over ``tokens`` rows: every recorded output is
    ``tokens x width`` fp32 (``4 * tokens * width`` bytes), each block's weight ``width**2``."""

    name = "benchmark-stack"
    impls = ("reference",)
    reference_impl = "reference"

    def __init__(self, layers: int = FULL["layers"], width: int = FULL["width"], tokens: int = FULL["tokens"],
                 seed: int = 0):
        from parity.run.subjects.base import check_ints

        check_ints("benchmark subject", {"layers": layers, "width": width, "tokens": tokens}, 1)
        self.args = {"layers": layers, "width": width, "tokens": tokens, "seed": seed}

    def make_inputs(self):
        from parity.run.subjects import Inputs

        gen = torch.Generator().manual_seed(self.args["seed"])
        return Inputs({"x": torch.randn(self.args["tokens"], self.args["width"], generator=gen)})

    def make_state(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        width = self.args["width"]
        state = {}
        for name, tensor in Stack(1, width).state_dict().items():
            for index in range(self.args["layers"]):
                key = name.replace("layers.0.", f"layers.{index}.")
                if name.endswith("fc.weight"):
                    state[key] = torch.randn(tensor.shape, generator=gen) / math.sqrt(width)
                elif name.endswith("weight"):
                    state[key] = torch.ones(tensor.shape)
                else:
                    state[key] = 0.01 * torch.randn(tensor.shape, generator=gen)
        return state

    def build(self, impl: str) -> nn.Module:
        return Stack(self.args["layers"], self.args["width"])

    def call(self, module: nn.Module, inputs) -> torch.Tensor:
        return module(inputs.tensors["x"])


def make_subject(**args: Any) -> StackSubject:
    """The factory the bundles name: ``harness_benchmark:make_subject`` (this file's folder is first on ``sys.path``
    when it runs as a script, and the tests put it there)."""
    return StackSubject(**args)


def subject_args(base: dict[str, int], multiplier: int) -> dict[str, int]:
    return {**base, "layers": base["layers"] * multiplier}


def model_bytes(args: dict[str, int]) -> int:
    width = args["width"]
    return 4 * args["layers"] * (width * width + 3 * width)


# ---------------------------------------------------------------------------------------------
# Measuring one piece of work in this process


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class RssSampler:
    """Samples this process's RSS on a thread while work runs: the peak from a mark on (the
    streaming phase: the mark is set when parity reports that its recorded run starts, after the
    module is built from the stored state), and the RSS at the mark."""

    def __init__(self, every_s: float = 0.01):
        self.every_s = every_s
        self.marked_rss: int | None = None
        self.peak_after_mark = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.marked_rss is not None:
                self.peak_after_mark = max(self.peak_after_mark, _status_bytes("VmRSS") or 0)

    def mark(self) -> None:
        if self.marked_rss is None:
            self.marked_rss = _status_bytes("VmRSS") or 0
            self.peak_after_mark = self.marked_rss

    def progress(self, marker: str) -> Callable[[str], None]:
        """A progress callback that sets the mark at the first message containing ``marker``."""
        return lambda message: self.mark() if marker in message else None

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict[str, int | None]:
        return {"rss_at_streaming_start_bytes": self.marked_rss,
                "streaming_peak_rss_bytes": self.peak_after_mark if self.marked_rss is not None else None}


def measure(work: Callable[[], dict[str, Any] | None], device: str = "cpu", *, settle_s: float = 0.0,
            remove: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``work`` once; wall and CPU seconds, minor page faults, peak RSS of this process.

    Outside the clock, first: ``remove`` (what an earlier run wrote where this one writes: parity's
    capture and the raw one alike start without it, so neither times the deletion of the other's
    files), then :func:`settle` with ``settle_s``, which also writes back the dirty pages that
    earlier measurements left (a raw ``save_file`` does not fsync), so no measurement waits for
    another's writeback.
    """
    cuda = device.startswith("cuda")
    if cuda:  # the CUDA context is made before the clock starts, in every process alike
        torch.empty(1, device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for path in remove:
        shutil.rmtree(path, ignore_errors=True)
    settled = settle(settle_s)
    rss_before, reported = _status_bytes("VmRSS"), reported_bytes()
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    extra = work() or {}
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    after, reported_after = resource.getrusage(resource.RUSAGE_SELF), reported_bytes()
    result = {
        "settle_seconds": settled,
        "handed_back_bytes": _handed_back(reported, reported_after),
        "seconds": seconds,
        "user_seconds": after.ru_utime - before.ru_utime,
        "system_seconds": after.ru_stime - before.ru_stime,
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": _status_bytes("VmHWM") or after.ru_maxrss * 1024,
    }
    result["cpu_seconds"] = result["user_seconds"] + result["system_seconds"]
    if cuda:
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    result.update(extra)
    # The kernel updates the high-water mark lazily: a sampled RSS can be above it.
    result["peak_rss_bytes"] = max(result["peak_rss_bytes"], extra.get("streaming_peak_rss_bytes") or 0)
    return result


def _trust():
    from parity.run.subjects import trust_subject

    trust_subject(SPEC)


def work_capture(job: dict[str, Any]) -> dict[str, Any]:
    from parity.run.capture import capture
    from parity.run.subjects import load_subject

    runner = load_subject(SPEC, job["subject"])
    sampler = RssSampler()

    def work():
        with sampler:
            result = capture(runner, job["bundle"], impl="reference", device=job["device"],
                             reference=job["reference"], force=True, progress=sampler.progress("recorded run"),
                             durable=job.get("durable", True))
        return {"bytes": result.bytes, "tensors": result.tensors, **sampler.result()}

    return measure(work, job["device"], settle_s=job.get("settle_s", 0.0), remove=[job["bundle"]])


def work_compare(job: dict[str, Any]) -> dict[str, Any]:
    from parity.judge.compare import compare_bundle

    _trust()
    sampler = RssSampler()

    def work():
        with sampler:
            report = compare_bundle(job["bundle"], impl="reference", device=job["device"],
                                    progress=sampler.progress("run impl"))
        return {"passed": report.passed, "tensors": len(report.layers),
                "budget_checked": report.budget_checked, **sampler.result()}

    return measure(work, job["device"], settle_s=job.get("settle_s", 0.0))


# --- raw baselines --------------------------------------------------------------------------


def _all_modules_hooks(module: nn.Module, hook: Callable[[str, Any], None]) -> list[Any]:
    handles = []
    for name, sub in module.named_modules():
        display = name or "<root>"
        def forward_hook(_module, _args, output, display=display):
            hook(display, output)  # returns None: the output is left as it is

        handles.append(sub.register_forward_hook(forward_hook))
    return handles


def _flat_tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _flat_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _flat_tensors(item)]
    return []


def bare_metrics(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """Cosine, max abs and rel L2 the plain way: whole tensors in float64."""
    x, y = a.reshape(-1).double(), b.reshape(-1).double()
    d = x - y
    y_norm = y.norm()
    cosine = torch.dot(x, y) / (x.norm() * y_norm)
    return float(cosine), float(d.abs().max()), float(d.norm() / y_norm)


def work_capture_raw(job: dict[str, Any]) -> dict[str, Any]:
    """The forwards capture needs and a raw save_file of the same bytes, shard by shard (each file
    fsynced after it is saved where ``job["fsync"]``)."""
    from safetensors.torch import save_file

    from parity.run.subjects import load_subject

    runner = load_subject(SPEC, job["subject"])
    device, out_dir = job["device"], Path(job["out"])
    shard_bytes = job.get("shard_bytes", 256 * 2**20)
    times = {"save_seconds": 0.0, "bytes": 0}

    def work():
        out_dir.mkdir(parents=True)
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = [0]
        shards = [0]

        def flush():
            if pending:
                started = time.perf_counter()
                file = out_dir / f"shard-{shards[0]:05d}.safetensors"
                save_file(pending, str(file))
                if job.get("fsync"):
                    _fsync_file(file)
                times["save_seconds"] += time.perf_counter() - started
                shards[0] += 1
                pending.clear()
                pending_bytes[0] = 0

        def keep(tensor: torch.Tensor) -> None:
            nbytes = tensor.numel() * tensor.element_size()
            if pending and pending_bytes[0] + nbytes > shard_bytes:
                flush()
            pending[f"t{times['bytes']:012d}"] = tensor
            pending_bytes[0] += nbytes
            times["bytes"] += nbytes

        inputs, state = runner.make_inputs(), runner.make_state()
        for tensor in [*inputs.tensors.values(), *state.values()]:
            keep(tensor.contiguous())
        module = runner.build("reference", state=state, device=device)
        device_inputs = inputs.to(device)
        runner.run(module, device_inputs)  # without hooks
        def copy_outputs(_name, output):
            for tensor in _flat_tensors(output):
                keep(tensor.detach().to("cpu", copy=True))

        handles = _all_modules_hooks(module, copy_outputs)
        runner.run(module, device_inputs)
        for handle in handles:
            handle.remove()
        if job["reference"] == "fp64":
            ref_module = runner.build("reference", state=state, device="cpu", dtype=torch.float64)
            handles = _all_modules_hooks(ref_module, copy_outputs)
            runner.run(ref_module, inputs.to("cpu", torch.float64))
            for handle in handles:
                handle.remove()
        flush()
        return times

    result = measure(work, device, settle_s=job.get("settle_s", 0.0), remove=[str(out_dir)])
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


class _RawBundle:
    """A bundle read the raw way: its manifest as JSON, tensors through ``safe_open``."""

    def __init__(self, path: str, device: str):
        from safetensors import safe_open

        self.path = Path(path)
        manifest = json.loads((self.path / "manifest.json").read_text())
        self.entries = {(e["kind"], e["name"]): e for e in manifest["entries"]}
        self.subject = manifest["subject"]
        self._files = {shard["file"]: safe_open(str(self.path / shard["file"]), framework="pt", device=device)
                       for shard in manifest["shards"]}

    def load(self, kind: str, name: str) -> torch.Tensor | None:
        entry = self.entries.get((kind, name))
        return None if entry is None else self._files[entry["shard"]].get_tensor(entry["key"])

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        return {name: self.load(k, name) for (k, name) in self.entries if k == kind}


def work_compare_raw(job: dict[str, Any]) -> dict[str, Any]:
    """Forward + a raw read of every tensor compare reads (+ the bare metrics of its pairs)."""
    from parity.run.subjects import Inputs, load_subject

    device, with_metrics = job["device"], job["metrics"]

    def work():
        bundle = _RawBundle(job["bundle"], device)
        runner = load_subject(bundle.subject["spec"], bundle.subject["args"])
        module = runner.build("reference", state=bundle.tensors("state"), device=device)
        inputs = Inputs({name: t.to(device, copy=True) for name, t in bundle.tensors("input").items()})
        counts = {"pairs": 0, "tensors": 0}
        calls: dict[str, int] = {}

        def hook(name: str, output: Any) -> None:
            index = calls.get(name, 0)
            calls[name] = index + 1
            layer = name if index == 0 else f"{name}#{index}"
            for tensor in _flat_tensors(output):
                golden = bundle.load("output", layer)
                reference = bundle.load("reference", layer)
                counts["tensors"] += 1
                if with_metrics and golden is not None:
                    bare_metrics(tensor, golden)
                    counts["pairs"] += 1
                    if reference is not None:
                        bare_metrics(tensor, reference)
                        bare_metrics(golden, reference)
                        counts["pairs"] += 2

        handles = _all_modules_hooks(module, hook)
        runner.run(module, inputs)
        for handle in handles:
            handle.remove()
        return counts

    return measure(work, device, settle_s=job.get("settle_s", 0.0))


def _pool(args: dict[str, int], shard_bytes: int) -> list[torch.Tensor]:
    """Distinct random fp32 tensors of the subject's output size, one shard's worth."""
    gen = torch.Generator().manual_seed(7)
    size = args["tokens"] * args["width"]
    count = max(2, -(-shard_bytes // (4 * size)) + 1)
    return [torch.randn(size, generator=gen).reshape(args["tokens"], args["width"]) for _ in range(count)]


def _fsync_file(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Free page reporting (virtio-balloon) in a VM guest: memory the guest frees is handed back to
# the host in the background, from about 2 s after it is freed, and the host faults it in again
# on its next use. On the 2-core CPU machine a write that overlaps the hand-back takes 2-10x the
# system time, for save_file and BundleWriter alike (BENCHMARK.md beside this file, "The write rate on a VM").
PAGE_REPORTING_COUNTER = "/sys/module/page_reporting/parameters/reported_kib"


def reported_bytes(counter: str = PAGE_REPORTING_COUNTER) -> int | None:
    """Bytes this guest has handed back to its host so far; None without free page reporting."""
    try:
        return int(Path(counter).read_text()) * 1024
    except (OSError, ValueError):
        return None


def _handed_back(before: int | None, after: int | None) -> int | None:
    """Bytes handed back between two :func:`reported_bytes` readings; None without reporting."""
    return None if before is None or after is None else after - before


def settle(quiet_s: float, *, limit_s: float = 300.0, poll_s: float = 0.1,
           counter: str = PAGE_REPORTING_COUNTER) -> float:
    """Write every dirty page back, then wait until the host has taken back the memory freed so far:
    until the page-reporting counter has not moved for ``quiet_s`` seconds (at most ``limit_s``).
    The seconds waited; no wait where the counter does not exist or ``quiet_s`` is 0."""
    os.sync()
    started = time.monotonic()
    last = reported_bytes(counter)
    if last is None or quiet_s <= 0:
        return 0.0
    still = started
    while (now := time.monotonic()) - still < quiet_s and now - started < limit_s:
        time.sleep(poll_s)
        value = reported_bytes(counter)
        if value != last:
            last, still = value, time.monotonic()
    return time.monotonic() - started


def work_write(job: dict[str, Any]) -> dict[str, Any]:
    """BundleWriter vs save_file on the same tensors and shards, alternating, bytes per second."""
    from safetensors.torch import save_file

    from parity.bundle.writer import BundleWriter

    shard_bytes = job.get("shard_bytes", 256 * 2**20)
    pool = _pool(job["subject"], shard_bytes)
    total = job["bytes"]
    tensor_bytes = pool[0].numel() * 4
    count = max(1, total // tensor_bytes)
    root = Path(job["out"])
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rates: dict[str, list[float]] = {"parity": [], "raw": [], "raw_fsync": [], "parity_nofsync": []}
    cpu: dict[str, list[list[float]]] = {key: [] for key in rates}
    handed_back: dict[str, list[int | None]] = {key: [] for key in rates}
    settled: dict[str, list[float]] = {key: [] for key in rates}

    def parity_write(durable: bool):
        with BundleWriter(root / "bundle", shard_bytes=shard_bytes, durable=durable) as writer:
            for index in range(count):
                writer.add("output", f"t{index}", pool[index % len(pool)], copy=False)
            writer.commit({"subject": {"spec": SPEC, "name": "write", "args": {}}})

    def raw_write(fsync: bool):
        directory = root / "raw"
        directory.mkdir()
        per_shard = max(1, shard_bytes // tensor_bytes)
        for shard, start in enumerate(range(0, count, per_shard)):
            tensors = {f"t{index}": pool[index % len(pool)] for index in range(start, min(count, start + per_shard))}
            file = directory / f"shard-{shard:05d}.safetensors"
            save_file(tensors, str(file))
            if fsync:
                _fsync_file(file)

    for _ in range(job.get("repeats", 1)):
        for key, write in (("raw", lambda: raw_write(False)), ("parity", lambda: parity_write(True)),
                           ("raw_fsync", lambda: raw_write(True)), ("parity_nofsync", lambda: parity_write(False))):
            # Every writer starts from the same state, outside the clock: the previous one's files
            # deleted (their page cache freed), everything written back, and on a VM guest the
            # freed memory handed back to the host (a write that overlaps the hand-back is slowed
            # by it, whichever writer it is). What was handed back during the write is recorded.
            for old in list(root.iterdir()):
                shutil.rmtree(old)
            settled[key].append(settle(job.get("settle_s", 0.0)))
            reported = reported_bytes()
            before, started = os.times(), time.perf_counter()
            write()
            seconds, after = time.perf_counter() - started, os.times()
            reported_after = reported_bytes()
            rates[key].append(count * tensor_bytes / seconds)
            cpu[key].append([after.user - before.user, after.system - before.system])
            handed_back[key].append(_handed_back(reported, reported_after))
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": count * tensor_bytes, "rates": rates, "cpu_seconds": cpu, "handed_back_bytes": handed_back,
            "settle_seconds": settled, "peak_rss_bytes": _status_bytes("VmHWM")}


WORKERS = {
    "capture": work_capture,
    "compare": work_compare,
    "capture_raw": work_capture_raw,
    "compare_raw": work_compare_raw,
    "write": work_write,
}


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """Run one job in a fresh interpreter (its own peak RSS) and return its result."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
    raise RuntimeError(f"benchmark worker {job['work']} failed (exit {done.returncode}): " + " | ".join(tail))


# ---------------------------------------------------------------------------------------------
# The table


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("seconds", "cpu_seconds", "user_seconds", "system_seconds", "minor_faults", "peak_rss_bytes",
            "rss_at_streaming_start_bytes", "streaming_peak_rss_bytes")
    summary = {key: _median([run[key] for run in runs]) for key in keys if all(key in run for run in runs)}
    summary["runs"] = [run["seconds"] for run in runs]
    for key in ("settle_seconds", "handed_back_bytes"):  # per run, as the runs
        summary[key] = [run.get(key) for run in runs]
    return summary


def work_read_baselines(job: dict[str, Any]) -> dict[str, Any]:
    """Compare's raw baselines, in one process (their peak RSS is not a target): the forward +
    a raw read of every tensor compare reads, without and with the bare metrics."""
    bare = work_compare_raw({**job, "metrics": True})  # first: cold, as parity's compare is
    return {"compare_raw/bare": bare, "compare_raw/read": work_compare_raw({**job, "metrics": False})}


def work_write_baselines(job: dict[str, Any]) -> dict[str, Any]:
    """Capture's raw baselines (forwards + save_file, without and with an fsync per file) and the
    write rates, in one process. They run after compare: writing as many bytes again evicts the
    bundle from the page cache."""
    return {"capture_raw": work_capture_raw({**job, "out": job["out"] + "-capture"}),
            "capture_raw_fsync": work_capture_raw({**job, "out": job["out"] + "-capture", "fsync": True}),
            "write": work_write({**job, "bytes": job["write_bytes"], "out": job["out"] + "-write",
                                 "repeats": job.get("write_repeats", 1), "settle_s": job.get("settle_s", 0.0)})}


def run_size(base: dict[str, int], multiplier: int, *, device: str, repeats: int, workdir: Path,
             say: Callable[[str], None], write_repeats: int = 1, settle_s: float = 0.0) -> list[dict[str, Any]]:
    """Every measurement at one size, ``repeats`` times, parity and raw runs interleaved; the
    write rates ``write_repeats`` times in each (single writes are the noisiest measurement), each
    write after :func:`settle` with ``settle_s``."""
    args = subject_args(base, multiplier)
    bundle = str(workdir / f"bench-{multiplier}x")
    common = {"subject": args, "device": device, "bundle": bundle, "settle_s": settle_s}
    measured: dict[str, list[dict[str, Any]]] = {}
    rates: dict[str, list[float]] = {}
    write_cpu: dict[str, list[list[float]]] = {}  # [user, system] seconds of each timed write
    write_state: dict[str, dict[str, list[Any]]] = {"handed_back_bytes": {}, "settle_seconds": {}}
    for repeat in range(repeats):
        # Three fresh processes per run: parity's capture; compare's raw baselines (which read
        # its bundle); parity's compare, then capture's raw baseline and the write rates (which
        # write as many bytes again, evicting the bundle from the page cache, so they come last).
        # Each parity measurement and the compare baseline start cold after their imports, and
        # parity's come first in their process, so their peak RSS is their own. The capture
        # baseline runs warm, after compare: if anything, that favours the baseline.
        say(f"{multiplier}x ({args['layers']} layers), run {repeat + 1} of {repeats}: parity capture, "
            "then capture --no-fsync")
        captured = run_worker({"work": "capture", **common, "reference": "fp64"})
        measured.setdefault("capture", []).append(captured)
        measured.setdefault("capture_nofsync", []).append(
            run_worker({"work": "capture", **common, "reference": "fp64", "durable": False}))
        say(f"{multiplier}x: raw forward + read + bare metrics, and forward + read")
        for name, value in run_worker({"work": "read_baselines", **common}).items():
            measured.setdefault(name, []).append(value)
        say(f"{multiplier}x: parity compare, then raw forwards + save_file and the write rates")
        second = run_worker({"work": ["compare", "write_baselines"], **common, "reference": "fp64",
                             "out": str(workdir / "raw"), "write_bytes": captured["bytes"],
                             "write_repeats": write_repeats})
        measured.setdefault("compare", []).append(second["compare"])
        measured.setdefault("capture_raw", []).append(second["write_baselines"]["capture_raw"])
        measured.setdefault("capture_raw_fsync", []).append(second["write_baselines"]["capture_raw_fsync"])
        for key, values in second["write_baselines"]["write"]["rates"].items():
            rates.setdefault(key, []).extend(values)
        for key, values in second["write_baselines"]["write"]["cpu_seconds"].items():
            write_cpu.setdefault(key, []).extend(values)
        for field, per_writer in write_state.items():
            for key, values in second["write_baselines"]["write"][field].items():
                per_writer.setdefault(key, []).extend(values)
    shutil.rmtree(bundle, ignore_errors=True)

    s = {name: _summary(runs) for name, runs in measured.items()}
    model = model_bytes(args)
    size = {"multiplier": multiplier, "layers": args["layers"], "bundle_bytes": captured["bytes"],
            "model_bytes": model, "tensors": captured["tensors"]}
    rows = [
        # Streaming starts once the module is built from the stored state. From there compare
        # holds nothing of the model beyond the module; capture builds its fp64 reference module
        # (2x the fp32 weights) during the streaming.
        {**size, "what": "compare", "parity": s["compare"], "raw": s["compare_raw/bare"], "target": 2.0,
         "streaming_model_bytes": 0, "passed": all(run.get("passed") for run in measured["compare"]),
         "compared": measured["compare"][0].get("tensors")},
        {**size, "what": "compare vs read", "parity": s["compare"], "raw": s["compare_raw/read"], "target": None,
         "streaming_model_bytes": 0},
        {**size, "what": "capture", "parity": s["capture"], "raw": s["capture_raw_fsync"], "target": 1.3,
         "baseline": "forwards + save_file + fsync per file + reference run", "streaming_model_bytes": 2 * model,
         "page_cache_ratio": s["capture"]["seconds"] / s["capture_raw"]["seconds"]},
        {**size, "what": "capture --no-fsync", "parity": s["capture_nofsync"], "raw": s["capture_raw"],
         "target": 1.3, "baseline": "forwards + save_file + reference run", "streaming_model_bytes": 2 * model},
    ]
    for row in rows:
        row["ratio"] = row["parity"]["seconds"] / row["raw"]["seconds"]
        row["cpu_ratio"] = row["parity"]["cpu_seconds"] / row["raw"]["cpu_seconds"]
        start, peak = row["parity"].get("rss_at_streaming_start_bytes"), row["parity"].get("streaming_peak_rss_bytes")
        # What streaming added to the RSS, less the model it builds meanwhile: the constant part.
        row["streaming_growth_bytes"] = None if start is None else peak - start - row["streaming_model_bytes"]
    rate = {key: _median(values) for key, values in rates.items()}
    rows.append({**size, "what": "write rate", "parity_rate": rate["parity"], "raw_rate": rate["raw_fsync"],
                 "baseline": "save_file + fsync", "ratio": rate["parity"] / rate["raw_fsync"],
                 "page_cache_ratio": rate["parity"] / rate["raw"], "target": 0.8, "cpu_seconds": write_cpu,
                 "rates": rates, **write_state})
    rows.append({**size, "what": "write rate --no-fsync", "parity_rate": rate["parity_nofsync"],
                 "raw_rate": rate["raw"], "baseline": "save_file", "ratio": rate["parity_nofsync"] / rate["raw"],
                 "target": 0.8})
    return rows


def _gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def _overlap_note(handed_back: list[int | None], what: str) -> str:
    """'; k of n <what> overlapped page reporting', or nothing where the host has none."""
    if not handed_back or None in handed_back:
        return ""
    return f"; {sum(1 for moved in handed_back if moved)} of {len(handed_back)} {what} overlapped page reporting"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table: one row per size and measurement."""
    from tabulate import tabulate

    table = []
    for row in rows:
        size = f"{row['multiplier']}x"
        if row["what"].startswith("write rate"):
            notes = f"raw: {row['baseline']}"
            if "page_cache_ratio" in row:
                notes += f"; {row['page_cache_ratio']:.2f} x save_file without fsync"
                notes += _overlap_note([moved for values in row["handed_back_bytes"].values() for moved in values],
                                       "writes")
            table.append([size, row["what"], f"{row['parity_rate'] / 1e9:.2f} GB/s", f"{row['raw_rate'] / 1e9:.2f} GB/s",
                          f"{row['ratio']:.2f}", f">= {row['target']}", "-", "-", notes])
            continue
        parity, raw = row["parity"], row["raw"]
        target = "-" if row["target"] is None else f"<= {row['target']}"
        peak = parity.get("peak_rss_bytes")
        notes = ""
        if row["streaming_growth_bytes"] is not None:
            notes = f"streaming adds {_gb(row['streaming_growth_bytes'])}"
            if row["streaming_model_bytes"]:
                notes += " + the fp64 model"
        if row["what"] == "compare":
            notes += f"; {row['compared']} tensors compared, {_gb(row['bundle_bytes'])} bundle"
        if "page_cache_ratio" in row:
            notes += f"; raw: {row['baseline']}; {row['page_cache_ratio']:.2f} x without fsync"
        notes += _overlap_note([*parity.get("handed_back_bytes", [None]), *raw.get("handed_back_bytes", [None])],
                               "runs")
        table.append([size, row["what"], f"{parity['seconds']:.2f} s", f"{raw['seconds']:.2f} s",
                      f"{row['ratio']:.2f}", target, f"{parity['cpu_seconds']:.1f} / {raw['cpu_seconds']:.1f}",
                      _gb(peak), notes])
    headers = ["size", "what", "parity", "raw", "ratio", "target", "CPU s parity / raw", "parity peak RSS", "notes"]
    return tabulate(table, headers=headers, tablefmt="github", disable_numparse=True)


# ---------------------------------------------------------------------------------------------
# Profile: where the time goes


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def primitive_rates(device: str = "cpu", megabytes: int = 256) -> dict[str, float]:
    """GB/s (of fp32 input bytes) of the primitives the harness is built from, on this host."""
    import hashlib

    nbytes = megabytes * 2**20
    data = torch.randn(nbytes // 4)
    rates: dict[str, float] = {}

    def best(fn, times=3):
        values = []
        for _ in range(times):
            started = time.perf_counter()
            fn()
            values.append(time.perf_counter() - started)
        return min(values)

    raw = data.view(torch.uint8).numpy()
    rates["sha256"] = _rate(nbytes, best(lambda: hashlib.sha256(raw).hexdigest()))
    rates["blake3"] = _rate(nbytes, best(lambda: checksums.of_buffer(checksums.BLAKE3, raw)))
    rates["fp32->fp64 whole tensor (fresh allocation)"] = _rate(nbytes, best(lambda: data.double()))
    scratch = torch.empty(2**15, dtype=torch.float64)

    def chunked():
        for start in range(0, data.numel(), 2**15):
            part = data[start:start + 2**15]
            scratch[: part.numel()].copy_(part)

    rates["fp32->fp64 in 2^15 chunks (reused buffer)"] = _rate(nbytes, best(chunked))
    rates["fresh allocation + first touch"] = _rate(nbytes, best(lambda: torch.empty(nbytes // 4).fill_(1.0)))
    reused = torch.empty(nbytes // 4)
    rates["touch of reused memory"] = _rate(nbytes, best(lambda: reused.fill_(1.0)))
    if device.startswith("cuda"):
        def to_device():
            data.to(device)
            torch.cuda.synchronize()

        rates["host to device copy (pageable)"] = _rate(nbytes, best(to_device))
    with tempfile.TemporaryDirectory() as directory:
        file = Path(directory) / "blob"
        started = time.perf_counter()
        with open(file, "wb") as out:
            out.write(raw)
            written = time.perf_counter()
            out.flush()
            os.fsync(out.fileno())
        rates["write (page cache)"] = _rate(nbytes, written - started)
        rates["fsync"] = _rate(nbytes, time.perf_counter() - written)
        target = torch.empty(nbytes, dtype=torch.uint8).numpy()
        fd = os.open(file, os.O_RDONLY)
        try:
            rates["pread (page cache)"] = _rate(nbytes, best(lambda: os.preadv(fd, [target], 0)))
        finally:
            os.close(fd)
    return rates


# Leaf functions by what they do: their own time (tottime) in the profile of the main thread.
_LEAVES = {
    "checksums on the main thread (sha256, BLAKE3)": ("_hashlib.openssl_sha256", "'update' of '_hashlib.HASH'",
                                                      "'hexdigest' of", "'update' of 'blake3", "blake3.blake3"),
    "pread on the main thread": ("posix.preadv", "posix.pread"),
    "file writes on the main thread": ("posix.write", "'write' of '_io.BufferedWriter'"),
    "fsync on the main thread": ("posix.fsync",),
    "waiting for the background threads": ("'acquire' of '_thread.lock'",),
    "tensor copies and casts (copy_, to, clone)": ("'copy_' of 'torch", "'to' of 'torch", "'clone' of 'torch"),
}
# Stages by where they are: cumulative time of these functions.
_STAGES = {
    "metrics (compute_metrics, compute_metrics_and_errors)": ("parity/judge/metrics.py",
                                                              ("compute_metrics", "compute_metrics_and_errors")),
    "bundle reads on the main thread (BundleReader.load)": ("parity/bundle/reader.py", "load"),
    "subject runs, hooks included (SubjectRunner.run)": ("parity/run/subjects/base.py", "run"),
    "recorder hooks (compare's comparisons, capture's stores)": ("parity/run/recorder.py", "hook"),
    "bundle writer: add (copies, small hashes, waits)": ("parity/bundle/writer.py", "add"),
    "bundle writer: commit": ("parity/bundle/writer.py", "commit"),
}


def _profile_categories(stats) -> dict[str, float]:
    """Seconds by category from a cProfile of the main thread (threads are not profiled: their
    work shows here as the main thread waiting for them)."""
    totals: dict[str, float] = {}
    for (file, _line, function), (_cc, _nc, tottime, cumtime, _callers) in stats.stats.items():
        label = f"{file}:{function}"
        for category, needles in _LEAVES.items():
            if any(needle in label for needle in needles):
                totals[category] = totals.get(category, 0.0) + tottime
        for category, (where, name) in _STAGES.items():
            names = (name,) if isinstance(name, str) else name
            if file.replace(os.sep, "/").endswith(where) and function in names:
                totals[category] = totals.get(category, 0.0) + cumtime
    runs = totals.get("subject runs, hooks included (SubjectRunner.run)", 0.0)
    hooks = totals.get("recorder hooks (compare's comparisons, capture's stores)", 0.0)
    totals["model forward (subject runs minus hooks)"] = runs - hooks
    return totals


def work_profile(job: dict[str, Any]) -> dict[str, Any]:
    import cProfile
    import pstats

    from parity.judge.compare import compare_bundle
    from parity.run.capture import capture
    from parity.run.subjects import load_subject

    _trust()
    runner = load_subject(SPEC, job["subject"])
    result: dict[str, Any] = {}
    for stage in ("capture", "compare"):
        profiler = cProfile.Profile()
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        profiler.enable()
        if stage == "capture":
            capture(runner, job["bundle"], impl="reference", device=job["device"], reference="fp64", force=True)
        else:
            compare_bundle(job["bundle"], impl="reference", device=job["device"])
        profiler.disable()
        seconds = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        result[stage] = {"wall seconds": seconds, **_profile_categories(pstats.Stats(profiler)),
                         "process CPU seconds, user": after.ru_utime - before.ru_utime,
                         "process CPU seconds, system": after.ru_stime - before.ru_stime,
                         "minor page faults": after.ru_minflt - before.ru_minflt}
    result["primitives_gb_per_s"] = primitive_rates(job["device"])
    result["metrics_ops"] = metrics_op_profile(job["subject"], job["device"])
    shutil.rmtree(job["bundle"], ignore_errors=True)
    return result


def metrics_op_profile(args: dict[str, int], device: str = "cpu", top: int = 8) -> dict[str, Any]:
    """The metrics of one recorded tensor as compare computes them (its golden pair under the
    built-in fp32 policy, and this host and the golden each against the fp64 reference): wall
    milliseconds against the bare metrics of the same pairs, and torch.profiler's self time per
    op, largest first, as (op, milliseconds, calls)."""
    from torch.profiler import ProfilerActivity, profile

    from parity.judge.checks import measure as measure_metrics
    from parity.judge.metrics import compute_error_vs_reference
    from parity.judge.policy import Policy

    gen = torch.Generator().manual_seed(3)
    reference = torch.randn(args["tokens"], args["width"], generator=gen, dtype=torch.float64)
    golden = reference.float()
    out = (reference + 1e-7 * torch.randn(reference.shape, generator=gen, dtype=torch.float64)).float()
    reference, golden, out = (t.to(device) for t in (reference, golden, out))
    tol = Policy().resolve("x", torch.float32)
    cuda = device.startswith("cuda")

    try:  # the one-scan path compare takes where it exists (absent before issue 16: profiled as it was)
        from parity.judge.metrics import compute_metrics_and_errors
    except ImportError:
        compute_metrics_and_errors = None

    def parity_metrics():
        if compute_metrics_and_errors is not None:
            compute_metrics_and_errors(out, golden, reference, atol=tol.atol, rtol=tol.rtol, atol_rms=tol.atol_rms,
                                       outlier_factor=tol.outlier_factor)
            return
        measure_metrics(out, golden, tol)
        compute_error_vs_reference(out, reference)
        compute_error_vs_reference(golden, reference)

    def bare():
        for a, b in ((out, golden), (out, reference), (golden, reference)):
            bare_metrics(a, b)

    def best_ms(fn, times=5):
        fn()
        values = []
        for _ in range(times):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            values.append(time.perf_counter() - started)
        return 1000 * statistics.median(values)

    result = {"parity_ms": best_ms(parity_metrics), "bare_ms": best_ms(bare)}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        parity_metrics()

    def self_time(event):
        if cuda:
            return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
        return event.self_cpu_time_total

    events = sorted(prof.key_averages(), key=self_time, reverse=True)[:top]
    result["ops"] = [(e.key, self_time(e) / 1000.0, e.count) for e in events]
    return result


def format_profile(profile: dict[str, Any]) -> str:
    from tabulate import tabulate

    lines = []
    for stage in ("capture", "compare"):
        rows = [[key, str(value) if key == "minor page faults" else f"{value:.2f}"]
                for key, value in profile[stage].items()]
        lines += [f"{stage} (cProfile of the main thread; seconds):",
                  tabulate(rows, headers=["where", "s"], tablefmt="github", disable_numparse=True), ""]
    lines.append("primitives on this host (GB/s of input bytes):")
    lines.append(tabulate([[k, f"{v:.2f}"] for k, v in profile["primitives_gb_per_s"].items()],
                          headers=["primitive", "GB/s"], tablefmt="github", disable_numparse=True))
    lines.append("")
    ops = profile["metrics_ops"]
    lines.append(f"metrics of one recorded tensor (its golden pair and both fp64 reference pairs): "
                 f"{ops['parity_ms']:.1f} ms, bare cosine / max abs / rel L2 of the same pairs "
                 f"{ops['bare_ms']:.1f} ms; torch.profiler self time by op:")
    lines.append(tabulate([[k, f"{ms:.1f}", str(n)] for k, ms, n in ops["ops"]],
                          headers=["op", "ms", "calls"], tablefmt="github", disable_numparse=True))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line


def _host() -> dict[str, Any]:
    import platform

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "machine": platform.machine()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _positive_ints(text: str) -> list[int]:
    """``--multipliers 1,2,4``: comma-separated integers from 1 to 64."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(not 1 <= value <= 64 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every multiplier must be from 1 to 64")
    return values


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not from {low} to {high}")
        return value
    return convert


def _settle_seconds(text: str) -> float:
    """``--settle``: seconds from 0 to 60."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 60:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not from 0 to 60 seconds")
    return value


def _write_json(result: dict[str, Any], path: str) -> None:
    """The document (``parity-harness-benchmark-report``) to ``path`` ('-': stdout), atomically."""
    from parity.base import jsonformat

    text = jsonformat.dumps({"format": FORMAT, "version": VERSION, **jsonformat.finite(result)}) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    from parity.base.files import write_atomically

    write_atomically(path, text, "--json")


def main(argv: Sequence[str] | None = None) -> int:
    from parity.cli.options import OneLineParser

    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="the CI preset: tiny sizes, 1x and 2x, one run")
    parser.add_argument("--multipliers", type=_positive_ints, default=None,
                        help="comma-separated size multipliers, each 1-64 (default 1,2,4)")
    parser.add_argument("--layers", type=_bounded_int(1, 10_000), default=None, help="layers at 1x (default 24)")
    parser.add_argument("--width", type=_bounded_int(1, 65_536), default=None,
                        help="width of each layer (default 1024)")
    parser.add_argument("--tokens", type=_bounded_int(1, 1_048_576), default=None,
                        help="rows of every recorded tensor (default 1536)")
    parser.add_argument("--repeats", type=_bounded_int(1, 100), default=None,
                        help="runs per measurement; medians reported (default 3, --small 1)")
    parser.add_argument("--write-repeats", type=_bounded_int(1, 100), default=None,
                        help="write-rate runs of each writer per run (default 3, --small 1)")
    parser.add_argument("--settle", type=_settle_seconds, default=None, metavar="SECONDS",
                        help="before each timed measurement and write, wait until the VM's free page reporting has been "
                             "still this long (default 3, --small 0; no wait where the host has none)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu or cuda (default cpu)")
    parser.add_argument("--workdir", default=None, help="where bundles are written (default: a temporary dir)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON ('-': stdout)")
    parser.add_argument("--profile", action="store_true", help="print where the time goes at the first size")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        job = json.loads(args.worker)
        workers = {**WORKERS, "read_baselines": work_read_baselines, "write_baselines": work_write_baselines,
                   "profile": work_profile}
        if isinstance(job["work"], list):  # several measurements, in order, in this one process
            result = {name: workers[name](job) for name in job["work"]}
        else:
            result = workers[job["work"]](job)
        print(_RESULT_MARK + json.dumps(result), flush=True)
        return 0

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{PROG}: error: --device cuda: torch sees no GPU here\n")
    if args.json not in (None, "-") and not Path(args.json).resolve().parent.is_dir():
        parser.exit(2, f"{PROG}: error: --json {args.json}: its directory does not exist\n")
    try:
        result, text = _run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, OSError) as err:  # a worker failed, or the work directory could not be written
        print(f"{PROG}: {str(err).splitlines()[0][:2000]}", file=sys.stderr)
        return 3
    if args.json != "-":
        print(text)
    if args.json:
        _write_json(result, args.json)
    return 0


def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    base = dict(SMALL if args.small else FULL)
    for key in ("layers", "width", "tokens"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    multipliers = args.multipliers or ([1, 2] if args.small else [1, 2, 4])
    repeats = args.repeats or (1 if args.small else 3)
    write_repeats = args.write_repeats or (1 if args.small else 3)
    settle_s = args.settle if args.settle is not None else (0.0 if args.small else 3.0)
    say = (lambda message: None) if args.quiet else (
        lambda message: print(f"harness_benchmark: {message}", file=sys.stderr, flush=True))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="parity-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if args.profile:
            job = {"work": "profile", "subject": subject_args(base, multipliers[0]), "device": args.device,
                   "bundle": str(workdir / "profile")}
            say(f"profile at {multipliers[0]}x")
            profile = run_worker(job)
            return ({"host": _host(), "base": base, "multiplier": multipliers[0], "profile": profile},
                    format_profile(profile))
        rows = []
        for multiplier in multipliers:
            rows.extend(run_size(base, multiplier, device=args.device, repeats=repeats, workdir=workdir, say=say,
                                 write_repeats=write_repeats, settle_s=settle_s))
        return ({"host": _host(), "base": base, "device": args.device, "repeats": repeats,
                 "write_repeats": write_repeats, "settle_s": settle_s,
                 "page_reporting": reported_bytes() is not None, "targets": TARGETS,
                 "rows": rows}, format_table(rows))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
