"""N-gram prompt lookup: hand-computed lookups, the delta contract, a reference cross-check."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from proposers.ngram import NgramConfig, NgramProposer, ngram_lookup
from protos.proposal import Proposal, ProposalRequest, ProposalSource


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def assert_draft(draft: np.ndarray, expected: list[int]) -> None:
    assert draft.dtype == np.int32, f"{draft.dtype=}"
    assert draft.tolist() == expected


# ---- ngram_lookup -------------------------------------------------------------------


def test_longest_match_preferred_over_shorter():
    # 2-gram [2 3] last occurs at s=5 (-> 5); 3-gram [1 2 3] only at s=0 (-> 4).
    ctx = ids(1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3)
    assert_draft(ngram_lookup(ctx, min_n=1, max_n=3, k=2), [4, 9])
    assert_draft(ngram_lookup(ctx, min_n=1, max_n=2, k=2), [5, 1])


def test_most_recent_occurrence_preferred():
    # [1 2] at s=0 (-> 7) and s=3 (-> 8); s=6 is the suffix itself.
    ctx = ids(1, 2, 7, 1, 2, 8, 1, 2)
    assert_draft(ngram_lookup(ctx, min_n=2, max_n=2, k=1), [8])


def test_no_match_returns_empty():
    assert_draft(ngram_lookup(ids(1, 2, 3, 4, 5), min_n=1, max_n=4, k=3), [])
    assert_draft(ngram_lookup(ids(), min_n=1, max_n=4, k=3), [])
    assert_draft(ngram_lookup(ids(7), min_n=1, max_n=4, k=3), [])


def test_k_truncates_and_zero_k_is_empty():
    ctx = ids(1, 2, 3, 4, 5, 6, 1, 2)  # [1 2] at s=0 -> 3 4 5 6 1 2
    assert_draft(ngram_lookup(ctx, min_n=2, max_n=2, k=3), [3, 4, 5])
    assert_draft(ngram_lookup(ctx, min_n=2, max_n=2, k=0), [])


def test_match_near_end_returns_fewer_than_k_and_may_overlap_suffix():
    # [4 5] at s=2 -> tokens 4 5 (index 4, 5), running into the suffix; then the context ends.
    assert_draft(ngram_lookup(ids(1, 2, 4, 5, 4, 5), min_n=2, max_n=2, k=5), [4, 5])
    # [7 7] ends at e=1 <= L-2: follows ctx[2:] = [7].
    assert_draft(ngram_lookup(ids(7, 7, 7), min_n=1, max_n=2, k=4), [7])


def test_min_n_respected():
    # Only the 1-gram [3] recurs (s=1 -> 8); the 2-gram [9 3] does not.
    ctx = ids(1, 3, 8, 9, 3)
    assert_draft(ngram_lookup(ctx, min_n=1, max_n=3, k=2), [8, 9])
    assert_draft(ngram_lookup(ctx, min_n=2, max_n=3, k=2), [])


def test_returns_a_copy():
    ctx = ids(1, 2, 3, 1, 2)
    draft = ngram_lookup(ctx, min_n=2, max_n=2, k=2)
    ctx[2] = 99
    assert_draft(draft, [3, 1])


@pytest.mark.parametrize(
    ("min_n", "max_n", "k", "field"), [(0, 2, 1, "min_n"), (3, 2, 1, "max_n"), (1, 2, -1, "k")]
)
def test_lookup_rejects_bad_arguments(min_n, max_n, k, field):
    with pytest.raises(ValueError, match=field):
        ngram_lookup(ids(1, 2, 1), min_n, max_n, k)


def reference_lookup(ctx: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Slow, literal reading of the spec."""
    num_tokens = len(ctx)
    for n in range(max_n, min_n - 1, -1):
        if n > num_tokens:
            continue
        pattern = ctx[num_tokens - n :]
        for start in range(num_tokens - n - 1, -1, -1):  # occurrence ends at <= L-2
            if ctx[start : start + n] == pattern:
                return ctx[start + n : start + n + k]
    return []


def test_matches_reference_on_random_contexts():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        vocab = int(rng.integers(2, 6))  # small vocab: matches of every length occur
        ctx = rng.integers(0, vocab, size=int(rng.integers(0, 40))).astype(np.int32)
        min_n = int(rng.integers(1, 5))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(0, 7))
        got = ngram_lookup(ctx, min_n, max_n, k)
        assert got.dtype == np.int32
        assert got.tolist() == reference_lookup(ctx.tolist(), min_n, max_n, k), f"{ctx=} {min_n=} {max_n=} {k=}"


# ---- NgramConfig ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"min_n": 0}, "min_n"), ({"min_n": 3, "max_n": 2}, "max_n"), ({"max_k": 0}, "max_k"), ({"max_n": 2.5}, "max_n")],
)
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"NgramConfig.{field}"):
        NgramConfig(**kwargs)


# ---- NgramProposer: the delta contract ------------------------------------------------


def request(seq_id: str, base_len: int, append: list[int], k: int = 4) -> ProposalRequest:
    return ProposalRequest(seq_id, base_len=base_len, append_token_ids=ids(*append), k=k)


def propose_one(proposer: NgramProposer, req: ProposalRequest) -> Proposal:
    (proposal,) = asyncio.run(proposer.propose([req]))
    assert proposal.seq_id == req.seq_id and proposal.draft_probs is None
    return proposal


def test_proposer_implements_protocol():
    assert isinstance(NgramProposer(), ProposalSource)
    assert NgramProposer.method == "ngram"


def test_first_round_then_delta_then_truncation_after_rejection():
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=3))
    first = propose_one(proposer, request("s", 0, [1, 2, 3, 4, 1, 2]))
    assert not first.resync
    assert_draft(first.draft_token_ids, [3, 4, 1, 2])  # [1 2] at s=0
    # Verifier rejected the draft and emitted 9; next round it sends the one new token.
    second = propose_one(proposer, request("s", 6, [9]))
    assert_draft(second.draft_token_ids, [])
    np.testing.assert_array_equal(proposer.context_token_ids("s"), ids(1, 2, 3, 4, 1, 2, 9))
    # A round told us to keep only 5 tokens (e.g. the engine rewound): [.. 1] + [2 3].
    third = propose_one(proposer, request("s", 5, [2, 3], k=2))
    np.testing.assert_array_equal(proposer.context_token_ids("s"), ids(1, 2, 3, 4, 1, 2, 3))
    assert_draft(third.draft_token_ids, [4, 1])  # [1 2 3] at s=0


def test_unknown_seq_resyncs_then_full_context_recovers():
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2))
    stale = propose_one(proposer, request("new", 3, [5]))
    assert stale.resync and stale.draft_token_ids.size == 0
    assert proposer.context_token_ids("new") is None
    full = propose_one(proposer, request("new", 0, [5, 6, 7, 5]))
    assert not full.resync
    assert_draft(full.draft_token_ids, [6, 7, 5])


def test_shorter_state_resyncs_and_is_dropped():
    proposer = NgramProposer()
    propose_one(proposer, request("s", 0, [1, 2, 3]))
    short = propose_one(proposer, request("s", 4, [1]))
    assert short.resync and short.draft_token_ids.size == 0
    assert proposer.context_token_ids("s") is None and proposer.num_sequences == 0


def test_release_forgets_and_is_idempotent():
    proposer = NgramProposer()
    propose_one(proposer, request("a", 0, [1, 2]))
    propose_one(proposer, request("b", 0, [3, 4]))
    proposer.release(["a", "missing"])
    proposer.release(["a"])
    assert proposer.num_sequences == 1
    assert propose_one(proposer, request("a", 2, [1])).resync
    assert not propose_one(proposer, request("b", 2, [3])).resync


def test_zero_k_updates_state_and_drafts_nothing():
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2))
    quiet = propose_one(proposer, request("s", 0, [1, 2, 1], k=0))
    assert not quiet.resync and quiet.draft_token_ids.size == 0
    assert_draft(propose_one(proposer, request("s", 3, [], k=1)).draft_token_ids, [2])


def test_k_capped_by_config_max_k():
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=1, max_k=2))
    assert_draft(propose_one(proposer, request("s", 0, [1, 2, 3, 4, 1], k=8)).draft_token_ids, [2, 3])


def test_batch_keeps_order_and_long_context_grows_buffer():
    proposer = NgramProposer(NgramConfig(min_n=2, max_n=2))
    long_ctx = list(range(3000)) + [0, 1]  # beyond the initial buffer capacity
    proposals = proposer.propose_sync(
        [request("x", 0, long_ctx, k=3), request("y", 9, [1]), request("z", 0, [4, 4, 4])]
    )
    assert [p.seq_id for p in proposals] == ["x", "y", "z"]
    assert_draft(proposals[0].draft_token_ids, [2, 3, 4])
    assert proposals[1].resync
    assert_draft(proposals[2].draft_token_ids, [4])
    # Grow again through many one-token rounds; the state must equal the concatenation.
    for i in range(2000):
        proposer.propose_sync([request("x", len(long_ctx) + i, [7], k=0)])
    np.testing.assert_array_equal(proposer.context_token_ids("x"), ids(*long_ctx, *([7] * 2000)))


def test_bad_request_raises_before_any_state_changes():
    proposer = NgramProposer()
    with pytest.raises(ValueError, match="ProposalRequest.k"):
        proposer.propose_sync([request("ok", 0, [1, 2]), request("bad", 0, [1], k=-1)])
    assert proposer.num_sequences == 0
    with pytest.raises(ValueError, match="append_token_ids"):
        proposer.propose_sync([ProposalRequest("f", 0, np.array([1.5]), k=1)])
