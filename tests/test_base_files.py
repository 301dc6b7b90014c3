"""Report files are written whole or not at all (parity.base.files), and every report writer uses it."""
import os

import pytest

from parity.base import files
from parity.base.errors import UsageError


def test_writes_the_text_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "r.json"
    assert files.write_atomically(target, "{\"a\": 1}\n", "--json") == target
    assert target.read_text(encoding="utf-8") == "{\"a\": 1}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.parametrize("fail", ["fsync", "replace"])
def test_a_failed_write_keeps_the_old_file_and_says_so_in_one_line(tmp_path, monkeypatch, fail):
    target = tmp_path / "r.json"
    target.write_text("old\n", encoding="utf-8")

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, fail, broken)
    with pytest.raises(UsageError) as raised:
        files.write_atomically(target, "new\n", "--json")
    assert str(raised.value) == f"--json {target}: cannot write: No space left on device"
    assert target.read_text(encoding="utf-8") == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_paths_that_cannot_be_written_are_refused_before_any_work(tmp_path):
    with pytest.raises(UsageError, match=r"^--html .* is a directory; give a file name$"):
        files.check_writable(tmp_path, "--html")
    with pytest.raises(UsageError, match=r"^--html .*page\.html: directory .*missing does not exist$"):
        files.write_atomically(tmp_path / "missing" / "page.html", "x", "--html")


def test_the_compare_report_writers_go_through_it(tmp_path, monkeypatch):
    # a JSON report that fails half-way leaves the previous report, not a truncated one
    from parity.report import json_report, junit, markdown
    from parity.judge.policy import Policy
    from parity.judge.results import CompareReport

    calls = []
    real = files.write_atomically
    for module in (json_report, junit, markdown):
        monkeypatch.setattr(module, "write_atomically",
                            lambda path, text, what: calls.append(what) or real(path, text, what))
    report = CompareReport(golden="g", subject={"name": "s", "spec": "s"}, impl="triton", golden_impl="reference",
                           device="cpu", policy=Policy(), layers=[], hosts={"golden": {}, "here": {}},
                           fingerprint_differences=[])
    json_report.write_json(report, tmp_path / "r.json")
    junit.write_junit_xml(report, tmp_path / "r.xml")
    markdown.write_markdown(report, tmp_path / "r.md")
    assert calls == ["--json", "--junit-xml", "--markdown"]
    assert (tmp_path / "r.json").read_text(encoding="utf-8").startswith("{")
