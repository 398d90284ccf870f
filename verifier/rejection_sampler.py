"""Acceptance rules for one sequence's round: greedy match and speculative sampling.

A round verifies k draft tokens d_0..d_{k-1}. The target's k+1 verified positions give
p_0..p_k: p_i is the target's (processed) distribution for the token after d_{i-1}, with
p_0 following the last committed token. Every round emits num_accepted + 1 tokens:

- **accepted** tokens: the leading drafts d_0..d_{n-1} that pass the rule below;
- **recovered** token: at the first rejection, position n < k, the target's replacement;
- **bonus** token: when all k drafts are accepted, one extra token drawn from p_k.

Greedy: accept d_i while d_i == argmax p_i; the recovered or bonus token is argmax p_n.
The output is then exactly the target's own greedy output.

Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv:2211.17192; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling", arXiv:2302.01318): with d_i drawn from the draft's q_i,

    accept d_i  with probability  min(1, p_i(d_i) / q_i(d_i));
    on the first rejection draw the recovered token from  max(0, p_i - q_i) / sum(...)
    and stop; if all k are accepted draw the bonus token from p_k.

Then P(emitted = x) = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x))
/ sum_y max(0, p(y) - q(y)) = p(x), for any q: the output follows p exactly. A draft
without probabilities is treated as one-hot q (q_i(d_i) = 1): accept with probability
p_i(d_i); max(0, p_i - onehot(d_i)) is p_i with d_i zeroed. That is lossless for any way
of choosing d_i, because the rule never uses how d_i was chosen.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def greedy_accept(target_token_ids: Sequence[int] | np.ndarray, draft_token_ids: np.ndarray) -> tuple[int, np.ndarray]:
    """Greedy acceptance: return (num_accepted, output_token_ids int32 [num_accepted + 1]).

    `target_token_ids`: int [k+1], the target's argmax at each verified position.
    `draft_token_ids`: int32 [k].

    Accepted drafts equal the target's tokens, so the output is target[:num_accepted + 1]:
    the accepted drafts, then the recovered token (first mismatch) or the bonus token.

    >>> greedy_accept([5, 6, 9, 4], np.array([5, 6, 7], dtype=np.int32))
    (2, array([5, 6, 9], dtype=int32))
    """
    target = np.asarray(target_token_ids)
    num_drafts = len(draft_token_ids)
    assert target.shape == (num_drafts + 1,), f"{target.shape=} {num_drafts=}"
    mismatch = target[:num_drafts] != draft_token_ids
    num_accepted = int(mismatch.argmax()) if mismatch.any() else num_drafts
    return num_accepted, target[: num_accepted + 1].astype(np.int32)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: np.ndarray,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, np.ndarray]:
    """Speculative sampling: return (num_accepted, output_token_ids int32 [num_accepted + 1]).

    `target_probs`: float32 [k+1, V], p_0..p_k (processed, rows sum to 1).
    `draft_token_ids`: int32 [k], d_i drawn from q_i.
    `draft_probs`: float32 [k, V], q_0..q_{k-1}, or None for a deterministic draft (one-hot q).
    `generator`: the request's seeded generator, on the device of `target_probs`; the only
    source of randomness, so a seed reproduces the round.

    One call draws k+1 float32 uniforms u_0..u_k. Position i accepts when u_i * q_i(d_i) <
    p_i(d_i), which is u_i < min(1, p/q) without a division (p >= q always accepts, p == 0
    always rejects). The recovered or bonus token is the inverse CDF of its (unnormalised)
    row w at u_k: the first j with cumsum(w)_j > u_k * sum(w), cumsum in float64; zero-weight
    tokens are never drawn, and u_k <= 1 - 2**-24 keeps the point below sum(w). Float32
    uniforms resolve probabilities to 2**-24 (6e-8 per token). Full-vocabulary work is done
    for that one row only; the acceptance test is k Python float comparisons, cheaper than
    tensor ops at k <= 16.

    >>> p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])  # p_0(0) = 0: draft 0 is always rejected
    >>> rejection_sample(p, np.array([0], dtype=np.int32), None, torch.Generator().manual_seed(0))
    (0, array([1], dtype=int32))
    """
    num_drafts = len(draft_token_ids)
    vocab_size = target_probs.shape[-1]
    assert target_probs.shape == (num_drafts + 1, vocab_size), f"{target_probs.shape=} {num_drafts=}"
    assert target_probs.dtype == torch.float32, f"{target_probs.dtype=}"
    assert draft_probs is None or draft_probs.shape == (num_drafts, vocab_size), f"{draft_probs.shape=}"
    device = target_probs.device
    uniform = torch.rand(num_drafts + 1, generator=generator, device=device, dtype=torch.float32).tolist()
    num_accepted = num_drafts
    if num_drafts:
        flat_index = torch.from_numpy(np.arange(num_drafts) * vocab_size + draft_token_ids).to(device)
        p_draft = target_probs.take(flat_index).tolist()  # p_i(d_i), i < k
        q_draft = [1.0] * num_drafts if draft_probs is None else draft_probs.take(flat_index).tolist()
        num_accepted = next((i for i in range(num_drafts) if uniform[i] * q_draft[i] >= p_draft[i]), num_drafts)
    row = target_probs[num_accepted]  # [V]: p_n
    if num_accepted < num_drafts:
        if draft_probs is None:  # max(0, p - onehot(d)) = p with d zeroed
            weights = row.clone()
            weights[int(draft_token_ids[num_accepted])] = 0.0
        else:
            weights = (row - draft_probs[num_accepted]).clamp_min(0.0)
    else:
        weights = row  # bonus token from p_k
    token = draw(weights, row, uniform[num_drafts])
    output = np.empty(num_accepted + 1, dtype=np.int32)
    output[:num_accepted] = draft_token_ids[:num_accepted]
    output[num_accepted] = token
    return num_accepted, output


def draw(weights: torch.Tensor, row: torch.Tensor, u: float) -> int:
    """The token at `u` (a float32 uniform) of the inverse CDF of `weights` (float32 [V],
    unnormalised): the first j with cumsum(w)_j > u * sum(w), cumsum in float64, so that
    zero-weight tokens are never drawn. `weights` of sum 0 (a residual max(0, p - q) that
    rounding emptied: it is 0 only when p == q up to rounding) draw from `row`, p itself,
    then the right distribution."""
    cdf = torch.cumsum(weights, dim=0, dtype=torch.float64)  # [V]
    total = float(cdf[-1])
    if not total > 0:
        cdf = torch.cumsum(row, dim=0, dtype=torch.float64)
        total = float(cdf[-1])
    return int(torch.searchsorted(cdf, u * total, right=True))
