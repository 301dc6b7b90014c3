"""The user documents: README.md is a front door to docs/, every link resolves, and the commands
marked runnable run as written.

A fenced ``sh`` block directly after a ``<!-- runnable -->`` line runs on a CPU: each command
(continuation lines joined) runs in a scratch folder laid out as the checkout's root (``golden/``
and ``tests/`` linked). A command whose comment says ``exit N`` must end with that status, others
with 0; one whose comment quotes ``PARITY HOLDS: k/n tensors`` must print exactly that. Blocks for
a GPU host (``--device cuda``) are not marked; docs/distributed.md's torchrun commands are run by
tests/test_distributed.py.

A ``[PYTHONPATH=...] python -m parity ARGS`` command runs in this process, through
``parity.cli.main.main`` (what ``python -m parity`` calls), its words split as the shell splits
them, with the sys.path a fresh ``python -m parity`` there would have: the PYTHONPATH entries, not
this checkout's tests/ folder, and none of its modules already imported. Any other command runs
through bash with this environment's Python first on the PATH. A Python start with torch costs
2-3 CPU-seconds, eighteen of them here; the process entry points are run by
tests/test_cli_exit_status.py, tests/test_run_trust.py and tests/test_wheel.py.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
DOCUMENTS = [README, *PAGES]
RUNNABLE = re.compile(r"^<!-- runnable -->\n```sh\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def runnable_blocks() -> list[tuple[str, int, list[str]]]:
    """(document, block number, commands) for every runnable block, in document order."""
    found = []
    for document in DOCUMENTS:
        for number, block in enumerate(RUNNABLE.findall(document.read_text(encoding="utf-8"))):
            commands = [line for line in block.replace("\\\n", " ").splitlines()
                        if line.strip() and not line.lstrip().startswith("#")]
            found.append((document.relative_to(REPO).as_posix(), number, commands))
    return found


BLOCKS = runnable_blocks()


def test_the_readme_is_a_front_door_to_every_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    linked = {target.split("#")[0] for target in LINK.findall(text)}
    assert {f"docs/{page.name}" for page in PAGES} <= linked, "a docs page the README does not link"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(document):
    broken = []
    for target in LINK.findall(document.read_text(encoding="utf-8")):
        path = target.split("#")[0]
        if not path or re.match(r"[a-z]+:", path):
            continue  # an anchor of the same page, or a URL
        if not (document.parent / path).exists():
            broken.append(target)
    assert broken == []


def test_the_user_documents_hold_runnable_commands():
    assert {document for document, _, _ in BLOCKS} >= {"README.md", "docs/walkthrough.md",
                                                       "docs/profile-and-bench.md"}
    assert all(commands for _, _, commands in BLOCKS)


def _expected(command: str) -> tuple[int, str | None]:
    comment = command.partition("  #")[2]
    status = re.search(r"\bexit (\d+)", comment)
    holds = re.search(r"PARITY HOLDS: \d+/\d+ tensors", comment)
    return (int(status.group(1)) if status else 0), (holds.group(0) if holds else None)


def in_process(command: str) -> tuple[list[str], list[str]] | None:
    """(PYTHONPATH entries, argv) of a ``[PYTHONPATH=...] python -m parity ARGS  # comment``
    command, split as the shell splits it; None for any other command."""
    try:
        words = shlex.split(command.partition("  #")[0])
    except ValueError:
        return None
    path: list[str] = []
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        if name != "PYTHONPATH" or "$" in value:
            return None
        path = [entry for entry in value.split(os.pathsep) if entry]
    if words[:3] != ["python", "-m", "parity"] or any(set(word) & set("$`|;&<>*?") for word in words):
        return None
    return path, words[3:]


def test_commands_split_as_the_shell_splits_them():
    assert in_process("PYTHONPATH=tests python -m parity compare --bundle 'a b' --impl triton   # exit 1") == (
        ["tests"], ["compare", "--bundle", "a b", "--impl", "triton"])
    assert in_process("python -m parity --version") == ([], ["--version"])
    for shell_only in ("python -m parity show b | head", "X=1 python -m parity show b", "python -m parity show $B",
                       "python -c 'print(1)'", "torchrun -m parity compare --bundle b"):
        assert in_process(shell_only) is None, shell_only


def _on_a_thread_of_its_own(main, argv: list[str]) -> int:
    """``main(argv)`` on a new thread, its Python stack starting empty as a process's does. Under
    pytest the main thread's stack is some 80 frames deep already; CPython 3.11 frees a chunk of
    its frame stack whenever a call returns below the chunk's start and allocates it again on the
    next call, and the Triton interpreter's calls crossed such an edge millions of times: a README
    compare took 16 s of user and 14 s of system time (2 million page faults) there, 13 s and
    0.4 s on a thread of its own, as in a process of its own."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(main(argv)), name="docs-command")
    thread.start()
    thread.join()
    assert result, f"parity {' '.join(argv)}: main raised instead of returning a status (traceback above)"
    return result[0]


def _run_in_process(argv: list[str], path: list[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    from parity.cli.main import main

    tests_folder = str(REPO / "tests")
    own_modules = {name for name, module in sys.modules.items()
                   if str(getattr(module, "__file__", None) or "").startswith(tests_folder + os.sep)}
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        # python -m parity's sys.path: PYTHONPATH first (the current directory it would put first
        # is taken off by parity/__main__.py), then the interpreter's own; the modules of this
        # checkout's tests/ were imported through pytest's entry, not through the document's.
        patch.setattr(sys, "path", [str(cwd / entry) for entry in path] + [
            entry for entry in sys.path if entry and os.path.realpath(entry) != os.path.realpath(tests_folder)])
        for name in own_modules:
            patch.delitem(sys.modules, name)
        if path:
            patch.setenv("PYTHONPATH", os.pathsep.join(str(cwd / entry) for entry in path))
        else:
            patch.delenv("PYTHONPATH", raising=False)
        capsys.readouterr()
        status = _on_a_thread_of_its_own(main, argv)
        captured = capsys.readouterr()
        for name in [name for name in sys.modules if name not in own_modules and str(
                getattr(sys.modules[name], "__file__", None) or "").startswith(str(cwd) + os.sep)]:
            del sys.modules[name]  # the document's own imports (through the scratch folder) go with it
    return status, captured.out, captured.err


@pytest.mark.slow
@pytest.mark.parametrize("document,number,commands", BLOCKS, ids=[f"{d}-{n}" for d, n, _ in BLOCKS])
def test_runnable_commands_run_as_written(document, number, commands, tmp_path, monkeypatch, capsys):
    for name in ("golden", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # only what the document's own lines set
    for command in commands:
        status, holds = _expected(command)
        parts = in_process(command)
        if parts is not None:
            returncode, stdout, stderr = _run_in_process(parts[1], parts[0], tmp_path, monkeypatch, capsys)
        else:
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
        assert returncode == status, f"{command}\n{stdout[-2000:]}\n{stderr[-3000:]}"
        if holds is not None:
            assert holds in stdout, f"{command}\n{stdout[-2000:]}"


def test_in_process_a_module_of_tests_is_found_only_through_the_commands_pythonpath(tmp_path, monkeypatch, capsys):
    """What a fresh ``python -m parity`` would do: a subject module in tests/ is not found without
    ``PYTHONPATH=tests`` (although this process imported it from there), and is with it."""
    import repeat_subject  # noqa: F401  (imported here first: the in-process run must not reuse it)

    (tmp_path / "tests").symlink_to(REPO / "tests")
    argv = ["capture", "--subject", "repeat_subject:make_subject", "--bundle", "rep", "--quiet"]
    status, _, err = _run_in_process(argv, [], tmp_path, monkeypatch, capsys)
    assert status == 2 and "repeat_subject" in err and not (tmp_path / "rep").exists()
    status, _, err = _run_in_process(argv, ["tests"], tmp_path, monkeypatch, capsys)
    assert status == 0 and (tmp_path / "rep" / "manifest.json").is_file(), err
