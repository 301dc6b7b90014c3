"""pytest plugin asserting parity against goldens (registered through the pytest11 entry point).

In a test::
    def test_attention(parity_check):
        out, lse = run_my_kernel()
        parity_check({"out": out, "lse": lse})            # golden <test dir>/goldens/<module>/<test id>
        parity_check(out, name="B1-Hq2-...-s0")           # golden <test dir>/goldens/B1-Hq2-...-s0

    @pytest.mark.parity(golden="attention-smoke", policy="tests/parity.toml")
    def test_subject(parity_check):
        parity_check.subject("attention", {"cases": "smoke"})   # a whole subject run, via compare_bundle

Without the fixture: ``assert_parity(name, tensor_or_dict, golden_dir=..., policy=...)``.

A subject check runs the subject's own ``reference_impl`` unless ``impl=``, the marker or
``--parity-impl`` names another, so a user's subject works without flags; messages name the
plugin's options (``--parity-impl``, ``--parity-device``), never the CLI's. A failing check keeps
what it obtained under pytest's temporary directory (or ``--parity-obtained-dir``), never in the
source tree, and prints the path. The end-of-run summary lists the tensors that did not pass;
passing ones are counted, and listed with ``-v``.

This module is options (:mod:`parity.cli.options`, the ``--parity-`` group), the ``parity`` marker,
the ``parity_check`` fixture and the summary hooks; the golden lifecycle behind every check
(record, judge, regenerate, keep the obtained tensors) is :mod:`parity.testing.goldens`, and the judge
the same engine as ``compare`` (:mod:`parity.judge.engine`).

Policy, most specific first: ``policy=`` of the call, ``policy=`` of the ``parity`` marker,
``--parity-tolerances FILE``, ``[tool.parity]`` of the rootdir's ``pyproject.toml``, the built-in
defaults (:func:`parity.judge.policy.as_policy`). A policy is a ``Policy`` or a path to a TOML file.

Each check's per-tensor results ride on the test report (its ``parity_tensors`` attribute, a list
of JSON-safe rows), so the end-of-run summary and ``--parity-report FILE`` (JSON, format
``parity-pytest-report``, :mod:`parity.base.jsonformat`) also work under pytest-xdist, where the
controller aggregates what the workers report. They are kept out of ``user_properties``: pytest's
``--junit-xml`` writes those as ``<properties>`` of each test case, which the JUnit (xunit2)
schema forbids. The run's totals go to the JUnit file as properties of the test suite instead
(``parity.tensors``, ``parity.tensors_passing``, ``parity.report``), as ``record_testsuite_property``
would put them.

Errors. Unusable input (a bad name, policy or golden) and an exception raised by a subject's own
code (make_inputs, build, forward: a :class:`parity.base.errors.SubjectError`) fail the test with one
line, like the CLI's exit statuses 2 and 3; ``PARITY_DEBUG=1`` shows a subject's traceback.

Trust. ``parity_check.subject(spec)`` builds the subject the test names; a golden bundle only
confirms it (a golden recorded from another spec fails). The golden's directory is never searched
for the subject's module, the same rule as ``compare`` (:mod:`parity.run.subjects.base`).

torch, safetensors and Hypothesis are imported inside hooks, fixtures and helpers, never when
pytest loads this module.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from tabulate import tabulate

from parity.base.errors import SubjectError, UsageError, debug_from_environment
from parity.base.files import write_atomically
from parity.base.jsonformat import PYTEST_REPORT, dumps, envelope
from parity.base.text import printable
from parity.cli.options import add_pytest_options
from parity.testing.goldens import (
    ParityFailure,
    ParityResult,
    check_name,
    check_parity,
    check_subject,
    default_golden_name,
)

MARKER = "parity"
REPORT_ATTRIBUTE = "parity_tensors"  # the test report attribute that carries per-tensor rows
_MARKER_KWARGS = ("golden", "policy", "subject", "args", "impl", "record_impl", "repeat", "isolate")

MARKER_HELP = (
    "parity(golden=None, policy=None, subject=None, args=None, impl=None, record_impl=None, repeat=None, "
    "isolate=None): "
    "defaults for the parity_check fixture: the golden name, a tolerance policy (Policy or TOML path), "
    "the subject and its args for parity_check.subject(), the impl to run and the impl that records, "
    "and how many times parity_check.subject() runs the impl to judge it bitwise run to run"
)


# ---------------------------------------------------------------------------------------------
# pytest integration


@dataclasses.dataclass
class _State:
    golden_dir: Path | None
    impl: str | None
    device: str | None
    tolerances: str | None
    report: Path | None
    record: bool
    regen: bool
    rootdir: Path
    obtained_dir: Path | None
    verbose: bool
    repeat: int = 1
    seeds: int = 1
    isolate: bool = False
    allow_nondeterministic: tuple[str, ...] = ()
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    is_worker: bool = False


STATE = pytest.StashKey[_State]()
ROWS = pytest.StashKey[list]()  # an item's per-tensor rows, until its teardown report carries them


def pytest_addoption(parser):
    add_pytest_options(parser.getgroup("parity", "numerical parity against golden bundles"))


def _device_option(device: str | None) -> str | None:
    # None and "auto" alike: cuda when torch sees a GPU, else cpu (resolved where the run starts).
    return None if device in (None, "auto") else device


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", MARKER_HELP)
    here = config.invocation_params.dir

    def absolute(value):
        return None if value is None else (here / value).resolve()

    config.stash[STATE] = _State(
        golden_dir=absolute(config.getoption("parity_golden")),
        impl=config.getoption("parity_impl"),
        device=_device_option(config.getoption("parity_device")),
        tolerances=str(absolute(config.getoption("parity_tolerances"))) if config.getoption("parity_tolerances")
        else None,
        report=absolute(config.getoption("parity_json")),
        record=config.getoption("parity_record"),
        regen=config.getoption("parity_regen"),
        rootdir=config.rootpath,
        obtained_dir=absolute(config.getoption("parity_obtained_dir")),
        verbose=config.getoption("verbose") > 0,
        repeat=config.getoption("parity_repeat"),
        seeds=config.getoption("parity_seeds"),
        isolate=config.getoption("parity_isolate"),
        allow_nondeterministic=tuple(config.getoption("parity_allow_nondeterministic") or ()),
        is_worker=hasattr(config, "workerinput"),
    )
    config.pluginmanager.register(_Aggregator(config.stash[STATE]), "parity-aggregator")
    # `--hypothesis-profile parity-gpu`: the parity profiles must exist before Hypothesis' own
    # plugin loads the named one in its pytest_configure (this hook runs first).
    profile = config.getoption("hypothesis_profile", None)
    if isinstance(profile, str) and profile.startswith("parity-"):
        from parity.testing import strategies  # noqa: F401  (registers the profiles)


class ParityChecker:
    """The ``parity_check`` fixture: checks bound to one test, its marker and the run's options."""

    def __init__(self, request: pytest.FixtureRequest):
        self._request = request
        self._state: _State = request.config.stash[STATE]
        self._marker = _marker_kwargs(request.node)
        self._checked: set[str] = set()

    @property
    def golden_dir(self) -> Path:
        """Where this test's goldens live: ``--parity-golden-dir``, else ``<test file dir>/goldens``."""
        if self._state.golden_dir is not None:
            return self._state.golden_dir
        return Path(self._request.node.path).parent / "goldens"

    def golden_name(self, name: str | None = None) -> str:
        if name is not None:
            return name
        return self._marker.get("golden") or default_golden_name(self._request.node.nodeid)

    @property
    def obtained_dir(self) -> Path:
        """Where a failing check keeps what it obtained: ``--parity-obtained-dir``, else
        ``parity-obtained/`` under pytest's temporary directory (kept for the last few runs, like
        ``tmp_path``), so that a failing run never writes into the source tree."""
        if self._state.obtained_dir is not None:
            return self._state.obtained_dir
        factory = self._request.getfixturevalue("tmp_path_factory")
        return factory.getbasetemp() / "parity-obtained"

    def _policy(self, policy: Any):
        if policy is not None:
            return policy
        if self._marker.get("policy") is not None:
            return self._marker["policy"]
        return self._state.tolerances

    def _run(self, name: str, check) -> ParityResult:
        __tracebackhide__ = True  # the failure is the message, not the plugin's frames

        if name in self._checked:
            pytest.fail(f"parity: golden {name!r} checked twice in one test; give each check its own name=",
                        pytrace=False)
        self._checked.add(name)
        try:
            result = check()
        except UsageError as err:
            problem = f"parity: {err}"
        except SubjectError as err:
            # The subject's own code raised: a failing test with the one line the CLI prints,
            # never a pass; PARITY_DEBUG=1 keeps the traceback (the original is chained).
            if debug_from_environment():
                raise
            problem = f"parity: {err}; set PARITY_DEBUG=1 for the traceback"
        else:
            problem = None
        if problem is not None:  # outside the except block: one line, no chained traceback
            pytest.fail(problem, pytrace=False)
        self._request.node.stash.setdefault(ROWS, []).extend(result.records())
        if not result.passed:
            raise ParityFailure(result)
        return result

    def __call__(self, obtained: Any, name: str | None = None, *, policy: Any = None) -> ParityResult:
        """Assert that ``obtained`` (a tensor or a mapping of names to tensors) matches its golden."""
        __tracebackhide__ = True
        golden = self.golden_name(name)
        state = self._state
        return self._run(golden, lambda: check_parity(
            golden, obtained, golden_dir=self.golden_dir, policy=self._policy(policy), record=state.record,
            regen=state.regen, rootdir=state.rootdir, test_id=self._request.node.nodeid,
            obtained_dir=self.obtained_dir))

    check = __call__

    def subject(self, subject: str | None = None, args: Mapping[str, Any] | None = None, *,
                name: str | None = None, policy: Any = None, impl: str | None = None,
                record_impl: str | None = None, repeat: int | None = None,
                isolate: bool | None = None) -> ParityResult:
        """Assert that a whole subject run matches its golden bundle. The implementation run is, most
        specific first: ``impl=``, the ``parity`` marker's ``impl``, ``--parity-impl``, the subject's
        own ``reference_impl``; on ``--parity-device``. ``repeat`` (else the marker's, else
        ``--parity-repeat``): run it that many times and fail where a tensor is not bitwise equal
        run to run, unless ``--parity-allow-nondeterministic`` names it (:mod:`parity.run.repeats`).
        ``isolate`` (else the marker's, else ``--parity-isolate``): the golden records its modules'
        inputs and every module is replayed on them; the result's ``beyond_derived_bound`` names the
        tensors whose replayed error exceeds their op's derived rounding bound (evidence beside the
        verdict, shown in the summary, never a failure by itself)."""
        __tracebackhide__ = True
        subject = subject or self._marker.get("subject")
        if subject is None:
            pytest.fail("parity: parity_check.subject() needs a subject (as an argument or in the parity marker)",
                        pytrace=False)
        args = args if args is not None else self._marker.get("args")
        golden = self.golden_name(name)
        state = self._state
        run_impl, impl_flag = next(((value, flag) for value, flag in (
            (impl, "impl= of parity_check.subject()"), (self._marker.get("impl"), "impl= of the parity marker"),
            (state.impl, "--parity-impl")) if value), (None, "the subject's reference_impl"))
        record_impl = record_impl or self._marker.get("record_impl")
        repeat = next((value for value in (repeat, self._marker.get("repeat")) if value is not None), state.repeat)
        isolate = next((value for value in (isolate, self._marker.get("isolate")) if value is not None), state.isolate)
        return self._run(golden, lambda: check_subject(
            subject, args, golden=self.golden_dir / check_name(golden), impl=run_impl, device=state.device,
            policy=self._policy(policy), record=state.record, regen=state.regen, record_impl=record_impl,
            rootdir=state.rootdir, test_id=self._request.node.nodeid, obtained_dir=self.obtained_dir,
            name=golden, impl_flag=impl_flag, device_flag="--parity-device", repeat=repeat, seeds=state.seeds,
            allow_nondeterministic=state.allow_nondeterministic, isolate=bool(isolate)))


def _marker_kwargs(node) -> dict[str, Any]:
    marker = node.get_closest_marker(MARKER)
    if marker is None:
        return {}
    kwargs = dict(marker.kwargs)
    if marker.args:
        if len(marker.args) > 1 or "golden" in kwargs:
            pytest.fail(f"parity marker on {node.nodeid}: at most one positional argument, the golden name",
                        pytrace=False)
        kwargs["golden"] = marker.args[0]
    unknown = set(kwargs) - set(_MARKER_KWARGS)
    if unknown:
        pytest.fail(f"parity marker on {node.nodeid}: unknown argument(s) {', '.join(sorted(unknown))}; "
                    f"expected {', '.join(_MARKER_KWARGS)}", pytrace=False)
    return kwargs


@pytest.fixture
def parity_check(request) -> ParityChecker:
    """Assert parity against goldens: ``parity_check(tensor_or_dict, name=None, policy=None)`` and
    ``parity_check.subject(subject, args)``; see ``parity.testing.plugin``."""
    return ParityChecker(request)


class _Aggregator:
    """Collects the per-tensor rows of every test report into the run's state (registered per config,
    so that a hook without a config argument can reach it)."""

    def __init__(self, state: _State):
        self.state = state

    def pytest_runtest_logreport(self, report):
        # The teardown report comes last and carries every row of the test. Under xdist this runs
        # on the controller for the workers' reports too: they arrive serialized, and pytest keeps
        # a report's extra attributes (plain JSON values) through that.
        if report.when == "teardown":
            self.state.records.extend(getattr(report, REPORT_ATTRIBUTE, None) or [])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "teardown":
        rows = item.stash.get(ROWS, None)
        if rows:
            setattr(report, REPORT_ATTRIBUTE, list(rows))
    return report


def _sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # xdist delivers reports in completion order; sort so the summary is the same run to run.
    return sorted(rows, key=lambda row: (row.get("test") or "", row.get("tensor") or ""))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The tensors that did not pass first (failed, recorded, regenerated), then the counts; the
    passing tensors are folded into the count unless ``-v`` lists them too (after the others)."""
    state = config.stash.get(STATE, None)
    if state is None or not state.records:
        return

    rows = sorted(_sorted_rows(state.records), key=lambda row: row.get("status") == "pass")  # stable
    shown = rows if state.verbose else [row for row in rows if row.get("status") != "pass"]
    passed = sum(1 for row in rows if row.get("status") == "pass")
    terminalreporter.section("parity summary")
    if shown:
        table = []
        for row in shown:
            text = row.get("text") or {}
            # A terminal table: names as they are (printable), no Markdown escapes.
            table.append([printable(row.get("test") or "-"), printable(row.get("tensor")), text.get("dtype", "-"),
                          text.get("cosine", "-"), text.get("max_abs", "-"), text.get("rel_l2", "-"),
                          row.get("verdict")])
        for line in tabulate(table, headers=["test", "tensor", "dtype", "cosine", "max abs", "rel L2", "verdict"],
                             tablefmt="github", disable_numparse=True).splitlines():
            terminalreporter.write_line(line)
    beyond = [row for row in rows if row.get("beyond_derived_bound")]
    for row in beyond:
        terminalreporter.write_line(f"beyond derived bound: {printable(row.get('test') or '-')} "
                                    f"{printable(row.get('tensor'))}: {row.get('iso_bound')} of its op's rounding bound "
                                    "(replayed on the golden inputs; evidence, not a failure)")
    folded = len(rows) - len(shown)
    tail = f" ({folded} passing not shown: -v lists them)" if folded and shown else (
        " (-v lists them)" if folded else "")
    terminalreporter.write_line(f"parity: {_count(len(rows), 'tensor')} checked: {_status_counts(rows, passed)}{tail}")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _status_counts(rows, passed: int) -> str:
    """``1 pass, 2 fail, 1 recorded``: the passes, then every other status that occurs."""
    others: dict[str, int] = {}
    for row in rows:
        status = str(row.get("status"))
        if status != "pass":
            others[status] = others.get(status, 0) + 1
    return ", ".join([f"{passed} pass"] + [f"{count} {status}" for status, count in sorted(others.items())])


@pytest.hookimpl(tryfirst=True)  # before pytest's junitxml writes its file (the suite properties)
def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash.get(STATE, None)
    if state is None or state.is_worker:
        return
    rows = _sorted_rows(state.records)
    passed = sum(1 for row in rows if row.get("status") == "pass")
    if rows:
        _junit_suite_properties(session.config, [("parity.tensors", len(rows)), ("parity.tensors_passing", passed)]
                                + ([("parity.report", state.report)] if state.report is not None else []))
    if state.report is None:
        return

    payload = {**envelope(PYTEST_REPORT), "checked": len(rows), "passed": passed, "not_passed": len(rows) - passed,
               "tensors": rows}

    state.report.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(state.report, dumps(payload, ensure_ascii=True) + "\n", "--parity-report")


def _junit_suite_properties(config, properties: list[tuple[str, Any]]) -> None:
    """Add ``<property>`` elements to the ``<testsuite>`` of pytest's ``--junit-xml`` file, if one is
    being written: what the ``record_testsuite_property`` fixture does, for the whole run."""
    try:
        from _pytest.junitxml import xml_key  # the LogXML the fixture itself uses
    except ImportError:  # a pytest that moved it: the file simply goes without the totals
        return
    xml = config.stash.get(xml_key, None)
    if xml is None:
        return
    for name, value in properties:
        xml.add_global_property(name, str(value))
