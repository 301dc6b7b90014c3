"""Whether a kernel's exponentials can run while its Hopper matrix products do, read from PTX.

On sm_90 a warpgroup matrix product is asynchronous: ``wgmma.mma_async`` instructions are issued,
``wgmma.commit_group`` closes them into a group, and ``wgmma.wait_group N`` blocks until at most
the N most recent groups are still running. FlashAttention-3 keeps a product running while the
same warps compute the softmax (its ``ex2`` instructions); that needs a wait with N > 0 between
them. ``exp2_overlap`` follows the count of groups that may be running through the PTX's
control-flow graph (a forward dataflow, the maximum over a block's predecessors) and counts the
``ex2`` instructions issued while it is above zero. Static and compile-only: it says what the
code allows, not how the hardware schedules it.
"""
from __future__ import annotations

import collections
import dataclasses
import re

__all__ = ["Exp2Overlap", "exp2_overlap"]

_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"^(@!?%\w+\s+)?bra(?:\.uni)?\s+(\$L__BB\d+_\d+)\s*;")
_PREDICATE = re.compile(r"^@!?%\w+\s+")
_CAP = 64  # more running groups than any kernel issues; bounds the dataflow


@dataclasses.dataclass(frozen=True)
class Exp2Overlap:
    exp2: int  # ex2 instructions in the code
    exp2_while_mma: int  # of them, those reachable while a wgmma group may still be running
    waits: dict[int, int]  # wgmma.wait_group N -> how many times N appears

    def to_dict(self) -> dict:
        return {"exp2": self.exp2, "exp2_while_mma": self.exp2_while_mma,
                "waits": {str(n): count for n, count in sorted(self.waits.items())}}


def _blocks(ptx: str) -> list[tuple[str, list[str]]]:
    """Basic blocks by LLVM's ``$L__BB`` labels (labels inside inline assembly, such as an
    mbarrier's wait loop, stay inside their block), comments and blank lines dropped."""
    blocks: list[tuple[str, list[str]]] = [("entry", [])]
    for line in ptx.splitlines():
        text = line.split("//", 1)[0].strip()
        label = _LABEL.match(text)
        if label:
            blocks.append((label.group(1), []))
        elif text:
            blocks[-1][1].append(text)
    return blocks


def _step(state: tuple[int, bool], text: str) -> tuple[int, bool]:
    """(groups that may be running, whether a group is open) after one instruction."""
    running, open_group = state
    op = _PREDICATE.sub("", text)
    if op.startswith("wgmma.mma_async"):
        if not open_group:
            return min(running + 1, _CAP), True
    elif op.startswith("wgmma.commit_group"):
        return running, False
    elif op.startswith("wgmma.wait_group"):
        pending = int(re.findall(r"\d+", op.split(None, 1)[1])[0])
        return min(running, pending), open_group
    return state


def _join(a: tuple[int, bool] | None, b: tuple[int, bool]) -> tuple[int, bool]:
    return b if a is None else (max(a[0], b[0]), a[1] or b[1])


def exp2_overlap(ptx: str) -> Exp2Overlap:
    """Count ``ex2`` instructions and those that can issue while a wgmma group is running, over
    every path through ``ptx`` (one kernel's PTX)."""
    blocks = _blocks(ptx)
    index = {name: i for i, (name, _) in enumerate(blocks)}
    entry: list[tuple[int, bool] | None] = [None] * len(blocks)
    entry[0] = (0, False)
    work = collections.deque([0])
    while work:  # forward dataflow to a fixpoint; states only grow and are bounded
        i = work.popleft()
        state = entry[i]
        falls_through = True
        for text in blocks[i][1]:
            branch = _BRANCH.match(text)
            if branch:
                target = index[branch.group(2)]
                joined = _join(entry[target], state)
                if joined != entry[target]:
                    entry[target] = joined
                    work.append(target)
                if not branch.group(1):  # unconditional: nothing after it runs
                    falls_through = False
                    break
                continue
            if _PREDICATE.sub("", text).startswith("ret"):
                falls_through = False
                break
            state = _step(state, text)
        if falls_through and i + 1 < len(blocks):
            joined = _join(entry[i + 1], state)
            if joined != entry[i + 1]:
                entry[i + 1] = joined
                work.append(i + 1)
    exp2 = while_mma = 0
    waits: collections.Counter[int] = collections.Counter()
    for i, (_, lines) in enumerate(blocks):
        state = entry[i]
        for text in lines:
            op = _PREDICATE.sub("", text)
            if op.startswith("ex2."):
                exp2 += 1
                while_mma += state is not None and (state[0] > 0 or state[1])
            elif op.startswith("wgmma.wait_group"):
                waits[int(re.findall(r"\d+", op.split(None, 1)[1])[0])] += 1
            if state is not None:
                state = _step(state, text)
    return Exp2Overlap(exp2, while_mma, dict(waits))
