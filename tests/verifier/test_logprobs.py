"""Log probabilities (`SamplingParams.logprobs`): each output token's, under the target's raw
distribution, whether the token was decoded, drafted and accepted, or drafted in a token
tree off the first-child chain.

References: hand computation for `token_logprobs`; HF transformers' own Llama forward on
the same GGUF weights (log_softmax of its logits at each output position) for the engine.
"""

from __future__ import annotations

import math

import pytest
import torch

from proposers.ngram import NgramProposer
from tests.verifier.test_engine import _OracleTreeProposer
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.errors import InvalidRequestError
from verifier.sampling import token_logprobs
from verifier.sampling_params import MAX_LOGPROBS, SamplingParams

CONFIG = EngineConfig(max_num_seqs=4, max_model_len=512)
TOP = 5


def test_token_logprobs_by_hand():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)],
                           [0.0, 1.0, 1.0]])  # row 1: ids 1 and 2 tie; softmax [1, e, e] / (1 + 2e)
    out = token_logprobs(logits, [1, 0], 2)
    assert [o.token_id for o in out] == [1, 0]
    assert out[0].logprob == pytest.approx(math.log(0.3), abs=1e-6)
    assert [t for t, _ in out[0].top] == [0, 1]
    assert [v for _, v in out[0].top] == pytest.approx([math.log(0.5), math.log(0.3)], abs=1e-6)
    z = 1 + 2 * math.e
    assert out[1].logprob == pytest.approx(-math.log(z), abs=1e-6)
    assert [t for t, _ in out[1].top] == [1, 2]  # the tie is ranked by id
    assert [v for _, v in out[1].top] == pytest.approx([1 - math.log(z)] * 2, abs=1e-6)
    assert [o.top for o in token_logprobs(logits, [2, 2], 0)] == [(), ()]
    # Ranks count the tokens at least as likely: 0.3 is second; in row 1 token 0 is last,
    # and the tied ids 1 and 2 both count 2 (vLLM's rule).
    assert [o.rank for o in out] == [2, 3]
    assert [o.rank for o in token_logprobs(logits, [0, 1], 0)] == [1, 2]
    assert [o.rank for o in token_logprobs(logits, [2, 2], 1)] == [3, 2]
    # More alternatives than the vocabulary: all of them.
    assert [t for t, _ in token_logprobs(logits[:1], [0], 7)[0].top] == [0, 1, 2]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 1.5])
def test_bad_logprobs_are_refused_naming_the_field(bad, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: bad}).validate()
    assert info.value.param == field


def test_token_bytes_and_text(tokenizer):
    text = "héllo — ✓ 日本\n\tx = {'a': 1}"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    # "✓" is three bytes that BPE splits over tokens: each piece is shown escaped.
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"\x9c" in pieces and tokenizer.token_text(ids[pieces.index(b"\x9c")]) == "\\x9c"
    assert tokenizer.token_text(ids[0]) == "h"
    eos = min(tokenizer.eos_token_ids)
    assert tokenizer.token_text(eos) == tokenizer.decode([eos]) == "<|im_end|>"


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from cluster.workloads import load_prompts

    return load_prompts("code_edit", tokenizer)[:2] + load_prompts("chat", tokenizer)[:2]


def _hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's log_softmax at each output position: [len(output), V]."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_against_hf(hf_model, prompt, result, num_top: int) -> None:
    assert len(result.logprobs) == len(result.token_ids)
    ref = _hf_logprobs(hf_model, prompt, result.token_ids)
    for i, (lp, token) in enumerate(zip(result.logprobs, result.token_ids)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(ref[i, token]), abs=1e-4), f"position {i}"
        assert len(lp.top) == num_top
        ids = [t for t, _ in lp.top]
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        # HF's own values for our top tokens, and HF's top values: equal up to rounding
        # (which tokens tie within 1e-4 may order differently).
        assert values == pytest.approx(ref[i, ids].tolist(), abs=1e-4)
        assert values == pytest.approx(torch.topk(ref[i], num_top).values.tolist(), abs=1e-4)


def test_greedy_logprobs_with_speculation_equal_hf_and_plain_decoding(model, tokenizer, hf_model, prompts):
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=TOP)
    plain = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(prompts, params)
    engine = Engine(model, tokenizer, CONFIG, NgramProposer(), Controller.static(4))
    spec = engine.generate_sync(prompts, params)
    assert engine.stats.num_accepted > 0  # drafted rows gave some of the tokens
    for prompt, a, b in zip(prompts, plain, spec):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-4)
        assert a.logprobs[0].top[0][0] == a.token_ids[0]  # greedy: the chosen token is the most likely
        _check_against_hf(hf_model, prompt, b, TOP)


def test_logprobs_of_a_token_trees_accepted_path(model, tokenizer, hf_model, prompts):
    """Each round's tree holds the next three tokens on a path that leaves the first-child
    chain (tree indices 1, 4, 5): their logprobs come from those rows, not the chain's."""
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    two = prompts[:2]
    plain = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(two, params)
    outputs = {tuple(p): r.token_ids for p, r in zip(two, plain)}
    engine = Engine(model, tokenizer, CONFIG, {"oracle": _OracleTreeProposer(outputs, model.config.vocab_size)},
                    Controller.static(3, ("oracle",)))
    trees = engine.generate_sync(two, params)
    assert all(r.stats.accepted == 3 * r.stats.rounds_with_drafts > 0 for r in trees)
    for prompt, a, b in zip(two, plain, trees):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-4)
        _check_against_hf(hf_model, prompt, b, 2)


def test_sampled_logprobs_are_the_raw_distributions(model, tokenizer, hf_model, prompts):
    """Sampled with temperature, top-k and speculation: each token's logprob is still the
    target's raw log_softmax (not the processed distribution it was drawn from)."""
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=7, logprobs=1)
    engine = Engine(model, tokenizer, CONFIG, NgramProposer(), Controller.static(4))
    results = engine.generate_sync(prompts, params)
    assert engine.stats.num_accepted > 0
    for prompt, r in zip(prompts, results):
        _check_against_hf(hf_model, prompt, r, 1)


def test_logprobs_end_with_the_output(model, tokenizer, prompts):
    """A stop string or max_tokens cuts a round's tokens: the logprobs are cut with them."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(prompts[:1], params)[0]
    stop = tokenizer.decode(plain.token_ids[5:7])  # ends the output within its first 7 tokens
    engine = Engine(model, tokenizer, CONFIG, NgramProposer(), Controller.static(4))
    for p in (SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,), logprobs=0),
              SamplingParams(max_tokens=3, temperature=0.0, logprobs=0)):
        r = engine.generate_sync(prompts[:1], p)[0]
        assert len(r.token_ids) < len(plain.token_ids)
        assert [lp.token_id for lp in r.logprobs] == r.token_ids
        assert all(lp.top == () for lp in r.logprobs)
    # Not asked: none.
    assert engine.generate_sync(prompts[:1], params)[0].logprobs is None


def test_prompt_logprobs_equal_hf_in_passes_beside_other_sequences(model, tokenizer, hf_model, prompts):
    """Prefills that ask for their prompt's logprobs (every prompt row's logits) share
    passes with other sequences' prefills and verifications (6 requests, 3 slots), and
    every output stays plain decoding's."""
    six = prompts + prompts[:2]
    params = [SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=2 if i % 2 == 0 else None)
              for i in range(len(six))]
    plain = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        six, SamplingParams(max_tokens=16, temperature=0.0))
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512), NgramProposer(),
                    Controller.static(4))
    results = engine.generate_sync(six, params)
    assert engine.stats.num_accepted > 0
    for prompt, p, r, want in zip(six, params, results, plain):
        assert r.token_ids == want.token_ids
        if p.prompt_logprobs is None:
            assert r.prompt_logprobs is None
            continue
        assert_prompt_logprobs_are_hf(hf_model, prompt, r.prompt_logprobs)


def assert_prompt_logprobs_are_hf(hf_model, prompt, prompt_logprobs, num_top: int = 2) -> None:
    """One entry per prompt token, None first, each token's logprob, rank and top
    `num_top` as HF's log_softmax of the whole prompt gives them."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    for j, lp in enumerate(prompt_logprobs[1:]):
        assert lp.token_id == prompt[j + 1]
        assert lp.logprob == pytest.approx(float(ref[j, prompt[j + 1]]), abs=1e-4), j
        row = ref[j]
        assert int((row > lp.logprob + 1e-3).sum()) < lp.rank <= int((row >= lp.logprob - 1e-3).sum()), j
        assert [v for _, v in lp.top] == pytest.approx(torch.topk(ref[j], num_top).values.tolist(), abs=1e-4)
