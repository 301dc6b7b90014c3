"""kernels.ptx_schedule: which ex2 instructions can issue while a Hopper wgmma group still runs,
on hand-written PTX whose answer is known (straight line, a loop whose product crosses the back
edge, a wait on one branch only, wait_group 1 of 2, unreachable code, inline-assembly labels).
The compiled kernels are read in tests/test_kernels_aot.py."""
from __future__ import annotations

import pytest

from parity.kernels.ptx_schedule import exp2_overlap

MMA = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1, %f2}, %rd1, %rd2, 1, 1, 1, 0, 0;"
COMMIT = "wgmma.commit_group.sync.aligned;"
EX2 = "ex2.approx.ftz.f32 %f3, %f4;"


def wait(n: int) -> str:
    return f"wgmma.wait_group.sync.aligned {n};"


def ptx(*lines: str) -> str:
    return "\n".join([".visible .entry k(", ")", "{", *lines, "ret;", "}"])


def counts(text: str) -> tuple[int, int, dict[int, int]]:
    result = exp2_overlap(text)
    return result.exp2, result.exp2_while_mma, result.waits


def test_straight_line_product_then_exp_then_wait():
    assert counts(ptx(MMA, MMA, COMMIT, EX2, EX2, wait(0), EX2)) == (3, 2, {0: 1})


def test_exp_between_issue_and_commit_counts_as_overlapped():
    assert counts(ptx(MMA, EX2, COMMIT, wait(0))) == (1, 1, {0: 1})


def test_wait_group_one_leaves_the_latest_group_running():
    # two groups; wait 1 leaves one running; wait 0 drains it
    text = ptx(MMA, COMMIT, MMA, COMMIT, wait(1), EX2, wait(0), EX2)
    assert counts(text) == (2, 1, {1: 1, 0: 1})


def test_a_group_left_running_at_the_loop_end_reaches_the_next_iteration():
    # the shape of Triton's attention loop if the exp came before the next wait: the P @ V group
    # committed at the end of the body is still running when the back edge reaches the header
    loop = ptx(
        "$L__BB0_1:",
        EX2,  # runs while last iteration's group may run (not on the first entry)
        MMA, COMMIT,
        "@%p1 bra $L__BB0_1;",
        wait(0),
    )
    assert counts(loop) == (1, 1, {0: 1})
    # with the wait at the top of the body, nothing overlaps
    drained = ptx("$L__BB0_1:", wait(0), EX2, MMA, COMMIT, "@%p1 bra $L__BB0_1;", wait(0))
    assert counts(drained) == (1, 0, {0: 2})


def test_a_group_from_the_back_edge_reaches_the_loop_exit():
    # the header's state changes only once the back edge is seen, and must flow on to the exit
    text = ptx(
        "$L__BB0_1:",
        "@%p1 bra $L__BB0_3;",
        "$L__BB0_2:",
        MMA, COMMIT,
        "bra.uni $L__BB0_1;",
        "$L__BB0_3:",
        EX2,
        wait(0),
    )
    assert counts(text) == (1, 1, {0: 1})


def test_a_wait_on_one_branch_only_does_not_cover_the_join():
    text = ptx(
        MMA, COMMIT,
        "@%p1 bra $L__BB0_2;",
        wait(0),
        "$L__BB0_2:",
        EX2,  # reached from the branch without the wait
    )
    assert counts(text) == (1, 1, {0: 1})
    both = ptx(MMA, COMMIT, "@%p1 bra $L__BB0_2;", wait(0), "bra.uni $L__BB0_3;", "$L__BB0_2:", wait(0),
               "$L__BB0_3:", EX2)
    assert counts(both) == (1, 0, {0: 2})


def test_code_after_an_unconditional_branch_is_unreachable():
    text = ptx(
        MMA, COMMIT,
        "bra.uni $L__BB0_3;",
        "$L__BB0_2:",
        EX2,  # no path reaches this block: counted, never as overlapped
        "$L__BB0_3:",
        wait(0),
        EX2,
    )
    assert counts(text) == (2, 0, {0: 1})


def test_inline_assembly_labels_and_comments_do_not_split_blocks():
    # Triton's mbarrier wait is an inline-assembly loop with its own label and branch
    text = ptx(
        MMA, COMMIT,
        "{",
        ".reg .pred P1;",
        "waitLoop:",
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%r1], %r2;",
        "@!P1 bra waitLoop;",
        "}",
        "// ex2.approx.f32 in a comment is not an instruction",
        EX2,
        wait(0),
    )
    assert counts(text) == (1, 1, {0: 1})


@pytest.mark.parametrize("op", ["ex2.approx.f32 %f1, %f2;", "@%p3 ex2.approx.ftz.f32 %f1, %f2;"])
def test_predicated_and_plain_ex2_are_both_counted(op):
    assert counts(ptx(MMA, COMMIT, op, wait(0))) == (1, 1, {0: 1})


def test_to_dict_names_the_wait_counts_as_strings():
    assert exp2_overlap(ptx(MMA, COMMIT, wait(1), EX2, wait(0))).to_dict() == {
        "exp2": 1, "exp2_while_mma": 1, "waits": {"0": 1, "1": 1}}
