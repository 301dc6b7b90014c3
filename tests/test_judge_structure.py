"""Output structure as it is: a recorded output that a module call which ran here returned as None.

The golden host's call of a module returned a tensor at some place of its output (attention
weights, say) and this host's call of the same module, which ran (its other outputs were
compared), returned None there. That output is ``absent-here`` (parity.judge.engine): named in
every report with its module and place, not a failure by default, a failure (``missing-here``)
with ``strict_structure``. Not ``fused-here``, whose modules never ran here.

Checked from outside material: a tiny Hugging Face Llama captured with transformers' own
``eager`` attention (which returns the attention weights) and compared with the Triton kernel
through ``parity_sparse`` (which returns None for them); and a small user subject whose port
drops an output, once where nothing uses it and once where the model uses it.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

from parity.run.capture import capture
from parity.judge.compare import compare_bundle
from parity.judge.diff import diff_bundles
from parity.judge.policy import Policy
from parity.judge.results import verdict_line
from parity.report.html import render_html
from parity.report.json_report import to_json
from parity.report.junit import to_junit_xml
from parity.report.markdown import format_markdown
from parity.report.text import format_text
from parity.run.subjects import Inputs, Subject, trusting
from test_report_json_schemas import validate

PAIR_SPEC = "test_judge_structure:make_pair_subject"
EAGER_SPEC = "test_judge_structure:make_eager_llama"


# ---- a user subject: a block returning (out, weights), ported with weights None ----------------


class Block(nn.Module):
    """``(x @ w, softmax(x @ x^T))``, or ``(x @ w, None)`` where ``weights`` is off (the port)."""

    def __init__(self, weights: bool):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.weights = weights

    def forward(self, x):
        out = self.proj(x)
        return out, (torch.softmax(x @ x.transpose(-1, -2), dim=-1) if self.weights else None)


class Model(nn.Module):
    """``block`` then ``head``; with ``uses_weights`` the head's input also takes the weights
    (``weights @ out``, left out where the block returned None: a port that drops a used output)."""

    def __init__(self, weights: bool, uses_weights: bool):
        super().__init__()
        self.block = Block(weights)
        self.head = nn.Linear(8, 4)
        self.uses_weights = uses_weights

    def forward(self, x):
        out, weights = self.block(x)
        if self.uses_weights and weights is not None:
            out = out + weights @ out
        return self.head(out)


class PairSubject(Subject):
    name = "pair"
    impls = ("full", "lean")  # lean: the block returns None for its weights
    reference_impl = "full"

    def __init__(self, uses_weights: bool = False):
        super().__init__(uses_weights=uses_weights)

    def make_inputs(self) -> Inputs:
        return Inputs({"x": torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))})

    def make_state(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)  # a seeded CPU generator, never the global RNG
        return {name: 0.3 * torch.randn(tensor.shape, generator=gen)
                for name, tensor in Model(True, False).state_dict().items()}

    def build(self, impl: str) -> nn.Module:
        return Model(impl == "full", self.args["uses_weights"])


def make_pair_subject(**args) -> PairSubject:
    return PairSubject(**args)


@pytest.fixture(autouse=True)
def _trusted():
    with trusting(PAIR_SPEC, EAGER_SPEC):
        yield


@pytest.fixture(scope="module")
def pair_goldens(tmp_path_factory):
    """Golden bundles of the full subject (recorded inputs, fp64 references), by ``uses_weights``."""
    root = tmp_path_factory.mktemp("pair")
    with trusting(PAIR_SPEC):
        for uses in (False, True):
            capture(PAIR_SPEC, root / f"uses{int(uses)}", subject_args={"uses_weights": uses}, impl="full",
                    record_inputs=True)
        capture(PAIR_SPEC, root / "lean", subject_args={"uses_weights": False}, impl="lean")
    return root


WEIGHTS = "block/1"  # the block's second output: its weights


def test_an_output_the_port_returns_as_none_is_absent_here_and_passes(pair_goldens):
    report = compare_bundle(pair_goldens / "uses0", impl="lean")
    by_name = {result.name: result for result in report.layers}
    assert set(by_name) == {"block.proj", "block/0", WEIGHTS, "head", "<root>"}
    absent = by_name[WEIGHTS]
    assert absent.status == "absent-here" and absent.passed
    assert absent.metrics is None and absent.shape == (2, 6, 6)
    assert absent.note.startswith("output '1' of block is absent here: this host's call ran")
    assert [r.name for r in report.absent_here] == [WEIGHTS] and report.fused_here == []
    assert all(by_name[name].status == "pass" for name in ("block.proj", "block/0", "head", "<root>"))
    assert report.passed
    assert verdict_line(report) == ("PARITY HOLDS: 5/5 tensors (1 absent here, outputs this host's module calls "
                                    "returned as None)")
    assert [w for w in report.warnings if "absent here" in w] == [
        "1 recorded output absent here (block/1): their module calls ran here but returned None there (attention "
        "weights only one backend materializes, say); not failures, an output the model uses fails downstream "
        "(strict_structure = true makes them failures)"]
    assert not any("never ran here" in w for w in report.warnings)


def test_strict_structure_fails_an_absent_output_and_says_which(pair_goldens):
    report = compare_bundle(pair_goldens / "uses0", impl="lean", policy=Policy(strict_structure=True))
    assert [(r.name, r.status) for r in report.failing] == [(WEIGHTS, "missing-here")]
    assert report.failing[0].verdict.reasons == [
        "missing here: output '1' of block is absent here: this host's call ran and returned its other outputs, "
        "but no tensor there (None), where the golden host's returned one (strict_structure)"]
    assert verdict_line(report) == f"PARITY FAILS: first failing tensor {WEIGHTS} (1 of 5 tensors fail)"


def test_a_dropped_output_the_model_uses_fails_downstream(pair_goldens):
    """Passing an absent output by default is safe only because what uses it is compared too."""
    report = compare_bundle(pair_goldens / "uses1", impl="lean", isolate=True)
    by_name = {result.name: result for result in report.layers}
    assert by_name[WEIGHTS].status == "absent-here"
    assert not report.passed
    assert [r.name for r in report.failing] == ["head", "<root>"]
    # the head's own replay passes on its golden inputs: the error comes from upstream
    assert by_name["head"].attribution == "inherited"
    assert by_name[WEIGHTS].isolated.status == "absent-here"  # the replayed block returns None too
    assert by_name["block/0"].isolated.status == "pass"


def test_diff_of_a_bundle_without_the_output_calls_it_absent(pair_goldens):
    report = diff_bundles(pair_goldens / "uses0", pair_goldens / "lean")
    assert [(r.name, r.status) for r in report.layers if r.status != "pass"] == [(WEIGHTS, "absent-here")]
    assert report.passed
    strict = diff_bundles(pair_goldens / "uses0", pair_goldens / "lean", policy=Policy(strict_structure=True))
    assert [(r.name, r.status) for r in strict.failing] == [(WEIGHTS, "missing-here")]


def test_every_report_shows_the_absent_output(pair_goldens):
    report = compare_bundle(pair_goldens / "uses0", impl="lean")
    document = validate(json.loads(to_json(report)))
    assert document["summary"]["absent_here"] == 1 and document["summary"]["fused_here"] == 0
    assert document["summary"]["statuses"] == {"pass": 4, "absent-here": 1}
    row = next(layer for layer in document["layers"] if layer["name"] == WEIGHTS)
    assert row["status"] == "absent-here" and row["passed"] is True and "output '1' of block" in row["note"]

    text = format_text(report, width=200)
    rows = [line.split("|") for line in text.splitlines() if line.startswith(f"| {WEIGHTS} ")]
    assert [row[-4].strip() for row in rows] == ["absent here"]  # the verdict column
    assert "warning: 1 recorded output absent here (block/1)" in text
    assert text.splitlines()[-1] == verdict_line(report)

    markdown = format_markdown(report)
    assert "- warning: 1 recorded output absent here (block/1)" in markdown
    assert f"**{verdict_line(report)}**" in markdown

    html = render_html(document)
    assert "5: 5 pass, 0 fail, 1 absent here" in html
    assert "1 absent here, outputs this host&#x27;s module calls returned as None" in html

    suite = ET.fromstring(to_junit_xml(report))
    case = next(c for c in suite.iter("testcase") if c.get("name") == WEIGHTS)
    assert case.find("failure") is None
    assert "status: absent-here" in case.find("system-out").text
    assert "note: output '1' of block is absent here" in case.find("system-out").text
    properties = {p.get("name"): p.get("value") for p in suite.iter("property") if p.get("name") == "verdict"}
    assert properties["verdict"] == verdict_line(report)


# ---- from outside: a Hugging Face Llama with transformers' eager attention -------------------


def make_eager_llama(**args):
    """tests/llama_subject.py's tiny Llama with a third impl, ``eager``: transformers' own eager
    attention, which returns the attention weights (the two parity impls return None for them)."""
    import llama_subject
    from parity.integrations import transformers as parity_tf

    class EagerLlama(llama_subject.LlamaSubject):
        impls = ("eager", "kernel")
        reference_impl = "eager"

        def build(self, impl: str) -> nn.Module:
            if impl != "eager":
                return super().build(impl)
            parity_tf.register()  # make_state builds the reference model through it
            return self._model("eager").to(self.dtype).eval()

    return EagerLlama(**args)


# Every module the eager model has. The parity impls add an ``attn_core`` child to each attention
# layer (their hook point), which an eager golden cannot hold: these globs leave it out, so the
# two sides differ in the attention weights alone.
LLAMA_LAYERS = ("<root>", "lm_head", "model", "model.embed_tokens", "model.rotary_emb", "model.norm", "model.layers.?",
                "model.layers.?.*_layernorm", "model.layers.?.self_attn", "model.layers.?.self_attn.?_proj",
                "model.layers.?.mlp", "model.layers.?.mlp.*")


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_eager_golden_against_the_kernel_calls_the_weights_absent(strict, tmp_path, device):
    import transformers  # noqa: F401  a test dependency (pyproject's test extra): missing, this errors, never skips

    golden = tmp_path / "eager"
    # padded_right: no query row sees no key (eager and the kernel define such rows differently)
    capture(EAGER_SPEC, golden, subject_args={"case": "padded_right"}, impl="eager", device=device,
            layers=LLAMA_LAYERS)
    report = compare_bundle(golden, impl="kernel", device=device, policy=Policy(strict_structure=strict))
    weights = ["model.layers.0.self_attn/1", "model.layers.1.self_attn/1"]
    assert len(report.layers) == 35
    assert report.fused_here == []
    assert not any("never ran here" in warning for warning in report.warnings)
    if not strict:
        assert [r.name for r in report.absent_here] == weights
        assert [r.name for r in report.layers if r.status != "pass"] == weights
        for result in report.absent_here:
            module = result.name.split("/")[0]
            assert result.note.startswith(f"output '1' of {module} is absent here: this host's call ran"), result.note
        assert report.passed
        assert verdict_line(report) == ("PARITY HOLDS: 35/35 tensors (2 absent here, outputs this host's module "
                                        "calls returned as None)")
    else:
        assert [(r.name, r.status) for r in report.failing] == [(name, "missing-here") for name in weights]
        assert "output '1' of model.layers.0.self_attn is absent here" in report.failing[0].verdict.reasons[0]
        assert verdict_line(report) == f"PARITY FAILS: first failing tensor {weights[0]} (2 of 35 tensors fail)"
