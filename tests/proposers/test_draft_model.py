"""The draft-model proposer on the real bundled model.

Drafts built in seconds from the target's own weights (DESIGN.md, "Models that run here"):
- the target itself: its greedy drafts are the target's own greedy tokens, so every draft
  is accepted unless the proposer's cache bookkeeping (reuse of accepted drafts, rollback)
  is wrong;
- the target without layers 5, 15 and 25: drafts that are sometimes right and sometimes
  not, so rounds accept part of a draft.
Expected tokens come from plain decoding (speculation off) or from running the model over
the whole context with a fresh cache, never from the proposer.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch

from cluster.workloads import load_prompts
from protos.proposal import ProposalRequest
from proposers.draft_model import (DraftModelConfig, DraftModelProposer, ranked_vocabulary, with_layers,
                                   with_vocab_subset)
from proposers.registry import build_proposer
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.models.vocab import VocabFingerprint
from verifier.rejection_sampler import rejection_sample
from verifier.sampling import logits_to_probs
from verifier.sampling_params import SamplingParams

SKIP_3 = [i for i in range(30) if i not in (5, 15, 25)]


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return VocabFingerprint.of(tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return load_prompts("chat", tokenizer)[:3]


def _greedy_continuation(model, context: list[int], n: int) -> list[int]:
    """n greedy tokens after `context`, each from a full pass over a fresh cache."""
    out = []
    for _ in range(n):
        ids = context + out
        cache = model.new_cache(1, len(ids) + 1)
        slot = cache.allocate()
        logits = model.forward(torch.tensor(ids), [slot], [len(ids)], cache, torch.tensor([len(ids) - 1]))
        out.append(int(logits[0].argmax()))
    return out


def _request(seq_id, base_len, append, k, temperature=0.0):
    return ProposalRequest(seq_id, base_len, np.asarray(append, dtype=np.int32), k, temperature)


def test_drafts_follow_the_delta_contract(model, vocab, prompts):
    draft = DraftModelProposer(model, vocab, DraftModelConfig(max_num_seqs=2, max_model_len=256, max_k=4))
    prompt = list(prompts[0])
    # A new sequence: its drafts are the target's greedy continuation (it is the target).
    g = _greedy_continuation(model, prompt, 6)
    (p,) = draft.propose_sync([_request("a", 0, prompt, 3)])
    assert p.draft_token_ids.tolist() == g[:3] and p.draft_probs is None and not p.resync
    # The verifier accepted g1 and emitted x != g2: the context is prompt + [g1, x].
    x = (g[1] + 1) % 49152
    (p,) = draft.propose_sync([_request("a", len(prompt), [g[0], x], 4)])
    assert p.draft_token_ids.tolist() == _greedy_continuation(model, prompt + [g[0], x], 4)
    # A shorter base_len (the verifier dropped tokens): truncate, then continue from there.
    (p,) = draft.propose_sync([_request("a", len(prompt) - 2, prompt[-2:] + [g[0]], 2)])
    assert p.draft_token_ids.tolist() == g[1:3]
    # k above max_k is capped; k = 0 only updates the state.
    (p,) = draft.propose_sync([_request("a", len(prompt) + 1, [g[1]], 0)])
    assert p.draft_token_ids.size == 0 and not p.resync
    (p,) = draft.propose_sync([_request("a", len(prompt) + 2, [], 9)])
    assert p.draft_token_ids.tolist() == g[2:6]
    # Unknown sequence, or more base_len than the proposer holds: resync.
    (p,) = draft.propose_sync([_request("b", 5, [1, 2], 2)])
    assert p.resync and p.draft_token_ids.size == 0
    (p,) = draft.propose_sync([_request("a", len(prompt) + 50, [1], 2)])
    assert p.resync
    # A full resend after the resync drafts again.
    (p,) = draft.propose_sync([_request("a", 0, prompt, 2)])
    assert p.draft_token_ids.tolist() == g[:2]


def test_least_recently_used_sequence_is_evicted_and_resyncs(model, vocab, prompts):
    draft = DraftModelProposer(with_layers(model, [0]), vocab, DraftModelConfig(max_num_seqs=2, max_model_len=256))
    for seq_id, prompt in zip("abc", prompts):  # c takes a's slot
        draft.propose_sync([_request(seq_id, 0, prompt, 1)])
    assert draft.num_sequences == 2
    out = draft.propose_sync([_request("a", len(prompts[0]), [7], 1), _request("b", len(prompts[1]), [7], 1)])
    assert [p.resync for p in out] == [True, False]
    draft.release(["b", "c", "never-seen"])
    assert draft.num_sequences == 0 and draft.cache.num_free_slots == 2


def test_token_ids_outside_the_vocabulary_are_refused(model, vocab):
    draft = DraftModelProposer(with_layers(model, [0]), vocab, DraftModelConfig(max_num_seqs=1, max_model_len=64))
    with pytest.raises(ValueError, match="append_token_ids"):
        draft.propose_sync([_request("a", 0, [1, 49152], 2)])


def test_the_target_as_its_own_draft_over_a_vocabulary_subset_accepts_exactly_the_tokens_inside(
        model, tokenizer, vocab, prompts):
    """A draft's LM head cut to the 3000 most frequent tokens (`vocab_subset`): the target
    drafting for itself proposes its own greedy token wherever that token is in the subset
    and something else where it is not. So, decoding the expected tokens (plain decoding)
    by hand in rounds of k = 4, a round accepts the drafts up to the first expected token
    outside the subset and emits one more."""
    ids = ranked_vocabulary(tokenizer, 3000)
    assert ids.size == 3000 and np.all(np.diff(ids) > 0) and set(tokenizer.eos_token_ids) <= set(ids.tolist())
    assert {tokenizer.encode(w, add_special_tokens=False)[0] for w in (" the", "def", " return")} <= set(ids.tolist())
    inside = set(ids.tolist())
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    config = EngineConfig(max_num_seqs=3, max_model_len=512)
    expected = [r.token_ids for r in Engine(model, tokenizer, config, None, Controller.off()).generate_sync(prompts, params)]
    draft = DraftModelProposer(with_vocab_subset(model, ids), vocab, DraftModelConfig(max_num_seqs=3, max_model_len=512),
                               token_map=ids)
    results = Engine(model, tokenizer, config, {"draft": draft}, Controller.static(4, ("draft",))).generate_sync(
        prompts, params)
    assert [r.token_ids for r in results] == expected
    total_outside = 0
    for want, r in zip(expected, results):
        accepted, drafted, pos = 0, 0, 1  # token 0 comes from the prefill
        while pos < len(want):
            k = min(4, len(want) - pos - 1)
            run = 0
            while run < k and want[pos + run] in inside:
                run += 1
            drafted, accepted, pos = drafted + k, accepted + run, pos + run + 1
        assert (r.stats.drafted, r.stats.accepted) == (drafted, accepted)
        total_outside += sum(t not in inside for t in want[1:])
    assert total_outside > 0  # the subset did cut some rounds short


def test_vocab_subset_is_for_plain_models():
    with pytest.raises(ValueError, match="apply to a plain model"):
        build_proposer("draft", {"vocab_subset": 1000})  # the committed draft is trained, with its own subset
    with pytest.raises(ValueError, match="vocab_subset must be a number of tokens >= 1"):
        build_proposer("draft", {"vocab_subset": 0})


@pytest.mark.parametrize("layers, all_accepted", [(None, True), (SKIP_3, False)])
def test_engine_with_a_draft_model_is_exact(model, tokenizer, vocab, prompts, layers, all_accepted):
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    plain = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512), None, Controller.off())
    expected = [r.token_ids for r in plain.generate_sync(prompts, params)]
    draft_model = model if layers is None else with_layers(model, layers)
    draft = DraftModelProposer(draft_model, vocab, DraftModelConfig(max_num_seqs=3, max_model_len=512))
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512), {"draft": draft},
                    Controller.static(4, ("draft",)))
    results = engine.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == expected
    for r in results:
        if all_accepted:
            # 21 tokens: 1 from the prefill, then 4 rounds of 4 accepted drafts + 1 bonus.
            assert (r.stats.rounds, r.stats.drafted, r.stats.accepted) == (4, 16, 16)
        else:
            assert 0 < r.stats.accepted < r.stats.drafted
    # Finished sequences are released from the draft's cache.
    assert draft.num_sequences == 0 and draft.cache.num_free_slots == 3


def test_sampled_drafts_come_with_the_distribution_they_were_drawn_from(model, tokenizer, vocab, prompts):
    """10,048 first drafts at temperature 0.8 for one context (64 copies of the sequence per
    round): the tokens follow the returned q, and rejection sampling with the target's p
    and that q emits tokens that follow p.

    Tokens are grouped into 11 categories (p's 10 most likely tokens and "other"), so the
    bound of tests/verifier/test_rejection_sampler.py applies with V = 11, N = 10,048:
    0.5 sqrt(11 / N) + sqrt(ln(1000) / 2N) = 0.0165 + 0.0185 = 0.035.
    """
    temperature, n_copies, n_rounds = 0.8, 64, 157
    # Two layers: a cheap draft whose distribution is far from the target's.
    draft = DraftModelProposer(with_layers(model, [0, 29]), vocab,
                               DraftModelConfig(max_num_seqs=n_copies, max_model_len=128, sample_top_k=64, seed=3))
    prompt = list(prompts[1])
    tokens, qs = [], []
    for r in range(n_rounds):
        base = 0 if r == 0 else len(prompt)
        append = prompt if r == 0 else []
        out = draft.propose_sync([_request(f"s{i}", base, append, 1, temperature) for i in range(n_copies)])
        for p in out:
            assert p.draft_token_ids.size == 1 and p.draft_probs.shape == (1, 49152)
            tokens.append(int(p.draft_token_ids[0]))
            qs.append(p.draft_probs[0])
    q = qs[-1]
    # One context, one q (the first round's prefill pass rounds a little differently).
    assert all(np.allclose(q, other, atol=1e-5) for other in qs)
    assert math.isclose(float(q.sum()), 1.0, abs_tol=1e-5) and (q > 0).sum() == 64

    cache = model.new_cache(1, 256)
    slot = cache.allocate()
    logits = model.forward(torch.tensor(prompt + [0]), [slot], [len(prompt) + 1], cache,
                           torch.tensor([len(prompt) - 1, len(prompt)]))
    p = logits_to_probs(logits, temperature, 0, 1.0)  # [2, V]: p0, and a bonus row

    top = torch.topk(p[0], 10).indices.tolist()
    category = {t: i for i, t in enumerate(top)}

    def histogram(ids) -> np.ndarray:
        counts = np.bincount([category.get(int(t), 10) for t in ids], minlength=11)
        return counts / len(ids)

    def grouped(dist) -> np.ndarray:
        d = np.asarray(dist, dtype=np.float64)
        return np.append(d[top], 1.0 - d[top].sum())

    n = len(tokens)
    bound = 0.5 * math.sqrt(11 / n) + math.sqrt(math.log(1000) / (2 * n))
    assert bound == pytest.approx(0.035, abs=5e-4)
    assert 0.5 * np.abs(histogram(tokens) - grouped(q)).sum() <= bound
    generator = torch.Generator().manual_seed(5)
    q_t = torch.from_numpy(q).unsqueeze(0)
    emitted = [int(rejection_sample(p, np.array([t], np.int32), q_t, generator)[1][0]) for t in tokens]
    assert 0.5 * np.abs(histogram(emitted) - grouped(p[0].numpy())).sum() <= bound
    # The test can fail: the draft's own distribution is far from p's.
    assert 0.5 * np.abs(grouped(q) - grouped(p[0].numpy())).sum() > 4 * bound


def test_over_grpc_drafts_probabilities_and_info_are_those_of_the_proposer(model, vocab, prompts):
    """A sampled round over gRPC (probabilities travel sparse: 64 entries per draft) gives
    the same tokens and q as the same proposer, same seed, in process."""
    import asyncio

    from proposers.server import ProposerServicer, start_server
    from verifier.proposer_client import GrpcProposalSource

    config = DraftModelConfig(max_num_seqs=2, max_model_len=256, max_k=4, seed=9)
    local = DraftModelProposer(with_layers(model, SKIP_3), vocab, config)
    served = DraftModelProposer(with_layers(model, SKIP_3), vocab, config)
    requests = [_request("a", 0, prompts[0], 3, 0.7), _request("b", 0, prompts[1], 2, 0.0)]

    async def run():
        server, port = await start_server(ProposerServicer(served, max_k=config.max_k))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="draft", deadline_s=30.0)
        try:
            info = await client.info()
            return info, await client.propose(requests)
        finally:
            await client.close()
            await server.stop(0)

    info, remote = asyncio.run(run())
    assert (info.method, info.max_k, info.needs_hidden_states) == ("draft", 4, False)
    assert VocabFingerprint.from_proto(info.tokenizer) == vocab
    expected = local.propose_sync(requests)
    for got, want in zip(remote, expected):
        assert got.draft_token_ids.tolist() == want.draft_token_ids.tolist()
    assert remote[1].draft_probs is None  # greedy: deterministic drafts
    assert remote[0].draft_probs.shape == (3, 49152)
    np.testing.assert_array_equal(remote[0].draft_probs, expected[0].draft_probs)


def test_sampled_engine_with_draft_probabilities_accepts_what_theory_says(model, tokenizer, vocab, prompts):
    """The target as its own draft at temperature 0.8, drafting from its top 64 tokens:
    a draft is accepted with probability sum_x min(p(x), q(x)) = p's mass on its own top 64
    (q is p restricted to them), close to 1. Were q ignored (one-hot), the rate would be
    sum_x q(x) p(x) ~ sum_x p(x)^2, far lower for a chat answer."""
    params = SamplingParams(max_tokens=21, temperature=0.8, ignore_eos=True, seed=1)
    draft = DraftModelProposer(model, vocab, DraftModelConfig(max_num_seqs=3, max_model_len=512, sample_top_k=64))
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512), {"draft": draft},
                    Controller.static(4, ("draft",)))
    results = engine.generate_sync(prompts, params)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    assert all(len(r.token_ids) == 21 for r in results)
    assert accepted / drafted > 0.8, (accepted, drafted)


@pytest.mark.slow
def test_sampled_token_trees_follow_the_targets_distribution(model, tokenizer, vocab):
    """768 requests of 3 tokens at temperature 0.8 after "My favourite colour is", the
    target itself drafting trees of its 3 best next tokens (depth 1: the 2 tokens left
    after the prefill's allow one draft position). The first token comes from the
    prefill; the round after it verifies the 3 children with `sample_accept_tree`, which
    emits a child and the bonus from that child's row, or a token of the residual.

    - The first two tokens follow p(t1) p(t2 | t1) (`_p_after`: the model over the whole
      context on a fresh cache), in 10 categories: t1 among p's 3 most likely, t2 among
      p(. | t1)'s 3, and "other". Bound of tests/verifier/test_rejection_sampler.py:
      0.5 sqrt(10 / 768) + sqrt(ln(1000) / 1536) = 0.124.
    - Given the most frequent first two tokens, the third (the bonus of an accepted child,
      read from that child's row of the tree pass) follows p(. | t1 t2) in 11 categories.
    """
    temperature, n_batches, batch = 0.8, 24, 32
    prompt = tokenizer.encode("My favourite colour is")
    draft = DraftModelProposer(model, vocab, DraftModelConfig(max_num_seqs=batch, max_model_len=64, tree=(3,)))
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=batch, max_model_len=64), {"draft": draft},
                    Controller.static(1, ("draft",)))
    outs = []
    for b in range(n_batches):
        params = [SamplingParams(max_tokens=3, temperature=temperature, seed=1000 + b * batch + i, ignore_eos=True)
                  for i in range(batch)]
        results = engine.generate_sync([prompt] * batch, params)
        assert all(len(r.token_ids) == 3 for r in results)
        outs += [tuple(r.token_ids) for r in results]
    accepted = sum(1 for r in results if r.stats.accepted)  # the last batch: trees were verified
    assert accepted > 0

    def p_after(context):
        return logits_to_probs(_last_logits(model, context), temperature, 0, 1.0)[0].numpy().astype(np.float64)

    n = len(outs)
    p1 = p_after(prompt)
    firsts = np.argsort(-p1)[:3].tolist()
    after = {t: p_after(prompt + [t]) for t in firsts}
    joint = {(t, u): p1[t] * after[t][u] for t in firsts for u in np.argsort(-after[t])[:3].tolist()}
    want = np.append(list(joint.values()), 1.0 - sum(joint.values()))
    got = np.bincount([list(joint).index(o[:2]) if o[:2] in joint else len(joint) for o in outs],
                      minlength=len(joint) + 1) / n
    bound = 0.5 * math.sqrt(len(want) / n) + math.sqrt(math.log(1000) / (2 * n))
    assert bound == pytest.approx(0.124, abs=1e-3)
    assert 0.5 * np.abs(got - want).sum() <= bound, (got, want)

    pair = collections.Counter(o[:2] for o in outs).most_common(1)[0][0]
    thirds = [o[2] for o in outs if o[:2] == pair]
    p3 = p_after(prompt + list(pair))
    top = np.argsort(-p3)[:10].tolist()
    got3 = np.bincount([top.index(t) if t in top else 10 for t in thirds], minlength=11) / len(thirds)
    want3 = np.append(p3[top], 1.0 - p3[top].sum())
    bound3 = 0.5 * math.sqrt(11 / len(thirds)) + math.sqrt(math.log(1000) / (2 * len(thirds)))
    assert len(thirds) >= 40 and 0.5 * np.abs(got3 - want3).sum() <= bound3, (len(thirds), got3, want3)
    # The test can fail: a bonus read from the root's row (the one before the accepted
    # child) would follow p(. | t1) instead, far from p(. | t1 t2).
    p2 = p_after(prompt + [pair[0]])
    assert 0.5 * np.abs(np.append(p2[top], 1.0 - p2[top].sum()) - want3).sum() > bound3


def _last_logits(model, context: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(context) + 1)
    slot = cache.allocate()
    return model.forward(torch.tensor(context), [slot], [len(context)], cache, torch.tensor([len(context) - 1]))
