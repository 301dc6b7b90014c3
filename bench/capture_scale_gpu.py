"""Benchmark: capture and compare of Llama-shaped models of 1 to 10 billion parameters on one GPU, against the issue's targets.

For each size and sequence length (a *row*), in child processes of their own (a size that does not
fit, or a row past its time limit, does not stop the others):

1. **capture** (one process): the model is built from a config with random weights directly in
   bf16 on the GPU (no download; ``transformers`` from the host); ``parity capture`` with
   ``--impl sdpa`` (transformers' attention through ``parity_sdpa``, parity's SDPA on the
   mask) and the per-module fp32 reference (``--reference fp32 --reference-scope module``),
   weights stored in the bundle (``--weights stored``, default) or named by reference
   (``--weights reference``: the model is saved with ``save_pretrained`` first and loaded from it
   with ``from_pretrained(device_map=...)``). Then, with the capture's model freed, the bf16
   forward (``parity_sdpa`` and the kernel, ``parity_sparse``) and the reference forward (the
   whole model run with each weight-owning module cast to fp32 while it runs: what the
   per-module reference's replay of the root costs) are timed, median of 3 after a warm-up.
2. **compare** (another process): ``parity compare`` of that bundle with the Triton kernel
   (``parity_sparse`` via :mod:`parity.integrations.transformers`), on the same GPU.
3. with ``--model-reference``: the same capture with the whole-model fp32 reference (a second,
   fp32 copy of the model on the GPU: about 3x the bf16 weights, so where it fits) and its
   compare, and whether the two compares fail the same tensors (``model_reference``). The
   per-module bundle is judged by the thresholds end to end, the whole-model one by the error
   budget.

What a row records (``--record``): ``budget`` (default) records every module of
``--record-blocks`` decoder layers spread over the depth (the first and the last for 2), the
embedding, the final norm, ``lm_head`` and the whole model's logits (``<root>``), so a 10B
model at 2k tokens stays a few GB of outputs and the four sizes fit the ~8-minute budget;
``all`` records every module of every layer (about 1 GB of outputs and fp32 references per
layer at 4096 hidden and 2k tokens: 40 GB at 10B, beyond the disk of a 64 GB host at 4k).
Peak memory and the reference's cost do not depend on how many layers are recorded
(``tests/test_run_scale.py`` measures that on the CPU); bytes written and read do, and the
time targets use the bundle's measured size.

Per row: wall times, peak host memory (VmHWM of each process) and GPU memory
(``max_memory_allocated``), bundle size by kind, the forward times, the verdict, and the
issue's targets evaluated with those numbers and the disk's write and read speed measured in
the work directory first (1 GiB written with fsync, read back after the page cache dropped it,
``posix_fadvise(DONTNEED)``):

- capture peak host <= 1.25 x bf16 weights;
- capture peak GPU <= weights + 2 GiB + the largest module's fp32 working set, the largest of:
  its fp32 weight copy (``capture.reference.peak_copy_bytes``) plus the largest fp32 output; the
  lm_head's fp32 logits, weight copy and input (4 x (vocabulary x tokens + vocabulary x hidden +
  tokens x hidden)); and the GPU memory the fp32 reference forward (the root's replay) was
  measured to allocate above the model (``fp32_working_set``: at 4k tokens the fp32 attention
  scores, heads x tokens^2 x 4 bytes, outgrow the others);
- capture wall <= 2 x (bf16 forward + reference forward + bundle bytes / write speed);
- compare wall <= 1.2 x max(kernel forward, bytes read / read speed), the bytes read being the
  bundle's tensors compare read plus, with weights by reference, the checkpoint files (read once
  for their digest; loading them again finds them in the page cache);
- with ``--weights reference``: bundle bytes <= outputs (every recorded tensor but the state) +
  the shards' headers + manifest, i.e. no weight stored.

Transformers is imported before any clock starts (a fixed cost of each process); what capture
and compare import themselves is counted.

One JSON per size (format ``parity-capture-scale-report``, schema in ``bench/schemas/``),
``capture-scale-<size>.json`` in ``--out``, rewritten after every row and after every step of a
row, so a run cut short keeps what it measured::

    python -m bench.capture_scale_gpu --sizes 1b,3b,8b,10b --seq 2048 --out results/
    python -m bench.capture_scale_gpu --sizes 10b --seq 4096 --record all --row-limit-s 900

Needs a CUDA GPU for the named sizes; ``--device cpu --sizes tiny`` runs the same path on the
CPU (the kernel through the Triton interpreter), as the test does.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn

from bench import formats

ROOT = Path(__file__).resolve().parents[1]
SPEC = "bench.capture_scale_gpu:make_subject"

# Llama shapes (untied embeddings). 1b: the 1.1B (vocabulary 32000); 3b: Llama-3.2-3B's
# (3.6B untied); 8b: Llama-3-8B's; 10b: Llama-3-8B's with 40 layers (9.8B); tiny: the CPU test's.
SIZES = {
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, mlp=8192, vocab=32000),
    "3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, mlp=8192, vocab=128256),
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, mlp=14336, vocab=128256),
    "10b": dict(layers=40, hidden=4096, heads=32, kv_heads=8, mlp=14336, vocab=128256),
    "tiny": dict(layers=3, hidden=128, heads=4, kv_heads=2, mlp=256, vocab=512),
}
IMPL_NAMES = {"sdpa": "parity_sdpa", "kernel": "parity_sparse"}


# ---------------------------------------------------------------------------------------------
# The subject


class LlamaSubject:
    """A parity subject: a Llama from a config in bf16, built on the device it runs on (random
    weights from ``seed``, or ``checkpoint``'s); input: ``tokens`` random token ids, batch 1;
    output: the logits. Impls: ``sdpa`` (``parity_sdpa``) and ``kernel`` (``parity_sparse``),
    both computing attention in ``model.layers.N.self_attn.attn_core``."""

    name = "llama-scale-gpu"
    impls = ("sdpa", "kernel")
    reference_impl = "sdpa"

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, mlp: int, vocab: int, tokens: int,
                 checkpoint: str = "", seed: int = 0):
        self.args = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, mlp=mlp, vocab=vocab,
                         tokens=tokens, checkpoint=checkpoint, seed=seed)

    def config(self, impl: str):
        from transformers import LlamaConfig

        a = self.args
        return LlamaConfig(hidden_size=a["hidden"], intermediate_size=a["mlp"], num_hidden_layers=a["layers"],
                           num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"], vocab_size=a["vocab"],
                           max_position_embeddings=max(4096, a["tokens"]), use_cache=False,
                           tie_word_embeddings=False, attn_implementation=IMPL_NAMES[impl])

    def make_inputs(self):
        gen = torch.Generator().manual_seed(self.args["seed"] + 1)
        return {"tokens": torch.randint(0, self.args["vocab"], (1, self.args["tokens"]), generator=gen)}

    def build(self, impl: str, device: torch.device | str = "cpu") -> nn.Module:
        from transformers import LlamaForCausalLM

        from parity.integrations import transformers as parity_tf

        parity_tf.register()
        device = torch.device(device)
        if self.args["checkpoint"] and device.type != "meta":
            placed = {} if device.type == "cpu" else {"device_map": str(device)}
            model = LlamaForCausalLM.from_pretrained(self.args["checkpoint"], dtype=torch.bfloat16,
                                                     attn_implementation=IMPL_NAMES[impl], **placed)
        else:
            torch.manual_seed(self.args["seed"])
            with torch.device(device):
                model = LlamaForCausalLM._from_config(self.config(impl), dtype=torch.bfloat16)
        parity_tf.attach(model)
        return model.eval()

    def call(self, module: nn.Module, inputs) -> torch.Tensor:
        return module(input_ids=inputs.tensors["tokens"], use_cache=False).logits


def make_subject(**args) -> LlamaSubject:
    return LlamaSubject(**args)


# ---------------------------------------------------------------------------------------------
# Measurements


def peak_host_bytes() -> int | None:
    from parity.run.resources import peak_host_bytes as peak

    return peak()


_RSS_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def _rss_now() -> dict | None:
    """This process's resident set now, by kind (bytes): ``rss`` and its ``anon`` (heap, tensors),
    ``file`` (mapped files' pages: a checkpoint mmap'd by safetensors) and ``shmem`` parts; None
    without /proc (the kinds need Linux 4.5)."""
    try:
        with open("/proc/self/status") as status:
            found = {_RSS_FIELDS[line.split(":")[0]]: int(line.split()[1]) * 1024
                     for line in status if line.split(":")[0] in _RSS_FIELDS}
    except (OSError, ValueError, IndexError):
        return None
    return found if len(found) == len(_RSS_FIELDS) else None


def reset_peak_host() -> bool:
    """Start VmHWM (the peak resident set) again from the current one (``/proc/self/clear_refs``,
    Linux 4.0 and later): a step's peak then excludes an earlier step's in the same process."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """The peak resident set split into anonymous and file-mapped pages, which VmHWM does not
    tell apart: /proc/self/status sampled every ``interval_s`` on a thread. ``peaks()``: the
    highest of each kind and the split at the highest ``rss`` sample since the last ``reset()``
    (a spike shorter than the interval can be missed; VmHWM, beside it, misses none)."""

    def __init__(self, interval_s: float = 0.02):
        import threading

        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._peak: dict[str, int] = {}
            self._at_peak: dict[str, int] | None = None
            self._samples = 0
        self.sample()

    def sample(self) -> None:
        now = _rss_now()
        if now is None:
            return
        with self._lock:
            self._samples += 1
            for kind, value in now.items():
                self._peak[kind] = max(self._peak.get(kind, 0), value)
            if self._at_peak is None or now["rss"] >= self._at_peak["rss"]:
                self._at_peak = now

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self) -> dict | None:
        self.sample()
        with self._lock:
            if not self._samples:
                return None
            return {"peak_bytes": dict(self._peak), "at_peak_rss_bytes": dict(self._at_peak or {}),
                    "vmhwm_bytes": peak_host_bytes(), "samples": self._samples, "interval_s": self.interval_s}


def disk_speed(directory: Path, gib: float) -> dict:
    """Write ``gib`` GiB with fsync, then read it back cold (its pages dropped from the page
    cache with posix_fadvise DONTNEED) and warm; GB/s each."""
    path = directory / "disk-probe.bin"
    block = os.urandom(64 * 2**20)
    blocks = max(1, int(gib * 2**30 / len(block)))
    size = blocks * len(block)
    start = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(blocks):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    write_s = time.perf_counter() - start
    result = {"bytes": size, "write_gb_s": round(size / write_s / 1e9, 3)}
    for label in ("cold", "warm"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if label == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while os.read(fd, 16 * 2**20):
                pass
            result[f"read_{label}_gb_s"] = round(size / (time.perf_counter() - start) / 1e9, 3)
        finally:
            os.close(fd)
    path.unlink()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``fn()`` (synchronized), after one warm-up call."""
    with torch.no_grad():
        fn()
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def record_globs(layers: int, record: str, blocks: int) -> tuple[list[str] | None, list[int]]:
    """``--layers`` globs of a row and the decoder layers they record in full."""
    if record == "all":
        return None, list(range(layers))
    count = max(1, min(blocks, layers))
    chosen = sorted({round(i * (layers - 1) / max(1, count - 1)) for i in range(count)}) if count > 1 else [0]
    globs = ["<root>", "model.embed_tokens", "model.norm", "lm_head"]
    for index in chosen:
        globs += [f"model.layers.{index}", f"model.layers.{index}.*"]
    return globs, chosen


def working_set(shape: dict, *, tokens: int, measured: int | None) -> dict:
    """The largest module's fp32 working set, for the capture GPU target: ``measured`` (bytes the
    reference forward allocated above the model, or None without a GPU) and ``lm_head_bytes``,
    what the head's replay needs at least: its fp32 logits (vocabulary x tokens x 4), its fp32
    weight copy (vocabulary x hidden x 4) and its fp32 input (tokens x hidden x 4)."""
    vocab, hidden = shape["vocab"], shape["hidden"]
    return {"measured_bytes": measured, "lm_head_bytes": 4 * (vocab * tokens + vocab * hidden + tokens * hidden)}


def bundle_bytes(path: Path) -> dict:
    from parity.bundle.reader import open_bundle

    bundle = open_bundle(path)
    by_kind: dict[str, int] = {}
    counts: dict[str, int] = {}
    largest_reference = 0
    for entry in bundle.entries:
        by_kind[entry.kind] = by_kind.get(entry.kind, 0) + entry.nbytes
        counts[entry.kind] = counts.get(entry.kind, 0) + 1
        if entry.kind == "reference":
            largest_reference = max(largest_reference, entry.nbytes)
    files = sum(file.stat().st_size for file in path.iterdir() if file.is_file())
    manifest = (path / "manifest.json").stat().st_size
    # The bundle without the weights: every tensor but the state, the shards' headers, the manifest
    # (what a bundle with weights by reference should be at most).
    outputs_and_manifest = files - by_kind.get("state", 0)
    return {"bytes": files, "manifest_bytes": manifest, "by_kind": by_kind,
            "outputs_plus_manifest_bytes": outputs_and_manifest,
            "tensors_by_kind": counts, "tensors": len(bundle.entries), "largest_reference_bytes": largest_reference,
            "reference": (bundle.capture_info or {}).get("reference"),
            "capture_resources": (bundle.capture_info or {}).get("resources")}


# ---------------------------------------------------------------------------------------------
# The steps (each in a child process)


def step_capture(args, row: dict, save, rss: RssSampler) -> None:
    from parity.run.capture import capture
    from parity.run.module_reference import HighPrecisionCast
    from parity.run.subjects import load_subject

    device = torch.device(args.device)
    sizes = dict(SIZES[args.size], tokens=args.tokens)
    work = Path(args.work)
    checkpoint = str(work / "checkpoint") if args.weights == "reference" else ""
    if args.child == "capture-model":  # the whole-model fp32 reference, for its verdicts beside the per-module one
        runner = load_subject(SPEC, dict(sizes, checkpoint=checkpoint))
        start = time.perf_counter()
        result = capture(runner, work / "bundle-model", impl="sdpa", device=device,
                         layers=record_globs(sizes["layers"], args.record, args.record_blocks)[0], reference="fp32",
                         reference_scope="model", weights_from=[checkpoint] if checkpoint else None,
                         shard_bytes=256 * 2**20, durable=True, force=True)
        row.setdefault("model_reference", {})["capture"] = {
            "wall_s": round(time.perf_counter() - start, 2), "resources": result.resources,
            "bundle": bundle_bytes(result.path)}
        save()
        return
    if checkpoint:
        start = time.perf_counter()
        model = LlamaSubject(**sizes).build("sdpa", device)
        model.save_pretrained(checkpoint)
        del model
        _free(device)
        row["checkpoint_save_s"] = round(time.perf_counter() - start, 2)
        # The save's own peak (safetensors copies a shard's tensors to the host before writing
        # it), kept apart from the capture's: VmHWM starts again from here where Linux allows.
        row["checkpoint_save_host_rss"] = rss.peaks()
        save()
    row["capture_peak_host_reset"] = reset_peak_host()
    rss.reset()
    runner = load_subject(SPEC, dict(sizes, checkpoint=checkpoint))
    row["gpu"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    globs, chosen = record_globs(sizes["layers"], args.record, args.record_blocks)
    row["recorded"] = {"mode": args.record, "globs": globs, "decoder_layers": chosen}
    start = time.perf_counter()
    result = capture(runner, work / "bundle", impl="sdpa", device=device, layers=globs, reference="fp32",
                     reference_scope="module", weights_from=[checkpoint] if checkpoint else None,
                     shard_bytes=256 * 2**20, durable=True, force=True)
    # phases: where the capture's time went (the checkpoint's digests on their own thread beside
    # the others; what the commit still waited for them is digests_wait).
    row["capture"] = {"wall_s": round(time.perf_counter() - start, 2), "resources": result.resources,
                      "phases": result.resources.get("phases"),
                      "peak_host_bytes": peak_host_bytes(), "host_rss": rss.peaks(), "tensors": result.tensors,
                      "layers": result.layers}
    row["bundle"] = bundle_bytes(result.path)
    save()
    del result
    _free(device)

    # The forwards, timed on a fresh model once the capture's is gone.
    model = runner.subject.build("sdpa", device)
    params = sum(p.numel() for p in model.parameters())
    row["parameters"] = params
    row["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = runner.make_inputs().tensors["tokens"].to(device)
    forward = {"bf16_sdpa_s": timed(lambda: model(input_ids=ids, use_cache=False), device)}
    save()
    cast = HighPrecisionCast(model, torch.float32)

    def reference_forward():
        cast.active = True
        try:
            model(input_ids=ids, use_cache=False)
        finally:
            cast.active = False
            cast.restore()

    # The reference forward is what the per-module replay of the root computes (every module of
    # the model run in fp32, each weight-owning one on an fp32 copy of its weights while it runs):
    # the GPU memory it allocates above the model is the largest recorded module's fp32 working
    # set (the fp32 attention of the largest layer, an fp32 weight copy, the fp32 logits).
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    forward["reference_fp32_s"] = timed(reference_forward, device, repeats=1)
    row["fp32_working_set"] = working_set(sizes, tokens=sizes["tokens"], measured=(
        torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None))
    cast.remove()
    from parity.integrations import transformers as parity_tf

    model.set_attn_implementation(IMPL_NAMES["kernel"])
    parity_tf.attach(model)
    forward["bf16_kernel_s"] = timed(lambda: model(input_ids=ids, use_cache=False), device)
    row["forward"] = {key: round(value, 4) for key, value in forward.items()}
    save()


def step_compare(args, row: dict, save, rss: RssSampler) -> None:
    from parity.judge.compare import compare_bundle
    from parity.run.subjects.base import trusting

    device = torch.device(args.device)
    whole = args.child == "compare-model"
    start = time.perf_counter()
    with trusting(SPEC):
        report = compare_bundle(Path(args.work) / ("bundle-model" if whole else "bundle"), impl="kernel",
                                device=device)
    wall = time.perf_counter() - start
    failing = report.failing
    resources = report.resources
    weights = resources.get("weights") or {}
    # What the row is judged on, each said once: compare's bundle reads (its tensors, the stored
    # weights among them) per second of its wall time, the weights' load, the checkpoint's digest.
    reads = {"bundle_bytes_read": resources["bytes_read"],
             "bundle_read_gb_s": round(resources["bytes_read"] / 1e9 / wall, 3) if wall > 0 else None,
             "weights_load_s": weights.get("seconds"), "weights_load_gb_s": weights.get("gb_per_second"),
             "checksum_s": weights.get("checkpoint_verify_seconds"),
             "checkpoint_bytes_verified": weights.get("checkpoint_bytes_verified")}
    result = {"wall_s": round(wall, 2), "resources": resources, "phases": resources.get("phases"), "reads": reads,
              "host_rss": rss.peaks(),
              "peak_host_bytes": peak_host_bytes(), "passed": report.passed, "tensors": len(report.layers),
              "failing": len(failing), "failing_names": [r.name for r in failing][:50],
              "first_failing": report.first_failing_layer, "rules": sorted({r.rule for r in report.layers if r.rule}),
              "warnings": report.warnings}
    if whole:
        row.setdefault("model_reference", {})["compare"] = result
        mine = row.get("compare") or {}
        row["model_reference"]["same_verdicts"] = (mine.get("passed") == result["passed"]
                                                   and mine.get("failing_names") == result["failing_names"])
    else:
        row["compare"] = result
    save()


def targets(row: dict, disk: dict) -> dict:
    """The issue's targets evaluated with the row's measurements (absent parts: not evaluated)."""
    out: dict = {}
    weights = row.get("weights_bytes")
    capture, bundle, forward, compare = (row.get(key) for key in ("capture", "bundle", "forward", "compare"))
    if capture and weights:
        host = capture["resources"]["peak_host_bytes"]
        out["capture_host"] = {"measured": host, "limit": int(1.25 * weights), "met": host <= 1.25 * weights}
        gpu = capture["resources"]["peak_gpu_bytes"]
        if gpu is not None and bundle:
            # The largest module's fp32 working set: the most of (its fp32 weight copy plus the
            # largest fp32 output, both recorded by the capture), the lm_head's (logits, weight
            # and input in fp32) and what the fp32 reference forward was measured to allocate
            # above the model (the attention's fp32 scores at long sequences).
            seen = row.get("fp32_working_set") or {}
            parts = {"weight_copy_and_output": (bundle["reference"] or {}).get("peak_copy_bytes", 0)
                     + bundle["largest_reference_bytes"],
                     "lm_head": seen.get("lm_head_bytes") or 0,
                     "reference_forward_measured": seen.get("measured_bytes") or 0}
            working = max(parts.values())
            limit = weights + 2 * 2**30 + working
            out["capture_gpu"] = {"measured": gpu, "limit": limit, "largest_module_fp32_bytes": working,
                                  "largest_module_fp32_parts": parts, "met": gpu <= limit}
    if compare and weights and compare["resources"].get("peak_gpu_bytes") is not None:
        # Not one of the targets (it sets none for compare's GPU memory): the capture's
        # slack of 2 GiB beside the weights, plus what loading them stages on the GPU beyond the
        # module (the chunk being loaded and the read-ahead, each at least the largest tensor:
        # the embedding's or lm_head's vocabulary x hidden bf16), which the build's check counts.
        from parity.run.subjects.base import staged_state_bytes

        shape = SIZES.get(row.get("size"), {})
        largest = 2 * shape["vocab"] * shape["hidden"] if shape else 0
        staged = staged_state_bytes([largest])
        gpu = compare["resources"]["peak_gpu_bytes"]
        limit = weights + 2 * 2**30 + staged
        out["compare_gpu"] = {"measured": gpu, "limit": limit, "staged_state_bytes": staged, "met": gpu <= limit}
    if capture and bundle and forward:
        write_s = bundle["bytes"] / (disk["write_gb_s"] * 1e9)
        limit = 2 * (forward["bf16_sdpa_s"] + forward["reference_fp32_s"] + write_s)
        out["capture_time"] = {"measured_s": capture["wall_s"], "limit_s": round(limit, 2),
                               "bundle_write_s_at_disk_speed": round(write_s, 2), "met": capture["wall_s"] <= limit}
    if compare and bundle and forward:
        # What compare must read from the disk: the bundle's tensors it read and, for weights by
        # reference, the checkpoint files once (their digest; the load that follows finds them in
        # the page cache).
        checkpoint = (compare["resources"].get("weights") or {}).get("checkpoint_bytes_verified", 0)
        read_s = (compare["resources"]["bytes_read"] + checkpoint) / (disk["read_cold_gb_s"] * 1e9)
        limit = 1.2 * max(forward["bf16_kernel_s"], read_s)
        out["compare_time"] = {"measured_s": compare["wall_s"], "limit_s": round(limit, 2),
                               "bundle_read_s_at_disk_speed": round(read_s, 2), "checkpoint_bytes": checkpoint,
                               "met": compare["wall_s"] <= limit}
    if bundle and row.get("weights_mode") == "reference":
        # Outputs: every recorded tensor but the state (the inputs, a few KB of token ids, included),
        # plus the shards' safetensors headers; met when no weight is stored.
        kinds = bundle["by_kind"]
        framing = bundle["bytes"] - bundle["manifest_bytes"] - sum(kinds.values())
        limit = sum(size for kind, size in kinds.items() if kind != "state") + framing + bundle["manifest_bytes"]
        out["bundle_size"] = {"measured": bundle["bytes"], "limit": limit, "state_bytes": kinds.get("state", 0),
                              "shard_header_bytes": framing, "met": bundle["bytes"] <= limit}
    return out


def child(args) -> int:
    from parity.integrations import transformers as parity_tf

    parity_tf.register()  # imports transformers before any clock starts: the process's cost, not the step's
    row_file = Path(args.row_file)
    row = json.loads(row_file.read_text()) if row_file.exists() else {}

    def save() -> None:
        tmp = row_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=1))
        tmp.replace(row_file)

    try:
        with RssSampler() as rss:
            (step_capture if args.child.startswith("capture") else step_compare)(args, row, save, rss)
    except Exception as err:  # the row says what stopped it; the parent goes on with the next
        row.setdefault("errors", []).append({"step": args.child, "error": f"{type(err).__name__}: {err}"[:2000],
                                             "traceback": traceback.format_exc()[-4000:]})
        save()
        return 1
    save()
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: rows in children, one JSON per size


def run_row(args, size: str, tokens: int, disk: dict, work: Path, document: dict, save) -> dict:
    row = {"size": size, "tokens": tokens, "weights_mode": args.weights, "status": "running"}
    row_file = work / "row.json"
    row_file.write_text(json.dumps(row))
    deadline = min(time.monotonic() + args.row_limit_s, args.deadline)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    status = "done"
    steps = ("capture", "compare") + (("capture-model", "compare-model") if args.model_reference else ())
    for step in steps:
        left = deadline - time.monotonic()
        if left <= 1:
            status = f"time limit reached before {step}"
            break
        command = [sys.executable, "-m", "bench.capture_scale_gpu", "--child", step, "--size", size, "--tokens",
                   str(tokens), "--device", args.device, "--work", str(work), "--row-file", str(row_file),
                   "--record", args.record, "--record-blocks", str(args.record_blocks), "--weights", args.weights]
        log = open(work / f"{step}.log", "w")
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=left)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = None
        finally:
            log.close()
        row = json.loads(row_file.read_text())
        row.setdefault("logs", {})[step] = (work / f"{step}.log").read_text()[-3000:]
        if code is None:
            status = f"time limit reached during {step} (--row-limit-s {args.row_limit_s:g}, --deadline-s)"
            break
        if code != 0:
            status = f"{step} failed (exit {code})"
            break
        document["rows"][-1] = dict(row, status="running")
        save()
        if step.startswith("compare"):  # the disk holds one bundle at a time
            shutil.rmtree(work / ("bundle-model" if step == "compare-model" else "bundle"), ignore_errors=True)
    row["status"] = status
    row["targets"] = targets(row, disk)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1b,3b,8b,10b", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--seq", default="2048", help="comma list of token counts (default 2048; the issue's: 2048,4096)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--record", default="budget", choices=("budget", "all"))
    parser.add_argument("--record-blocks", type=int, default=2, help="decoder layers recorded in full (budget)")
    parser.add_argument("--weights", default="stored", choices=("stored", "reference"))
    parser.add_argument("--model-reference", action="store_true",
                        help="also capture with the whole-model fp32 reference (a second, fp32 model on the GPU: "
                             "where it fits) and compare it, for the verdicts of both")
    parser.add_argument("--row-limit-s", type=float, default=300.0, help="time limit of one row (capture + compare)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="seconds for the whole run: a row gets what is left at most, none starts after it")
    parser.add_argument("--disk-probe-gib", type=float, default=1.0)
    parser.add_argument("--out", default="capture-scale", help="folder of the JSON files")
    parser.add_argument("--workdir", default=None, help="where bundles go (default: a temporary folder)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    args.deadline = time.monotonic() + (args.deadline_s if args.deadline_s is not None else float("inf"))
    sizes = [name.strip() for name in args.sizes.split(",") if name.strip()]
    unknown = [name for name in sizes if name not in SIZES]
    if unknown:
        parser.error(f"unknown --sizes {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    try:
        seqs = [int(value) for value in args.seq.split(",") if value.strip()]
    except ValueError:
        parser.error(f"--seq takes a comma list of integers, got {args.seq!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.workdir or tempfile.mkdtemp(prefix="capture-scale-gpu-"))
    base.mkdir(parents=True, exist_ok=True)
    disk = disk_speed(base, args.disk_probe_gib)
    print(json.dumps({"disk": disk}), flush=True)
    # The GPU's name comes from the capture child (row "gpu"): this process leaves the GPU alone.
    machine = {"torch": torch.__version__, "cpus": os.cpu_count()}
    for size in sizes:
        document = {"format": formats.CAPTURE_SCALE_REPORT, "version": formats.FORMATS[formats.CAPTURE_SCALE_REPORT][0],
                    "size": size, "shape": SIZES[size], "device": args.device, "machine": machine, "disk": disk,
                    "record": args.record, "record_blocks": args.record_blocks, "weights": args.weights,
                    "model_reference": args.model_reference,
                    "limits": {"row_limit_s": args.row_limit_s, "deadline_s": args.deadline_s}, "rows": []}
        path = out / f"capture-scale-{size}.json"

        def save(document=document, path=path) -> None:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(document, indent=1))
            tmp.replace(path)

        for tokens in seqs:
            work = base / f"{size}-{tokens}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            document["rows"].append({"size": size, "tokens": tokens, "status": "running"})
            save()
            if time.monotonic() >= args.deadline - 1:
                row = {"size": size, "tokens": tokens, "status": "not run: --deadline-s reached", "targets": {}}
            else:
                row = run_row(args, size, tokens, disk, work, document, save)
            document["rows"][-1] = row
            save()
            shutil.rmtree(work, ignore_errors=True)  # the next row needs the disk
            summary = {key: row.get(key) for key in ("size", "tokens", "status", "parameters")}
            summary["targets_met"] = {name: target["met"] for name, target in row["targets"].items()}
            print(json.dumps(summary), flush=True)
    if args.workdir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
