"""Subjects: the protocol loader and its errors, the attention case sets, the decoder, determinism."""
import re

import pytest
import torch

from parity.base.errors import UsageError
from parity.run.subjects import Inputs, SubjectRunner, load_subject, runner_from_manifest
from parity.run.subjects.attention import CASE_SETS, AttentionCase, AttentionSubject

EXAMPLE = "user_subject_example:make_subject"


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# ---- loader -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    ("nope", r"unknown subject 'nope'; use a built-in \(attention, decoder\) or package\.module:factory"),
    ("a:b:c", r"bad subject spec 'a:b:c'"),
    (":factory", r"bad subject spec ':factory'"),
    ("no_such_package_xyz.mod:make", r"cannot import subject module 'no_such_package_xyz\.mod'.*ModuleNotFoundError"),
    ("user_subject_example:missing", r"subject module 'user_subject_example' has no attribute 'missing'"),
    ("user_subject_example:NOT_CALLABLE", r"subject factory 'user_subject_example:NOT_CALLABLE' is a int, not callable"),
    ("user_subject_example:returns_wrong_type", r"returned a int without make_inputs, build"),
])
def test_loader_errors_name_the_spec(spec, message):
    with pytest.raises(UsageError, match=message) as info:
        load_subject(spec)
    assert "\n" not in str(info.value)


def test_loader_rejects_arguments_the_factory_does_not_take(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match=r"subject 'decoder' takes no argument cases; it takes vocab, d_model, layers, "):
        load_subject("decoder", {"cases": "default"})
    # Only the arguments it does not take are named; a missing required one is said as such.
    (tmp_path / "needs_width.py").write_text("def make(width, *, depth=2):\n    raise AssertionError('not called')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError) as info:
        load_subject("needs_width:make", {"width": 4, "depht": 3, "colour": 1})
    assert str(info.value) == "subject 'needs_width:make' takes no argument colour, depht; it takes width, depth"
    with pytest.raises(UsageError) as info:
        load_subject("needs_width:make", {"depth": 3})
    assert str(info.value) == "subject 'needs_width:make': missing a required argument: 'width'"


def test_user_subject_round_trips_through_its_description():
    runner = load_subject(EXAMPLE, {"dim": 8})
    assert runner.name == "tiny-gated-mlp"
    assert runner.describe() == {"spec": EXAMPLE, "name": "tiny-gated-mlp",
                                 "args": {"dim": 8, "batch": 3, "seed": 0, "dtype": "fp32"}}
    with pytest.raises(UsageError, match=r"names subject 'user_subject_example:make_subject', which this host "
                                         r"does not trust; pass --subject user_subject_example:make_subject"):
        runner_from_manifest(runner.describe())  # a manifest alone never chooses code to import
    again = runner_from_manifest(runner.describe(), trusted=[EXAMPLE])
    assert again.args == runner.args
    assert _same_bits(again.make_inputs().tensors["x"], runner.make_inputs().tensors["x"])


def test_unknown_impl_is_a_usage_error():
    runner = load_subject(EXAMPLE)
    with pytest.raises(UsageError, match=r"subject tiny-gated-mlp has no implementation 'triton'; choose from reference, tanh"):
        runner.build("triton", state=None)


def test_minimal_subject_stores_the_built_weights_and_the_compare_host_loads_them():
    runner = load_subject("user_subject_example:make_minimal")
    assert runner.impls is None and runner.reference_impl == "reference"
    state = runner.make_state("reference")  # no make_state: the built module's (random) weights
    inputs = runner.make_inputs()
    first = runner.run(runner.build("reference", state=state), inputs)
    second = runner.run(runner.build("reference", state=state), inputs)  # a fresh random init, overwritten
    assert _same_bits(first, second)


def test_state_that_does_not_fit_is_a_usage_error():
    runner = load_subject(EXAMPLE)
    state = runner.make_state()
    state.pop("head.bias")
    with pytest.raises(UsageError, match=r"stored state does not fit .* missing head\.bias"):
        runner.build("reference", state=state)
    state = runner.make_state()
    state["head.bias"] = torch.zeros(99)
    with pytest.raises(UsageError, match=r"stored state does not fit subject tiny-gated-mlp"):
        runner.build("reference", state=state)


def test_inputs_made_off_the_cpu_or_not_tensors_are_refused():
    class Bad:
        args = {}

        def make_inputs(self):
            return {"x": [1, 2]}

        def build(self, impl):
            return torch.nn.Identity()

    with pytest.raises(UsageError, match=r"input 'x' must be a tensor"):
        SubjectRunner("bad", Bad()).make_inputs()

    class NotJson(Bad):
        args = {"when": object()}

    with pytest.raises(UsageError, match=r"arguments of subject 'bad' must be JSON-safe"):
        SubjectRunner("bad", NotJson())


def test_inputs_cast_only_floating_tensors():
    inputs = Inputs({"x": torch.ones(2, dtype=torch.bfloat16), "ids": torch.arange(3)}, {"k": 1})
    moved = inputs.to("cpu", torch.float64)
    assert moved.tensors["x"].dtype == torch.float64 and moved.tensors["ids"].dtype == torch.int64
    assert moved.meta == {"k": 1}


# ---- attention --------------------------------------------------------------------------------


def test_case_ids_are_readable_and_unique():
    case = AttentionCase(2, 8, 2, 1000, 1000, 64, "causal", "bf16", 0)
    assert case.id == "B2-Hq8-Hkv2-Sq1000-Sk1000-D64-causal-bf16-s0"
    for cases in CASE_SETS.values():
        ids = [c.id for c in cases]
        assert len(set(ids)) == len(ids)
        assert all(re.fullmatch(r"[A-Za-z0-9-]+", i) for i in ids)  # usable as module names


def test_default_case_set_covers_the_edge_cases():
    cases = CASE_SETS["default"]
    assert {c.layout for c in cases} == {"causal", "window", "sink", "random", "dense", "emptyrow"}
    assert {c.dtype for c in cases} == {"fp16", "bf16", "fp32"}
    assert any(c.heads_q != c.heads_kv for c in cases)  # GQA
    assert any(c.seq_q == 1 for c in cases)
    assert any(c.seq_q % c.block_m for c in cases if c.seq_q > 1)  # a partial tail block
    assert any(c.batch > 1 for c in cases)
    # Interpreter-sized: at most 2**20 attention scores in all and 2**18 in one case, at most 256
    # rows or keys, so that `make demo` and the interpreter tests stay in seconds; a bigger set
    # belongs in "gpu".
    scores = [c.batch * c.heads_q * c.seq_q * c.seq_k for c in cases]
    assert sum(scores) <= 2**20 and max(scores) <= 2**18
    assert max(max(c.seq_q, c.seq_k) for c in cases) <= 256


def test_empty_row_case_really_has_an_empty_row():
    case = next(c for c in CASE_SETS["default"] if c.layout == "emptyrow")
    runner = load_subject("attention", {"cases": [case.to_json()]})
    inputs = runner.make_inputs()
    out = runner.run(runner.build("reference", state=None), inputs)[case.id]
    rows = slice(case.empty_block * case.block_m, (case.empty_block + 1) * case.block_m)
    assert torch.isneginf(out["lse"][:, :, rows]).all()
    assert (out["out"][:, :, rows] == 0).all()
    assert torch.isfinite(out["lse"][:, :, : case.block_m]).all()


def test_attention_inputs_are_deterministic_and_carry_layouts():
    runner = load_subject("attention", {"cases": "smoke"})
    torch.manual_seed(123)  # the global RNG must not matter
    first = runner.make_inputs()
    torch.manual_seed(456)
    second = runner.make_inputs()
    assert list(first.tensors) == list(second.tensors)
    assert all(_same_bits(first.tensors[k], second.tensors[k]) for k in first.tensors)
    case = CASE_SETS["smoke"][0]
    assert first.tensors[f"{case.id}/q"].dtype == torch.float16
    assert f"{case.id}/layout/kv_indices" in first.tensors
    assert first.meta["layouts"][case.id]["kind"] == "causal"


def test_attention_args_record_the_expanded_cases_and_dtype_override():
    subject = AttentionSubject(cases="smoke", dtype="fp32")
    assert subject.args["case_set"] == "smoke" and subject.args["dtype"] is None
    assert all(case["dtype"] == "fp32" for case in subject.args["cases"])
    again = AttentionSubject(**subject.args)
    assert [c.id for c in again.cases] == [c.id for c in subject.cases]


def test_attention_module_has_one_layer_per_case():
    runner = load_subject("attention", {"cases": "smoke"})
    module = runner.build("reference", state=None)
    assert [name for name, _ in module.named_children()] == [c.id for c in CASE_SETS["smoke"]]
    out = runner.run(module, runner.make_inputs())
    case = CASE_SETS["smoke"][0]
    assert out[case.id]["out"].dtype == torch.float16 and out[case.id]["lse"].dtype == torch.float32


@pytest.mark.parametrize("args, message", [
    ({"cases": "huge"}, r"unknown attention case set 'huge'"),
    ({"dtype": "fp8"}, r"attention dtype must be fp16, bf16 or fp32"),
    ({"cases": [{"batch": 1}]}, r"bad attention case"),
    ({"cases": [dict(batch=0, heads_q=2, heads_kv=1, seq_q=8, seq_k=8, head_dim=32)]},
     r"attention case batch must be a positive integer, got 0"),
    ({"cases": [dict(batch=1, heads_q=3, heads_kv=2, seq_q=8, seq_k=8, head_dim=32)]},
     r"heads_q \(3\) must be a multiple of heads_kv \(2\)"),
    ({"cases": [dict(batch=1, heads_q=2, heads_kv=1, seq_q=8, seq_k=8, head_dim=32, layout="random", density=1.5)]},
     r"density must be in \[0, 1\], got 1.5"),
    ({"cases": [dict(batch=1, heads_q=2, heads_kv=1, seq_q=8, seq_k=8, head_dim=32, window=-3)]},
     r"window must be a non-negative integer, got -3"),
])
def test_attention_bad_args(args, message):
    with pytest.raises(UsageError, match=message):
        load_subject("attention", args)


# ---- decoder ----------------------------------------------------------------------------------


def test_decoder_state_is_deterministic_and_fits_every_impl():
    runner = load_subject("decoder", {"layers": 2})
    first, second = runner.make_state(), runner.make_state()
    assert list(first) == list(second)
    assert all(_same_bits(first[k], second[k]) for k in first)
    assert first["embed.weight"].dtype == torch.bfloat16
    assert first["layers.0.attn.layout_kv_indices"].dtype == torch.int32  # layouts travel with the state
    for impl in ("reference", "triton"):
        assert set(runner.subject.build(impl).state_dict()) == set(first)


def test_decoder_runs_and_uses_mixed_layouts():
    runner = load_subject("decoder", {"layers": 3, "seq_len": 96})
    module = runner.build("reference", state=runner.make_state())
    kinds = [layer.attn.layout_meta["kind"] for layer in module.layers]
    assert kinds == ["causal", "window48", "window48-sink1"]
    logits = runner.run(module, runner.make_inputs())
    assert logits.shape == (2, 96, 256) and logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()


def test_decoder_fp64_reference_build_casts_weights_not_layouts():
    runner = load_subject("decoder", {"layers": 1, "seq_len": 64})
    state = runner.make_state()
    module = runner.build("reference", state=state, dtype=torch.float64)
    assert module.embed.weight.dtype == torch.float64
    assert module.layers[0].attn.layout_kv_indices.dtype == torch.int32
    logits = runner.run(module, runner.make_inputs().to("cpu", torch.float64))
    assert logits.dtype == torch.float64


def test_decoder_bad_args():
    with pytest.raises(UsageError, match=r"decoder dtype must be fp16, bf16 or fp32"):
        load_subject("decoder", {"dtype": "fp64"})
    with pytest.raises(UsageError, match=r"heads \(4\) must be a multiple of kv_heads \(3\)"):
        load_subject("decoder", {"kv_heads": 3})
