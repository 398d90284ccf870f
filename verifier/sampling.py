"""The processed target distribution p, and drawing tokens from it.

Speculative sampling is lossless with respect to the distribution the target would sample
from on its own, so p is the *processed* distribution: logits divided by the temperature,
then top-k, then top-p (nucleus) filtering, renormalised. Greedy (temperature 0) is not
handled here: the caller takes the argmax.

With logits z over V tokens, temperature T, the steps are, per row:

    p      = softmax(z / T)
    top-k: keep tokens with z_j >= z_(k), the k-th largest logit (ties with it are kept)
    top-p: sort the kept probabilities descending, p_(1) >= p_(2) >= ...; keep token (j)
           while sum_{i<j} p_(i) < top_p, i.e. the smallest prefix whose mass reaches
           top_p; the top token is always kept (its prefix mass is 0). Tokens tied with
           the last kept probability are kept too, so the set does not depend on how the
           sort orders ties.
    p_j    = p_j * keep_j / sum_i p_i * keep_i

`top_k <= 0` or `top_k >= V` disables top-k; `top_p == 1` disables top-p (the sort over
V, the costly step, is then skipped).
"""

from __future__ import annotations

import torch

from verifier.sequence import TokenLogprob


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Return the processed target distribution, float32 [n, V].

    `logits`: float32 or bf16 [n, V] (upcast to float32 before anything else).
    `temperature` > 0; `top_k` <= 0 or >= V disables top-k; `top_p` in (0, 1], 1 disables.

    Example: logits log([0.5, 0.3, 0.15, 0.05]), T = 1, top_k = 0, top_p = 0.7. The prefix
    masses before each sorted token are 0, 0.5, 0.8, 0.95; the first two are < 0.7, so
    tokens 0 and 1 are kept and the result is [0.625, 0.375, 0, 0].
    """
    assert logits.dim() == 2, f"{logits.shape=}"
    assert temperature > 0, f"{temperature=} (greedy is the caller's argmax)"
    assert 0.0 < top_p <= 1.0, f"{top_p=}"
    scaled = logits.float() / temperature  # float32 [n, V]
    vocab_size = scaled.shape[-1]
    if 0 < top_k < vocab_size:
        kth_logit = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth_logit, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # float32 [n, V]
    if top_p < 1.0:
        sorted_probs = torch.sort(probs, dim=-1, descending=True).values  # [n, V]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # exclusive prefix sums
        num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)  # int64 [n, 1], >= 1
        min_kept_prob = sorted_probs.gather(-1, num_kept - 1)  # [n, 1]
        probs = probs.masked_fill(probs < min_kept_prob, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row: int64 [n] from `probs` float32 [n, V] (rows sum to 1).

    Randomness comes only from `generator` (on the device of `probs`), so a per-request
    seed reproduces the draw.
    """
    assert probs.dim() == 2 and probs.dtype == torch.float32, f"{probs.shape=} {probs.dtype=}"
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Each token's log probability under the raw distribution of its row, log_softmax(z)
    in float32, its rank there (how many tokens are at least as likely), and the `num_top`
    most likely tokens' (highest first; ties by lower id).

    `logits`: float32 or bf16 [n, V]; `token_ids`: n ids, one per row.

    Example: logits log([0.5, 0.3, 0.2]) and token 1 give log(0.3), rank 2, with top 2
    [(0, log 0.5), (1, log 0.3)].
    """
    assert logits.dim() == 2 and logits.shape[0] == len(token_ids), f"{logits.shape=} {len(token_ids)=}"
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen_t = logp.gather(-1, torch.tensor(token_ids, dtype=torch.int64).view(-1, 1))  # [n, 1]
    chosen = chosen_t.view(-1).tolist()
    ranks = (logp >= chosen_t).sum(-1).tolist()
    if num_top <= 0:
        return [TokenLogprob(t, lp, rank=rank) for t, lp, rank in zip(token_ids, chosen, ranks)]
    # Every token at or above the num_top-th value, ranked by value then id, so that the
    # top does not depend on how topk orders ties.
    threshold = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1).values[:, -1:]  # [n, 1]
    out = []
    for r, (t, lp) in enumerate(zip(token_ids, chosen)):
        ids = torch.nonzero(logp[r] >= threshold[r]).view(-1)
        ranked = sorted(zip(logp[r, ids].tolist(), ids.tolist()), key=lambda vi: (-vi[0], vi[1]))[:num_top]
        out.append(TokenLogprob(t, lp, tuple((i, v) for v, i in ranked), ranks[r]))
    return out
