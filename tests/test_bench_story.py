"""The H200 story script (bench/h200_story.sh), run on the CPU at a tiny size: every step runs,
the bench with the Triton kernel is accepted and the one with the wrong impl is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ("--set d_model=64 --set layers=2 --set heads=2 --set kv_heads=1 --set head_dim=32 --set ffn_dim=128 "
        "--set seq_len=64 --set batch=1 --set vocab=128 --set window=32 --set block=16")


@pytest.mark.slow
def test_story_script_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "DEVICE": "cpu", "SKIP_INSTALL": "1",
           "SIZE": TINY, "PROFILE_ARGS": "--skip 0 --warmup 1 --active 1", "BENCH_ARGS": "--warmup 1 --reps 3",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "h200_story.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with tarfile.open(tmp_path / "story.tgz") as archive:
        archive.extractall(tmp_path, filter="data")
    story = tmp_path / "story"
    status = dict(line.split()[:2] for line in (story / "status.txt").read_text().splitlines())
    wrong = json.loads((story / "bench-wrong.json").read_text())
    # The wrong impl skips attention; at this tiny size on a loaded CPU it is usually, not always,
    # the fastest: the exit status must follow the gate either way (test_speed_bench pins it).
    refused = "rc=1" if wrong["fastest"] == "skip_attention" else "rc=0"
    assert status == {"profile-reference": "rc=0", "profile-triton": "rc=0", "capture": "rc=0", "bench": "rc=0",
                      "capture-wrong": "rc=0", "bench-wrong": refused}
    profile = json.loads((story / "profile-reference.json").read_text())
    modules = {row["name"]: row for row in profile["modules"]}
    assert modules["layers.*.attn.core"]["calls"] == 2 and modules["layers.*.attn.core"]["share"] > 0
    assert sum(row["share"] for row in profile["modules"]) == pytest.approx(1.0)
    assert json.loads((story / "profile-triton.json").read_text())["against"]["by"] == "module"
    assert "traceEvents" in json.loads((story / "trace-triton.json").read_text())  # the launches, as recorded
    bench = {row["impl"]: row for row in json.loads((story / "bench.json").read_text())["impls"]}
    assert bench["triton"]["parity"]["status"] == "holds" and bench["triton"]["valid"] is True
    rows = {row["impl"]: row for row in wrong["impls"]}
    assert rows["skip_attention"]["validity"] == "not valid: parity fails at <root>"
    assert rows["triton"]["parity"]["status"] == "holds"
    assert wrong["passed"] is (wrong["fastest"] != "skip_attention")
