"""logits_to_probs and sample_from_probs against hand-computed distributions."""

from __future__ import annotations

import math

import pytest
import torch

from verifier.sampling import logits_to_probs, sample_from_probs

# float32 softmax of a handful of logits is exact to a few ulps.
ATOL = 1e-6


def _log(probs: list[float]) -> torch.Tensor:
    """float32 [1, V] logits whose softmax is `probs` (zeros become -inf)."""
    return torch.tensor([probs], dtype=torch.float64).log().float()


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[0.0, math.log(2.0)]])  # softmax at T = 1: [1/3, 2/3]
    torch.testing.assert_close(logits_to_probs(logits, 1.0, 0, 1.0), torch.tensor([[1 / 3, 2 / 3]]), atol=ATOL, rtol=0)
    # T = 0.5 squares the odds 2 -> 4; T = 2 takes their square root.
    torch.testing.assert_close(logits_to_probs(logits, 0.5, 0, 1.0), torch.tensor([[0.2, 0.8]]), atol=ATOL, rtol=0)
    root2 = math.sqrt(2.0)
    expected = torch.tensor([[1 / (1 + root2), root2 / (1 + root2)]])
    torch.testing.assert_close(logits_to_probs(logits, 2.0, 0, 1.0), expected, atol=ATOL, rtol=0)


def test_temperature_zero_is_the_callers_job():
    with pytest.raises(AssertionError):
        logits_to_probs(torch.zeros(1, 3), 0.0, 0, 1.0)


def test_top_k_keeps_the_k_highest_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    e = math.e
    expected = torch.tensor([[0.0, e / (e + 1), 1 / (e + 1), 0.0]])  # softmax over logits {3, 2}
    torch.testing.assert_close(logits_to_probs(logits, 1.0, 2, 1.0), expected, atol=ATOL, rtol=0)


def test_top_k_keeps_ties_with_the_kth_logit():
    # top_k = 2, but logits 2 and 2 tie for second place: both are kept (3 tokens).
    logits = torch.tensor([[3.0, 2.0, 2.0, 0.0]])
    kept = torch.tensor([math.exp(3.0), math.exp(2.0), math.exp(2.0), 0.0])
    torch.testing.assert_close(logits_to_probs(logits, 1.0, 2, 1.0), (kept / kept.sum())[None], atol=ATOL, rtol=0)


@pytest.mark.parametrize("top_k", [0, -1, 4, 5])
def test_top_k_disabled(top_k):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_k, 1.0), torch.softmax(logits, -1), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # Prefix masses before each sorted token: 0, 0.5, 0.8, 0.95; keep those < top_p.
        (0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (1.0, [0.5, 0.3, 0.15, 0.05]),
        # The top token is kept even though its own mass 0.5 is far above top_p.
        (0.1, [1.0, 0.0, 0.0, 0.0]),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, expected):
    # Unsorted on purpose: the filter must work in sorted order, not vocabulary order.
    logits = _log([0.15, 0.5, 0.05, 0.3])
    order = [2, 0, 3, 1]  # expected is given in sorted order [0.5, 0.3, 0.15, 0.05]
    result = logits_to_probs(logits, 1.0, 0, top_p)
    torch.testing.assert_close(result, torch.tensor([[expected[i] for i in order]]), atol=ATOL, rtol=0)


def test_top_p_keeps_ties_with_the_last_kept_token():
    # Masses before: 0, 0.4, 0.65; top_p = 0.5 keeps 0.4 and one 0.25, and its twin is kept
    # too, so the result does not depend on how the sort orders the tie.
    result = logits_to_probs(_log([0.25, 0.4, 0.1, 0.25]), 1.0, 0, 0.5)
    torch.testing.assert_close(result, torch.tensor([[0.25 / 0.9, 0.4 / 0.9, 0.0, 0.25 / 0.9]]), atol=ATOL, rtol=0)


def test_top_p_applies_to_the_top_k_distribution():
    # top_k = 3 renormalises to [4/9, 3/9, 2/9]; masses before 0, 4/9, 7/9: top_p = 0.75 keeps 2.
    # (top_p on the unfiltered [0.4, 0.3, 0.2, 0.1] would keep 3: masses before 0, 0.4, 0.7.)
    result = logits_to_probs(_log([0.4, 0.3, 0.2, 0.1]), 1.0, 3, 0.75)
    torch.testing.assert_close(result, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]), atol=ATOL, rtol=0)


def test_bf16_logits_are_upcast():
    logits = torch.tensor([[0.5, -1.25, 2.0, 0.0]], dtype=torch.bfloat16)  # exact in bf16
    result = logits_to_probs(logits, 0.7, 3, 0.9)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, logits_to_probs(logits.float(), 0.7, 3, 0.9), atol=0, rtol=0)


def test_rows_are_independent_and_sum_to_one():
    num_rows, vocab_size, top_k, top_p = 8, 50, 10, 0.8
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    batched = logits_to_probs(logits, 0.9, top_k, top_p)
    assert batched.shape == (num_rows, vocab_size) and batched.dtype == torch.float32
    torch.testing.assert_close(batched.sum(-1), torch.ones(num_rows), atol=ATOL, rtol=0)
    kept = (batched > 0).sum(-1)
    assert ((kept >= 1) & (kept <= top_k)).all(), kept
    for i in range(num_rows):
        torch.testing.assert_close(batched[i : i + 1], logits_to_probs(logits[i : i + 1], 0.9, top_k, top_p), atol=0, rtol=0)


def test_sample_from_probs_one_hot_and_reproducible():
    one_hot = torch.eye(5)[[3, 0, 4]]
    tokens = sample_from_probs(one_hot, torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64 and tokens.tolist() == [3, 0, 4]
    probs = torch.softmax(torch.randn(4, 100, generator=torch.Generator().manual_seed(1)), -1)
    first = sample_from_probs(probs, torch.Generator().manual_seed(7))
    assert torch.equal(first, sample_from_probs(probs, torch.Generator().manual_seed(7)))
