"""The user documents: README.md is a front door to docs/, every link resolves, and the commands
marked runnable run as written.

A fenced ``sh`` block directly after a ``<!-- runnable -->`` line runs on a CPU: each command
(continuation lines joined) runs through bash in a scratch folder laid out as the checkout's root
(``golden/`` and ``tests/`` linked), with this environment's Python first on the PATH. A command
whose comment says ``exit N`` must end with that status, others with 0; one whose comment quotes
``PARITY HOLDS: k/n tensors`` must print exactly that. Blocks for a GPU host (``--device cuda``)
are not marked; docs/distributed.md's torchrun commands are run by tests/test_distributed.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
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


@pytest.mark.slow
@pytest.mark.parametrize("document,number,commands", BLOCKS, ids=[f"{d}-{n}" for d, n, _ in BLOCKS])
def test_runnable_commands_run_as_written(document, number, commands, tmp_path):
    for name in ("golden", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # only what the document's own lines set
    for command in commands:
        status, holds = _expected(command)
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == status, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        if holds is not None:
            assert holds in done.stdout, f"{command}\n{done.stdout[-2000:]}"
