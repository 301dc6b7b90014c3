"""The case space and its drawers: bounds hold, every drawn case builds, edge cases are reachable,
the seeded fuzzer is deterministic, profiles are chosen as documented, and a shrunk failure
prints the command that reproduces it."""
import json
import re

import hypothesis  # noqa: F401  (kept loaded across pytester's in-process runs)
import pytest
from hypothesis import HealthCheck, find, given, settings

from parity.run import fuzz
from parity.base.errors import UsageError
from parity.run.fuzz import CPU_BOUNDS, GPU_BOUNDS, CaseBounds
from parity.testing.strategies import (
    PROFILES, attention_cases, block_sizes, case_bounds, head_counts, layout_specs, parity_settings,
    profile_name, seq_lengths,
)
from parity.run.subjects.attention import AttentionCase, AttentionSubject

pytest_plugins = ["pytester"]

ID = re.compile(r"B\d+-Hq\d+-Hkv\d+-Sq\d+-Sk\d+-D\d+-[a-z0-9-]+-(fp16|bf16|fp32)-s\d+")
# Drawing only: no kernels run here, so many examples cost little.
MANY = settings(max_examples=150, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
FIND = settings(max_examples=2000, derandomize=True, database=None)


@MANY
@given(case=attention_cases())
def test_drawn_cases_lie_inside_their_bounds_and_build(case):
    assert CPU_BOUNDS.admits(case), case
    assert ID.fullmatch(case.id), case.id
    assert AttentionCase.from_json(json.loads(json.dumps(case.to_json()))) == case
    layout = case.make_layout()
    assert (layout.seq_q, layout.seq_k, layout.block_m, layout.block_n) == (
        case.seq_q, case.seq_k, case.block_m, case.block_n)
    assert layout.batch_heads[0] in (1, case.batch) and layout.batch_heads[1] in (1, case.heads_q)


@MANY
@given(case=attention_cases("cpu", max_seq_q=8, max_seq_k=300, layouts=("window", "sink"), dtypes=("fp32",),
                            head_dims=(64,), block_sizes=(16,), max_tiles=64))
def test_bounds_are_arguments(case):
    assert case.seq_q <= 8 and case.layout in ("window", "sink") and case.dtype == "fp32"
    assert case.head_dim == 64 and case.block_m == case.block_n == 16
    assert CPU_BOUNDS.replace(max_tiles=64).tiles(case) <= 64


@pytest.mark.parametrize("description, condition", [
    ("Sq = 1", lambda c: c.seq_q == 1),
    ("Sk = 1 with Sq > 1", lambda c: c.seq_k == 1 and c.seq_q > 1),
    ("Sq not a multiple of the block, > 1 block", lambda c: c.seq_q > c.block_m and c.seq_q % c.block_m),
    ("Sq = Sk a multiple of the block", lambda c: c.seq_q == c.seq_k and c.seq_q % c.block_m == 0 and c.seq_q > 16),
    ("Sq != Sk", lambda c: c.seq_q != c.seq_k and min(c.seq_q, c.seq_k) > 1),
    ("GQA 8:1", lambda c: c.heads_q == 8 * c.heads_kv),
    ("GQA 4:2", lambda c: (c.heads_q, c.heads_kv) == (4, 2)),
    ("batch 2", lambda c: c.batch == 2),
    ("D = 96", lambda c: c.head_dim == 96),
    ("D = 256", lambda c: c.head_dim == 256),
    ("block 128 x 16", lambda c: (c.block_m, c.block_n) == (128, 16)),
    ("empty query block other than the first", lambda c: c.layout == "emptyrow" and c.empty_block > 0),
    ("sink with a sink block", lambda c: c.layout == "sink" and c.sink_blocks >= 1),
    ("window of 1", lambda c: c.layout == "window" and c.window == 1),
    ("random density strictly between 0 and 1", lambda c: c.layout == "random" and 0 < c.density < 1),
    ("dense", lambda c: c.layout == "dense"),
    ("bf16", lambda c: c.dtype == "bf16"),
])
def test_edge_cases_are_reachable(description, condition):
    found = find(attention_cases(), condition, settings=FIND)
    assert condition(found), description


def test_the_gpu_bounds_draw_larger_cases_and_still_bound_the_reference():
    cases = [AttentionCase.from_json(case) for case in fuzz.draw_cases(200, seed=0, bounds="gpu")]
    assert all(GPU_BOUNDS.admits(case) for case in cases)
    assert max(case.seq_q for case in cases) > 1024 and max(case.heads_q for case in cases) > 8
    assert all(case.batch * case.heads_q * case.seq_q * case.seq_k <= 2**27 for case in cases)
    assert case_bounds("gpu") == GPU_BOUNDS and case_bounds("ci") == CPU_BOUNDS


def test_component_strategies():
    assert find(seq_lengths(200, 64), lambda n: n == 129, settings=FIND) == 129
    assert find(seq_lengths(200, 64), lambda n: n == 1, settings=FIND) == 1
    assert find(block_sizes(), lambda b: b == 128, settings=FIND) == 128
    q, kv = find(head_counts(), lambda h: h[0] == 8 * h[1], settings=FIND)
    assert q == 8 * kv
    spec = find(layout_specs(kinds=("blockmask",)), lambda s: len(s.empty_rows) >= 1, settings=FIND)
    assert not spec.block_mask()[:, :, list(spec.empty_rows)].any()
    with pytest.raises(UsageError, match="block sizes need 16 <= min_size"):
        block_sizes(8)


# ---- the seeded fuzzer -----------------------------------------------------------------------------


def test_draw_cases_is_a_pure_function_of_n_seed_and_bounds():
    first = fuzz.draw_cases(12, seed=5)
    assert fuzz.draw_cases(12, seed=5) == first
    assert fuzz.draw_cases(12, seed=6) != first
    assert fuzz.draw_cases(5, seed=5) == first[:5]  # a prefix: more cases extend, never reshuffle
    assert len({AttentionCase.from_json(case).id for case in first}) == 12
    json.dumps(first, allow_nan=False)
    subject = AttentionSubject(cases=first)  # what capture --subject attention --arg cases=... builds
    assert [case.to_json() for case in subject.cases] == first


def test_draw_cases_rejects_bad_arguments():
    with pytest.raises(UsageError, match="positive int"):
        fuzz.draw_cases(0)
    with pytest.raises(UsageError, match="unknown case bounds 'tpu'"):
        fuzz.draw_cases(1, bounds="tpu")
    with pytest.raises(UsageError, match="could not draw 5 distinct cases"):
        fuzz.draw_cases(5, bounds=CaseBounds(max_batch=1, max_heads_kv=1, max_heads_q=1, max_seq_q=1, max_seq_k=1,
                                             head_dims=(16,), block_sizes=(16,), layouts=("causal",),
                                             dtypes=("fp16",), max_seed=1))
    with pytest.raises(UsageError, match="powers of two >= 16"):
        CaseBounds(block_sizes=(8,))
    with pytest.raises(UsageError, match="head dims \\[24\\] are not supported"):
        CaseBounds(head_dims=(24,))


def test_fuzz_cli_draws_and_checks_one_case(capsys):
    assert fuzz.main(["draw", "3", "--seed", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == fuzz.draw_cases(3, seed=1)
    case = AttentionCase(1, 2, 1, 20, 20, 16, layout="causal", dtype="fp16", block_m=16, block_n=16)
    assert fuzz.main(["check", "--case", fuzz.case_json(case)]) == 0
    assert capsys.readouterr().out.startswith(f"{case.id}: pass: kernel max abs err")
    assert fuzz.main(["check", "--case", "{not json"]) == 2
    assert "--case is not JSON" in capsys.readouterr().err
    assert fuzz.main(["check", "--case", '{"batch": 1}']) == 2


# ---- profiles ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("environ, expected", [
    ({}, "local"),
    ({"CI": "true"}, "ci"),
    ({"CI": "0"}, "local"),
    ({"CI": "1", "PARITY_HYPOTHESIS_PROFILE": "gpu"}, "gpu"),
    ({"PARITY_HYPOTHESIS_PROFILE": "parity-ci"}, "ci"),
])
def test_profile_is_chosen_by_environment(environ, expected):
    assert profile_name(environ) == expected


def test_profiles_have_no_deadline_and_ci_is_derandomized():
    for name in PROFILES:
        assert parity_settings(name).deadline is None
        assert parity_settings(name).print_blob
    ci = parity_settings("ci")
    assert ci.derandomize and ci.database is None and 15 <= ci.max_examples <= 25
    assert parity_settings("gpu").max_examples > ci.max_examples
    assert parity_settings("ci", max_examples=3).max_examples == 3
    with pytest.raises(UsageError, match="PARITY_HYPOTHESIS_PROFILE='fast': unknown profile"):
        profile_name({"PARITY_HYPOTHESIS_PROFILE": "fast"})


def test_max_examples_from_the_environment_keeps_each_tests_ratio(monkeypatch):
    monkeypatch.setenv("PARITY_HYPOTHESIS_MAX_EXAMPLES", "30")
    gpu = parity_settings("gpu")
    assert gpu.max_examples == 30 and gpu.deadline is None
    assert parity_settings("gpu", max_examples=2 * 200).max_examples == 60
    assert parity_settings("ci", max_examples=10).max_examples == 15  # 10/20 of 30
    for bad in ("0", "many"):
        monkeypatch.setenv("PARITY_HYPOTHESIS_MAX_EXAMPLES", bad)
        with pytest.raises(UsageError, match=f"PARITY_HYPOTHESIS_MAX_EXAMPLES='{bad}': expected a positive integer"):
            parity_settings("ci")


def test_a_shrunk_failure_prints_the_command_that_reproduces_it(pytester):
    pytester.makepyfile('''
from hypothesis import given
from parity.testing.strategies import attention_cases, note_case, parity_settings

@parity_settings("ci", max_examples=50)
@given(case=attention_cases())
def test_long_sequences_fail(case):
    note_case(case)
    assert case.seq_q < 20
''')
    result = pytester.runpytest("-p", "no:cacheprovider", "--parity-impl", "triton")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    lines = [line.removeprefix("E").strip() for line in text.splitlines()]
    line = next(line for line in lines if line.startswith("reproduce: "))
    # Shrunk to the smallest failing case, and the command names it exactly.
    case = AttentionCase.from_json(json.loads(line.split("--case ", 1)[1].strip("'")))
    assert case.seq_q == 20 and (case.batch, case.heads_q, case.heads_kv) == (1, 1, 1), case.id
    assert f"case {case.id}" in text
    assert line == f"reproduce: python -m parity.run.fuzz check --case '{fuzz.case_json(case)}'"
    assert "@reproduce_failure" in text or "derandomize" in text  # print_blob, or the ci profile's replay


def test_a_parity_profile_can_be_named_on_the_command_line(pytester):
    pytester.makepyfile('''
from parity.testing.strategies import GPU_BOUNDS, case_bounds, parity_settings, profile_name

def test_profile():
    assert profile_name() == "gpu"
    assert case_bounds() == GPU_BOUNDS and parity_settings().max_examples == 200
''')
    before = hypothesis.settings.get_current_profile_name()
    try:
        # The plugin registers the parity profiles before Hypothesis' plugin loads the named one.
        result = pytester.runpytest("-p", "no:cacheprovider", "--hypothesis-profile", "parity-gpu")
    finally:
        hypothesis.settings.load_profile(before)  # an in-process run loads it for this process too
    result.assert_outcomes(passed=1)
