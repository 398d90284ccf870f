"""N-gram prompt lookup: draft the tokens that followed the last time the context's tail appeared.

No model, no probabilities: the draft is copied from the context itself, so it pays off
when the output repeats its input (editing code, quoting, extraction) and costs almost
nothing when it does not (DESIGN.md: 4.5 tokens per pass on code edits, ~1.3 on chat).

`ngram_lookup` is the algorithm (a pure function); `NgramProposer` is a thin stateful
shell that keeps each sequence's context under the delta contract of
`protos.proposal` and answers batched `ProposalRequest`s.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from protos.proposal import Proposal, ProposalRequest

logger = logging.getLogger(__name__)

# Capacity of a new sequence buffer when its first delta is smaller: 1024 int32 = 4 KiB,
# enough for a typical prompt, so most sequences grow (and copy) at most a few times.
_INITIAL_CAPACITY = 1024


def ngram_lookup(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Prompt lookup: the up-to-`k` tokens that followed the latest earlier copy of the tail.

    `token_ids`: int32 [L], the context. Returns int32 [m], 0 <= m <= k, a fresh array.

    Let `ctx = token_ids`, `L = len(ctx)`. For n = max_n, max_n - 1, ..., min_n (longest
    pattern first), the pattern is the suffix `ctx[L-n:]`; an *occurrence* is a start
    `s` with `ctx[s:s+n] == ctx[L-n:]` and `s + n <= L - 1` (it ends before the final
    position, so the suffix itself does not count). The first n with an occurrence wins,
    and its most recent (largest) `s` gives the draft `ctx[s+n : s+n+k]` — shorter than
    k near the end of the context, and free to run into the suffix itself, which is what
    repetitive text (`a a a a`) wants. No occurrence for any n: empty draft.

    >>> ctx = np.array([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], dtype=np.int32)
    >>> ngram_lookup(ctx, min_n=1, max_n=3, k=2)  # [1 2 3] at s=0 beats the later [2 3]
    array([4, 9], dtype=int32)
    >>> ngram_lookup(ctx, min_n=1, max_n=2, k=2)  # longest is now [2 3]: latest at s=5
    array([5, 1], dtype=int32)
    >>> ngram_lookup(np.array([7, 7, 7], dtype=np.int32), 1, 2, k=4)  # [7 7] at s=0
    array([7], dtype=int32)

    Method: instead of comparing every window with every pattern, keep the end positions
    `e` (e <= L-2) where the 1-gram suffix occurs, then for n = 2, 3, ... keep only those
    whose token n-1 places back also matches, `ctx[e-n+1] == ctx[L-n]`. Each step filters
    the survivors of the last one, so the cost is one O(L) comparison plus O(matches) per
    n, and the loop stops as soon as no n-gram occurs (no longer one can). Ends stay
    sorted, so the most recent occurrence is the last survivor.
    """
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"max_n must be >= min_n ({min_n}), got {max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    assert token_ids.ndim == 1, f"{token_ids.shape=}"
    last = token_ids.shape[0] - 1  # index of the final position
    # An n-gram occurrence ends at e in [n-1, last-1], so n <= last is needed.
    if k == 0 or last < min_n:
        return np.empty(0, dtype=np.int32)

    # ends: int64 [c], ascending; positions e <= last-1 where the current n-gram suffix ends.
    ends = np.flatnonzero(token_ids[:last] == token_ids[last])
    best_end = -1
    for n in range(1, min(max_n, last) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[token_ids[ends - (n - 1)] == token_ids[last - (n - 1)]]
        if ends.size == 0:
            break
        if n >= min_n:
            best_end = int(ends[-1])
    if best_end < 0:
        return np.empty(0, dtype=np.int32)
    return token_ids[best_end + 1 : best_end + 1 + k].astype(np.int32, copy=True)


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Pattern lengths and draft cap of the n-gram proposer.

    `min_n = 2`: a 1-gram match fires on almost every common token (space, comma,
    newline, "the") of a multi-thousand-token context and its continuation is close to a
    guess; every rejected draft still costs verifier time (4 extra positions: 37.6 ->
    43.2 ms, +15%, DESIGN.md), so a lone repeated token is not worth speculating on.
    `max_n = 4`: in code and quoted text a 4-token match already pins down the place being
    copied in most cases, while longer patterns match less often and rarely change which
    occurrence is chosen. Both are starting points, not tuned here: revisit with measured
    acceptance per n.
    `max_k = 8`: the most draft tokens per round whatever the request asks; verifying 9
    positions costs x1.21 of one (DESIGN.md), and beyond ~8 even a 0.9 per-token
    acceptance adds under 0.4 expected tokens per extra position.
    """

    min_n: int = 2
    max_n: int = 4
    max_k: int = 8

    def __post_init__(self) -> None:
        for name in ("min_n", "max_n", "max_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"NgramConfig.{name} must be an integer, got {value!r}")
        if self.min_n < 1:
            raise ValueError(f"NgramConfig.min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"NgramConfig.max_n must be >= min_n ({self.min_n}), got {self.max_n}")
        if self.max_k < 1:
            raise ValueError(f"NgramConfig.max_k must be >= 1, got {self.max_k}")


class _TokenBuffer:
    """One sequence's context: int32 tokens `buf[:length]` in a buffer that doubles.

    Truncation only moves `length`; appending copies just the new tokens, so a round
    costs O(delta) amortised instead of O(L).
    """

    __slots__ = ("buf", "length")

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int32)
        self.length = 0

    def replace_tail(self, base_len: int, append_token_ids: np.ndarray) -> None:
        """Keep the first `base_len` tokens, then append `append_token_ids` (int32 [n])."""
        assert 0 <= base_len <= self.length, f"{base_len=} {self.length=}"
        new_length = base_len + append_token_ids.shape[0]
        if new_length > self.buf.shape[0]:
            grown = np.empty(max(new_length, 2 * self.buf.shape[0], _INITIAL_CAPACITY), dtype=np.int32)
            grown[:base_len] = self.buf[:base_len]
            self.buf = grown
        self.buf[base_len:new_length] = append_token_ids
        self.length = new_length

    def view(self) -> np.ndarray:
        """int32 [length]; a view, valid until the next `replace_tail`."""
        return self.buf[: self.length]


def _check_request(request: ProposalRequest) -> np.ndarray:
    """Validate one request; return its append tokens as int32 [n]."""
    for name in ("base_len", "k"):
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(
                f"ProposalRequest.{name} must be an integer >= 0, got {value!r} (seq_id={request.seq_id!r})"
            )
    append = np.asarray(request.append_token_ids)
    if append.ndim != 1 or not (append.size == 0 or np.issubdtype(append.dtype, np.integer)):
        raise ValueError(
            "ProposalRequest.append_token_ids must be a 1-D integer array, "
            f"got dtype={append.dtype} shape={append.shape} (seq_id={request.seq_id!r})"
        )
    return append.astype(np.int32, copy=False)


class NgramProposer:
    """`ProposalSource` drafting with `ngram_lookup` over each sequence's own context.

    State: `seq_id -> _TokenBuffer`. For each request the proposer keeps `base_len`
    tokens, appends `append_token_ids` and drafts `min(k, config.max_k)` tokens at most;
    `k == 0` only updates the state. If it holds fewer than `base_len` tokens (unknown
    `seq_id`, a restart, a lost delta) it answers `resync=True` and *drops* whatever it
    held for that `seq_id`: the engine's next request is the full context
    (`base_len == 0`), which rebuilds the state, and a sequence whose engine never comes
    back leaves nothing behind. Drafts are deterministic, so `draft_probs` is None.

    >>> p = NgramProposer(NgramConfig(min_n=1, max_n=2))
    >>> req = ProposalRequest("a", base_len=0, append_token_ids=np.array([1, 2, 3, 1], np.int32), k=2)
    >>> p.propose_sync([req])[0].draft_token_ids
    array([2, 3], dtype=int32)
    >>> p.propose_sync([ProposalRequest("b", base_len=5, append_token_ids=np.array([], np.int32), k=2)])[0].resync
    True
    """

    method = "ngram"

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config if config is not None else NgramConfig()
        self._contexts: dict[str, _TokenBuffer] = {}

    @property
    def num_sequences(self) -> int:
        """Sequences with state held."""
        return len(self._contexts)

    def context_token_ids(self, seq_id: str) -> np.ndarray | None:
        """int32 [L] copy of the context held for `seq_id`, or None if none is held."""
        state = self._contexts.get(seq_id)
        return None if state is None else state.view().copy()

    def propose_sync(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        """Apply every request's delta and draft; one `Proposal` per request, in order.

        All requests are validated before any state changes, so a bad batch raises
        `ValueError` (naming the field and `seq_id`) and leaves the state as it was.
        """
        appends = [_check_request(request) for request in requests]
        return [self._propose_one(request, append) for request, append in zip(requests, appends)]

    async def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        """`propose_sync`, run inline: a lookup is microseconds per sequence, well below
        the cost of handing it to a thread (and the state would then need a lock)."""
        return self.propose_sync(requests)

    def release(self, seq_ids: Sequence[str]) -> None:
        """Forget the state of finished or aborted sequences (idempotent)."""
        for seq_id in seq_ids:
            self._contexts.pop(seq_id, None)

    def _propose_one(self, request: ProposalRequest, append_token_ids: np.ndarray) -> Proposal:
        state = self._contexts.get(request.seq_id)
        num_held = 0 if state is None else state.length
        if num_held < request.base_len:
            self._contexts.pop(request.seq_id, None)
            logger.debug("resync seq_id=%s: holds %d tokens, base_len=%d", request.seq_id, num_held, request.base_len)
            return Proposal(request.seq_id, np.empty(0, dtype=np.int32), resync=True)
        if state is None:
            state = self._contexts[request.seq_id] = _TokenBuffer()
        state.replace_tail(request.base_len, append_token_ids)
        k = min(int(request.k), self.config.max_k)
        draft_token_ids = ngram_lookup(state.view(), self.config.min_n, self.config.max_n, k)
        return Proposal(request.seq_id, draft_token_ids)
