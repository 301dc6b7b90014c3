"""kernels.sass_schedule: which MUFU.EX2 can issue while a Hopper HGMMA group may still run, on
hand-written SASS listings (cuobjdump's format) whose answer is known: straight line, a wait
placed before the commit, a loop whose product crosses the back edge, a state that must travel
on from a loop header, a wait on one branch only, predicated waits, exits and branches, a branch
with a predicate operand, wait 1 of 2, and listings it must refuse. The compiled kernels are read
in tests/test_kernels_aot.py."""
from __future__ import annotations

import pytest

from parity.kernels.sass_schedule import exp2_overlap

HGMMA = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24"
COMMIT = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0"
EX2 = "MUFU.EX2 R3, R4"


def wait(n: int) -> str:
    return f"WARPGROUP.DEPBAR.LE gsb0, {n:#x}"


def sass(*lines: str) -> str:
    """A listing of one kernel; ``@0x40 BRA 0x20``-style lines keep their own address, given as
    ``(address, text)`` tuples; plain lines are numbered 0x0, 0x10, ... in order."""
    body, address = [], 0
    for line in (*lines, "EXIT"):
        if isinstance(line, tuple):
            address, line = line
        body.append(f"        /*{address:04x}*/                   {line} ;   /* 0x000000000000000000 */")
        body.append("                                                       /* 0x000fe20000000000 */")
        address += 0x10
    return "\n\tcode for sm_90a\n\t\tFunction : k\n\t.headerflags\t@\"EF_CUDA_SM90\"\n" + "\n".join(body) + "\n"


def counts(text: str) -> tuple[int, int, dict[int, int]]:
    result = exp2_overlap(text)
    return result.exp2, result.exp2_while_mma, result.waits


def test_straight_line_product_then_exp_then_wait():
    assert counts(sass(HGMMA, COMMIT, EX2, EX2, wait(0), EX2)) == (3, 2, {0: 1})


def test_exp_between_issue_and_commit_counts_as_overlapped():
    assert counts(sass(HGMMA, EX2, COMMIT, wait(0))) == (1, 1, {0: 1})


def test_a_wait_before_the_commit_does_not_cover_the_group_committed_after_it():
    assert counts(sass(HGMMA, wait(0), COMMIT, EX2, wait(0))) == (1, 1, {0: 2})


def test_wait_one_leaves_the_latest_group_running():
    assert counts(sass(COMMIT, COMMIT, wait(1), EX2, wait(0), EX2)) == (2, 1, {1: 1, 0: 1})


def test_a_group_left_running_at_the_loop_end_reaches_the_next_iteration():
    # body at 0x0: the exp before the wait runs while last iteration's group may still run
    loop = sass(EX2, COMMIT, "@P0 BRA 0x0", wait(0))
    assert counts(loop) == (1, 1, {0: 1})
    drained = sass(wait(0), EX2, COMMIT, "@P0 BRA 0x0", wait(0))
    assert counts(drained) == (1, 0, {0: 2})


def test_a_group_from_the_back_edge_reaches_the_loop_exit():
    # header 0x0 exits to 0x30; the body commits and jumps back: the exit sees the group
    text = sass("@P1 BRA 0x30", COMMIT, "BRA 0x0", EX2, wait(0))
    assert counts(text) == (1, 1, {0: 1})


def test_a_wait_on_one_branch_only_does_not_cover_the_join():
    text = sass(COMMIT, "@!P1 BRA 0x30", wait(0), EX2)
    assert counts(text) == (1, 1, {0: 1})
    both = sass(COMMIT, "@P1 BRA 0x40", wait(0), "BRA 0x50", wait(0), EX2)
    assert counts(both) == (1, 0, {0: 2})


def test_a_predicated_wait_may_not_execute():
    assert counts(sass(COMMIT, "@P2 " + wait(0), EX2, wait(0))) == (1, 1, {0: 2})


def test_a_predicated_exit_falls_through_and_an_unpredicated_one_ends_the_path():
    assert counts(sass(COMMIT, "@P3 EXIT", EX2, wait(0))) == (1, 1, {0: 1})
    # the code after a plain EXIT is reached only through the branch, which comes after the wait
    text = sass("@P0 BRA 0x40", COMMIT, wait(0), "EXIT", EX2)
    assert counts(text) == (1, 0, {0: 1})


@pytest.mark.parametrize("branch", ["BRA.U !UP0, 0x30", "BRA.DIV UR4, 0x30"])
def test_a_branch_with_an_operand_besides_its_target_is_conditional(branch):
    # BRA.U !UP0, target / BRA.DIV UR4, target: the path that does not branch (no wait) also
    # reaches the exp
    text = sass(COMMIT, branch, wait(0), EX2)
    assert counts(text) == (1, 1, {0: 1})


def test_an_exp_no_path_reaches_is_refused():
    with pytest.raises(ValueError, match="on no path from the kernel's entry"):
        exp2_overlap(sass(COMMIT, wait(0), "BRA 0x40", EX2))


@pytest.mark.parametrize("text, message", [
    (sass(COMMIT, "CALL.REL.NOINC 0x40", wait(0)), "unsupported control flow"),
    (sass(COMMIT, "BRXU UR4 -0x20", wait(0)), "unsupported control flow"),
    (sass(COMMIT, "JMXU UR4", wait(0)), "unsupported control flow"),
    (sass(COMMIT, "BRA 0x999"), "branch to an unknown address"),
    (sass(COMMIT, "WARPGROUP.DEPBAR.LE gsb1"), "unreadable wait"),
    (sass(EX2) + sass(EX2).replace("Function : k", "Function : j"), "expected the SASS of one kernel, got 2"),
    ("\n\tcode for sm_90a\n\t\tFunction : k\n", "no SASS instructions"),
])
def test_listings_it_cannot_read_with_confidence_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        exp2_overlap(text)


def test_exponentials_on_a_cycle_are_counted_as_in_a_loop():
    # a peeled exp before the loop (nothing issued yet), the loop's exp at 0x20 (overlapped by
    # the group the back edge carries), an exp after the loop (drained); then a spin loop that
    # holds no exp
    result = exp2_overlap(sass(EX2, "NOP", EX2, COMMIT, "@P0 BRA 0x10", wait(0), EX2))
    assert (result.exp2, result.exp2_while_mma, result.loop_exp2, result.loop_exp2_while_mma) == (3, 1, 1, 1)
    spin = exp2_overlap(sass(COMMIT, "@P0 BRA 0x10", EX2, wait(0)))  # the branch loops on itself
    assert (spin.loop_exp2, spin.loop_exp2_while_mma, spin.exp2_while_mma) == (0, 0, 1)


def test_to_dict_names_the_wait_counts_as_strings():
    assert exp2_overlap(sass(COMMIT, wait(1), EX2, wait(0))).to_dict() == {
        "exp2": 1, "exp2_while_mma": 1, "loop_exp2": 0, "loop_exp2_while_mma": 0, "waits": {"0": 1, "1": 1}}
