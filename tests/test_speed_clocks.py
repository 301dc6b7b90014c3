"""Clock throttling in ``parity bench`` (parity.speed.clocks): the NVML and amdsmi readers on fake
libraries (no GPU here), nothing reported on a CPU, and a throttling device's warning in the
table, the JSON and the HTML page of a real CPU run whose clock reader is a fake."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from parity.base.jsonformat import schema_for
from parity.cli.main import main
from parity.speed import clocks

import speed_subjects
from speed_subjects import MATMUL_SPEC

import jsonschema  # a test dependency (pyproject's test extra): missing, the file errors, never skips
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


@pytest.fixture(autouse=True)
def single_cpu_thread():
    yield from speed_subjects.one_thread()


def test_nvml_mask_decoding():
    assert clocks.nvml_reasons(0) == ()
    assert clocks.nvml_reasons(0x1 | 0x2 | 0x10 | 0x100) == ()  # idle, app clocks, sync boost, display: no throttling
    assert clocks.nvml_reasons(0x4 | 0x40) == ("software power cap", "hardware thermal slowdown")
    assert clocks.nvml_reasons(0x8 | 0x20 | 0x80 | 0x1) == ("hardware slowdown", "software thermal slowdown",
                                                            "hardware power brake slowdown")


def fake_pynvml(masks, clocks_mhz, *, old_binding=False):
    calls = {"clock": iter(clocks_mhz), "mask": iter(masks)}
    module = types.SimpleNamespace(NVML_CLOCK_SM=1)
    module.nvmlDeviceGetClockInfo = lambda handle, kind: next(calls["clock"]) if kind == 1 else -1
    reasons = lambda handle: next(calls["mask"])  # noqa: E731
    if old_binding:
        module.nvmlDeviceGetCurrentClocksThrottleReasons = reasons
    else:
        module.nvmlDeviceGetCurrentClocksEventReasons = reasons
        module.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: pytest.fail("the deprecated call was used")
    return module


@pytest.mark.parametrize("old_binding", [False, True])
def test_nvml_reader_samples_clock_and_reasons(monkeypatch, old_binding):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([0x1, 0x0, 0x40 | 0x1, 0x40], [1980, 1980, 1755, 1410],
                                                           old_binding=old_binding))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", lambda device: ("handle", device), raising=False)
    watch = clocks.ClockWatch(CUDA)  # the reader's own first sample (idle, 1980 MHz) checks that NVML answers
    for _ in range(3):
        watch.sample()
    assert [s.clock_mhz for s in watch.samples] == [1980, 1755, 1410]
    assert watch.throttled() == {"hardware thermal slowdown": 2}
    summary = watch.to_dict()
    assert summary["reported"] is True and summary["source"] == "NVML (pynvml)" and summary["samples"] == 3
    assert summary["clock_mhz"] == {"first": 1980, "last": 1410, "min": 1410, "max": 1980}
    assert watch.warnings() == [
        "the device reported clock throttling during the timed rounds: hardware thermal slowdown (2 of 3 samples); "
        "the timings are not those of a cool device at full clock (let it cool down, check its power and cooling)",
        "the device clock fell from 1980 to 1410 MHz during the timed rounds: the timings are not comparable with a "
        "cool run",
    ]
    assert summary["summary"] == ("3 samples through NVML (pynvml), clock 1410-1980 MHz; THROTTLED: hardware "
                                  "thermal slowdown")


def test_a_clock_drop_of_less_than_10_percent_and_idle_are_not_warned(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([0x1, 0x1, 0x2], [1980, 1980, 1783]))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", lambda device: "handle", raising=False)
    watch = clocks.ClockWatch(CUDA)
    watch.sample()
    watch.sample()
    assert watch.warnings() == []  # 1783 >= 0.9 * 1980 = 1782; GpuIdle and app clocks are not throttling
    assert watch.to_dict()["summary"].endswith("no throttling reported")


def test_amdsmi_reader(monkeypatch):
    statuses = iter([0, 0, 0x3])
    smi = types.SimpleNamespace(AmdSmiClkType=types.SimpleNamespace(GFX="gfx"))
    smi.amdsmi_get_clock_info = lambda handle, kind: {"clk": 2100, "min_clk": 500, "max_clk": 2100}
    smi.amdsmi_get_gpu_metrics_info = lambda handle: {"indep_throttle_status": next(statuses)}
    monkeypatch.setitem(sys.modules, "amdsmi", smi)
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    monkeypatch.setattr(torch.cuda, "_get_amdsmi_handler", lambda device: "handle", raising=False)
    watch = clocks.ClockWatch(CUDA)
    watch.sample()
    watch.sample()
    assert watch.to_dict()["source"] == "amdsmi"
    assert watch.throttled() == {"throttle status 0x3": 1}
    assert watch.warnings()[0].startswith("the device reported clock throttling during the timed rounds: throttle "
                                          "status 0x3 (1 of 2 samples)")


def test_nothing_is_reported_on_a_cpu_or_without_the_library(monkeypatch):
    watch = clocks.ClockWatch(torch.device("cpu"))
    watch.sample()
    assert watch.to_dict() == {"reported": False, "source": None,
                               "note": "not reported: a CPU reports no clock throttling here", "samples": 0,
                               "clock_mhz": {"first": None, "last": None, "min": None, "max": None},
                               "throttling": {}, "summary": "not reported: a CPU reports no clock throttling here"}
    assert watch.warnings() == []
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.setattr(torch.version, "hip", None)
    reader, note = clocks.reader_for(CUDA)
    assert reader is None and note == "not reported: pynvml (nvidia-ml-py) is not installed"


def test_a_reader_that_stops_answering_is_warned_not_fatal():
    class Flaky:
        source = "flaky"

        def __init__(self):
            self.left = 2

        def sample(self):
            self.left -= 1
            if self.left < 0:
                raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
            return clocks.Sample(1500)

    watch = clocks.ClockWatch(CUDA, chooser=lambda device: (Flaky(), "fake"))
    for _ in range(4):
        watch.sample()
    assert len(watch.samples) == 2
    assert watch.warnings() == ["the clock stopped answering during the timed rounds (RuntimeError: "
                                "NVML_ERROR_GPU_IS_LOST); throttling after that is unknown"]


class ThrottlingDevice:
    """A fake reader: full clock for the first three samples, then thermal throttling at 1300 MHz."""

    source = "a fake reader"

    def __init__(self):
        self.count = 0

    def sample(self):
        self.count += 1
        if self.count <= 3:
            return clocks.Sample(1980)
        return clocks.Sample(1300, ("hardware thermal slowdown",))


def test_throttling_is_warned_in_the_table_json_and_html(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(clocks, "reader_for", lambda device: (ThrottlingDevice(), "fake"))
    out, page = tmp_path / "b.json", tmp_path / "b.html"
    status = main(["bench", "--quiet", "--reps", "6", "--warmup", "1", "--subject", MATMUL_SPEC,
                   "--impls", "reference,fast", "--no-modules", "--json", str(out), "--html", str(page)])
    text = capsys.readouterr().out
    assert status == 0  # throttling is warned; the verdict is parity's
    document = json.loads(out.read_text())
    jsonschema.validate(document, schema_for("parity-bench-report"))
    # 7 samples: one before the rounds and one after each of the 6 rounds; the last 4 throttled.
    assert document["clocks"]["samples"] == 7 and document["clocks"]["throttling"] == {"hardware thermal slowdown": 4}
    assert document["clocks"]["clock_mhz"] == {"first": 1980, "last": 1300, "min": 1300, "max": 1980}
    throttled = ("the device reported clock throttling during the timed rounds: hardware thermal slowdown (4 of 7 "
                 "samples)")
    fell = "the device clock fell from 1980 to 1300 MHz during the timed rounds"
    assert [w for w in document["warnings"] if w.startswith((throttled, fell))] == [
        w for w in document["warnings"] if w.startswith("the device")]
    assert sum(w.startswith(throttled) for w in document["warnings"]) == 1
    assert sum(w.startswith(fell) for w in document["warnings"]) == 1
    assert f"warning: {throttled}" in text and f"warning: {fell}" in text
    assert "clock throttling: 7 samples through a fake reader, clock 1300-1980 MHz; THROTTLED: hardware thermal " \
           "slowdown" in text
    html = page.read_text()
    assert throttled in html and fell in html
    assert "THROTTLED: hardware thermal slowdown" in html


def test_a_cpu_run_says_nothing_is_reported(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--quiet", "--reps", "3", "--warmup", "1", "--subject", MATMUL_SPEC,
                 "--impls", "reference,fast", "--no-modules", "--json", str(out)]) == 0
    assert "clock throttling: not reported: a CPU reports no clock throttling here" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["clocks"]["reported"] is False and document["clocks"]["samples"] == 0
    assert not any(warning.startswith("the device") or "throttl" in warning for warning in document["warnings"])
