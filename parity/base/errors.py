"""Exception types and exit statuses: each status means one thing.

====  ==========================================================================================
0     parity holds
1     parity fails (a verdict: some layer is outside its tolerance)
2     unusable input: bad arguments, a bad config or tolerance file, a damaged or untrusted
      bundle, subject arguments that do not validate or do not fit this host's memory, a missing
      optional dependency (with the command that installs it)
3     internal error: an exception raised by parity itself (a bug) or by a subject's own code
      (its factory, make_inputs, make_state, build or forward); never a verdict
130   interrupted (Ctrl-C)
====  ==========================================================================================

The CLI prints one line on stderr for 2 and 3. For 3 the line names the failing place (exception
type, the start of its message, the innermost relevant frame as ``file:line``); ``--debug`` or
``PARITY_DEBUG=1`` prints the full traceback too.
"""
from __future__ import annotations

import importlib.util
import os
import stat
import sys
import sysconfig
import traceback

from parity.base.text import printable

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# Optional dependencies: import name -> (what it is called in messages, the pip extra).
OPTIONAL_DEPENDENCIES = {"triton": ("Triton", "triton")}

_MESSAGE_LIMIT = 200


class ParityError(Exception):
    """Base class for errors raised by parity."""


class UsageError(ParityError, ValueError):
    """The input was unusable: bad arguments, a bad config file, a damaged bundle.

    The CLI prints ``str(err)`` as a single line on stderr and exits with status 2. Messages must
    name the offending thing (the file, the argument, the layer) and the problem.
    """


class BundleError(UsageError):
    """A golden bundle is missing, truncated, corrupted or of an unknown schema."""


class SubjectError(ParityError):
    """An exception raised inside a subject's own code: its factory, ``make_inputs``,
    ``make_state``, ``build`` or forward (``call``). Exit status 3, not 2: the arguments were
    accepted and the code that ran on them broke, which is a bug to fix, not an input to change.

    ``subject`` is the spec (``mypkg:make``, ``decoder``), ``stage`` the method that raised and
    ``error`` the original exception (also ``__cause__``, so ``--debug`` shows its traceback).
    """

    def __init__(self, subject: str, stage: str, error: BaseException):
        self.subject = subject
        self.stage = stage
        self.error = error
        super().__init__(f"internal error in subject {_printable(subject)} ({stage}): {describe_exception(error)}")


def _printable(value: object, limit: int = _MESSAGE_LIMIT) -> str:
    return printable(value, limit=limit)


def dependency_available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (``sys.modules[name] = None``,
    the way tests hide a package, counts as missing)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_dependency(module: str, needed_by: str) -> UsageError:
    """The UsageError for a missing optional dependency: ``--impl triton needs Triton: pip install
    'parity[triton]'``. ``needed_by`` names what needs it (an option, a command)."""
    label, extra = OPTIONAL_DEPENDENCIES.get(module, (module, None))
    hint = f"pip install 'parity[{extra}]'" if extra else f"pip install {module}"
    return UsageError(f"{needed_by} needs {label}: {hint}")


def require_dependency(module: str, needed_by: str) -> None:
    """Raise :func:`missing_dependency` unless ``module`` can be imported."""
    if not dependency_available(module):
        raise missing_dependency(module, needed_by)


# Tolerance files are a few KiB; anything this large is not one (and would be read into memory).
MAX_CONFIG_BYTES = 16 * 2**20


def check_readable_file(path: str | os.PathLike, what: str, *, expected: str = "a TOML file",
                        max_bytes: int = MAX_CONFIG_BYTES) -> None:
    """UsageError unless ``path`` is a regular, readable file of sane size, checked *before* it is
    opened: opening a FIFO blocks until a writer appears (forever, in CI), and a directory or a
    device would fail later with a less clear message. ``what`` names the option (``--tolerances``),
    ``expected`` the kind of file it takes, ``max_bytes`` the largest size accepted."""

    name = os.fspath(path)
    try:
        info = os.stat(name)
    except FileNotFoundError:
        raise UsageError(f"{what} {_printable(name)}: no such file") from None
    except OSError as err:
        raise UsageError(f"{what} {_printable(name)}: cannot read: {err.strerror or err}") from None
    if stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{what} {_printable(name)}: is a directory, not {expected}")
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "a device"
        raise UsageError(f"{what} {_printable(name)}: is {kind}, not a regular file")
    if not os.access(name, os.R_OK):
        raise UsageError(f"{what} {_printable(name)}: permission denied")
    if info.st_size > max_bytes:
        raise UsageError(f"{what} {_printable(name)}: {info.st_size / 2**20:.0f} MiB is too large for {expected} "
                         f"(at most {max_bytes // 2**20} MiB)")


# ---------------------------------------------------------------------------------------------
# Describing an exception in one line


def _stdlib_dirs() -> tuple[str, ...]:
    paths = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
    return tuple(os.path.realpath(p) + os.sep for p in paths if p)


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return os.path.realpath(os.path.dirname(file)) + os.sep if file else None


def _short_path(file: str) -> str:
    """``file`` relative to the current directory if it is below it (``mypkg/model.py``), else to
    the ``sys.path`` entry it was imported from (``torch/nn/functional.py``), else as given."""
    real = os.path.realpath(file)
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        cwd = None
    if cwd and real.startswith(cwd + os.sep):
        return os.path.relpath(real, cwd)
    best = None
    # parity's own root too: an editable install is found through an import hook, not sys.path.
    parity_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for base in [parity_root, *(entry or cwd for entry in sys.path if isinstance(entry, str))]:
        if not base:
            continue
        try:
            root = os.path.realpath(base)
        except (OSError, ValueError):
            continue
        if real.startswith(root + os.sep) and (best is None or len(root) > len(best)):
            best = root
    return os.path.relpath(real, best) if best else file


def error_location(err: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``err``'s traceback that is neither in the standard
    library nor inside torch (an error raised deep in ``torch.nn.functional`` is located at the
    line that called it, the line to fix); the innermost frame if every frame is library code."""
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
    if not frames:
        return None
    skip = _stdlib_dirs() + tuple(d for d in (_package_dir("torch"),) if d)
    chosen = frames[-1]
    for frame in reversed(frames):
        real = os.path.realpath(frame.filename)
        if frame.filename.startswith("<") or real.startswith(skip):
            continue
        chosen = frame
        break
    return f"{_short_path(chosen.filename)}:{chosen.lineno}"


def describe_exception(err: BaseException) -> str:
    """``ValueError: boom at mypkg/model.py:42``: type, first line of the message (cut to a few
    hundred characters, control characters escaped), and :func:`error_location`."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(err, KeyError) and len(err.args) == 1:
        first = repr(err.args[0])
    described = type(err).__name__ + (f": {_printable(first)}" if first else "")
    where = error_location(err)
    return f"{described} at {where}" if where else described


def classify(err: BaseException) -> tuple[int, str, str]:
    """``(exit status, kind, one-line message)`` for an exception that ended a command.

    kind is ``"usage"`` (status 2) or ``"internal"`` (status 3). The message has no ``parity:``
    prefix and no hint about ``--debug`` (the CLI adds those).
    """
    if isinstance(err, UsageError):
        return EXIT_USAGE, "usage", " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, ModuleNotFoundError) and (err.name or "").partition(".")[0] in OPTIONAL_DEPENDENCIES:
        # A lazy import of an optional dependency that no up-front check caught: still the
        # user's environment, not a bug, so the install hint rather than a traceback.
        return EXIT_USAGE, "usage", str(missing_dependency(err.name.partition(".")[0], "this command"))
    if isinstance(err, SubjectError):
        return EXIT_INTERNAL, "internal", str(err)
    return EXIT_INTERNAL, "internal", f"internal error: {describe_exception(err)}"


def print_traceback(err: BaseException, file=None) -> None:
    """The full traceback (with the chained original of a SubjectError), for ``--debug``."""
    traceback.print_exception(type(err), err, err.__traceback__, file=file or sys.stderr)


def debug_from_environment() -> bool:
    return os.environ.get("PARITY_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


__all__ = [
    "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "EXIT_INTERNAL", "EXIT_INTERRUPTED",
    "ParityError", "UsageError", "BundleError", "SubjectError",
    "classify", "describe_exception", "error_location", "dependency_available", "missing_dependency",
    "require_dependency", "print_traceback", "debug_from_environment", "check_readable_file",
]
