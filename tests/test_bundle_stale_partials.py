"""A capture --force killed mid-write (a real process, SIGKILL): its hidden partial directory is
removed by the next verify or compare of that path, the old bundle is intact, and a live
writer's partial is never touched."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.bundle import commit
from parity.cli.main import main

pytestmark = pytest.mark.slow  # a real capture process, killed

TESTS = Path(__file__).resolve().parent
SPEC = "stalling_subject:make"


def _partials(target: Path) -> list[Path]:
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.partial-"))


def _killed_force_capture(tmp_path: Path) -> tuple[Path, Path]:
    """An old bundle at ``tmp_path/b`` and the partial a --force capture left when SIGKILLed."""
    target = tmp_path / "b"
    assert main(["capture", "--subject", SPEC, "--bundle", str(target), "--reference", "none",
                 "--set", "tag=0", "--no-fsync"]) == 0
    flag = tmp_path / "stalled"
    env = {**os.environ, "PARITY_TEST_STALL": str(flag),
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "parity", "capture", "--subject", SPEC, "--bundle", str(target), "--force",
         "--reference", "none", "--set", "tag=1", "--shard-mib", "0.1"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the capture never reached its second layer"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
    (partial,) = _partials(target)
    shards = [p for p in partial.iterdir() if p.suffix == ".safetensors"]
    assert shards, "the killed writer had written shards into its partial directory"
    return target, partial


def _tag(target: Path) -> int:
    return json.loads((target / "manifest.json").read_text())["subject"]["args"]["tag"]


@pytest.mark.parametrize("command", ["verify", "compare"])
def test_the_next_verify_or_compare_removes_a_killed_force_captures_partial(tmp_path, command, capsys):
    target, partial = _killed_force_capture(tmp_path)
    if command == "verify":
        assert main(["verify", str(target)]) == 0
    else:
        assert main(["compare", "--bundle", str(target), "--subject", SPEC, "--impl", "reference", "--device", "cpu"]) == 0
    assert not partial.exists()
    assert _partials(target) == []
    assert _tag(target) == 0  # the old bundle, intact (verify checked every checksum)
    assert main(["verify", str(target)]) == 0


def test_a_live_writers_partial_is_left_alone(tmp_path):
    target = tmp_path / "b"
    assert main(["capture", "--subject", SPEC, "--bundle", str(target), "--reference", "none", "--no-fsync"]) == 0
    live = tmp_path / f"{commit._partial_prefix(target)}{os.getpid()}-live"  # this process: alive
    live.mkdir()
    (live / "shard-00000.safetensors").write_bytes(b"half")
    assert main(["verify", str(target)]) == 0
    assert live.is_dir() and (live / "shard-00000.safetensors").read_bytes() == b"half"
