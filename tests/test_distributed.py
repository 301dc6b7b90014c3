"""Rank sets on CPU with gloo: capture under torchrun with 2 and 4 ranks, compare across world sizes, faults.

The ranks are real processes (``python -m parity`` per rank with torchrun's environment, and once
torchrun itself); the test subject is tests/dist_subject.py, a small decoder with DTensor tensor
parallelism on attention and MLP (or a manual Megatron-style split of the MLP). Faults come from
outside parity: a wrong weight on one rank (the subject's ``fault-rank1`` impl), bytes flipped in
a saved shard, a rank killed with SIGKILL, bundles replaced or removed after the commit.

Spawns are the cost (each rank imports torch), so the captures are made once per module and
every comparison that can run in this process does.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.bundle.writer import edit_manifest
from parity.cli.main import main
from parity.distributed.compare import compare_rank_set, diff_sets, open_golden
from parity.distributed.rankset import TOP_NAME, open_rank_set
from parity.base.errors import BundleError, UsageError
from parity.bundle.manifest import seal

TESTS = Path(__file__).resolve().parent
SPEC = "dist_subject:TPDecoderSubject"
MEGATRON_MAP = ["layers.*.mlp.gate_proj=shard(-1)", "layers.*.mlp.up_proj=shard(-1)", "layers.*.mlp.down_proj=partial"]
LAUNCH_TIMEOUT_S = 120


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("PARITY_DEBUG", None)
    return {**env, **(extra or {})}


def launch(world: int, *argv: str, cwd: Path, program: tuple[str, ...] = ("-m", "parity")
           ) -> list[subprocess.CompletedProcess]:
    """``python -m parity ARGV`` (or ``python PROGRAM ARGV``) on ``world`` ranks, with the environment
    torchrun gives each; as under torchrun, the rendezvous store is hosted outside the ranks (here), so
    no rank's exit takes it away from the others."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(world):
        env = _env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True"})
        procs.append(subprocess.Popen([sys.executable, *program, *argv], cwd=cwd, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    del store
    return done


def _stderr(ranks: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"rank {rank}: {r.stderr[-2000:]}" for rank, r in enumerate(ranks))


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """TP=2 (through torchrun itself), TP=4, a manual Megatron split with a placement map, and one process."""
    from parity.run.capture import capture

    root = tmp_path_factory.mktemp("ranksets")
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "parity",
         "capture", "--subject", SPEC, "--bundle", "tp2", "--quiet"],
        cwd=root, env=_env(), text=True, capture_output=True, timeout=LAUNCH_TIMEOUT_S)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert "wrote rank set tp2: 2 ranks" in torchrun.stdout
    ranks = launch(4, "capture", "--subject", SPEC, "--bundle", "tp4", "--quiet", cwd=root)
    assert [r.returncode for r in ranks] == [0] * 4, _stderr(ranks)
    placements = [arg for item in MEGATRON_MAP for arg in ("--placement", item)]
    ranks = launch(2, "capture", "--subject", SPEC, "--set", "split=megatron", "--bundle", "megatron", "--quiet",
                   *placements, cwd=root)
    assert [r.returncode for r in ranks] == [0, 0], _stderr(ranks)
    capture(SPEC, root / "tp1")
    capture(SPEC, root / "tp1-megatron", subject_args={"split": "megatron"})
    return root


@pytest.fixture(autouse=True)
def trust_the_test_subject():
    from parity.run.subjects.base import trusting

    with trusting(SPEC):
        yield


def _copy(root: Path, name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(root / name, target)
    return target


def test_rank_set_records_placements_devices_and_one_state(sets):
    rank_set = open_rank_set(sets / "tp4")
    assert rank_set.world_size == 4 and rank_set.mesh["shape"] == [4] and rank_set.backend == "gloo"
    placements = {name: placement.text for name, placement in rank_set.placements.items()}
    assert placements["layers.0.attn.q_proj"] == "shard(2)"  # ColwiseParallel's plain output, from the plan
    assert placements["layers.0.attn.o_proj"] == "replicate"  # RowwiseParallel: after its all-reduce
    assert placements["lm_head"] == "shard(2)"  # a DTensor output carries its own
    assert placements["layers.0"] == "replicate"
    # vocab 66 over 4 ranks: DTensor's uneven shards, 17/17/17/15
    assert [reader.entry("lm_head").shape[-1] for reader in rank_set.ranks] == [17, 17, 17, 15]
    assert all(entry.device == "cpu" for reader in rank_set.ranks for entry in reader.entries_of("output"))
    assert rank_set.ranks[0].entries_of("state") and not rank_set.ranks[1].entries_of("state")
    assert all(reader.hooks_check["bitwise_equal"] for reader in rank_set.ranks)
    view = open_golden(sets / "tp4")
    assert view.entry("lm_head").shape == (2, 16, 66)
    assert view.load("lm_head").shape == (2, 16, 66)
    # o_proj's output is recorded after RowwiseParallel's all-reduce: the 4 copies agree bit for bit
    # (before it, each rank holds a different partial sum).
    assert view.load("layers.0.attn.o_proj").shape == (2, 16, 32) and view.disagreements == {}


@pytest.mark.parametrize("name, kinds", [("tp4", {"shard", "replicate"}),
                                         ("megatron", {"shard", "replicate", "partial"})])
def test_rebuilding_a_set_holds_one_full_tensor_at_a_time(sets, name, kinds):
    """Every piece a view reads is dropped before the next is read, and a full tensor handed to the
    judge is not kept by the view: walking a whole set never holds two of either."""
    import weakref

    from parity.distributed.compare import view_outputs

    view = open_golden(sets / name)
    world = view.world_size
    handed, held_at_read = [], []

    def alive():
        return [t for t in (ref() for ref in handed) if t is not None]

    for reader in view.readers:
        def load(entry, kind="output", *, device=None, _load=reader.load):
            held_at_read.append(len(alive()))
            piece = _load(entry, kind, device=device)
            handed.append(weakref.ref(piece))
            return piece

        reader.load = load
    fulls, full_alive = [], []
    for item in view_outputs(view):
        full_alive.append(sum(ref() is not None for ref in fulls))
        fulls.append(weakref.ref(item.tensor))
        replicated = view.placement(item.name).kind == "replicate"
        # pieces alive as each rank's piece was read: a replicated tensor's rank 0 copy (the result)
        # while the other ranks' are checked against it; a shard or partial sum, none
        assert held_at_read[-world:] == ([0] + [1] * (world - 1) if replicated else [0] * world), item.name
        # a replicated tensor is rank 0's copy itself; otherwise no piece outlives the rebuild
        assert [t is item.tensor for t in alive()] == ([True] if replicated else [])
        del item
    assert len(fulls) == 28 and full_alive == [0] * 28 and len(held_at_read) == 28 * world
    assert {view.placement(e.name).kind for e in view.entries_of("output")} == kinds
    assert alive() == []


def test_tp2_and_tp4_hold_against_one_process(sets):
    for name in ("tp2", "tp4"):
        report = compare_rank_set(sets / name, impl="reference", device="cpu", policy=None)
        assert report.passed, [r.name for r in report.failing]
        assert len(report.layers) == 28 and all(r.rule == "budget" for r in report.layers)
    report = diff_sets(sets / "tp1", sets / "tp4")  # one process against 4 ranks, no run
    assert report.passed and len(report.layers) == 28
    assert main(["diff", str(sets / "tp4"), str(sets / "tp1"), "--quiet", "--json", str(sets / "diff41.json")]) == 0
    document = _valid(json.loads((sets / "diff41.json").read_text()))
    assert document["passed"] is True and len(document["layers"]) == 28


def test_tp4_against_tp2_and_tp2_against_tp2_rank_by_rank(sets, capsys):
    assert main(["diff", str(sets / "tp4"), str(sets / "tp2"), "--json", str(sets / "diff42.json")]) == 0
    document = _valid(json.loads((sets / "diff42.json").read_text()))
    assert document["passed"] is True
    assert any("full tensors rebuilt" in warning for warning in document["warnings"])
    report = diff_sets(sets / "tp2", sets / "tp2")
    assert report.passed and len(report.layers) == 56  # 28 tensors on each of 2 ranks
    assert report.layers[0].name == "embed@rank0" and report.layers[1].name == "embed@rank1"
    assert all(r.metrics.max_abs == 0 for r in report.layers)


DISTRIBUTED_DOC = TESTS.parent / "docs" / "distributed.md"


def readme_multi_gpu_commands() -> list[str]:
    """The shell commands of docs/distributed.md, in order, continuation lines joined."""
    section = DISTRIBUTED_DOC.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def test_readme_multi_gpu_commands_run_as_written(tmp_path):
    """docs/distributed.md's torchrun commands, as written but for ``--device cuda`` -> ``--device cpu`` (gloo),
    run by bash from a directory laid out as the repository root (``tests/`` and ``parity/``)."""
    import parity

    commands = readme_multi_gpu_commands()
    kinds = [("torchrun" in c, c.split(" -m parity ")[1].split()[0], c) for c in commands]
    assert {(launched, verb) for launched, verb, _ in kinds} == {
        (True, "capture"), (True, "compare"), (False, "compare"), (False, "diff")}, commands
    (tmp_path / "tests").symlink_to(TESTS)
    (tmp_path / "parity").symlink_to(Path(parity.__file__).resolve().parent)
    env = {**_env(), "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    env.pop("PYTHONPATH")  # only what the document's own lines set
    for launched, verb, command in kinds:
        on_cpu = command.replace("--device cuda", "--device cpu")
        assert on_cpu.count("--device cpu") == (verb != "diff"), command
        done = subprocess.run(["bash", "-c", on_cpu], cwd=tmp_path, env=env, text=True, capture_output=True,
                              timeout=LAUNCH_TIMEOUT_S)
        assert done.returncode == 0, f"{on_cpu}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        if verb == "capture":
            out = re.search(r"--bundle (\S+)", command).group(1)
            world = int(re.search(r"--nproc-per-node (\d+)", command).group(1))
            assert f"wrote rank set {out}: {world} ranks, 28 recorded tensors per rank" in done.stdout
            for rank in range(world):  # each rank's true count, once its run is recorded
                for kind in ("output", "reference"):
                    assert f"[rank {rank}/{world}]: recorded 28 {kind} tensors" in done.stderr
            rank_set = open_rank_set(tmp_path / out)
            assert (rank_set.world_size, rank_set.backend) == (world, "gloo")
        else:
            assert done.stdout.rstrip().splitlines()[-1] == "PARITY HOLDS: 28/28 tensors", on_cpu
    report = diff_sets(tmp_path / "bundles" / "tp4", tmp_path / "bundles" / "tp2")
    assert report.passed and len(report.layers) == 28
    assert any("full tensors rebuilt" in warning for warning in report.warnings)


def _valid(document):
    """The report validates against its published JSON Schema (parity/schemas)."""
    from jsonschema import Draft202012Validator

    from parity.base import jsonformat

    Draft202012Validator(jsonformat.schema_for(document["format"])).validate(document)
    return document


def _failing_reasons(document, name):
    row = next(row for row in document["layers"] if row["name"] == name)
    return row, " | ".join(row["verdict"]["reasons"])


def test_wrong_weight_on_one_rank_is_named_with_its_rank_and_layer(sets):
    # this run: 2 ranks, rank 1's shard of layers.1.mlp.up_proj scaled by 1.01; golden: 4 ranks
    ranks = launch(2, "compare", "--bundle", str(sets / "tp4"), "--impl", "fault-rank1", "--device", "cpu",
                   "--subject", SPEC, "--json", "report42.json", "--quiet", cwd=sets)
    assert [r.returncode for r in ranks] == [1, 1], _stderr(ranks)
    assert ranks[1].stdout == ""  # rank 0 alone reports
    assert "PARITY FAILS: first failing tensor layers.1.mlp.up_proj " in ranks[0].stdout
    document = _valid(json.loads((sets / "report42.json").read_text()))
    names = [row["name"] for row in document["layers"]]
    first = names.index("layers.1.mlp.up_proj")
    assert all(row["passed"] for row in document["layers"][:first])  # upstream of the fault holds
    row, reasons = _failing_reasons(document, "layers.1.mlp.up_proj")
    assert "this run (2 ranks, shard(2)): rank 1's shard differs" in reasons
    assert "golden (4 ranks, shard(2)): the shards of ranks 2, 3 differ" in reasons

    # the same world size: rank against rank
    ranks = launch(2, "compare", "--bundle", str(sets / "tp2"), "--impl", "fault-rank1", "--device", "cpu",
                   "--subject", SPEC, "--json", "report22.json", "--quiet", cwd=sets)
    assert [r.returncode for r in ranks] == [1, 1], _stderr(ranks)
    document = _valid(json.loads((sets / "report22.json").read_text()))
    assert document["summary"]["first_failing_layer"] == "layers.1.mlp.up_proj@rank1"
    verdicts = {row["name"]: row["passed"] for row in document["layers"]}
    assert verdicts["layers.1.mlp.up_proj@rank0"] is True and verdicts["layers.1.attn@rank1"] is True


def test_a_corrupted_shard_names_its_rank(sets, tmp_path, capsys):
    damaged = _copy(sets, "tp2", tmp_path)
    manifest = json.loads((damaged / "rank-00001" / "manifest.json").read_text())
    entry = next(e for e in manifest["entries"] if e["kind"] == "output" and e["name"] == "layers.1.mlp.up_proj")
    shard = damaged / "rank-00001" / entry["shard"]
    data = bytearray(shard.read_bytes())
    header_bytes = int.from_bytes(data[:8], "little")
    start = json.loads(data[8:8 + header_bytes])[entry["key"]]["data_offsets"][0]
    data[8 + header_bytes + start + 1] ^= 0x40  # one bit of the tensor's first element; the shard keeps its size
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    status = main(["diff", str(sets / "tp4"), str(damaged), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert "rank 1" in err[0] and "checksum mismatch" in err[0]
    assert main(["verify", str(damaged)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank 1:" in err[0] and "checksum mismatch" in err[0], err
    assert main(["verify", str(sets / "tp2")]) == 0
    assert "rank set" in capsys.readouterr().out


def test_a_killed_rank_leaves_no_valid_set(sets, capsys):
    ranks = launch(2, "capture", "--subject", SPEC, "--impl", "die-rank1", "--set", "split=megatron",
                   "--bundle", "killed", "--quiet", cwd=sets)
    assert ranks[1].returncode == -9  # SIGKILL, from the subject, in the recorded run
    # the survivor: one line (no traceback, not an internal error), exit 2
    assert ranks[0].returncode == 2, _stderr(ranks)
    lines = ranks[0].stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "parity: error: rank 0 of 2: the process group broke during the recorded run: another rank exited"), lines
    assert not (sets / "killed" / TOP_NAME).exists()
    with pytest.raises(BundleError, match="rank 1"):
        open_rank_set(sets / "killed")
    capsys.readouterr()
    assert main(["compare", "--bundle", str(sets / "killed"), "--impl", "reference", "--subject", SPEC]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank 1" in err[0] and "not committed" in err[0], err


def test_the_hooks_on_off_check_runs_on_every_rank(sets):
    # rank 1's output alone changes when hooks watch the model; rank 0's own check passes
    ranks = launch(2, "capture", "--subject", SPEC, "--impl", "observed-rank1", "--reference", "none",
                   "--bundle", "observed", "--quiet", cwd=sets)
    assert [r.returncode for r in ranks] == [2, 2], _stderr(ranks)
    lines = [r.stderr.strip().splitlines() for r in ranks]
    assert all(len(rank_lines) == 1 for rank_lines in lines), lines
    assert "on rank 1 the recorded run's output differs from the run without hooks at <output>" in lines[1][0]
    assert lines[0][0].startswith("parity: error: rank 1 of 2 failed during the recorded run: ")
    assert "on rank 1 the recorded run's output differs" in lines[0][0]
    assert not (sets / "observed" / TOP_NAME).exists()
    with pytest.raises(BundleError, match="not committed"):
        open_rank_set(sets / "observed")


LIBRARY_RANK = """
import sys
import torch.distributed as dist

dist.init_process_group("gloo")  # the caller's own group, from torchrun's environment
from parity.distributed.capture import capture_rank_set
from parity.distributed.compare import compare_distributed
from parity.run.subjects.base import trusting

with trusting(sys.argv[1]):
    result = capture_rank_set(sys.argv[1], "library", reference="fp32", device="cpu")
    report, passed = compare_distributed("library", impl="reference", device="cpu")
print(dist.get_rank(), result.world_size, len(result.placements), passed,
      None if report is None else len(report.layers), dist.is_initialized())
dist.destroy_process_group()
"""


def test_library_api_inside_an_initialised_group(sets, tmp_path):
    """capture_rank_set and compare_distributed from code that initialised its own group: they use it
    (rank 0 commits the set, rank by rank on the same world size) and leave it initialised."""
    script = tmp_path / "library_rank.py"
    script.write_text(LIBRARY_RANK)
    ranks = launch(2, SPEC, cwd=tmp_path, program=(str(script),))
    assert [r.returncode for r in ranks] == [0, 0], _stderr(ranks)
    assert [r.stdout.split() for r in ranks] == [["0", "2", "28", "True", "56", "True"],
                                                 ["1", "2", "28", "True", "None", "True"]]
    rank_set = open_rank_set(tmp_path / "library")
    assert rank_set.world_size == 2 and rank_set.placements["lm_head"].text == "shard(2)"
    assert rank_set.rank0.manifest["capture"]["reference"]["precision"] == "fp32"
    assert diff_sets(sets / "tp1", tmp_path / "library").passed


def test_missing_or_stale_rank_is_refused(sets, tmp_path, capsys):
    missing = _copy(sets, "tp4", tmp_path)
    shutil.rmtree(missing / "rank-00002")
    with pytest.raises(BundleError, match="rank 2's bundle rank-00002 is missing"):
        open_rank_set(missing)
    stale = _copy(sets, "tp2", tmp_path)
    edit_manifest(stale / "rank-00001", lambda manifest: manifest.update(impl="edited"))  # re-sealed: valid alone
    with pytest.raises(BundleError, match="rank 1's bundle rank-00001 is stale"):
        open_rank_set(stale)
    foreign = _copy(sets, "tp2", tmp_path / "foreign")
    top = json.loads((foreign / TOP_NAME).read_text())
    top["set_id"] = "0" * 32
    (foreign / TOP_NAME).write_text(json.dumps(seal(top)))
    with pytest.raises(BundleError, match="rank 0's bundle rank-00000 belongs to another capture"):
        open_rank_set(foreign)
    # every command that opens a set: exit 2, one line on stderr naming the rank, no traceback
    for damaged, named in ((missing, "rank 2's bundle rank-00002 is missing"),
                           (stale, "rank 1's bundle rank-00001 is stale"),
                           (foreign, "rank 0's bundle rank-00000 belongs to another capture")):
        for argv in (["verify", str(damaged)], ["diff", str(sets / "tp1"), str(damaged), "--quiet"],
                     ["diff", str(damaged), str(sets / "tp1"), "--quiet"],
                     ["compare", "--bundle", str(damaged), "--impl", "reference", "--subject", SPEC, "--quiet"]):
            capsys.readouterr()
            assert main(argv) == 2, argv
            captured = capsys.readouterr()
            lines = captured.err.strip().splitlines()
            assert len(lines) == 1 and named in lines[0], (argv, lines)
            assert "Traceback" not in captured.err + captured.out


def test_one_process_records_each_tensor_device_and_places_pipeline_stages(sets, tmp_path):
    from parity.bundle.reader import open_bundle
    from parity.run.capture import capture
    from parity.judge.compare import compare_bundle

    bundle = open_bundle(sets / "tp1")
    assert {entry.device for entry in bundle.entries_of("output")} == {"cpu"}
    assert {entry.device for entry in bundle.entries_of("state")} == {None}  # made on the CPU, not recorded
    # The subject places its own stages (place()); on this CPU-only host both stages are the CPU.
    capture(SPEC, tmp_path / "pipe", subject_args={"pipeline": True}, reference="none")
    report = compare_bundle(tmp_path / "pipe", impl="reference", device="cpu")
    assert report.passed and len(report.layers) == 28


def test_prepare_invalidates_the_old_set_first_and_never_touches_other_directories(sets, tmp_path):
    from parity.distributed.rankset import prepare
    from parity.base.errors import UsageError

    old = _copy(sets, "tp4", tmp_path)
    with pytest.raises(UsageError, match="already exists; pass --force"):
        prepare(old, world_size=2, force=False)
    assert (old / TOP_NAME).exists()
    prepare(old, world_size=2, force=True)  # a new capture of 2 ranks is about to be written
    assert not (old / TOP_NAME).exists()
    assert sorted(p.name for p in old.iterdir()) == ["rank-00000", "rank-00001"]
    with pytest.raises(BundleError, match="not committed"):
        open_rank_set(old)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not a parity rank set"):
        prepare(other, world_size=2, force=True)
    assert (other / "notes.txt").read_text() == "mine"


def test_capture_refuses_an_existing_set_without_force(sets, capsys):
    # one process is not a launch: the single-bundle capture refuses the existing directory
    capsys.readouterr()
    assert main(["capture", "--subject", SPEC, "--bundle", str(sets / "tp2"), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    for argv in (["capture", "--subject", SPEC, "--bundle", str(sets / "new"), "--placement", "x=shard(0)"],
                 ["compare", "--bundle", str(sets / "tp2"), "--impl", "reference", "--placement", "x=shard(0)"],
                 ["compare", "--bundle", str(sets / "tp2"), "--impl", "reference", "--isolate"]):
        assert main([*argv, "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("--placement applies" in err[0] or "--isolate is not available" in err[0]), err


def test_manual_megatron_split_with_a_placement_map(sets, tmp_path):
    rank_set = open_rank_set(sets / "megatron")
    placements = {name: placement.text for name, placement in rank_set.placements.items()}
    assert placements["layers.0.mlp.up_proj"] == "shard(2)"
    assert placements["layers.0.mlp.down_proj"] == "partial(sum)"
    assert placements["layers.0.mlp"] == "replicate"  # the MLP all-reduces itself
    report = compare_rank_set(sets / "megatron", impl="reference", device="cpu")
    assert report.passed and len(report.layers) == 28
    assert diff_sets(sets / "tp1-megatron", sets / "megatron").passed

    # The same set declared replicated where it is a partial sum: the copies disagree, named by rank.
    wrong = _copy(sets, "megatron", tmp_path)
    top = json.loads((wrong / TOP_NAME).read_text())
    top["placements"]["layers.0.mlp.down_proj"] = {"kind": "replicate"}
    (wrong / TOP_NAME).write_text(json.dumps(seal(top)))
    report = compare_rank_set(wrong, impl="reference", device="cpu")
    failing = {r.name: r for r in report.failing}
    assert list(failing) == ["layers.0.mlp.down_proj"]
    assert any("replicated on every rank, but rank 1's copy differs from rank 0's" in reason
               for reason in failing["layers.0.mlp.down_proj"].verdict.reasons)
    # the same set as the candidate of a diff: its copies are checked too, and named
    report = diff_sets(sets / "tp1-megatron", wrong)
    failing = {r.name: r for r in report.failing}
    assert list(failing) == ["layers.0.mlp.down_proj"]
    assert any(reason.startswith("the candidate is replicated on every rank, but rank 1's copy differs from rank 0's "
                                 "(max abs difference") for reason in failing["layers.0.mlp.down_proj"].verdict.reasons)


def test_a_partial_sum_is_rebuilt_as_the_sum_of_the_ranks(sets):
    from parity.bundle.reader import open_bundle

    view = open_golden(sets / "megatron")
    name = "layers.1.mlp.down_proj"
    assert view.placement(name).text == "partial(sum)"
    parts = [reader.load(name) for reader in view.rank_set.ranks]
    full = view.load(name)
    assert torch.equal(full, parts[0] + parts[1])  # fp32: accumulated in fp32, so exactly the sum
    whole = open_bundle(sets / "tp1-megatron").load(name)  # the unsplit model's output
    assert (parts[0] - whole).abs().max() > 0.1  # one rank's part is far from the output ...
    assert torch.allclose(full, whole, rtol=0, atol=1e-5)  # ... the sum is it


@pytest.mark.gpu
def test_gpu_smoke_single_rank_nccl(tmp_path):
    """On one GPU: a single-rank NCCL process group captures and compares (run by the lead on the H200)."""
    assert torch.cuda.is_available()
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "parity"]
    captured = subprocess.run([*run, "capture", "--subject", SPEC, "--device", "cuda", "--bundle", "gpu1"],
                              cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=600)
    assert captured.returncode == 0, captured.stderr[-3000:]
    rank_set = open_rank_set(tmp_path / "gpu1")
    assert rank_set.world_size == 1 and rank_set.backend == "nccl" and rank_set.mesh["device_type"] == "cuda"
    assert all(entry.device == "cuda:0" for entry in rank_set.rank0.entries_of("output"))
    compared = subprocess.run([*run, "compare", "--bundle", "gpu1", "--impl", "reference", "--device", "cuda",
                               "--subject", SPEC], cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=600)
    assert compared.returncode == 0, compared.stdout[-3000:] + compared.stderr[-3000:]
    assert "PARITY HOLDS: 28/28 tensors" in compared.stdout
    single = compare_rank_set(tmp_path / "gpu1", impl="reference", device="cuda")
    assert single.passed


@pytest.mark.gpu
def test_gpu_modules_on_two_devices_in_one_process(tmp_path):
    """Pipeline stages in one process: the embedding and block 0 on the CPU, the rest on the GPU."""
    from parity.bundle.reader import open_bundle
    from parity.run.capture import capture
    from parity.judge.compare import compare_bundle
    from parity.run.subjects.base import trusting

    with trusting(SPEC):
        capture(SPEC, tmp_path / "pipe", subject_args={"pipeline": True}, device="cuda")
        devices = {entry.name: entry.device for entry in open_bundle(tmp_path / "pipe").entries_of("output")}
        assert devices["embed"] == "cpu" and devices["layers.0"] == "cpu"
        assert devices["layers.1"] == "cuda:0" and devices["lm_head"] == "cuda:0"
        report = compare_bundle(tmp_path / "pipe", impl="reference", device="cuda")
    assert report.passed and len(report.layers) == 28


# ---- a rank's bundle outside its set, show of a set, placements that cannot be ----------------------


def _one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI; it must exit 2 with exactly one line on stderr (no traceback), returned."""
    capsys.readouterr()
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err + captured.out, (argv, lines)
    return lines[0]


def test_a_rank_bundle_alone_is_refused_where_it_would_be_judged(sets, capsys):
    """compare, diff and bench (and the library) would judge one rank's shards as full tensors (a false
    verdict) or run the subject without its inputs: refused, exit 2, naming the set to pass."""
    from parity.judge.compare import compare_bundle

    tp2 = sets / "tp2"
    take = "(compare, diff, verify and show take a rank set)"

    def lone(rank: int) -> str:
        return (f"parity: error: {tp2 / f'rank-0000{rank}'} is rank {rank} of the rank set {tp2} (world size 2); "
                f"pass the set directory {tp2} {take}")

    for rank in (0, 1):
        bundle = str(tp2 / f"rank-0000{rank}")
        for argv in (["compare", "--bundle", bundle, "--subject", SPEC, "--impl", "reference", "--device", "cpu"],
                     ["bench", "--bundle", bundle, "--subject", SPEC, "--impls", "reference,fault-rank1",
                      "--device", "cpu"],
                     ["diff", str(sets / "tp1"), bundle, "--quiet"]):
            assert _one_line_error(capsys, argv) == lone(rank)
    assert _one_line_error(capsys, ["diff", str(tp2 / "rank-00000"), str(tp2 / "rank-00001")]) == lone(0)
    assert _one_line_error(capsys, ["diff", str(sets / "tp4"), str(tp2 / "rank-00001"), "--quiet"]) == lone(1)
    with pytest.raises(BundleError, match="is rank 1 of the rank set"):
        compare_bundle(tp2 / "rank-00001", impl="reference", device="cpu")
    # the set where one bundle is taken: bench's message comes from the shared opening path
    assert _one_line_error(capsys, ["bench", "--bundle", str(tp2), "--subject", SPEC, "--impls",
                                    "reference,fault-rank1", "--device", "cpu"]) == (
        f"parity: error: {tp2} is a rank set (world size 2), not a single bundle: this command takes one bundle "
        f"{take}")
    # verify and show judge nothing: one rank's bundle is checked and shown alone
    capsys.readouterr()
    assert main(["verify", str(tp2 / "rank-00001")]) == 0
    assert main(["show", str(tp2 / "rank-00001"), "--no-verify"]) == 0
    assert capsys.readouterr().out.startswith(f"parity verify: {tp2 / 'rank-00001'}: OK")


def test_show_of_a_rank_set_summarises_the_set(sets, capsys):
    capsys.readouterr()
    assert main(["show", str(sets / "tp4")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"parity show: rank set {sets / 'tp4'}"
    assert lines[1].startswith("  world size 4, mesh [4] (tp on cpu), backend gloo; set id ")
    assert lines[4] == "  checksums (blake3): verified, every tensor and shard of all 4 ranks match"
    assert lines[6] == "ranks: 4"
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("| ")]
    ranks = [row for row in cells if row[1].startswith("rank-")]
    assert [(row[0], row[1], row[5], row[6]) for row in ranks] == [
        ("0", "rank-00000", "yes", "verified"), ("1", "rank-00001", "no", "verified"),
        ("2", "rank-00002", "no", "verified"), ("3", "rank-00003", "no", "verified")]
    assert ["27", "<root>", "shard(2)", "float32", "2x16x66"] in cells, cells
    assert main(["show", str(sets / "tp4"), "--no-verify", "--json", "-"]) == 0
    document = _valid(json.loads(capsys.readouterr().out))
    assert (document["format"], document["rank_set"], document["world_size"]) == (
        "parity-show-report", str(sets / "tp4"), 4)
    assert document["checksums"] == {"algorithm": "blake3", "verified": False, "ok": None}
    assert [(r["rank"], r["bundle"], r["holds_subject"]) for r in document["ranks"]] == [
        (0, "rank-00000", True), (1, "rank-00001", False), (2, "rank-00002", False), (3, "rank-00003", False)]
    placed = {p["name"]: (p["placement"], p["shape"]) for p in document["placements"]}
    assert len(placed) == 28 and placed["lm_head"] == ("shard(2)", [2, 16, 66])
    assert placed["layers.0.attn.o_proj"] == ("replicate", [2, 16, 32])
    from jsonschema import ValidationError

    document["ranks"][0]["bundle"] = "rank-0"
    with pytest.raises(ValidationError):
        _valid(document)


def _replace_placement(rank_set: Path, name: str, placement: dict) -> None:
    """Edit one placement in ``rankset.json`` and re-seal it (a set that opens, but for what is checked)."""
    top = json.loads((rank_set / TOP_NAME).read_text())
    top["placements"][name] = placement
    (rank_set / TOP_NAME).write_text(json.dumps(seal(top)))


def test_a_shard_dim_the_tensor_does_not_have_is_refused(sets, tmp_path, capsys):
    bad = _copy(sets, "tp2", tmp_path)
    _replace_placement(bad, "embed", {"kind": "shard", "dim": 7})
    message = (f"parity: error: rank set {bad}: rankset.json: tensor 'embed' is placed shard(7), but it has 3 "
               "dimensions (a shard dim from -3 to 2)")
    for argv in (["verify", str(bad)], ["show", str(bad), "--no-verify"], ["diff", str(sets / "tp1"), str(bad)],
                 ["compare", "--bundle", str(bad), "--subject", SPEC, "--impl", "reference", "--device", "cpu"]):
        assert _one_line_error(capsys, argv) == message
    _replace_placement(bad, "embed", {"kind": "shard", "dim": -4})
    assert "is placed shard(-4), but it has 3 dimensions" in _one_line_error(capsys, ["verify", str(bad)])
    # counted from the end, in range: the same placement as the capture's shard(2)
    last = _copy(sets, "tp2", tmp_path / "last")
    _replace_placement(last, "lm_head", {"kind": "shard", "dim": -1})
    assert main(["verify", str(last)]) == 0
    assert open_rank_set(last).placements["lm_head"].text == "shard(2)"
    assert diff_sets(sets / "tp2", last).passed


# -------------------------------------------------------------------------------------------
# Under torchrun: the per-module reference and weights by reference


@pytest.fixture(scope="module")
def scale_sets(tmp_path_factory):
    """TP=2 under torchrun with the per-module fp64 reference and weights named by a checkpoint
    file (the subject's state saved with safetensors), and the manual Megatron split with the
    per-module reference (its MLP all-reduces inside the forward, so each replay does too)."""
    from safetensors.torch import save_file

    from dist_subject import TPDecoderSubject

    root = tmp_path_factory.mktemp("scalesets")
    (root / "ckpt").mkdir()
    save_file({name: tensor.contiguous() for name, tensor in TPDecoderSubject().make_state().items()},
              str(root / "ckpt" / "model.safetensors"))
    ranks = launch(2, "capture", "--subject", SPEC, "--bundle", "tp2m", "--reference-scope", "module",
                   "--weights-from", "ckpt", "--quiet", cwd=root)
    assert [r.returncode for r in ranks] == [0, 0], _stderr(ranks)
    placements = [arg for item in MEGATRON_MAP for arg in ("--placement", item)]
    ranks = launch(2, "capture", "--subject", SPEC, "--set", "split=megatron", "--bundle", "megatron-m",
                   "--reference-scope", "module", "--quiet", *placements, cwd=root)
    assert [r.returncode for r in ranks] == [0, 0], _stderr(ranks)
    return root


def _rel_l2(value, reference) -> float:
    return float((value.double() - reference).norm() / reference.norm())


def test_torchrun_per_module_reference_replays_each_module_with_its_split(sets, scale_sets):
    per_module, whole = open_golden(scale_sets / "tp2m"), open_golden(sets / "tp2")
    info = per_module.rank0.capture_info["reference"]
    assert info["scope"] == "module" and info["dtype"] == "float64" and info["outputs_without_reference"] == []
    for reader in per_module.rank_set.ranks:  # each rank's cost, in its own manifest
        resources = reader.capture_info["resources"]
        assert resources["bytes_written"] == sum(shard.bytes for shard in reader.shards) > 0
        assert resources["tensors"] == len(reader.entries) and resources["peak_host_bytes"] > 0
    assert info["peak_copy_bytes"] > 0
    assert sorted(e.name for e in per_module.entries_of("reference")) == sorted(e.name for e in whole.entries_of("output"))
    # Where a module's inputs are the model's own (or exact: the embedding), the per-module reference
    # is the whole-model one, bit for bit: the replay ran the same split and collectives in fp64.
    for name in ("embed", "layers.0.attn_norm", "layers.0", "<root>"):
        assert torch.equal(per_module.load(name, "reference"), whole.load(name, "reference")), name
    # Deeper, it holds only the error the module introduces (one fp32 matmul: measured 1.0e-7),
    # not the one inherited from the layers before (measured 4.7e-7).
    name = "layers.1.mlp.down_proj"
    golden = per_module.load(name)
    introduced = _rel_l2(golden, per_module.load(name, "reference"))
    accumulated = _rel_l2(golden, whole.load(name, "reference"))
    assert 2e-8 < introduced < 2.5e-7 and accumulated > 3 * introduced, (introduced, accumulated)


def test_torchrun_per_module_reference_of_a_manual_split_is_summed_like_its_output(scale_sets):
    view = open_golden(scale_sets / "megatron-m")
    name = "layers.0.mlp.down_proj"
    assert view.placement(name).text == "partial(sum)"
    # Each rank's reference is its partial sum in fp64; rebuilt, the sum is the module's output.
    assert _rel_l2(view.load(name), view.load(name, "reference")) < 2.5e-7
    assert _rel_l2(view.load("<root>"), view.load("<root>", "reference")) < 1e-6
    report = compare_rank_set(view, impl="reference", device="cpu")
    assert report.passed and len(report.layers) == 28


def test_a_set_with_per_module_references_is_judged_by_the_thresholds(scale_sets):
    report = compare_rank_set(scale_sets / "tp2m", impl="reference", device="cpu")
    assert report.passed and len(report.layers) == 28
    assert {result.rule for result in report.layers} == {"thresholds"}
    # What it read: every output of both ranks (no reference: the thresholds need none) and the inputs.
    view = open_golden(scale_sets / "tp2m")
    outputs = sum(entry.nbytes for reader in view.readers for entry in reader.entries_of("output"))
    inputs = sum(entry.nbytes for entry in view.rank0.entries_of("input"))
    assert report.resources["bytes_read"] == outputs + inputs and report.resources["tensors"] == 28
    assert any("references are per module" in warning for warning in report.warnings)
    with pytest.raises(UsageError, match="isolated replay"):
        compare_rank_set(scale_sets / "tp2m", impl="reference", device="cpu", budget=True)


def test_torchrun_weights_by_reference_are_named_by_rank_0_and_verified_before_the_build(scale_sets, tmp_path,
                                                                                         capsys):
    rank0 = open_rank_set(scale_sets / "tp2m").ranks[0]
    assert rank0.schema_version == 5 and [f["name"] for f in rank0.weights["files"]] == ["model.safetensors"]
    assert rank0.entries_of("state") == []  # every weight is in the file
    assert code_and_lines(capsys, ["verify", str(scale_sets / "tp2m")])[0] == 0
    # Moved: refused without --weights-dir, judged with it, under torchrun and in one process.
    _copy(scale_sets, "tp2m", tmp_path).rename(tmp_path / "set")
    shutil.copytree(scale_sets / "ckpt", tmp_path / "elsewhere")
    ranks = launch(2, "compare", "--golden", "set", "--impl", "reference", "--subject", SPEC, "--weights-dir",
                   "elsewhere", "--json", "r.json", "--quiet", cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], _stderr(ranks)
    document = _valid(json.loads((tmp_path / "r.json").read_text()))
    assert document["passed"] and len(document["layers"]) == 56
    assert document["resources"]["tensors"] == 56 and document["resources"]["bytes_read"] > 0
    assert any("references are per module" in warning for warning in document["warnings"])
    assert compare_rank_set(tmp_path / "set", impl="reference", device="cpu", weights_dir=tmp_path / "elsewhere").passed
    # Changed: every rank stops before it builds, with one line naming the file.
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "elsewhere" / "model.safetensors"))
    weights["lm_head.weight"][0, 0] += 1
    save_file(weights, str(tmp_path / "elsewhere" / "model.safetensors"))
    ranks = launch(2, "compare", "--golden", "set", "--impl", "reference", "--subject", SPEC, "--weights-dir",
                   "elsewhere", "--quiet", cwd=tmp_path)
    assert [r.returncode for r in ranks] == [2, 2], _stderr(ranks)
    for rank in ranks:
        lines = rank.stderr.strip().splitlines()
        assert len(lines) == 1 and "model.safetensors" in lines[0], lines
    assert "BLAKE3" in ranks[0].stderr  # rank 0 (LOCAL_RANK 0) read the file through; rank 1 agreed on its error


def code_and_lines(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err.strip().splitlines()


def test_verify_of_a_set_that_names_its_checkpoint(scale_sets, tmp_path, capsys):
    code, out, err = code_and_lines(capsys, ["verify", str(scale_sets / "tp2m")])
    assert code == 0 and out[-1].startswith("  weights by reference: 1 checkpoint file") and "verified" in out[-1]
    moved = _copy(scale_sets, "tp2m", tmp_path)
    rank0 = moved / "rank-00000"
    edit_manifest(rank0, lambda m: m["weights"]["files"][0].update(path=str(tmp_path / "gone.safetensors")))
    # the rank's manifest digest changed: re-seal the set's record of it
    top = json.loads((moved / TOP_NAME).read_text())
    from parity.bundle.reader import open_bundle
    from parity.bundle.manifest import DIGEST_FIELD

    top["ranks"][0][DIGEST_FIELD] = open_bundle(rank0, rank_of_a_set=True).manifest[DIGEST_FIELD]
    (moved / TOP_NAME).write_text(json.dumps(seal({k: v for k, v in top.items() if k != DIGEST_FIELD})))
    code, out, err = code_and_lines(capsys, ["verify", str(moved)])
    assert code == 2 and len(err) == 1 and "gone.safetensors" in err[0] and "could not be verified" in err[0]
    code, out, err = code_and_lines(capsys, ["verify", str(moved), "--weights-dir", str(scale_sets / "ckpt")])
    assert code == 0 and out[-1].endswith("size and BLAKE3 verified")
