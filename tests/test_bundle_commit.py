"""Committing a bundle cannot lose one: a kill between any two filesystem steps, writers racing
with and without --force, SIGKILL at random moments, and the umask's permissions.

Writers that are killed run in processes forked from a small server process (the "zygote"),
which imports torch once: each child then costs milliseconds, and its pid is really gone after
the kill, as the stale-directory cleanup expects. A child is killed at a chosen step by the
commit module's ``_fs_step`` hook calling ``os._exit`` (no cleanup, no ``finally``: like SIGKILL).
The three ways a bundle can be moved into place are each tested: ``exchange`` (renameat2 with
RENAME_EXCHANGE), ``journal`` (the exchange unavailable: the old bundle is parked as
``.NAME.old-*``) and ``plain`` (no renameat2 at all: plain rename(2)).
"""
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parity.bundle import commit as B
from parity.bundle.writer import BundleWriter
from parity.bundle.reader import open_bundle
from parity.base.errors import BundleError, UsageError

MODES = ("exchange", "journal", "plain")

ZYGOTE = r"""
import json, os, sys, time
import torch
from parity.bundle import commit as B
from parity.bundle.writer import BundleWriter
from parity.base.errors import UsageError

def configure(mode, kill_at, log):
    if mode in ("journal", "plain"):
        def unsupported(src, dst):
            raise B._Unsupported("disabled by the test")
        B.rename_exchange = unsupported
    if mode == "plain":
        B._renameat2_function = None
    count = [0]
    def hook(operation, *paths):
        if log is not None:
            with open(log, "a") as out:
                out.write(operation + "\n")
        if kill_at is not None and count[0] == kill_at:
            os._exit(9)
        count[0] += 1
    B._fs_step = hook

def write(spec, gate):
    configure(spec.get("mode", "exchange"), spec.get("kill_at"), spec.get("log"))
    if gate is not None:
        os.read(gate, 1)
    try:
        for round in range(spec.get("repeat", 1)):
            with BundleWriter(spec["target"], force=spec["force"], shard_bytes=spec.get("shard_bytes", 200)) as w:
                for i in range(spec.get("tensors", 4)):
                    w.add("output", f"t{i}", torch.full((40,), float(i)))
                w.commit({"subject": {"spec": "test", "name": spec["tag"], "args": {"round": round}}})
    except UsageError as err:
        with open(spec["err"], "w") as out:
            out.write(str(err) + "\n")
        os._exit(3)
    os._exit(0)

for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "run":  # fork every writer, release them together, wait for all
        gate, release = os.pipe()
        pids = []
        for spec in command["writers"]:
            pid = os.fork()
            if pid == 0:
                os.close(release)
                write(spec, gate)
            pids.append(pid)
        os.close(gate)
        os.write(release, b"x" * len(pids))
        os.close(release)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps({"codes": codes}), flush=True)
    elif command["op"] == "spawn":  # one writer, not waited for: the test kills it
        pid = os.fork()
        if pid == 0:
            write(command["writer"], None)
        print(json.dumps({"pid": pid}), flush=True)
    elif command["op"] == "reap":
        _, status = os.waitpid(command["pid"], 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Zygote:
    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.run() == []  # answers once torch is imported: timings below exclude the start

    def ask(self, **command):
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the zygote process died"
        return json.loads(line)

    def run(self, *writers):
        return self.ask(op="run", writers=list(writers))["codes"]

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote():
    server = Zygote()
    yield server
    server.close()


def _writer(target, tag, *, force, mode="exchange", tmp=None, **extra):
    return {"target": str(target), "tag": tag, "force": force, "mode": mode,
            "err": str((tmp or target.parent) / f"err-{tag}.txt"), **extra}


def _tag(path):
    """Which writer's bundle is at ``path`` (verified whole), or None where nothing is."""
    bundle = open_bundle(path)
    bundle.verify()
    return bundle.subject["name"]


def _siblings(directory, name="b"):
    """Everything next to the bundle that a writer made: partial, old and conflict directories."""
    return sorted(entry for entry in os.listdir(directory) if entry != name and not entry.startswith("err-")
                  and not entry.endswith(".log"))


def _write_in_process(target, tag, *, force=False, tensors=3):
    with BundleWriter(target, force=force, shard_bytes=200) as writer:
        for i in range(tensors):
            writer.add("output", f"t{i}", torch.full((40,), float(i)))
        writer.commit({"subject": {"spec": "test", "name": tag, "args": {}}})


# ---- a kill before each filesystem step ---------------------------------------------------------


SCENARIOS = [  # (name, an old bundle at the target first, force, mode)
    ("new target", False, False, "exchange"),
    ("new target, plain rename", False, False, "plain"),
    ("new target with force", False, True, "exchange"),
    ("replace by exchange", True, True, "exchange"),
    ("replace by journal", True, True, "journal"),
    ("replace by plain rename", True, True, "plain"),
]


def _steps(zygote, tmp_path, old, force, mode):
    """The filesystem steps one commit takes in this scenario, from an uninterrupted run."""
    target = tmp_path / "probe" / "b"
    target.parent.mkdir()
    if old:
        _write_in_process(target, "old")
    log = tmp_path / "probe" / "steps.log"
    assert zygote.run(_writer(target, "new", force=force, mode=mode, log=str(log))) == [0]
    assert _tag(target) == "new" and _siblings(target.parent) == []
    return log.read_text().split()


@pytest.mark.parametrize("name, old, force, mode", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_a_kill_before_any_step_leaves_the_old_or_the_new_bundle(zygote, tmp_path, name, old, force, mode):
    steps = _steps(zygote, tmp_path, old, force, mode)
    assert len(steps) >= 4
    assert ("rename" in steps) == (mode != "exchange" and old)  # the journal parks the old bundle
    for kill_at in range(len(steps)):
        where = tmp_path / f"k{kill_at}"
        where.mkdir()
        target = where / "b"
        if old:
            _write_in_process(target, "old")
        assert zygote.run(_writer(target, "new", force=force, mode=mode, kill_at=kill_at)) == [9]
        context = f"killed before step {kill_at} ({steps[kill_at]}) of {steps}"
        # The next reader sees a complete bundle, old or new, whenever one existed; never a partial one.
        if old:
            assert _tag(target) in ("old", "new"), context
        else:
            try:
                assert _tag(target) == "new", context
            except BundleError as err:
                assert "does not exist" in str(err), context
        # The next writer cleans up whatever the killed one left, and leaves nothing else.
        _write_in_process(target, "next", force=True)
        assert _tag(target) == "next", context
        assert _siblings(where) == [], context


# ---- two writers interleaved ----------------------------------------------------------------


def _pause_at(monkeypatch, operation, action, occurrence=0):
    """Run ``action`` when the writer reaches ``operation`` (its ``occurrence``-th time), once."""
    seen = []

    def hook(op, *paths):
        if op != operation:
            return
        seen.append(op)
        if len(seen) - 1 == occurrence:
            monkeypatch.setattr(B, "_fs_step", None)  # the other writer runs unhooked
            action()
            monkeypatch.setattr(B, "_fs_step", hook)

    monkeypatch.setattr(B, "_fs_step", hook)
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_without_force_a_writer_that_lost_the_race_fails_and_deletes_nothing(tmp_path, monkeypatch, mode):
    _use_mode(monkeypatch, mode)
    target = tmp_path / "b"
    _pause_at(monkeypatch, "rename_noreplace", lambda: _write_in_process(target, "second"))
    with pytest.raises(UsageError) as info:
        _write_in_process(target, "first")
    message = str(info.value)
    assert "\n" not in message
    assert "was created by another process while this bundle was written" in message
    assert _tag(target) == "second"
    kept = [name for name in _siblings(tmp_path) if name.startswith("b.conflict-")]
    assert _siblings(tmp_path) == kept and len(kept) == 1 and kept[0] in message
    assert _tag(tmp_path / kept[0]) == "first"


@pytest.mark.parametrize("mode", MODES)
def test_with_force_the_last_writer_wins_and_nothing_is_left_over(tmp_path, monkeypatch, mode):
    _use_mode(monkeypatch, mode)
    target = tmp_path / "b"
    _write_in_process(target, "old")
    pause = {"exchange": "rename_exchange", "journal": "rename", "plain": "rename"}[mode]
    seen = _pause_at(monkeypatch, pause, lambda: _write_in_process(target, "second", force=True))
    _write_in_process(target, "first", force=True)
    assert seen
    assert _tag(target) == "first"
    assert _siblings(tmp_path) == []


@pytest.mark.parametrize("mode", ("journal", "plain"))
def test_journal_a_writer_that_installs_while_the_target_is_parked(tmp_path, monkeypatch, mode):
    """Writer 1 parked the old bundle and is about to rename its own in; writer 2 finds no
    target and installs. Writer 1's rename fails, it drops the parked old one and retries."""
    _use_mode(monkeypatch, mode)
    target = tmp_path / "b"
    _write_in_process(target, "old")
    seen = _pause_at(monkeypatch, "rename_noreplace", lambda: _write_in_process(target, "second", force=True))
    _write_in_process(target, "first", force=True)
    assert len(seen) >= 2  # it had to try again
    assert _tag(target) == "first"
    assert _siblings(tmp_path) == []


def test_force_swaps_back_what_is_not_a_bundle(tmp_path, monkeypatch):
    """Between the check and the exchange someone put a directory of their own files at the target:
    the writer swaps it back untouched and refuses."""
    target = tmp_path / "b"
    _write_in_process(target, "old")

    def someone_else():
        B.discard(target)
        target.mkdir()
        (target / "thesis.txt").write_text("precious")

    _pause_at(monkeypatch, "rename_exchange", someone_else)
    with pytest.raises(UsageError, match="replaced by something that is not a parity bundle"):
        _write_in_process(target, "new", force=True)
    assert (target / "thesis.txt").read_text() == "precious"
    assert _siblings(tmp_path) == []


def _use_mode(monkeypatch, mode):
    if mode in ("journal", "plain"):
        def unsupported(src, dst):
            raise B._Unsupported("disabled by the test")
        monkeypatch.setattr(B, "rename_exchange", unsupported)
    if mode == "plain":
        monkeypatch.setattr(B, "_renameat2_function", None)


def test_renameat2_is_used_where_available():
    # On Linux with glibc >= 2.28 (every supported host) the atomic renames are really there.
    if sys.platform != "linux":
        pytest.skip("renameat2 is Linux-only")
    assert B._renameat2_function is not None


def test_noreplace_never_replaces_a_bundle_even_by_plain_rename(tmp_path, monkeypatch):
    for mode in ("exchange", "plain"):
        monkeypatch.setattr(B, "_renameat2_function", B._load_renameat2() if mode == "exchange" else None)
        a, b = tmp_path / f"a-{mode}", tmp_path / f"b-{mode}"
        for directory in (a, b):
            directory.mkdir()
            (directory / "manifest.json").write_text(directory.name)
        with pytest.raises(FileExistsError):
            B.rename_noreplace(a, b)
        assert (b / "manifest.json").read_text() == b.name and (a / "manifest.json").is_file()


# ---- racing writers ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_four_forced_writers_racing_leave_one_complete_bundle(zygote, tmp_path, mode):
    for round in range(4):
        where = tmp_path / f"r{round}"
        where.mkdir()
        target = where / "b"
        if round % 2:
            _write_in_process(target, "old")
        writers = [_writer(target, f"w{i}", force=True, mode=mode, tensors=6) for i in range(4)]
        codes = zygote.run(*writers)
        errors = [(where / f"err-w{i}.txt").read_text() for i in range(4) if (where / f"err-w{i}.txt").exists()]
        assert codes == [0, 0, 0, 0], errors
        assert _tag(target) in {"w0", "w1", "w2", "w3"}
        assert _siblings(where) == []


@pytest.mark.parametrize("mode", ("exchange", "plain"))
def test_four_writers_racing_without_force_one_wins_the_others_keep_theirs(zygote, tmp_path, mode):
    """Without --force exactly one writer commits; every other one fails with one line and loses
    nothing: it either finished writing and kept its complete bundle as the conflict folder its
    message names, or it came late, found the target committed and was refused up front, before
    writing anything (how many come late depends on the scheduling: both kinds are checked)."""
    target = tmp_path / "b"
    codes = zygote.run(*[_writer(target, f"w{i}", force=False, mode=mode) for i in range(4)])
    assert sorted(codes) == [0, 3, 3, 3]
    winner = f"w{codes.index(0)}"
    assert _tag(target) == winner
    named = []
    for i in range(4):
        if codes[i] != 3:
            continue
        message = (tmp_path / f"err-w{i}.txt").read_text()
        assert message.count("\n") == 1 and "pass --force to replace it" in message, message
        kept = re.search(r"this bundle was kept as (\S+)\n$", message)
        if kept is None:  # refused up front: the target was already there when it started
            assert message == f"output {target} already exists; pass --force to replace it\n"
        else:  # lost the race at the rename: its complete bundle is beside the target
            folder = Path(kept.group(1))
            assert folder.parent == tmp_path and folder.name.startswith("b.conflict-"), message
            assert _tag(folder) == f"w{i}"
            named.append(folder.name)
    # Nothing else is left beside the target: no partial, no old, no unnamed conflict folder.
    assert _siblings(tmp_path) == sorted(named)


# ---- SIGKILL at random moments ----------------------------------------------------------------


def test_sigkill_at_random_moments_leaves_no_bundle_or_a_complete_one(zygote, tmp_path):
    """A writer replacing its target over and over (several shards each time) is SIGKILLed at 24
    seeded moments; each time the target is missing (killed before the first commit) or a complete
    bundle that verifies, and the next writer leaves nothing else behind."""
    rng = random.Random(11)
    probe = tmp_path / "probe"
    probe.mkdir()
    began = time.monotonic()
    assert zygote.run(_writer(probe / "b", "probe", force=True, repeat=5, tensors=8)) == [0]
    duration = time.monotonic() - began
    outcomes = {"missing": 0, "complete": 0, "writer had finished": 0}
    for moment in range(24):
        where = tmp_path / f"m{moment}"
        where.mkdir()
        target = where / "b"
        mode = MODES[moment % 3]
        pid = zygote.ask(op="spawn", writer=_writer(target, "w", force=True, mode=mode, repeat=5, tensors=8))["pid"]
        # Moments inside the probe's duration (measured on this machine, now): most kills land
        # while the writer is still writing, whatever the machine's speed and load.
        time.sleep(rng.uniform(0, 0.8 * duration))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        code = zygote.ask(op="reap", pid=pid)["code"]
        assert code in (0, -signal.SIGKILL)
        outcomes["writer had finished"] += code == 0
        try:
            assert _tag(target) == "w"
            outcomes["complete"] += 1
        except BundleError as err:
            assert "does not exist" in str(err), f"moment {moment} ({mode}): {err}"
            outcomes["missing"] += 1
        _write_in_process(target, "next", force=True)
        assert _siblings(where) == [], f"moment {moment} ({mode})"
    print(f"SIGKILL at 24 moments: {outcomes}")
    # The kills must have landed: some writers died before any commit, some after one. (No
    # bound on how many finished first: that depends on the load of the machine.)
    assert outcomes["complete"] > 0
    assert 24 - outcomes["writer had finished"] >= 3  # at least 3 writers were killed mid-write


# ---- permissions --------------------------------------------------------------------------------


@pytest.mark.parametrize("umask, directory, file", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600),
                                                     (0o002, 0o775, 0o664)])
def test_bundles_get_the_umasks_permissions(tmp_path, umask, directory, file):
    previous = os.umask(umask)
    try:
        _write_in_process(tmp_path / "b", "x")
        _write_in_process(tmp_path / "b", "y", force=True)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == directory
    names = os.listdir(tmp_path / "b")
    assert len(names) > 2
    for name in names:
        assert stat.S_IMODE(os.stat(tmp_path / "b" / name).st_mode) == file, name


def test_a_parked_old_bundle_is_restored_only_when_its_writer_is_gone(tmp_path):
    """The journal's ``.NAME.old-HOST-PID-*`` goes back in place when the target is missing and
    its writer process is gone from this host; a live writer's, or another host's, is left alone."""
    target = tmp_path / "b"
    _write_in_process(target, "old")
    parked = tmp_path / f"{B._old_prefix(target)}{os.getpid()}-live"  # this process: alive
    os.rename(target, parked)
    with pytest.raises(BundleError, match="does not exist"):
        open_bundle(target)
    assert parked.is_dir()
    elsewhere = tmp_path / f".b.old-otherhost-{os.getpid()}-x"
    os.rename(parked, elsewhere)
    with pytest.raises(BundleError, match="does not exist"):
        open_bundle(target)
    assert elsewhere.is_dir()
    gone = tmp_path / f"{B._old_prefix(target)}{_reaped_pid()}-x"  # a writer that is gone
    os.rename(elsewhere, gone)
    assert _tag(target) == "old"
    assert sorted(os.listdir(tmp_path)) == ["b"]


def _reaped_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _fsynced_files(monkeypatch) -> list[str]:
    """Record the name of every regular file the bundle module fsyncs (directories left out)."""
    synced: list[str] = []
    real = os.fsync

    def recording(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(B.os, "fsync", recording)
    return synced


@pytest.mark.parametrize("durable", [True, False])
def test_every_file_is_fsynced_unless_not_durable(tmp_path, monkeypatch, durable):
    """The default writer fsyncs every shard and the manifest before the bundle is moved into
    place; ``durable=False`` (capture --no-fsync) fsyncs none of them, and the bundle is the same."""
    synced = _fsynced_files(monkeypatch)
    with BundleWriter(tmp_path / "b", shard_bytes=4096, durable=durable) as writer:
        for number in range(6):
            writer.add("output", f"t{number}", torch.full((512,), float(number)))
        writer.commit({"subject": {"spec": "test", "name": "durable", "args": {}}})
    bundle = open_bundle(tmp_path / "b")
    assert bundle.verify() == 6 and torch.equal(bundle.load("t5"), torch.full((512,), 5.0))
    shards = sorted(shard.file for shard in bundle.shards)
    assert len(shards) == 3
    assert sorted(synced) == (sorted([*shards, "manifest.json"]) if durable else [])
