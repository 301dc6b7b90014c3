"""The fixed thresholds back the error budget up; a threshold the golden itself does not meet
against the high-precision reference is waived (a note), never asked of the port."""
from __future__ import annotations

import torch

from parity.judge.engine import compare_tensors


def _noisy(reference: torch.Tensor, relative: float, seed: int) -> torch.Tensor:
    """``reference`` plus independent Gaussian noise of that relative L2 size, stored in bf16."""
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (reference + relative * noise * reference.norm() / noise.norm()).to(torch.bfloat16)


REFERENCE = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_a_backstop_the_golden_fails_too_is_waived_and_said():
    """A deep bf16 layer: the golden is 3% (rel L2) from fp32, beyond the 2.5e-2 backstop itself;
    a correct port as far from the reference (3%, independent) is 4.2% from the golden. The
    budget holds (3% <= 2 x 3%): the verdict passes, with a note naming the golden's own value."""
    golden, out = _noisy(REFERENCE, 0.03, 1), _noisy(REFERENCE, 0.03, 2)
    result = compare_tensors("deep", out, golden, reference=REFERENCE)
    assert result.metrics.rel_l2 > result.tolerance.max_rel_l2  # the backstop alone would fail it
    assert result.passed, result.verdict.reasons
    (note,) = [note for note in result.verdict.notes if note.startswith("backstop waived")]
    assert "max_rel_l2" in note and "min_cosine" in note and "rel L2 3.0e-2" in note


def test_a_port_beyond_the_budget_still_fails():
    """The same golden, a port 7% from the reference: beyond 2 x 3%, it fails by the budget
    (nothing is waived where the budget does not hold)."""
    golden, out = _noisy(REFERENCE, 0.03, 1), _noisy(REFERENCE, 0.07, 3)
    result = compare_tensors("deep", out, golden, reference=REFERENCE)
    assert not result.passed and "budget_k" in result.verdict.failed
    assert not any(note.startswith("backstop waived") for note in result.verdict.notes)


def test_a_backstop_the_golden_meets_is_kept():
    """A golden 2% from the reference (inside the backstop), a port 3.5% from it: within the
    budget (2 x 2%) but 4% from the golden; the golden meets the thresholds, so they judge."""
    golden, out = _noisy(REFERENCE, 0.02, 1), _noisy(REFERENCE, 0.035, 4)
    result = compare_tensors("shallow", out, golden, reference=REFERENCE)
    assert "budget_k" not in result.verdict.failed
    assert not result.passed and "max_rel_l2" in result.verdict.failed
    assert not any(note.startswith("backstop waived") for note in result.verdict.notes)
