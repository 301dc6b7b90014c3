"""The harness benchmark (bench/harness/harness_benchmark.py): its CI preset runs and reports
sane numbers, its subject round-trips through capture and compare, and its baseline computes what
parity's metrics compute. Timing ratios are never asserted: they go into BENCHMARK.md beside it.
Its folder goes first on ``sys.path``, as when it runs as a script, so the benchmark imports as
``harness_benchmark`` and its bundles' subject (``harness_benchmark:make_subject``) resolves."""
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from bench import formats
from parity.judge.metrics import compute_metrics

HARNESS = Path(__file__).resolve().parents[1] / "bench" / "harness"
sys.path.insert(0, str(HARNESS))
import harness_benchmark as benchmark  # noqa: E402

SCRIPT = str(Path(benchmark.__file__).resolve())


def test_small_preset_produces_a_sane_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, SCRIPT, "--small", "--quiet", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| size" in done.stdout and "compare" in done.stdout and "write rate" in done.stdout
    result = json.loads(out.read_text())
    assert (result["format"], result["version"]) == (formats.HARNESS_BENCHMARK_REPORT, 2)
    jsonschema.Draft202012Validator(formats.schema_for(result["format"])).validate(result)
    rows = {(row["multiplier"], row["what"]): row for row in result["rows"]}
    assert set(rows) == {(m, what) for m in (1, 2) for what in ("compare", "compare vs read", "capture",
                                                                 "capture --no-fsync", "write rate",
                                                                 "write rate --no-fsync")}
    for multiplier in (1, 2):
        compare, capture = rows[(multiplier, "compare")], rows[(multiplier, "capture")]
        fast = rows[(multiplier, "capture --no-fsync")]
        assert compare["passed"], "the bundle's own impl must hold against its golden"
        assert compare["compared"] == 4 * compare["layers"] + 1
        # like for like: the durable capture against the baseline with fsync, --no-fsync without
        assert capture["baseline"] == "forwards + save_file + fsync per file + reference run"
        assert fast["baseline"] == "forwards + save_file + reference run"
        assert capture["page_cache_ratio"] == pytest.approx(capture["parity"]["seconds"] / fast["raw"]["seconds"])
        for row in (compare, capture, fast):
            for side in ("parity", "raw"):
                assert row[side]["seconds"] > 0 and row[side]["cpu_seconds"] >= 0
            assert row["parity"]["peak_rss_bytes"] >= row["parity"]["streaming_peak_rss_bytes"] > 0
            assert row["streaming_growth_bytes"] is not None
            assert math.isfinite(row["ratio"]) and row["ratio"] > 0
            for side in ("parity", "raw"):  # per run, as the runs; --small: --settle 0
                assert row[side]["settle_seconds"] == [0.0] and len(row[side]["handed_back_bytes"]) == 1
        write, fast_write = rows[(multiplier, "write rate")], rows[(multiplier, "write rate --no-fsync")]
        rates = write["rates"]
        assert set(rates) == {"parity", "parity_nofsync", "raw", "raw_fsync"} and all(rates.values())
        assert write["raw_rate"] == statistics.median(rates["raw_fsync"])
        assert fast_write["raw_rate"] == statistics.median(rates["raw"])
        assert fast_write["parity_rate"] == statistics.median(rates["parity_nofsync"])
        assert write["ratio"] == pytest.approx(write["parity_rate"] / write["raw_rate"])
        for field in ("handed_back_bytes", "settle_seconds"):  # one value per timed write of each writer
            assert {key: len(values) for key, values in write[field].items()} == {key: 1 for key in rates}
        assert all(seconds == 0 for seconds in write["settle_seconds"]["parity"])  # --small: --settle 0
    assert result["settle_s"] == 0 and result["page_reporting"] == (benchmark.reported_bytes() is not None)
    assert rows[(2, "compare")]["bundle_bytes"] > rows[(1, "compare")]["bundle_bytes"]
    assert rows[(2, "compare")]["layers"] == 2 * rows[(1, "compare")]["layers"]
    assert not list(tmp_path.glob("parity-bench-*")), "the temporary work directory is removed"


def test_bare_metrics_compute_what_parity_metrics_compute():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(300, 7, generator=gen, dtype=torch.float64)
    out = (ref + 1e-3 * torch.randn(ref.shape, generator=gen, dtype=torch.float64)).float()
    cosine, max_abs, rel_l2 = benchmark.bare_metrics(out, ref)
    m = compute_metrics(out, ref)
    assert cosine == pytest.approx(m.cosine, rel=1e-12)
    assert max_abs == m.max_abs
    assert rel_l2 == pytest.approx(m.rel_l2, rel=1e-12)


def test_the_subject_records_four_modules_per_layer_and_holds_against_itself(tmp_path):
    from parity.run.capture import capture
    from parity.judge.compare import compare_bundle
    from parity.run.subjects import load_subject, trusting

    runner = load_subject(benchmark.SPEC, {"layers": 2, "width": 8, "tokens": 4})
    result = capture(runner, tmp_path / "b", impl="reference", device="cpu", reference="fp64")
    assert result.layers == 2 * 4 + 1  # block, norm, fc, act per layer, and the root
    with trusting(benchmark.SPEC):
        report = compare_bundle(tmp_path / "b", impl="reference", device="cpu")
    assert report.passed and report.budget_checked and len(report.layers) == result.layers
    assert benchmark.model_bytes(runner.args) == sum(
        t.numel() * t.element_size() for t in runner.make_state().values())


def test_profile_categories_from_a_cprofile_of_the_main_thread():
    import cProfile
    import pstats

    from parity.judge.metrics import compute_metrics_and_errors

    key = "metrics (compute_metrics, compute_metrics_and_errors)"
    profiler = cProfile.Profile()
    profiler.enable()
    compute_metrics(torch.ones(10), torch.ones(10))
    profiler.disable()
    alone = benchmark._profile_categories(pstats.Stats(profiler))[key]
    assert alone > 0
    profiler.enable()
    compute_metrics_and_errors(torch.ones(10), torch.ones(10), torch.ones(10, dtype=torch.float64))
    profiler.disable()
    categories = benchmark._profile_categories(pstats.Stats(profiler))
    assert categories[key] > alone  # the fused scan is counted as metrics too
    assert "model forward (subject runs minus hooks)" in categories


BAD_ARGUMENTS = [
    (["--multipliers", "1,x"], "argument --multipliers: '1,x' is not a comma-separated list of integers"),
    (["--multipliers", "0"], "argument --multipliers: '0': every multiplier must be from 1 to 64"),
    (["--repeats", "0"], "argument --repeats: 0 is not from 1 to 100"),
    (["--settle", "-1"], "argument --settle: -1 is not from 0 to 60 seconds"),
    (["--settle", "nan"], "argument --settle: nan is not from 0 to 60 seconds"),
    (["--settle", "soon"], "argument --settle: 'soon' is not a number of seconds"),
    (["--small", "--json", "/nonexistent-dir/r.json"], "--json /nonexistent-dir/r.json: its directory does not exist"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS)
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    # In-process: every refusal is the parser's (parser.exit before any work), the same code the
    # script runs; the real process below checks that the script's exit status and stderr are these.
    with pytest.raises(SystemExit) as exited:
        benchmark.main(argv)
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == ""
    assert captured.err == f"{benchmark.PROG}: error: {message}\n"


@pytest.mark.parametrize("argv, message", [BAD_ARGUMENTS[0], BAD_ARGUMENTS[-1]], ids=["argparse", "after-parsing"])
def test_bad_arguments_in_a_real_process(argv, message):
    done = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"{benchmark.PROG}: error: {message}\n"


def test_reported_bytes_reads_the_page_reporting_counter_or_says_there_is_none(tmp_path):
    counter = tmp_path / "reported_kib"
    assert benchmark.reported_bytes(str(counter)) is None  # a host without free page reporting
    counter.write_text("1536\n")
    assert benchmark.reported_bytes(str(counter)) == 1536 * 1024
    counter.write_text("garbled")
    assert benchmark.reported_bytes(str(counter)) is None


class _MovingCounter:
    """A page-reporting counter that moves on each of its first ``moves`` reads, then stays."""

    def __init__(self, path, moves):
        self.path, self.moves, self.reads = path, moves, 0
        path.write_text("0")

    def read(self, counter):
        self.reads += 1
        if self.reads <= self.moves:
            self.path.write_text(str(self.reads * 100))
        return int(self.path.read_text()) * 1024


class _FakeTime:
    """The benchmark's clock, moved only by its own sleeps and by what a test says work costs."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds):
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch):
    clock = _FakeTime()
    monkeypatch.setattr(benchmark, "time", clock)
    return clock


def test_settle_waits_until_the_counter_has_been_still_for_the_quiet_time(tmp_path, monkeypatch, fake_time):
    counter = _MovingCounter(tmp_path / "reported_kib", moves=5)
    monkeypatch.setattr(benchmark, "reported_bytes", counter.read)
    waited = benchmark.settle(5, poll_s=1, counter=str(counter.path))
    # The counter moves at reads 1-5 (t = 0..4 s, one read per 1 s poll); the quiet time of 5 s
    # then runs from t = 4 to t = 9: 10 reads in all, 9 s waited.
    assert counter.reads == 10 and counter.path.read_text() == "500"
    assert waited == 9.0


def test_measure_removes_and_settles_before_the_clock_and_records_both(tmp_path, monkeypatch, fake_time):
    left = tmp_path / "bundle"
    (left / "shards").mkdir(parents=True)
    (left / "shards" / "old.safetensors").write_bytes(b"x" * 4096)
    settled = []

    def slow_settle(quiet_s):
        settled.append((quiet_s, left.exists()))
        fake_time.sleep(0.3)
        return 0.3

    monkeypatch.setattr(benchmark, "settle", slow_settle)
    seen = {}
    def work():
        seen["left"] = left.exists()
        fake_time.sleep(0.125)  # what the timed work costs

    result = benchmark.measure(work, settle_s=2.5, remove=[str(left), str(tmp_path / "never-there")])
    # removed first, then settled (after the removal), and neither inside the clock
    assert settled == [(2.5, False)] and seen == {"left": False}
    assert result["settle_seconds"] == 0.3 and result["seconds"] == 0.125
    reported = benchmark.reported_bytes()
    assert (result["handed_back_bytes"] is None) == (reported is None)


def test_settle_gives_up_at_its_limit_and_does_not_wait_without_a_counter(tmp_path, monkeypatch, fake_time):
    counter = _MovingCounter(tmp_path / "reported_kib", moves=10**9)  # never still
    monkeypatch.setattr(benchmark, "reported_bytes", counter.read)
    waited = benchmark.settle(10, limit_s=3, poll_s=1, counter=str(counter.path))
    assert waited == 3.0 and counter.reads == 4  # one read, then one per 1 s poll until the 3 s limit
    monkeypatch.setattr(benchmark, "reported_bytes", lambda counter: None)
    assert benchmark.settle(10) == 0.0
    counter = _MovingCounter(tmp_path / "still", moves=0)
    monkeypatch.setattr(benchmark, "reported_bytes", counter.read)
    assert benchmark.settle(0) == 0.0 and counter.reads == 1  # --settle 0: no wait


def test_the_document_encodes_non_finite_numbers_as_strings(tmp_path):
    # a ratio from a zero-second baseline is infinite: written as "inf", never a bare Infinity token
    path = tmp_path / "r.json"
    benchmark._write_json({"host": {"python": "3", "torch": "2", "cpus": 2}, "base": {"layers": 1, "width": 1,
                           "tokens": 1}, "device": "cpu", "repeats": 1, "targets": {}, "rows": [
                           {"what": "compare", "multiplier": 1, "layers": 1, "bundle_bytes": 0,
                            "ratio": float("inf"), "cpu_ratio": float("nan"), "parity": {"seconds": 1.0},
                            "raw": {"seconds": 0.0}}]}, str(path))
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    document = json.loads(text)
    assert document["rows"][0]["ratio"] == "inf" and document["rows"][0]["cpu_ratio"] == "nan"
    jsonschema.Draft202012Validator(formats.schema_for(document["format"])).validate(document)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left


def test_the_committed_results_validate_and_the_document_quotes_them():
    """BENCHMARK.md's target table is the committed JSON of the runs it describes."""
    results = HARNESS / "results"
    document = (results.parent / "BENCHMARK.md").read_text()
    validator = jsonschema.Draft202012Validator(formats.schema_for(formats.HARNESS_BENCHMARK_REPORT))
    for path in sorted(results.glob("*.json")):
        validator.validate(json.loads(path.read_text()))
    runs = {"cpu": ["cpu-1x.json", "cpu-2x.json", "cpu-4x.json"], "h200": ["h200-1x-2x.json", "h200-4x.json"]}
    for host, names in runs.items():
        rows = {}
        for name in names:
            result = json.loads((results / name).read_text())
            assert result["host"]["cpus"] == (2 if host == "cpu" else 16)
            rows.update({(row["multiplier"], row["what"]): row for row in result["rows"]})
        assert {multiplier for multiplier, _ in rows} == {1, 2, 4}
        for what in ("compare", "capture", "capture --no-fsync", "write rate", "write rate --no-fsync"):
            quoted = " / ".join(f"{rows[(multiplier, what)]['ratio']:.2f}" for multiplier in (1, 2, 4))
            assert quoted in document, (host, what, quoted)
        for what in ("capture", "write rate"):  # the durable runs against the page cache, quoted too
            quoted = " / ".join(f"{rows[(multiplier, what)]['page_cache_ratio']:.2f}" for multiplier in (1, 2, 4))
            assert quoted in document, (host, what, "page cache", quoted)
