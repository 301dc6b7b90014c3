"""Whether a kernel's exponentials can run while its Hopper matrix products do, read from the
machine code (SASS) the GPU runs.

On sm_90 a warpgroup matrix product is asynchronous. In SASS its ``HGMMA`` instructions issue
one after another, the last of a group carries ``gsb0`` (the group is committed), and
``WARPGROUP.DEPBAR.LE gsb0, N`` blocks until at most N committed groups are still running.
FlashAttention-3 keeps a product running while the same warps compute the softmax (``MUFU.EX2``).
``exp2_overlap`` follows the number of groups that may be running (committed and not yet waited
for, or issued and not yet committed) through the listing's control flow, a forward dataflow
over instructions that takes the maximum where paths meet, and counts the ``MUFU.EX2`` issued
while it is above zero.

It reads SASS, not PTX, because ptxas schedules: it moves unrelated instructions, exponentials
included, past a wait that the PTX places before them. Static and compile-only: it says what the
machine code's order allows on some path, not how often or how long the hardware overlaps.
"""
from __future__ import annotations

import collections
import dataclasses
import re

__all__ = ["Exp2Overlap", "exp2_overlap"]

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_CAP = 64  # more running groups than any kernel issues; bounds the dataflow


@dataclasses.dataclass(frozen=True)
class Exp2Overlap:
    exp2: int  # MUFU.EX2 instructions in the kernel
    exp2_while_mma: int  # of them, those some path reaches while an HGMMA group may still run
    waits: dict[int, int]  # WARPGROUP.DEPBAR.LE gsb0, N -> how many times N appears
    # The same two counts for the exponentials inside a loop (on a cycle of the control flow):
    # the key loop's, which run once per key tile, apart from a tile peeled out of it.
    loop_exp2: int
    loop_exp2_while_mma: int

    def to_dict(self) -> dict:
        return {"exp2": self.exp2, "exp2_while_mma": self.exp2_while_mma,
                "loop_exp2": self.loop_exp2, "loop_exp2_while_mma": self.loop_exp2_while_mma,
                "waits": {str(n): count for n, count in sorted(self.waits.items())}}


@dataclasses.dataclass(frozen=True)
class _Op:
    address: int
    predicate: str | None  # "@P0", "@!P1", "@UPT"...; None when the instruction always executes
    opcode: str
    operands: str

    @property
    def always(self) -> bool:
        return self.predicate in (None, "@PT", "@UPT")


def _instructions(sass: str) -> list[_Op]:
    """The one kernel of a ``cuobjdump -sass`` listing, in address order."""
    if sass.count("Function :") != 1:
        raise ValueError(f"expected the SASS of one kernel, got {sass.count('Function :')} functions")
    ops = [_Op(int(address, 16), predicate or None, opcode, operands.strip())
           for address, predicate, opcode, operands in _INSTRUCTION.findall(sass)]
    if not ops:
        raise ValueError("no SASS instructions in the listing")
    return ops


def _pending(op: _Op) -> int:
    """N of a ``WARPGROUP.DEPBAR.LE gsb0, N`` wait."""
    pending = re.search(r"gsb0\s*,\s*(0x[0-9a-f]+|\d+)", op.operands)
    if pending is None:
        raise ValueError(f"unreadable wait at {op.address:#x}: {op.opcode} {op.operands}")
    return int(pending.group(1), 0)


def _step(state: tuple[int, bool], op: _Op) -> tuple[int, bool]:
    """(committed groups that may be running, whether an uncommitted group is open) after ``op``.
    A predicated wait may not execute, so it lowers nothing (what may run, may still run)."""
    running, open_group = state
    if op.opcode.startswith("HGMMA"):
        if re.search(r"\bgsb0\b", op.operands):
            return min(running + 1, _CAP), False
        return running, True
    if op.opcode.startswith("WARPGROUP.DEPBAR") and op.always:
        return min(running, _pending(op)), open_group
    return state


def _successors(ops: list[_Op], index: dict[int, int], i: int) -> list[int]:
    op = ops[i]
    base = op.opcode.split(".")[0]
    if base.startswith(("CALL", "BRX", "JMX", "JMP")):  # Triton inlines everything; these would hide code
        raise ValueError(f"unsupported control flow at {op.address:#x}: {op.opcode} {op.operands}")
    following = [i + 1] if i + 1 < len(ops) else []
    if base == "BRA":
        target = re.findall(r"0x[0-9a-f]+", op.operands)
        if not target or int(target[-1], 16) not in index:
            raise ValueError(f"branch to an unknown address at {op.address:#x}: {op.operands}")
        jump = [index[int(target[-1], 16)]]
        # conditional: a guard predicate (@P0 BRA), or any operand besides the target (a predicate,
        # BRA.U !UP0, 0x...; a divergence test, BRA.DIV UR4, 0x...)
        conditional = not op.always or "," in op.operands
        return jump + following if conditional else jump
    if base in ("EXIT", "RET") and op.always:
        return []
    return following


def exp2_overlap(sass: str) -> Exp2Overlap:
    """Count ``MUFU.EX2`` and those that can issue while an HGMMA group runs, over every path
    through the kernel's SASS (``cuobjdump -sass`` of its cubin). A ValueError where the listing
    cannot be read with confidence: not one kernel, calls or indirect branches, or an exponential
    that no path reaches (the reading would have missed a way in)."""
    ops = _instructions(sass)
    index = {op.address: i for i, op in enumerate(ops)}
    states: list[tuple[int, bool] | None] = [None] * len(ops)  # before each instruction
    states[0] = (0, False)
    successors: list[list[int]] = [[] for _ in ops]  # filled for the instructions a path reaches
    work = collections.deque([0])
    while work:  # states only grow and are bounded: a fixpoint
        i = work.popleft()
        after = _step(states[i], ops[i])
        successors[i] = _successors(ops, index, i)
        for j in successors[i]:
            old = states[j]
            new = after if old is None else (max(old[0], after[0]), old[1] or after[1])
            if new != old:
                states[j] = new
                work.append(j)
    on_cycle = _on_cycle(successors)
    exp2 = while_mma = loop_exp2 = loop_while_mma = 0
    waits: collections.Counter[int] = collections.Counter()
    for i, (op, state) in enumerate(zip(ops, states)):
        if op.opcode.startswith("MUFU.EX2"):
            if state is None:
                raise ValueError(f"MUFU.EX2 at {op.address:#x} is on no path from the kernel's entry")
            overlapped = state[0] > 0 or state[1]
            exp2 += 1
            while_mma += overlapped
            loop_exp2 += on_cycle[i]
            loop_while_mma += on_cycle[i] and overlapped
        elif op.opcode.startswith("WARPGROUP.DEPBAR") and state is not None:
            waits[_pending(op)] += 1
    return Exp2Overlap(exp2, while_mma, dict(waits), loop_exp2, loop_while_mma)


def _on_cycle(successors: list[list[int]]) -> list[bool]:
    """Whether each node lies on a cycle: its strongly connected component (Tarjan's algorithm,
    without recursion) has more than one node, or it is its own successor."""
    count = len(successors)
    order, low = [-1] * count, [0] * count
    stack, on_stack, result = [], [False] * count, [False] * count
    counter = 0
    for root in range(count):
        if order[root] != -1:
            continue
        frames = [(root, 0)]
        order[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while frames:
            node, edge = frames[-1]
            if edge < len(successors[node]):
                frames[-1] = (node, edge + 1)
                nxt = successors[node][edge]
                if order[nxt] == -1:
                    order[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack[nxt] = True
                    frames.append((nxt, 0))
                elif on_stack[nxt]:
                    low[node] = min(low[node], order[nxt])
                continue
            frames.pop()
            if frames:
                low[frames[-1][0]] = min(low[frames[-1][0]], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    component.append(member)
                    if member == node:
                        break
                cyclic = len(component) > 1 or node in successors[node]
                for member in component:
                    result[member] = cyclic
    return result
