"""bench/capture_scale_gpu.py, the GPU measurement of capture and compare at 1-10B parameters, run on the CPU at a tiny size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from bench import capture_scale_gpu as scale
from bench import formats

REPO = Path(__file__).resolve().parents[1]


def _valid(document: dict) -> dict:
    Draft202012Validator(formats.schema_for(document["format"])).validate(document)
    return document


def test_the_sizes_have_the_parameters_they_are_named_for():
    def parameters(shape):
        head = shape["hidden"] // shape["heads"]
        attention = 2 * shape["hidden"] ** 2 + 2 * shape["hidden"] * shape["kv_heads"] * head
        layer = attention + 3 * shape["hidden"] * shape["mlp"] + 2 * shape["hidden"]
        return shape["layers"] * layer + 2 * shape["vocab"] * shape["hidden"] + shape["hidden"]

    billions = {name: parameters(shape) / 1e9 for name, shape in scale.SIZES.items() if name != "tiny"}
    assert 1.0 < billions["1b"] < 1.2 and 3.0 < billions["3b"] < 3.7
    assert 7.9 < billions["8b"] < 8.1 and 9.5 < billions["10b"] < 10.2


def test_budget_records_every_module_of_a_few_layers_and_the_ends():
    globs, chosen = scale.record_globs(40, "budget", 2)
    assert chosen == [0, 39]
    assert globs == ["<root>", "model.embed_tokens", "model.norm", "lm_head", "model.layers.0", "model.layers.0.*",
                     "model.layers.39", "model.layers.39.*"]
    assert scale.record_globs(40, "budget", 3)[1] == [0, 20, 39]
    assert scale.record_globs(40, "all", 2) == (None, list(range(40)))


def test_targets_are_the_issues_formulas():
    gib = 2**30
    disk = {"write_gb_s": 2.0, "read_cold_gb_s": 4.0}
    row = {"weights_bytes": 20 * gib, "weights_mode": "reference",
           "capture": {"wall_s": 30.0, "resources": {"peak_host_bytes": 24 * gib, "peak_gpu_bytes": 25 * gib}},
           "bundle": {"bytes": 8_000_000_000, "manifest_bytes": 1000, "largest_reference_bytes": 2 * gib,
                      "by_kind": {"output": 3_000_000_000, "reference": 4_999_998_000, "input": 1000},
                      "reference": {"peak_copy_bytes": 2 * gib}},
           "forward": {"bf16_sdpa_s": 1.0, "reference_fp32_s": 10.0, "bf16_kernel_s": 0.5},
           "compare": {"wall_s": 3.0, "resources": {"bytes_read": 10_000_000_000}}}
    out = scale.targets(row, disk)
    assert out["capture_host"] == {"measured": 24 * gib, "limit": 25 * gib, "met": True}
    assert out["capture_gpu"]["limit"] == 26 * gib and out["capture_gpu"]["met"] is True
    assert out["capture_time"]["limit_s"] == 2 * (1.0 + 10.0 + 4.0) and out["capture_time"]["met"] is True
    assert out["compare_time"]["limit_s"] == 1.2 * 2.5 and out["compare_time"]["met"] is True
    assert out["bundle_size"] == {"measured": 8_000_000_000, "limit": 8_000_000_000, "state_bytes": 0,
                                  "shard_header_bytes": 0, "met": True}
    row["capture"]["resources"]["peak_host_bytes"] = 25 * gib + 1
    row["compare"]["wall_s"] = 3.01
    row["bundle"]["by_kind"]["state"] = 1  # one byte of weights stored
    row["bundle"]["by_kind"]["reference"] -= 1
    out = scale.targets(row, disk)
    assert [out[key]["met"] for key in ("capture_host", "compare_time", "bundle_size")] == [False, False, False]
    assert set(scale.targets({}, disk)) == set()


def test_the_gpu_limit_counts_the_largest_fp32_working_set_and_compare_the_checkpoint_it_reads():
    gib = 2**30
    disk = {"write_gb_s": 2.0, "read_cold_gb_s": 2.0}
    shape = scale.SIZES["10b"]
    seen = scale.working_set(shape, tokens=4096, measured=None)
    # The lm_head's fp32 logits (128256 x 4096), weight copy (128256 x 4096) and input (4096 x 4096).
    assert seen == {"measured_bytes": None, "lm_head_bytes": 4 * (2 * 128256 * 4096 + 4096 * 4096)}
    row = {"weights_bytes": 20 * gib, "weights_mode": "reference",
           "capture": {"wall_s": 30.0, "resources": {"peak_host_bytes": 4 * gib, "peak_gpu_bytes": 26 * gib}},
           "bundle": {"bytes": 8_000_000_000, "manifest_bytes": 1000, "largest_reference_bytes": 128256 * 4096 * 4,
                      "by_kind": {"output": 3_000_000_000, "reference": 4_999_999_000},
                      "reference": {"peak_copy_bytes": 128256 * 4096 * 4}},
           "fp32_working_set": seen,
           "forward": {"bf16_sdpa_s": 1.0, "reference_fp32_s": 2.0, "bf16_kernel_s": 0.5},
           "compare": {"wall_s": 30.0, "resources": {"bytes_read": 4_000_000_000, "weights": {
               "checkpoint_bytes_verified": 20_000_000_000}}}}
    gpu = scale.targets(row, disk)["capture_gpu"]
    assert gpu["largest_module_fp32_parts"]["weight_copy_and_output"] == 2 * 128256 * 4096 * 4
    assert gpu["largest_module_fp32_bytes"] == seen["lm_head_bytes"] > 2 * 128256 * 4096 * 4  # its input counts too
    assert gpu["limit"] == 22 * gib + seen["lm_head_bytes"] and gpu["met"] is False  # 26 GiB is above it
    row["fp32_working_set"] = dict(seen, measured_bytes=5 * gib)  # the fp32 attention scores outgrow the head
    gpu = scale.targets(row, disk)["capture_gpu"]
    assert gpu["limit"] == 27 * gib and gpu["met"] is True
    compare = scale.targets(row, disk)["compare_time"]
    assert compare["checkpoint_bytes"] == 20_000_000_000
    assert compare["bundle_read_s_at_disk_speed"] == 12.0 and compare["limit_s"] == 14.4 and compare["met"] is False


def test_no_row_starts_after_the_deadline(tmp_path, capsys):
    assert scale.main(["--sizes", "tiny,1b", "--seq", "128", "--device", "cpu", "--out", str(tmp_path / "out"),
                       "--workdir", str(tmp_path / "work"), "--disk-probe-gib", "0.01", "--deadline-s", "0"]) == 0
    for size in ("tiny", "1b"):
        document = _valid(json.loads((tmp_path / "out" / f"capture-scale-{size}.json").read_text()))
        assert document["disk"]["write_gb_s"] > 0 and document["disk"]["read_cold_gb_s"] > 0
        assert [row["status"] for row in document["rows"]] == ["not run: --deadline-s reached"]


def _tiny_row(tmp_path, *extra: str) -> tuple[dict, dict]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "bench.capture_scale_gpu", "--sizes", "tiny", "--seq", "128",
                           "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path / "work"),
                           "--disk-probe-gib", "0.05", "--row-limit-s", "600", "--deadline-s", "900", *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    document = _valid(json.loads((out / "capture-scale-tiny.json").read_text()))
    (row,) = document["rows"]
    assert row["status"] == "done", (row.get("errors"), row.get("logs"))
    return document, row


def test_the_rerun_with_weights_by_reference_records_what_it_is_judged_on(tmp_path):
    """The 10B rerun's path (``--weights reference``) at the tiny size: the checkpoint saved, its
    save's peak kept apart from the capture's, the compare's reads, digest time and host peak
    by kind recorded beside its limits, and the seconds of each phase of both."""
    document, row = _tiny_row(tmp_path, "--weights", "reference", "--row-limit-s", "300")
    assert document["weights"] == "reference" and document["limits"]["row_limit_s"] == 300
    assert row["checkpoint_save_s"] > 0 and row["checkpoint_save_host_rss"]["peak_bytes"]["anon"] > 0
    assert row["capture_peak_host_reset"] is True
    reads, bundle = row["compare"]["reads"], row["bundle"]
    assert reads["checkpoint_bytes_verified"] > row["weights_bytes"] and reads["checksum_s"] > 0  # the file's header too
    assert reads["weights_load_s"] > 0 and reads["bundle_bytes_read"] < bundle["bytes"]  # no weight in the bundle
    assert "state" not in bundle["by_kind"] and row["targets"]["bundle_size"]["met"] is True
    assert row["compare"]["passed"] and row["compare"]["host_rss"]["peak_bytes"]["file"] > 0
    assert row["targets"]["compare_time"]["checkpoint_bytes"] == reads["checkpoint_bytes_verified"]
    # where each step's time went, for the GPU run: the checkpoint's digests beside the capture's
    # other phases, the verification before compare's build, the judging inside its run
    capture_phases, compare_phases = row["capture"]["phases"], row["compare"]["phases"]
    assert {"build", "weights_check", "forward", "recorded_run", "reference_replay", "copy_to_writer", "writing",
            "digests", "digests_wait"} <= set(capture_phases)
    assert capture_phases["digests"] > 0 and capture_phases["reference_replay"] > 0
    assert capture_phases["reference_replay"] + capture_phases["copy_to_writer"] <= capture_phases["recorded_run"]
    assert list(compare_phases)[:3] == ["verify", "build", "load"]
    assert {"run", "judge", "fingerprint"} <= set(compare_phases)
    assert compare_phases["verify"] == pytest.approx(reads["checksum_s"], abs=0.01)
    assert compare_phases["load"] <= compare_phases["build"] and compare_phases["judge"] <= compare_phases["run"]
    assert sum(compare_phases.values()) - compare_phases["load"] - compare_phases["judge"] <= row["compare"]["wall_s"]


def test_a_tiny_llama_is_captured_and_compared_with_the_kernel_on_the_cpu(tmp_path):
    document, row = _tiny_row(tmp_path)
    assert row["parameters"] == 574_336 and row["weights_bytes"] == 2 * row["parameters"]
    # Recorded: every module of layers 0 and 2 of 3, the ends; each with its fp32 reference.
    assert row["recorded"]["decoder_layers"] == [0, 2]
    bundle = row["bundle"]
    assert bundle["by_kind"]["state"] == row["weights_bytes"]
    assert bundle["by_kind"]["reference"] == 2 * bundle["by_kind"]["output"]  # fp32 of every bf16 output
    assert bundle["reference"]["scope"] == "module" and bundle["reference"]["outputs_without_reference"] == []
    capture = row["capture"]
    assert capture["resources"]["bytes_written"] + bundle["manifest_bytes"] == bundle["bytes"]
    assert capture["resources"]["peak_gpu_bytes"] is None and capture["peak_host_bytes"] > 0
    compare = row["compare"]
    assert compare["passed"] and compare["failing"] == 0 and compare["tensors"] == bundle["tensors_by_kind"]["output"]
    assert compare["resources"]["bytes_read"] >= bundle["by_kind"]["output"] + bundle["by_kind"]["state"]
    assert bundle["outputs_plus_manifest_bytes"] == bundle["bytes"] - bundle["by_kind"]["state"]
    shape = scale.SIZES["tiny"]
    assert row["fp32_working_set"] == {"measured_bytes": None, "lm_head_bytes": 4 * (
        shape["vocab"] * 128 + shape["vocab"] * shape["hidden"] + 128 * shape["hidden"])}  # no GPU: not measured
    assert compare["resources"]["weights"]["bytes"] == bundle["by_kind"]["state"]
    assert set(row["forward"]) == {"bf16_sdpa_s", "reference_fp32_s", "bf16_kernel_s"}
    assert all(value > 0 for value in row["forward"].values())
    assert set(row["targets"]) == {"capture_host", "capture_time", "compare_time"}  # no GPU: no GPU target
    assert not (tmp_path / "work" / "tiny-128").exists()  # the bundle is removed after its row
    assert document["limits"] == {"row_limit_s": 600, "deadline_s": 900}
    reads = compare["reads"]
    assert reads["bundle_bytes_read"] == compare["resources"]["bytes_read"] and reads["bundle_read_gb_s"] > 0
    assert reads["weights_load_s"] > 0 and reads["checksum_s"] == 0 and reads["checkpoint_bytes_verified"] == 0
    for step in (capture, compare):
        rss = step["host_rss"]
        # VmHWM follows the resident set lazily (the kernel syncs its counters from time to time):
        # a sample may lead it by a few pages
        assert 0 < rss["peak_bytes"]["anon"] <= rss["peak_bytes"]["rss"] <= rss["vmhwm_bytes"] + 2**20
        assert rss["peak_bytes"]["file"] > 0 and rss["samples"] >= 2
    assert row["capture_peak_host_reset"] is True


def test_compare_gpu_memory_counts_the_weights_staged_while_they_load():
    from parity.run.subjects.base import STATE_CHUNK_BYTES, STATE_READ_AHEAD_BYTES

    gib = 2**30
    head = 2 * 128256 * 4096  # the 10B embedding's (and lm_head's) bf16 bytes: larger than a chunk
    assert head > max(STATE_CHUNK_BYTES, STATE_READ_AHEAD_BYTES)
    row = {"size": "10b", "weights_bytes": 20 * gib,
           "compare": {"wall_s": 3.0, "resources": {"bytes_read": 1, "peak_gpu_bytes": 22 * gib + 2 * head}}}
    gpu = scale.targets(row, {"write_gb_s": 1.0, "read_cold_gb_s": 1.0})["compare_gpu"]
    assert gpu["staged_state_bytes"] == 2 * head and gpu["limit"] == 22 * gib + 2 * head and gpu["met"] is True
    row["compare"]["resources"]["peak_gpu_bytes"] += 1
    assert scale.targets(row, {"write_gb_s": 1.0, "read_cold_gb_s": 1.0})["compare_gpu"]["met"] is False
    row["compare"]["resources"]["peak_gpu_bytes"] = None  # no GPU: nothing to judge
    assert "compare_gpu" not in scale.targets(row, {"write_gb_s": 1.0, "read_cold_gb_s": 1.0})


def test_the_host_peak_is_split_into_anonymous_and_file_pages_and_restarts_per_step(tmp_path):
    import mmap

    path = tmp_path / "mapped.bin"
    path.write_bytes(os.urandom(64 * 2**20))
    with scale.RssSampler(interval_s=0.005) as rss:
        anonymous = bytearray(96 * 2**20)
        anonymous[::4096] = b"\1" * len(anonymous[::4096])  # touched: resident
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            total = sum(mapped[offset] for offset in range(0, len(mapped), 4096))  # every page read: resident
        peaks = rss.peaks()
        del anonymous
        rss.reset()
        after = rss.peaks()
    assert total >= 0
    if peaks is None:
        pytest.skip("no /proc/self/status with RssAnon and RssFile here")
    assert peaks["peak_bytes"]["anon"] >= 96 * 2**20 and peaks["peak_bytes"]["file"] >= 64 * 2**20
    assert peaks["at_peak_rss_bytes"]["rss"] == peaks["peak_bytes"]["rss"] and peaks["samples"] >= 2
    assert after["peak_bytes"]["anon"] < peaks["peak_bytes"]["anon"] - 64 * 2**20  # the reset forgot the buffer
    assert scale.reset_peak_host() is True and scale.peak_host_bytes() < peaks["vmhwm_bytes"]
