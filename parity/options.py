"""Options shared by the CLI and the pytest plugin, defined once.

Each option has a CLI flag (``python -m parity compare --golden DIR``) and a pytest flag in the
``parity`` group with the ``--parity-`` prefix (``pytest --parity-golden-dir DIR``); both read
the same help text, type and default from here.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Option:
    dest: str
    cli_flag: str | None
    pytest_flag: str | None
    help: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def as_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)


OPTIONS: dict[str, Option] = {
    opt.dest: opt
    for opt in (
        Option("golden", "--golden", "--parity-golden-dir",
               "golden bundle directory (compare) / directory of goldens (pytest)", (("metavar", "DIR"),)),
        Option("impl", "--impl", "--parity-impl", "attention implementation to run: reference or triton",
               (("default", "triton"),)),
        Option("device", "--device", "--parity-device", "device to run on (default: cuda if present, else cpu)",
               (("default", None),)),
        Option("tolerances", "--tolerances", "--parity-tolerances",
               "tolerance policy TOML file (default: [tool.parity] of ./pyproject.toml if present)",
               (("metavar", "FILE"), ("default", None))),
        Option("json", "--json", "--parity-report", "write the machine-readable report (JSON) here",
               (("metavar", "FILE"), ("default", None))),
        Option("junit_xml", "--junit-xml", None, "write a JUnit XML report here", (("metavar", "FILE"), ("default", None))),
        Option("record", None, "--parity-record",
               "reference host: re-record every golden a test checks from this run (missing goldens are "
               "always recorded; either way the test fails, so a recording is never a pass)",
               (("action", "store_true"), ("default", False))),
        Option("regen", None, "--parity-regen",
               "overwrite existing goldens with this run's tensors (explicit regeneration)",
               (("action", "store_true"), ("default", False))),
    )
}


def add_cli_options(parser: argparse.ArgumentParser, *names: str, required: tuple[str, ...] = ()) -> None:
    """Add the named shared options to an argparse (sub)parser."""
    for name in names:
        opt = OPTIONS[name]
        if opt.cli_flag is None:
            raise KeyError(f"option {name!r} has no CLI flag")
        kwargs = opt.as_kwargs()
        if name in required:
            kwargs.pop("default", None)
            kwargs["required"] = True
        parser.add_argument(opt.cli_flag, dest=opt.dest, help=opt.help, **kwargs)


def add_judging_options(parser: argparse.ArgumentParser) -> None:
    """The CLI options of every command that judges tensors (compare, diff): the error-budget mode,
    ``--strict-structure``, ``--max-rows`` and ``--quiet``."""
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget", action="store_true", default=None,
                        help="require the error budget: the bundle must hold high-precision references, and a "
                             "tensor without one is reported as not checked (default: the budget judges every "
                             "tensor the bundle has a reference of, the fixed thresholds the others)")
    budget.add_argument("--no-budget", dest="budget", action="store_false",
                        help="judge by the fixed per-dtype thresholds alone, even where the bundle has references")
    parser.add_argument("--strict-structure", action="store_true",
                        help="a recorded module that this host never ran is a failure (missing-here), even "
                             "inside a compared enclosing module (default: fused-here, not a failure)")
    parser.add_argument("--max-rows", type=int, default=None, metavar="N",
                        help="collapse runs of passing rows when the table has more than N rows "
                             "(default: show every row)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_pytest_options(group) -> None:
    """Add every option that has a pytest flag to the plugin's ``parity`` option group."""
    for opt in OPTIONS.values():
        if opt.pytest_flag is not None:
            group.addoption(opt.pytest_flag, dest=f"parity_{opt.dest}", help=opt.help, **opt.as_kwargs())
