"""Kernels whose launch torch linked to nothing (Triton's ``cuLaunchKernelEx`` inside a module's
``record_function`` range, as ``parity profile --impl triton`` recorded it on the H200): charged to
the module around the launch call in time. On synthetic events with known answers, and on an
excerpt of the real H200 trace, which the code under test did not write."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from parity.speed.profile import Event, account

from speed_subjects import cpu, gpu

TRACE = Path(__file__).parent / "data" / "profiles" / "h200-triton-decoder-trace.json.gz"


def step_with_unlinked_launches(offset=0, runtime_thread=99, linked_gemm=True):
    """One step: two layers' attention each launch the Triton kernel ``attn_fwd`` from Python; the
    driver calls are recorded, inside the layers' ranges in time, with no link. Runtime calls carry
    another number for the thread than torch's ops (99 against 1); the GEMM's linked call is what
    tells that 99 is thread 1 (left out with ``linked_gemm=False``)."""
    o, c = offset, offset // 10
    events = [
        cpu("ProfilerStep#3", "user_annotation", o + 0, 10_000, correlation=c + 500),
        cpu("parity/<root>", "user_annotation", o + 10, 9_000, correlation=c + 501),
        cpu("aten::linear", "cpu_op", o + 20, 500, correlation=c + 502),
        cpu("parity/layers.0.attn", "user_annotation", o + 600, 2_000, correlation=c + 504),
        cpu("cuLaunchKernelEx", "cuda_driver", o + 700, 50, correlation=c + 12, thread=runtime_thread),
        cpu("parity/layers.1.attn", "user_annotation", o + 3_000, 2_000, correlation=c + 505),
        cpu("cuLaunchKernelEx", "cuda_driver", o + 3_100, 50, correlation=c + 13, thread=runtime_thread),
        gpu("attn_fwd", "kernel", o + 1_200, 3_000, correlation=c + 12),
        gpu("attn_fwd", "kernel", o + 4_300, 5_000, correlation=c + 13),
    ]
    if linked_gemm:
        events += [cpu("cudaLaunchKernel", "cuda_runtime", o + 40, 50, correlation=c + 11, thread=runtime_thread,
                       linked=c + 502),
                   gpu("gemm_kernel", "kernel", o + 100, 1_000, correlation=c + 11, linked=c + 502)]
    return events


def test_an_unlinked_launch_is_charged_to_the_module_around_it():
    result = account(step_with_unlinked_launches() + step_with_unlinked_launches(offset=20_000))
    calls = {row["name"]: row["total_ns"] for row in result["module_calls"]}
    assert (calls["layers.0.attn"], calls["layers.1.attn"]) == (2 * 3_000, 2 * 5_000)
    modules = {row["name"]: row for row in result["modules"]}
    assert "(unattributed)" not in modules and modules["layers.*.attn"]["calls"] == 4
    assert modules["layers.*.attn"]["share"] == pytest.approx(16_000 / 18_000)
    assert {row["name"]: row["total_ns"] for row in result["ops"]} == {"aten::linear": 2_000,
                                                                       "(launched from Python)": 16_000}
    assert result["hot"]["module"] == "layers.*.attn" and result["warnings"] == []


def test_the_same_thread_number_needs_no_mapping():
    result = account(step_with_unlinked_launches(runtime_thread=1, linked_gemm=False))
    calls = {row["name"]: row["total_ns"] for row in result["module_calls"]}
    assert (calls["layers.0.attn"], calls["layers.1.attn"]) == (3_000, 5_000)


def test_a_launch_on_a_thread_that_cannot_be_mapped_stays_unattributed():
    # Thread 99 has no linked call to say which of torch's threads it is: no guess.
    result = account(step_with_unlinked_launches(linked_gemm=False))
    modules = {row["name"]: row["total_ns"] for row in result["modules"] if row["total_ns"]}
    assert modules == {"(unattributed)": 8_000}
    assert any("could not be traced" in w for w in result["warnings"])


def trace_events(path: Path) -> list[Event]:
    """A Chrome trace's events as ``kineto_events`` gives them: ops and ranges carry their External
    id as correlation; runtime calls and device events their CUPTI correlation, linked to the
    External id of the op that issued them, where they have one."""
    events = []
    for item in json.loads(gzip.open(path, "rt").read())["traceEvents"]:
        cat, args = item["cat"], item.get("args", {})
        on_device = cat in ("kernel", "gpu_memcpy", "gpu_memset")
        frontend = cat in ("cpu_op", "user_annotation")
        events.append(Event(item["name"], cat, round(item["ts"] * 1000), round(item["dur"] * 1000),
                            thread=int(item["tid"]), on_device=on_device,
                            correlation=int(args.get("External id", 0) if frontend else args.get("correlation", 0)),
                            linked=0 if frontend else int(args.get("External id", 0))))
    return events


def test_the_h200_trace_charges_the_triton_kernel_to_the_attention_core():
    events = trace_events(TRACE)
    launches = [e for e in events if e.name == "cuLaunchKernelEx"]
    triton_runs = [e for e in events if e.name == "block_sparse_attn_fwd"]
    # What the H200 recorded: the Triton kernel's driver call has no link (other launches do).
    assert len(triton_runs) == 2
    assert all(e.linked == 0 for e in launches if e.correlation in {run.correlation for run in triton_runs})
    result = account(events)
    # Without those two driver calls the runs have nothing to be placed by: the difference each
    # layer's attention core sees is exactly its Triton run.
    unplaced = account([e for e in events if not (e in launches and e.correlation in
                                                  {run.correlation for run in triton_runs})])
    assert {row["name"]: row["total_ns"] for row in unplaced["modules"]}["(unattributed)"] == sum(
        run.dur_ns for run in triton_runs)
    calls = {row["name"]: row for row in result["module_calls"]}
    before = {row["name"]: row for row in unplaced["module_calls"]}
    for layer, run in zip((0, 1), sorted(triton_runs, key=lambda e: e.start_ns)):
        name = f"layers.{layer}.attn.core"
        assert calls[name]["total_ns"] - before[name]["total_ns"] == run.dur_ns
    names = {row["name"] for row in result["modules"]}
    assert "(unattributed)" not in names and "(outside modules)" not in names
    kernels = {row["name"]: row for row in result["kernels"]}
    assert kernels["block_sparse_attn_fwd"]["calls"] == 2
    assert sum(row["share"] for row in result["modules"]) == pytest.approx(1.0)
    assert not any("could not be traced" in w for w in result["warnings"])


@pytest.mark.gpu
def test_profile_charges_the_triton_kernel_to_its_module_on_a_gpu():
    # The H200's finding, checked where it was found: with the Triton kernel, every device kernel
    # of the decoder is charged to a module; the attention kernel to the attention core.
    from parity.speed.profile import profile_subject

    args = {"d_model": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64, "ffn_dim": 512, "seq_len": 512,
            "batch": 1, "vocab": 512, "window": 128, "block": 64}
    document = profile_subject("decoder", subject_args=args, impl="triton", device="cuda", skip_first=1, warmup=1,
                               active=2)
    modules = {row["name"]: row for row in document["modules"]}
    assert "(unattributed)" not in modules, document["warnings"]
    assert modules["layers.*.attn.core"]["calls"] == 2 * 2 and modules["layers.*.attn.core"]["share"] > 0
    kernels = {row["name"]: row for row in document["kernels"]}
    assert kernels["block_sparse_attn_fwd"]["calls"] == 2 * 2
    assert sum(row["share"] for row in document["modules"]) == pytest.approx(1.0)
