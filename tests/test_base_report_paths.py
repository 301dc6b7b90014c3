"""Report paths that would lose data are refused before a run (exit 2, one line), and what is
already at a report path decides how it is written (parity.base.files, parity.cli.commands._output).

Refused: a report at an input file's path (``--import``, ``--against``, ``--tolerances``) or at
another report's, by any name (a link, a hard link, another spelling); a report inside a parity
bundle or rank set; a name too long; a socket. The inputs and bundles stay byte-identical and
``parity verify`` still passes. A FIFO or a character device is written through, a symbolic link's
target replaced (the link stays). A failed run leaves every report file asked for recording the
error, never an earlier run's page.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from parity.base import files
from parity.base.errors import UsageError
from parity.cli.main import main
from parity.distributed import rankset
from parity.run.capture import capture

from speed_subjects import MATMUL_SPEC

PROFILES = Path(__file__).parent / "data" / "profiles"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def contents(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative name -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("golden") / "B"
    capture(MATMUL_SPEC, root, impl="reference")
    return root


@pytest.fixture
def bundle(golden, tmp_path) -> Path:
    """A fresh copy of the golden bundle, in ``tmp_path``."""
    return Path(shutil.copytree(golden, tmp_path / "B"))


@pytest.fixture
def csv(tmp_path) -> Path:
    return Path(shutil.copy(PROFILES / "nsys_cuda_gpu_kern_sum.csv", tmp_path / "in.csv"))


def refused(capsys, message: str, *argv) -> None:
    code, _, err = run(capsys, *argv)
    assert (code, err) == (2, f"parity: error: {message}\n")


# ---- a report at an input's or another report's path ----------------------------------------------


def test_a_report_at_the_import_file_is_refused_and_the_file_kept(capsys, csv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = csv.read_bytes()
    os.link(csv, tmp_path / "hard.csv")
    os.symlink(csv, tmp_path / "link.csv")
    refused(capsys, "--json in.csv is also the --import file", "profile", "--import", "in.csv", "--json", "in.csv")
    refused(capsys, "--html ./in.csv is also the --import file", "profile", "--import", "in.csv", "--html", "./in.csv")
    refused(capsys, "--json hard.csv is also the --import file", "profile", "--import", "in.csv", "--json", "hard.csv")
    refused(capsys, "--json link.csv is also the --import file", "profile", "--import", "in.csv", "--json", "link.csv")
    assert csv.read_bytes() == before and (tmp_path / "link.csv").is_symlink()


def test_a_report_at_the_against_file_is_refused_and_the_file_kept(capsys, csv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "profile", "--import", "in.csv", "--json", "other.json")[0] == 0
    before = (tmp_path / "other.json").read_bytes()
    refused(capsys, "--json other.json is also the --against file",
            "profile", "--import", "in.csv", "--against", "other.json", "--json", "other.json")
    assert (tmp_path / "other.json").read_bytes() == before


def test_a_report_at_the_tolerance_file_is_refused_and_the_file_kept(capsys, bundle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tol.toml").write_text("[tolerances]\n", encoding="utf-8")
    refused(capsys, "--junit-xml tol.toml is also the --tolerances file",
            "compare", "--bundle", "B", "--tolerances", "tol.toml", "--junit-xml", "tol.toml")
    refused(capsys, "--markdown tol.toml is also the --tolerances file",
            "diff", "B", "B", "--tolerances", "tol.toml", "--markdown", "tol.toml")
    assert (tmp_path / "tol.toml").read_text(encoding="utf-8") == "[tolerances]\n"


def test_two_outputs_at_one_path_are_refused(capsys, csv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(capsys, "--json t.json is also the --trace file",
            "profile", "--subject", MATMUL_SPEC, "--device", "cpu", "--trace", "t.json", "--json", "t.json")
    assert not (tmp_path / "t.json").exists()  # the run's own output is not the error report's to take
    refused(capsys, f"--html {tmp_path / 'o.json'} is also the --json file",
            "profile", "--import", "in.csv", "--json", "o.json", "--html", tmp_path / "o.json")
    # The first of the two still records why the run was refused.
    assert json.loads((tmp_path / "o.json").read_text())["error"]["message"].endswith("is also the --json file")
    refused(capsys, "--markdown r.x is also the --junit-xml file",
            "compare", "--bundle", "nowhere", "--junit-xml", "r.x", "--markdown", "r.x")
    refused(capsys, "--json - and --html -: only one report can go to standard output; give the other a file name",
            "bench", "--subject", MATMUL_SPEC, "--impls", "reference", "--json", "-", "--html", "-")


# ---- a report inside a bundle or a rank set --------------------------------------------------------


@pytest.mark.parametrize("argv, flag, name", [
    (["bench", "--bundle", "B", "--impls", "reference"], "--json", "manifest.json"),
    (["bench", "--bundle", "B", "--impls", "reference"], "--html", "shard-00000.safetensors"),
    (["bench", "--bundle", "B", "--impls", "reference"], "--json", "report.json"),
    (["compare", "--bundle", "B", "--impl", "reference", "--device", "cpu"], "--json", "manifest.json"),
    (["compare", "--bundle", "B", "--impl", "reference", "--device", "cpu"], "--html", "page.html"),
    (["diff", "B", "B"], "--junit-xml", "manifest.json"),
    (["show", "B"], "--json", "manifest.json"),
    (["profile", "--import", "in.csv"], "--html", "report.html"),
    (["inspect"], "--json", "report.json"),
])
def test_a_report_inside_a_bundle_is_refused_and_the_bundle_kept(capsys, bundle, csv, tmp_path, monkeypatch, argv,
                                                                  flag, name):
    monkeypatch.chdir(tmp_path)
    before = contents(bundle)
    refused(capsys, f"{flag} B/{name} is inside parity bundle {bundle.resolve()}; write reports outside it",
            *argv, flag, f"B/{name}")
    assert contents(bundle) == before
    assert run(capsys, "verify", "B")[0] == 0


def test_a_bundle_reached_through_a_link_is_refused_and_a_safe_report_still_records_the_error(
        capsys, bundle, csv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink(bundle, tmp_path / "link")
    before = contents(bundle)
    refused(capsys, f"--html link/x.html is inside parity bundle {bundle.resolve()}; write reports outside it",
            "compare", "--bundle", "B", "--json", "out.json", "--html", "link/x.html")
    assert json.loads((tmp_path / "out.json").read_text())["error"]["status"] == 2
    assert contents(bundle) == before and run(capsys, "verify", "B")[0] == 0


def test_a_report_inside_a_rank_set_is_refused_but_the_set_writer_writes_there(capsys, golden, tmp_path,
                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(golden, tmp_path / "S" / "rank-00000")

    def commit():  # parity's own writer of the top manifest, inside the set
        rankset.commit(tmp_path / "S", set_id="0" * 32, world_size=1, mesh={"shape": [1]}, backend="gloo",
                       ranks=[{"rank": 0, "bundle": "rank-00000", "manifest_sha256": "0" * 64}], placements={},
                       placement_rules=[])

    commit()
    before = contents(tmp_path / "S")
    refused(capsys, f"--json S/report.json is inside parity rank set {tmp_path.resolve() / 'S'}; write reports "
                    f"outside it", "diff", "S", "S", "--json", "S/report.json")
    refused(capsys, f"--json S/rank-00000/r.json is inside parity bundle {tmp_path.resolve() / 'S' / 'rank-00000'}; "
                    f"write reports outside it", "show", "S/rank-00000", "--json", "S/rank-00000/r.json")
    assert contents(tmp_path / "S") == before
    commit()  # not refused: the set's own manifest is no user's report
    assert json.loads((tmp_path / "S" / rankset.TOP_NAME).read_text())["format"] == rankset.FORMAT


def test_a_directory_with_an_unrelated_manifest_is_no_bundle(capsys, csv, tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text('{"format": "my-app", "name": "x"}\n', encoding="utf-8")
    code, _, err = run(capsys, "profile", "--import", csv, "--json", app / "report.json")
    assert code == 0, err
    assert json.loads((app / "report.json").read_text())["format"] == "parity-profile-report"


# ---- names and kinds of file -----------------------------------------------------------------------


def test_a_name_too_long_is_one_line_and_exit_2(capsys, csv, tmp_path):
    name = tmp_path / ("a" * 300 + ".json")
    code, _, err = run(capsys, "profile", "--import", csv, "--json", name)
    assert code == 2 and err.count("\n") == 1 and len(err) < 250
    assert err.startswith(f"parity: error: --json {tmp_path}/aaa") and err.endswith(
        " more characters): file name too long\n")


@pytest.mark.parametrize("mode, disposition", [
    (stat.S_IFREG, files.REPLACE), (stat.S_IFCHR, files.WRITE_THROUGH), (stat.S_IFIFO, files.WRITE_THROUGH),
    (stat.S_IFDIR, files.REFUSE), (stat.S_IFSOCK, files.REFUSE), (stat.S_IFBLK, files.REFUSE),
])
def test_what_is_at_the_path_decides_how_it_is_written(mode, disposition):
    info = os.stat_result((mode | 0o666, 1, 1, 1, 0, 0, 0, 0, 0, 0))
    assert files.disposition(info) == disposition
    assert files.disposition(None) == files.REPLACE


def test_a_character_device_is_written_through_never_replaced(tmp_path, monkeypatch):
    device = tmp_path / "null"
    device.touch()
    inode = device.stat().st_ino
    real_stat = os.stat

    def as_device(path, *args, **kwargs):
        info = real_stat(path, *args, **kwargs)
        if Path(path) == device:
            return os.stat_result((stat.S_IFCHR | 0o666,) + tuple(info)[1:10])
        return info

    monkeypatch.setattr(os, "stat", as_device)
    files.write_atomically(device, "{}\n", "--json")
    monkeypatch.undo()
    assert device.stat().st_ino == inode and device.read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["null"]  # no temporary file was made or left


def test_one_character_device_takes_several_reports(capsys, csv, tmp_path, monkeypatch):
    # --json /dev/null --html /dev/null: nothing written to a device replaces anything, so the
    # distinct-outputs rule does not apply to it (a stand-in file here, never the real /dev/null).
    device = tmp_path / "null"
    device.touch()
    real_stat = os.stat

    def as_device(path, *args, **kwargs):
        info = real_stat(path, *args, **kwargs)
        if os.path.realpath(path) == str(device):
            return os.stat_result((stat.S_IFCHR | 0o666,) + tuple(info)[1:10])
        return info

    monkeypatch.setattr(os, "stat", as_device)
    code, _, err = run(capsys, "profile", "--import", csv, "--json", device, "--html", device)
    monkeypatch.undo()
    assert code == 0, err
    assert "<html" in device.read_text()  # both written through, the page last
    refused(capsys, f"--html {tmp_path / 'o.json'} is also the --json file",  # a regular file still is not
            "profile", "--import", csv, "--json", tmp_path / "o.json", "--html", tmp_path / "o.json")


def test_a_link_to_a_missing_directory_is_refused_before_the_run(capsys, csv, tmp_path):
    os.symlink("nodir/x.json", tmp_path / "dangling.json")
    refused(capsys, f"--json {tmp_path / 'dangling.json'}: directory {tmp_path / 'nodir'} does not exist",
            "profile", "--import", csv, "--json", tmp_path / "dangling.json")


@pytest.mark.parametrize("stdout", ["file", "pipe"])
def test_dev_stdout_is_the_stream_after_what_it_holds(tmp_path, stdout):
    # /dev/stdout names this process's stdout: the report is written as with "-", alone on stdout
    # after what the stream held (it replaced a redirected log file, or failed on a pipe, when the
    # path was resolved first; it followed the text report before it was taken for "-").
    command = [sys.executable, "-m", "parity", "profile", "--import", str(PROFILES / "nsys_cuda_gpu_kern_sum.csv"),
               "--json", "/dev/stdout"]
    if stdout == "file":
        log = tmp_path / "log.txt"
        log.write_text("earlier lines\n")
        with open(log, "a") as handle:
            code = subprocess.run(command, stdout=handle, stderr=subprocess.PIPE, timeout=120).returncode
        out = log.read_text()
    else:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        code, out = done.returncode, done.stdout
    assert code == 0
    if stdout == "file":
        assert out.startswith("earlier lines\n")
        out = out.removeprefix("earlier lines\n")
    assert json.loads(out)["format"] == "parity-profile-report"  # the JSON alone: no text report


def test_a_fifo_without_a_reader_does_not_hold_up_an_error_report(tmp_path, csv):
    # After a failure, the error report is best effort: a FIFO nobody reads is skipped, not waited on.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    bad = tmp_path / "bad.csv"
    bad.write_text("not,a,kernel,table\n")
    done = subprocess.run([sys.executable, "-m", "parity", "profile", "--import", str(bad), "--json", str(fifo)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"parity: error: --import {bad}")
    with pytest.raises(UsageError, match="cannot write: No such device or address"):
        files.write_atomically(fifo, "x", "--json", wait_for_reader=False)


def test_a_fifo_is_written_through(capsys, csv, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        code, _, err = run(capsys, "profile", "--import", csv, "--json", fifo)
        reader.join(timeout=30)
    finally:
        if reader.is_alive():  # a writer that never opened the FIFO: release the reader
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert code == 0, err
    assert json.loads(received[0])["format"] == "parity-profile-report"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_symbolic_link_stays_and_its_target_is_replaced(capsys, csv, tmp_path):
    (tmp_path / "real.json").write_text("old\n")
    os.symlink("real.json", tmp_path / "link.json")
    os.symlink("new.json", tmp_path / "dangling.json")
    for link in ("link.json", "dangling.json"):
        assert run(capsys, "profile", "--import", csv, "--json", tmp_path / link)[0] == 0
        assert (tmp_path / link).is_symlink()
    for target in ("real.json", "new.json"):
        assert json.loads((tmp_path / target).read_text())["format"] == "parity-profile-report"


def test_a_trace_is_written_as_every_report_is(capsys, tmp_path):
    # profile's --trace goes through the same writer: a symbolic link stays, its target is replaced.
    (tmp_path / "real-trace.json").write_text("old\n")
    os.symlink("real-trace.json", tmp_path / "trace.json")
    code, _, err = run(capsys, "profile", "--quiet", "--subject", MATMUL_SPEC, "--device", "cpu", "--skip", "0",
                       "--warmup", "1", "--active", "1", "--trace", tmp_path / "trace.json")
    assert code == 0, err
    assert (tmp_path / "trace.json").is_symlink()
    assert "traceEvents" in json.loads((tmp_path / "real-trace.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real-trace.json", "trace.json"]  # no temporary left


def test_a_socket_is_refused(capsys, csv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a socket's path is limited to about 100 bytes
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("sock")
        refused(capsys, "--json sock is a socket, not a regular file; refusing to replace it",
                "profile", "--import", csv, "--json", "sock")
    with pytest.raises(UsageError, match="^--html sock is a socket"):
        files.write_atomically("sock", "x", "--html")


# ---- a failed run leaves no earlier run's report ----------------------------------------------------


def test_a_failed_run_replaces_every_report_by_the_error(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("o.json", "o.html", "o.md", "o.xml"):
        (tmp_path / name).write_text("an earlier run's report\n")
    code, _, err = run(capsys, "profile", "--import", "missing.csv", "--json", "o.json", "--html", "o.html")
    assert (code, err) == (2, "parity: error: --import missing.csv: no such file\n")
    assert json.loads((tmp_path / "o.json").read_text())["error"]["message"] == "--import missing.csv: no such file"
    page = (tmp_path / "o.html").read_text()
    assert "<title>parity profile: error</title>" in page and "<pre>--import missing.csv: no such file</pre>" in page
    code, _, _ = run(capsys, "compare", "--bundle", "nowhere", "--html", "o.html", "--markdown", "o.md",
                     "--junit-xml", "o.xml")
    assert code == 2
    assert "<title>parity compare: error</title>" in (tmp_path / "o.html").read_text()
    assert (tmp_path / "o.md").read_text() == ("## parity compare: error\n\nexit status 2 (usage error): no result\n\n"
                                               "    bundle nowhere does not exist\n")
    assert 'errors="1"' in (tmp_path / "o.xml").read_text()
    code, out, _ = run(capsys, "bench", "--subject", "nowhere:make", "--impls", "reference", "--html", "-")
    assert code == 2 and out.startswith("<!DOCTYPE html>") and "parity bench: error" in out


def test_an_error_summary_keeps_every_line_of_the_message_in_its_code_block():
    from parity.report.error_report import error_markdown

    text = error_markdown(3, "internal error", "first line\nsecond line")
    assert text.endswith("\n\n    first line\n    second line\n")
    assert text.startswith("## parity compare: error\n\nexit status 3")


def test_two_reports_on_stdout_are_refused_however_stdout_is_named():
    # "-" and /dev/stdout are the same stream: two reports there would run into one another.
    done = subprocess.run([sys.executable, "-m", "parity", "profile", "--import",
                           str(PROFILES / "nsys_cuda_gpu_kern_sum.csv"), "--json", "-", "--html", "/dev/stdout"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "only one report can go to standard output" in done.stderr
    # As with "--json - --html -": the JSON error report, alone on stdout.
    assert json.loads(done.stdout)["error"]["message"].startswith("--json - and --html -: only one report")


# ---- a report that fails after another was written -----------------------------------------------
def _fails_for(flag: str, real):
    """``real`` (a report writer), except that writing the ``flag`` report fails as a full disk does."""
    def write(*args, **kwargs):
        if flag in args or flag in (kwargs.get("what"),):
            raise UsageError(f"{flag} out.x: cannot write: No space left on device")
        return real(*args, **kwargs)
    return write


def test_a_report_written_before_a_later_one_fails_keeps_this_runs_report(capsys, csv, tmp_path, monkeypatch):
    """profile: --json is written, then --html fails (disk full). The JSON keeps the profile it
    holds (this run's, whole); the HTML gets the error report; exit 2 and one line on stderr."""
    from parity.cli.commands import _speed_output

    monkeypatch.setattr(_speed_output, "write_atomically", _fails_for("--html", _speed_output.write_atomically))
    code, _, err = run(capsys, "profile", "--import", csv, "--json", tmp_path / "out.json",
                       "--html", tmp_path / "out.html")
    assert (code, err) == (2, "parity: error: --html out.x: cannot write: No space left on device\n")
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["format"] == "parity-profile-report" and "error" not in document and document["kernels"]
    assert "error" in (tmp_path / "out.html").read_text().lower()


def test_compare_keeps_its_json_when_the_junit_write_fails(capsys, bundle, tmp_path, monkeypatch):
    from parity.report import junit

    def full_disk(report, path):
        raise UsageError(f"--junit-xml {path}: cannot write: No space left on device")

    monkeypatch.setattr(junit, "write_junit_xml", full_disk)
    code, _, err = run(capsys, "compare", "--bundle", bundle, "--impl", "reference", "--json", tmp_path / "out.json",
                       "--junit-xml", tmp_path / "out.xml")
    assert code == 2  # progress lines, then the one error line
    assert err.splitlines()[-1] == f"parity: error: --junit-xml {tmp_path / 'out.xml'}: cannot write: No space left on device"
    report = json.loads((tmp_path / "out.json").read_text())
    assert "error" not in report and report["passed"] is True and report["verdict"].startswith("PARITY HOLDS")
    assert "error" in (tmp_path / "out.xml").read_text().lower()  # the one not written says why


def test_a_gz_trace_is_compressed_and_streamed_beside_its_target(capsys, tmp_path):
    # --trace t.json.gz: torch's gzip export, filled beside the target and renamed (never read into memory)
    import gzip

    code, _, err = run(capsys, "profile", "--quiet", "--subject", MATMUL_SPEC, "--device", "cpu", "--skip", "0",
                       "--warmup", "1", "--active", "1", "--trace", tmp_path / "t.json.gz")
    assert code == 0, err
    with gzip.open(tmp_path / "t.json.gz", "rt") as handle:
        assert "traceEvents" in json.load(handle)
    assert [p.name for p in tmp_path.iterdir()] == ["t.json.gz"]  # no temporary left
    code, _, err = run(capsys, "profile", "--quiet", "--subject", MATMUL_SPEC, "--device", "cpu", "--skip", "0",
                       "--warmup", "1", "--active", "1", "--trace", "/dev/null")  # a device: written through
    assert code == 0, err


def test_a_file_filled_in_place_is_whole_or_not_at_all(tmp_path):
    target = tmp_path / "trace.json"
    target.write_text("the earlier trace\n")

    def fails_half_way(temporary):
        temporary.write_text('{"traceEvents": [')
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UsageError, match=r"^--trace .*trace\.json: cannot write: No space left on device$"):
        files.write_file_atomically(target, fails_half_way, "--trace")
    assert target.read_text() == "the earlier trace\n" and [p.name for p in tmp_path.iterdir()] == ["trace.json"]
    files.write_file_atomically(target, lambda temporary: temporary.write_text("{}\n"), "--trace")
    assert target.read_text() == "{}\n" and [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_a_writer_that_only_logs_its_failure_leaves_nothing_behind(tmp_path):
    # torch's trace export writes "<name>.tmp", renames it, and on a failure logs instead of
    # raising: what it left goes, the earlier file stays, and the error says nothing was written.
    target = tmp_path / "trace.json"
    target.write_text("the earlier trace\n")

    def logs_instead_of_raising(temporary):
        Path(f"{temporary}.tmp").write_text('{"traceEv')

    with pytest.raises(UsageError, match=r"^--trace .*trace\.json: cannot write: nothing was written"):
        files.write_file_atomically(target, logs_instead_of_raising, "--trace")
    assert target.read_text() == "the earlier trace\n" and [p.name for p in tmp_path.iterdir()] == ["trace.json"]
    with pytest.raises(UsageError, match=r"^--trace /dev/null: cannot write: nothing was written"):
        files.write_file_atomically("/dev/null", lambda temporary: None, "--trace")  # written through
