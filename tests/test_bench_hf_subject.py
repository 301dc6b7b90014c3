"""bench/hf_subject.py: a Hugging Face Llama's prefill timed by ``parity bench`` with ``sdpa``,
``parity_sdpa`` and ``parity_sparse``, each speedup valid only where parity holds.

On the CPU at the tiny size (the kernel through the Triton interpreter); the Llama-3-8B shape is
checked on the meta device (its parameter count), and timed on the GPU by the ``hf-bench`` step
of bench/h200_run.sh.
"""
from __future__ import annotations

import json

import pytest
import torch

import transformers  # noqa: F401  a test dependency (pyproject's test extra): missing, the file errors, never skips

from bench import hf_subject
from parity.cli.main import main
from parity.integrations import transformers as parity_tf

SPEC = "bench.hf_subject:make_subject"
TINY = ["--set", "size=tiny", "--set", "seq=64", "--set", "dtype=fp32"]


def bench(tmp_path, *argv):
    out = tmp_path / "bench.json"
    status = main(["bench", "--quiet", "--subject", SPEC, "--json", str(out), "--warmup", "1", "--reps", "3", *argv])
    return status, json.loads(out.read_text())


def test_bench_of_the_three_attention_implementations_is_gated_on_parity(tmp_path):
    status, report = bench(tmp_path, "--impls", "sdpa,parity_sdpa,parity_sparse", *TINY,
                           "--module", "model.layers.*.self_attn")
    assert status == 0
    assert report["subject"] == {"spec": SPEC, "name": "hf-prefill",
                                 "args": {"size": "tiny", "seq": 64, "batch": 1, "dtype": "fp32", "seed": 0,
                                          "layers": 0}}
    assert report["input_shapes"] == {"input_ids": {"dtype": "int64", "shape": [1, 64]}}
    rows = {row["impl"]: row for row in report["impls"]}
    assert list(rows) == ["sdpa", "parity_sdpa", "parity_sparse"]
    assert report["settings"]["baseline"] == "sdpa"
    assert rows["sdpa"]["parity"]["status"] == "baseline"
    for impl in ("parity_sdpa", "parity_sparse"):  # judged against sdpa's logits, the whole output
        assert rows[impl]["parity"]["status"] == "holds", rows[impl]["parity"]
        assert [r["name"] for r in rows[impl]["parity"]["results"]] == ["<root>"]
        assert rows[impl]["valid"] is True
        # on the CPU the interpreted kernel may be SLOWER, which claims no speedup but stands on parity
        expected = "parity holds; slower" if rows[impl]["vs_baseline"]["verdict"] == "SLOWER" else "valid: parity holds"
        assert rows[impl]["validity"] == expected
        assert rows[impl]["vs_baseline"]["speedup"] > 0
    assert report["passed"] is True
    assert report["modules"]["patterns"] == ["model.layers.*.self_attn"]
    assert {row["impl"] for row in report["modules"]["rows"]} == set(rows)


def test_a_wrong_kernel_speedup_is_not_valid(tmp_path, monkeypatch):
    """The kernel's attention output off by 1% in every layer: parity_sparse's row fails parity
    at the logits and its speedup is refused, whatever its time."""
    right = parity_tf.ParityAttention._run_kernel

    def off_by_one_percent(self, *args, **kwargs):
        return right(self, *args, **kwargs) * 1.01

    monkeypatch.setattr(parity_tf.ParityAttention, "_run_kernel", off_by_one_percent)
    status, report = bench(tmp_path, "--impls", "sdpa,parity_sdpa,parity_sparse", *TINY,
                           "--no-modules", "--no-device-time")
    rows = {row["impl"]: row for row in report["impls"]}
    assert rows["parity_sparse"]["parity"]["status"] == "fails"
    assert rows["parity_sparse"]["valid"] is False
    assert rows["parity_sparse"]["validity"] == "not valid: parity fails at <root>"
    assert rows["parity_sdpa"]["parity"]["status"] == "holds"  # the integration's SDPA side is untouched
    assert status == (1 if report["fastest"] == "parity_sparse" else 0)


def test_capture_with_parity_sdpa_then_compare_with_the_kernel(tmp_path):
    """capture and compare load the subject too. The integration's two impls record the same
    modules (``attn_core`` included), so a capture with parity_sdpa is compared layer by layer;
    transformers' own sdpa never calls ``attn_core``, so its bundle has none to compare with."""
    bundle = tmp_path / "bundle"
    assert main(["capture", "--quiet", "--subject", SPEC, *TINY, "--impl", "parity_sdpa", "--reference", "none",
                 "--bundle", str(bundle)]) == 0
    out = tmp_path / "compare.json"
    assert main(["compare", "--quiet", "--bundle", str(bundle), "--subject", SPEC, "--impl", "parity_sparse",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [row["name"] for row in report["layers"]]
    assert "model.layers.1.self_attn.attn_core" in names and "<root>/logits" in names
    assert report["passed"] is True and all(row["passed"] for row in report["layers"])


def test_llama8b_has_llama_3_8b_shape():
    model = hf_subject.make_subject(size="llama8b").build("parity_sparse", device="meta")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (32, 4096, 32, 8, 128, 14336, 128256)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Meta's published Llama-3-8B count
    assert config._attn_implementation == "parity_sparse"
    assert "model.layers.31.self_attn.attn_core" in dict(model.named_modules())
    sdpa = hf_subject.make_subject(size="llama8b").build("sdpa", device="meta")
    assert set(sdpa.state_dict()) == set(model.state_dict())  # one set of weights serves every impl
    inputs = hf_subject.make_subject(size="llama8b").make_inputs().tensors
    assert inputs["input_ids"].shape == (1, 4096) and int(inputs["input_ids"].max()) < 128256


def test_builds_are_seeded_and_leave_the_callers_random_state_alone():
    subject = hf_subject.make_subject(size="tiny", dtype="fp32", seed=3)
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)
    first = subject.build("sdpa").state_dict()
    assert torch.equal(torch.rand(4), expected_next)
    second = subject.build("parity_sparse").state_dict()
    other_seed = hf_subject.make_subject(size="tiny", dtype="fp32", seed=4).build("sdpa").state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first[name], second[name])
    assert not torch.equal(first[name], other_seed[name])


@pytest.mark.parametrize("override, message", [
    ("size=llama70b", "size must be one of tiny, llama8b, mistral7b, got 'llama70b'"),
    ("seq=0", "seq must be an integer >= 1, got 0"),
    ("seq=40000", "seq must be at most 32768 for size llama8b"),
    ("dtype=int8", "dtype must be one of fp32, fp16, bf16, got 'int8'"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path, capsys, override, message):
    out = tmp_path / "bench.json"
    status = main(["bench", "--quiet", "--subject", SPEC, "--impls", "sdpa,parity_sparse", "--set", override,
                   "--json", str(out)])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_bench_builds_a_subject_without_make_state_once_per_impl(monkeypatch):
    """No extra build on the host only to read the weights (for llama8b: 16 GB and minutes of
    initialisation); every impl gets the first build's weights."""
    from parity.speed.bench import prepare

    built = []
    original = hf_subject.HFSubject.build

    def counting(self, impl, device="cpu"):
        built.append((impl, str(device)))
        return original(self, impl, device=device)

    monkeypatch.setattr(hf_subject.HFSubject, "build", counting)
    prepared = prepare(SPEC, {"size": "tiny", "seq": 8, "dtype": "fp32", "seed": 5},
                       impls=["parity_sparse", "sdpa", "parity_sdpa"], device=torch.device("cpu"))
    assert built == [("parity_sparse", "cpu"), ("sdpa", "cpu"), ("parity_sdpa", "cpu")]
    first = prepared.modules["parity_sparse"].state_dict()
    for impl in ("sdpa", "parity_sdpa"):
        state = prepared.modules[impl].state_dict()
        assert set(state) == set(first) and all(torch.equal(state[name], first[name]) for name in first)
    assert "weights of its parity_sparse build" in prepared.source
