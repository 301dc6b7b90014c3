"""Options shared by the CLI commands and the pytest plugin, defined once, with one help formatter.

Each option has a CLI flag (``python -m parity compare --bundle DIR``) and, where the plugin has it,
a pytest flag in the ``parity`` group with the ``--parity-`` prefix (``pytest --parity-golden-dir
DIR``); both read the same help text, type and default from here unless the CLI needs its own
(``cli_help``, ``cli_kwargs``: a ``-`` for standard output, ``--device auto``).

Spellings (the old ones stay accepted as deprecated aliases for one release, until 0.3)::
    canonical        deprecated alias      commands               pytest
    --bundle DIR     --out (capture)       capture, compare       --parity-golden-dir (a dir of goldens)
                     --golden (compare)    (diff: positional A B)
    --set KEY=VALUE  --arg (capture)       capture, inspect
    --json FILE      -                     compare, diff, inspect, show   --parity-report FILE
    --junit-xml FILE -                     compare, diff
    --html FILE      -                     compare, diff
    --markdown FILE  -                     compare, diff
    --quiet          -                     capture, compare, diff, inspect
    --device DEV     -                     capture, compare       --parity-device
    --impl NAME      -                     capture, compare       --parity-impl
    --tolerances F   -                     compare, diff          --parity-tolerances
    -                -                     -                      --parity-obtained-dir DIR

``FILE`` ``-`` is standard output in every command (the text report is then not printed); a file
literally named ``-`` is ``./-``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
from typing import Any

from parity.base.files import is_standard_output
from parity.base.text import printable

STDOUT = "-"  # a report FILE of "-" is standard output, in every command
DEPRECATED_UNTIL = "0.3"

class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors as one line on stderr (``<prefix>: error: ...``, no usage
    block) and exit status 2. ``error_prefix`` defaults to the parser's ``prog``."""

    error_prefix: str | None = None

    def error(self, message: str):
        self.exit(2, f"{self.error_prefix or self.prog}: error: {printable(message, limit=500)}\n")


DEVICE_HELP = "device to run on: cpu, cuda or cuda:N (ROCm GPUs are cuda in PyTorch)"
AUTO_DEVICE = "auto"
IMPL_HELP = "implementation to run: one of the subject's impls"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written, and every meaningful default shown in the help:
    ``(default: X)`` is added unless the help already says its default, or the default is None,
    False or empty (a flag that is off, an option that is absent), which would only be noise."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or "%(default)" in text
                or default is None or default is False or default is argparse.SUPPRESS
                or (isinstance(default, (list, tuple, str)) and not default)
                or isinstance(action, (argparse._StoreConstAction, argparse._VersionAction,  # store_true/false too
                                       argparse._HelpAction))):
            return text
        return text + " (default: %(default)s)"


@dataclasses.dataclass(frozen=True)
class Option:
    dest: str
    cli_flag: str | None
    pytest_flag: str | None
    help: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    cli_aliases: tuple[str, ...] = ()  # deprecated CLI spellings, still accepted
    cli_help: str | None = None  # the CLI's own help where it differs from the plugin's
    cli_kwargs: tuple[tuple[str, Any], ...] = ()  # the CLI's own argparse settings (defaults)

    def as_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def as_cli_kwargs(self) -> dict[str, Any]:
        return {**dict(self.kwargs), **dict(self.cli_kwargs)}


def runs_argument(text: str) -> int:
    """argparse type of ``--repeat``: a whole number >= 1 (argparse turns the ValueError into its
    one-line usage error, exit 2)."""
    stripped = text.strip()
    if not stripped.isdigit() or int(stripped) < 1:
        raise ValueError(text)
    return int(stripped)


runs_argument.__name__ = "whole number >= 1"  # argparse names the type in its message


def _stdout_help(what: str) -> str:
    return f"write {what} to FILE ('-': standard output, instead of the text report)"


OPTIONS: dict[str, Option] = {
    opt.dest: opt
    for opt in (
        Option("golden", "--bundle", "--parity-golden-dir",
               "directory of the goldens the tests check (default: goldens/ beside each test file)",
               (("metavar", "DIR"),),
               cli_aliases=("--golden",),
               cli_help=f"the golden bundle directory to compare against (--golden: deprecated alias, until "
                        f"{DEPRECATED_UNTIL})"),
        Option("impl", "--impl", "--parity-impl",
               IMPL_HELP + " (default: the subject's own reference_impl; a test's impl= or parity marker "
               "names another)",
               (("default", None), ("metavar", "NAME")), cli_help=IMPL_HELP,
               cli_kwargs=(("default", "triton"),)),  # capture and profile set their own default
        Option("device", "--device", "--parity-device",
               DEVICE_HELP + ", or auto (the default): cuda when torch sees a GPU, else cpu",
               (("default", None), ("metavar", "DEV")),
               cli_help=DEVICE_HELP + ", or auto: cuda when torch sees a GPU, else cpu",
               cli_kwargs=(("default", "auto"),)),
        Option("tolerances", "--tolerances", "--parity-tolerances",
               "tolerance policy TOML file (default: [tool.parity] of the rootdir's pyproject.toml if present)",
               (("metavar", "FILE"), ("default", None)),
               cli_help="tolerance policy TOML file (default: [tool.parity] of ./pyproject.toml if present)"),
        Option("json", "--json", "--parity-report", "write the machine-readable report (JSON) here",
               (("metavar", "FILE"), ("default", None)), cli_help=_stdout_help("the machine-readable report (JSON)")),
        Option("junit_xml", "--junit-xml", None, _stdout_help("a JUnit XML report"),
               (("metavar", "FILE"), ("default", None))),
        Option("html", "--html", None, _stdout_help("the report as one self-contained HTML page"),
               (("metavar", "FILE"), ("default", None))),
        Option("markdown", "--markdown", None,
               _stdout_help("the report as Markdown (for a CI job summary or a pull-request comment)"),
               (("metavar", "FILE"), ("default", None))),
        Option("quiet", "--quiet", None, "no progress on stderr", (("action", "store_true"),)),
        Option("weights_dir", "--weights-dir", None,
               "where this host holds the checkpoint files a bundle captured with --weights-from names (found by "
               "file name; default: the paths recorded at capture). Each file's size and digest (BLAKE3, else "
               "sha256) are checked before the model is built",
               (("metavar", "DIR"), ("default", None))),
        Option("repeat", "--repeat", "--parity-repeat",
               "run the implementation N times on the same inputs and judge every recorded tensor bitwise run "
               "to run: a tensor that differs fails, named with its spread max|run_i - run_0| (default: 1, "
               "one run)", (("type", runs_argument), ("default", 1), ("metavar", "N"))),
        Option("seeds", "--seeds", "--parity-seeds",
               "record the input draws of N seeds (the subject's seed argument and the N-1 after it) through one "
               "model in one bundle; compare judges every draw a bundle holds, each tensor on its worst "
               "(default: 1)", (("type", runs_argument), ("default", 1), ("metavar", "N")),
               cli_help="record the input draws of N seeds (the subject's seed argument and the N-1 after it) "
                        "through one model; compare judges every draw and each tensor on its worst (default: 1)"),
        Option("allow_nondeterministic", "--allow-nondeterministic", "--parity-allow-nondeterministic",
               "with --repeat: tensors (or layers) matching this glob may differ run to run (atomics-based "
               "reductions); still reported with their spread; repeatable",
               (("action", "append"), ("default", None), ("metavar", "GLOB"))),
        Option("isolate", None, "--parity-isolate",
               "subject checks: record the goldens' module inputs and replay every module on them, so each "
               "tensor also gets the error it introduces and, where its op's arithmetic is known, that error "
               "over the derived rounding bound (tensors beyond it are named in the summary)",
               (("action", "store_true"), ("default", False))),
        Option("record", None, "--parity-record",
               "reference host: re-record every golden a test checks from this run (missing goldens are "
               "always recorded; either way the test fails, so a recording is never a pass)",
               (("action", "store_true"), ("default", False))),
        Option("obtained_dir", None, "--parity-obtained-dir",
               "where a failing check keeps what it obtained, as <DIR>/<golden name>.obtained bundles "
               "(default: parity-obtained/ under pytest's temporary directory, never the source tree)",
               (("metavar", "DIR"), ("default", None))),
        Option("regen", None, "--parity-regen",
               "rewrite the goldens that fail (and record missing ones) from this run; passing goldens are "
               "left as they are, and a rewritten check fails, so a regeneration is never a pass",
               (("action", "store_true"), ("default", False))),
    )
}


REPORT_DESTS = ("json", "junit_xml", "html", "markdown")


def stdout_as_dash(args: argparse.Namespace) -> None:
    """A report FILE that names standard output itself (``/dev/stdout``, or the file stdout is
    redirected to) becomes STDOUT, so it is written as ``-`` is: alone on stdout, with no text
    report before it and no second report there."""
    for dest in REPORT_DESTS:
        value = getattr(args, dest, None)
        if isinstance(value, str) and value != STDOUT and is_standard_output(value):
            setattr(args, dest, STDOUT)


def resolve_device(name: str) -> str:
    """``--device auto``: ``cuda`` when torch sees a GPU (a ROCm build reports its GPUs as cuda too),
    else ``cpu``; any other name as given (checked where it is used)."""
    if name != AUTO_DEVICE:
        return name
    from parity.run import platform

    return "cuda" if platform.gpu_available() else "cpu"


def builtin_impls_text() -> str:
    """``attention: reference, triton; decoder: reference, triton``, read from the subject registry
    (each built-in's ``impls``); empty if a subject module cannot be imported here."""

    from parity.run.subjects.base import BUILTINS

    parts = []
    for name, target in sorted(BUILTINS.items()):
        module_name, _, attribute = target.partition(":")
        try:
            impls = getattr(importlib.import_module(module_name), attribute).impls
        except (ImportError, AttributeError):  # a built-in whose dependencies are missing here: not listed
            continue
        parts.append(f"{name}: {', '.join(impls)}")
    return "; ".join(parts)


def add_cli_options(parser: argparse.ArgumentParser, *names: str, required: tuple[str, ...] = (),
                    defaults: dict[str, Any] | None = None) -> None:
    """Add the named shared options to an argparse (sub)parser (``defaults``: this command's own)."""
    for name in names:
        opt = OPTIONS[name]
        if opt.cli_flag is None:
            raise KeyError(f"option {name!r} has no CLI flag")
        kwargs = opt.as_cli_kwargs()
        if defaults and name in defaults:
            kwargs["default"] = defaults[name]
        if name in required:
            kwargs.pop("default", None)
            kwargs["required"] = True
        help_text = opt.cli_help or opt.help
        if name == "impl":
            listing = builtin_impls_text()
            help_text += f" (built-in subjects: {listing})" if listing else ""
        parser.add_argument(opt.cli_flag, *opt.cli_aliases, dest=opt.dest, help=help_text, **kwargs)


def add_judging_options(parser: argparse.ArgumentParser) -> None:
    """The CLI options of every command that judges tensors (compare, diff): the error-budget mode,
    ``--strict-structure``, the table's ``--max-rows`` and ``--wide``, ``--html``, ``--markdown`` and
    ``--quiet``."""
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget", action="store_true", default=None,
                        help="require the error budget: the bundle must hold high-precision references, and a "
                             "tensor without one is reported as not checked (default: the budget judges every "
                             "tensor the bundle has a reference of, the fixed thresholds the others)")
    budget.add_argument("--no-budget", dest="budget", action="store_false",
                        help="judge by the fixed per-dtype thresholds alone, even where the bundle has references")
    parser.add_argument("--strict-structure", action="store_true",
                        help="a recorded module that this host never ran is a failure (missing-here), even "
                             "inside a compared enclosing module (default: fused-here, not a failure); so is "
                             "a recorded output that a module call which ran here returned as None (default: "
                             "absent-here, not a failure)")
    parser.add_argument("--max-rows", type=int, default=None, metavar="N",
                        help="collapse runs of passing rows when the table has more than N rows "
                             "(default: show every row)")
    parser.add_argument("--wide", action="store_true",
                        help="show every column of the table (shape, mismatch %%, the isolated verdict, rel L2 "
                             "against the reference on both hosts) and names in full (default: fit 120 columns)")
    parser.add_argument("--distribution", action="store_true",
                        help="also print every tensor's error distribution: percentiles (median, p90, p99, "
                             "p99.9) of |out - golden| and of the relative error (always in --json and --html)")
    add_cli_options(parser, "html", "markdown", "quiet")


def add_pytest_options(group) -> None:
    """Add every option that has a pytest flag to the plugin's ``parity`` option group."""
    for opt in OPTIONS.values():
        if opt.pytest_flag is not None:
            group.addoption(opt.pytest_flag, dest=f"parity_{opt.dest}", help=opt.help, **opt.as_kwargs())
