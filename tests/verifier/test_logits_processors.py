"""Penalties, logit bias, min_tokens and bad words (`verifier.logits_processors`) stay exact under
speculation: each verified row is processed on its own context (the output plus the
drafts on its path).

References: hand computation; HF transformers' `generate` with its own
`repetition_penalty`; and, for what HF's `generate` does not have as such (OpenAI's
presence and frequency penalties and logit bias, vLLM's min_tokens and bad_words), a decoding loop
written here over HF's forward (its logits, the formula from the API references, argmax).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from proposers.ngram import NgramProposer
from tests.verifier.test_engine import _OracleTreeProposer
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.errors import InvalidRequestError
from verifier.logits_processors import RowContext, bad_word_token_ids, process_rows, row_paths
from verifier.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(max_num_seqs=4, max_model_len=512)
MAX_TOKENS = 24
PRESENCE, FREQUENCY = 1.0, 1.5


def test_penalties_by_hand():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    context = RowContext([0, 0])
    context.add([2, 3, 2])  # counts {2: 2, 3: 1}
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]] * 2)
    process_rows(logits, params, context, [[], [1]])
    # Token 0 (prompt only): 2 / 2. Token 1: untouched in row 0; in row 1 (drafted once
    # before it): -1 * 2 - 0.5 - 0.25. Token 2: 0.5 / 2 - 0.5 * 2 - 0.25. Token 3: 3 / 2 - 0.5 - 0.25.
    assert logits.tolist() == [[1.0, -1.0, -1.0, 0.75], [1.0, -2.75, -1.0, 0.75]]
    assert context.counts == {2: 2, 3: 1}  # the paths are not added to the output's counts


def test_logit_bias_and_min_tokens_by_hand():
    """Bias after the penalties; min_tokens 4 with 2 tokens out: the rows deciding tokens 3
    and 4 (paths of 0 and 1 drafts) cannot end the output, the row deciding token 5 can."""
    params = SamplingParams(max_tokens=8, presence_penalty=1.0, logit_bias=((1, 2.5), (3, -100.0)), min_tokens=4)
    context = RowContext([], stop_token_ids=[3])
    context.add([1, 2])
    logits = torch.zeros(3, 4)
    process_rows(logits, params, context, [[], [0], [0, 2]])
    ninf = float("-inf")
    assert logits.tolist() == [[0.0, 1.5, -1.0, ninf], [-1.0, 1.5, -1.0, ninf], [-1.0, 1.5, -1.0, -100.0]]
    assert context.num_output == 2


def test_bad_words_by_hand():
    """Bad words (5) and (7, 8, 9) after an output ending in 7: 5 is refused on every
    row; 9 only on the row after a path that ends the output with 7, 8."""
    context = RowContext([], bad_words=[(5,), (7, 8, 9)])
    context.add([1, 7])
    logits = torch.zeros(4, 10)
    process_rows(logits, SamplingParams(bad_words=("unused",)), context, [[], [8], [8, 3], [7, 8]])
    banned = [[j for j in range(10) if row[j] == float("-inf")] for row in logits.tolist()]
    assert banned == [[5], [5, 9], [5], [5, 9]]
    assert context.tail == [1, 7]  # the last two output tokens: the longest prefix's length
    context.add([8])
    assert context.tail == [7, 8] and context.banned([]) == [5, 9]
    assert RowContext([], bad_words=[(7, 8, 9)]).banned([8]) == []  # too short an output


def test_allowed_token_ids_by_hand():
    # Every row keeps only ids 1 and 3, with the values processing gave them (bias on 3).
    context = RowContext([], allowed_token_ids=(3, 1, 3))
    logits = torch.tensor([[0.5, 1.0, 2.0, 3.0], [4.0, -1.0, 0.0, 1.0]])
    process_rows(logits, SamplingParams(allowed_token_ids=(3, 1, 3), logit_bias=((3, 1.0),)), context, [[], [2]])
    ninf = float("-inf")
    assert logits.tolist() == [[ninf, 1.0, ninf, 4.0], [ninf, -1.0, ninf, 2.0]]


def test_bad_word_token_ids_by_hand(tokenizer):
    def pieces(ids):
        return [tokenizer.decode([t]) for t in ids]

    # " Paris" is another token than "Paris": both refused, so the word is refused at the
    # start of the output and after a space; leading spaces of the word do not count.
    alone, spaced = bad_word_token_ids(tokenizer, ["Paris"])
    assert pieces(alone) == ["Paris"] and pieces(spaced) == [" Paris"]
    assert bad_word_token_ids(tokenizer, ["  Paris"]) == [alone, spaced]
    # A word whose spaced form takes another number of tokens keeps its unspaced form only.
    word = "Lyon"  # "L", "yon" beside " Lyon"
    assert len(tokenizer.encode(" " + word, add_special_tokens=False)) != len(
        tokenizer.encode(word, add_special_tokens=False))
    assert [pieces(w) for w in bad_word_token_ids(tokenizer, [word])] == [
        [tokenizer.decode([t]) for t in tokenizer.encode(word, add_special_tokens=False)]]


def test_row_paths_by_hand():
    assert row_paths(np.array([7, 8, 9], np.int32), None) == [[], [7], [7, 8], [7, 8, 9]]
    # Root children 5 and 6; 6's children 7 and 8; 8's child 9.
    tree = row_paths(np.array([5, 6, 7, 8, 9], np.int32), np.array([-1, -1, 1, 1, 3], np.int32))
    assert tree == [[], [5], [6], [6, 7], [6, 8], [6, 8, 9]]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
                                          ("logit_bias", ((5, 101.0),)), ("logit_bias", ((-1, 1.0),)),
                                          ("min_tokens", -1), ("min_tokens", 17), ("bad_words", (" ",)),
                                          ("bad_words", ("",)), ("allowed_token_ids", ()),
                                          ("allowed_token_ids", (-2,))])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validate()  # max_tokens 16
    assert info.value.param == field


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from cluster.workloads import load_prompts

    return load_prompts("code_edit", tokenizer)[:2] + load_prompts("chat", tokenizer)[:2]


def _reference(hf_model, tokenizer, prompt: list[int], adjust, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy decoding over HF's logits (with its KV cache, as its `generate`), each step's
    adjusted by `adjust(logits, output)`."""
    out: list[int] = []
    with torch.inference_mode():
        step = hf_model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            logits = step.logits[0, -1].float()
            adjust(logits, out)
            token = int(logits.argmax())
            out.append(token)
            if token in tokenizer.eos_token_ids:
                break
            step = hf_model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def _speculative_runs(model, tokenizer, prompts, params: SamplingParams, plain: list[list[int]]):
    """The outputs of n-gram chains (k = 4) and of oracle token trees whose accepted path
    leaves the first-child chain, both drafting for `params`."""
    engine = Engine(model, tokenizer, CONFIG, NgramProposer(), Controller.static(4))
    chains = engine.generate_sync(prompts, params)
    assert engine.stats.num_accepted > 0
    oracle = _OracleTreeProposer({tuple(p): o for p, o in zip(prompts, plain)}, model.config.vocab_size)
    trees = Engine(model, tokenizer, CONFIG, {"oracle": oracle}, Controller.static(3, ("oracle",))).generate_sync(
        prompts, params)
    assert all(r.stats.accepted == 3 * r.stats.rounds_with_drafts > 0 for r in trees)
    return [r.token_ids for r in chains], [r.token_ids for r in trees]


def test_repetition_penalty_is_exact_under_speculation(model, tokenizer, hf_model, prompts):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.3)
    plain = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(prompts, greedy)]
    eos = sorted(tokenizer.eos_token_ids)
    with torch.inference_mode():
        for prompt, ours in zip(prompts, plain):
            ids = torch.tensor([prompt])
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, repetition_penalty=1.3, eos_token_id=eos, pad_token_id=eos[0])
            assert ours == ref[0, len(prompt):].tolist()
    unpenalized = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [r.token_ids for r in unpenalized] != plain  # the penalty matters here
    chains, trees = _speculative_runs(model, tokenizer, prompts, greedy, plain)
    assert chains == plain and trees == plain


def test_presence_and_frequency_penalties_are_exact_under_speculation(model, tokenizer, hf_model, prompts):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, presence_penalty=PRESENCE,
                            frequency_penalty=FREQUENCY)
    plain = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(prompts, greedy)]
    def adjust(logits, out):
        for token in set(out):
            logits[token] -= FREQUENCY * out.count(token) + PRESENCE

    for prompt, ours in zip(prompts, plain):
        assert ours == _reference(hf_model, tokenizer, prompt, adjust)
    unpenalized = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [r.token_ids for r in unpenalized] != plain
    chains, trees = _speculative_runs(model, tokenizer, prompts, greedy, plain)
    assert chains == plain and trees == plain
    # Sampling reads the penalised rows too: with top_k = 1 each row's distribution is
    # one-hot on its penalised argmax, so sampled speculation gives the greedy output.
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_k=1, seed=3, presence_penalty=PRESENCE,
                             frequency_penalty=FREQUENCY)
    chains, trees = _speculative_runs(model, tokenizer, prompts, sampled, plain)
    assert chains == plain and trees == plain


def test_logit_bias_and_min_tokens_are_exact_under_speculation(model, tokenizer, hf_model, prompts):
    """Each prompt's first two greedy tokens banned (-100) and a newline favoured (+3);
    chat answers that end early kept from ending before 20 tokens."""
    unbiased = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    chat = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
            for q in ("What is the capital of Italy? Answer briefly.", "Reply with one word: yes or no?")]
    eos = sorted(tokenizer.eos_token_ids)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias=((u[0], -100.0), (u[1], -100.0),
                                                                                 (newline, 3.0)))
              for u in unbiased]
    params += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=20)] * 2
    everything = prompts + chat
    plain = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        everything, params)]
    for prompt, p, ours in zip(everything, params, plain):
        def adjust(logits, out, p=p):
            for token, bias in p.logit_bias:
                logits[token] += bias
            if len(out) < p.min_tokens:
                logits[eos] = float("-inf")

        assert ours == _reference(hf_model, tokenizer, prompt, adjust)
    assert all(o[:2] != u[:2] for o, u in zip(plain, unbiased))
    # Without min_tokens both chat answers end before 20 tokens; with it they end after.
    short = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        chat, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert all(len(r.token_ids) < 20 and r.token_ids[-1] in eos for r in short)
    assert all(len(o) >= 20 for o in plain[len(prompts):])
    chains, trees = _speculative_runs(model, tokenizer, everything, params, plain)
    assert chains == plain and trees == plain


def test_bad_words_are_exact_under_speculation(model, tokenizer, hf_model, prompts):
    """Each code prompt's greedy output with one of its own two-token words made bad (one
    whose tokens are among the word's refused sequences) and, for the first, a one-token
    word too: plain decoding equals a loop over HF's logits that refuses, by the rule
    written here, a sequence's last token where the output ends with the rest; chains
    and trees give the same."""
    code = prompts[:2]
    free = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        code, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
    params = []
    for n, out in enumerate(free):
        pair = next(tokenizer.decode(out[i:i + 2]) for i in range(len(out) - 1)
                    if tokenizer.decode(out[i:i + 2]).strip().isalpha()
                    and tuple(out[i:i + 2]) in bad_word_token_ids(tokenizer, [tokenizer.decode(out[i:i + 2])]))
        words = (pair,) if n else (pair, next(tokenizer.decode([t]).strip() for t in out
                                              if len(tokenizer.decode([t]).strip()) > 3
                                              and tokenizer.decode([t]).strip().isalpha()))
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, bad_words=words))
    plain = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(code, params)]
    for prompt, p, ours, before in zip(code, params, plain, free):
        sequences = bad_word_token_ids(tokenizer, p.bad_words)

        def adjust(logits, out, sequences=sequences):
            for w in sequences:
                if len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1:]) == w[:-1]:
                    logits[w[-1]] = float("-inf")

        assert ours == _reference(hf_model, tokenizer, prompt, adjust) and ours != before
        assert not any(tuple(ours[i:i + len(w)]) == w for w in sequences for i in range(len(ours)))
    chains, trees = _speculative_runs(model, tokenizer, code, params, plain)
    assert chains == plain and trees == plain


def test_allowed_token_ids_are_exact_under_speculation(model, tokenizer, hf_model, prompts):
    """The first code prompt's greedy output's own tokens allowed, but its third token:
    plain decoding equals the loop over HF's logits keeping only those ids; chains and
    trees give the same."""
    free, = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        prompts[:1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
    allowed = tuple(sorted(set(free) - {free[2]}))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, allowed_token_ids=allowed)
    plain = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        prompts[:1], params)]

    def adjust(logits, out):
        keep = logits[list(allowed)].clone()
        logits.fill_(float("-inf"))
        logits[list(allowed)] = keep

    assert plain[0] == _reference(hf_model, tokenizer, prompts[0], adjust) and plain[0] != free
    assert set(plain[0]) <= set(allowed)
    chains, trees = _speculative_runs(model, tokenizer, prompts[:1], params, plain)
    assert chains == plain and trees == plain


def test_stop_token_ids_end_the_output_exactly_under_speculation(model, tokenizer, prompts):
    """A stop token id ends the output there, included with its text, whether decoded or
    drafted and accepted; under min_tokens it cannot be chosen before that position."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    code = prompts[:2]
    unstopped = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        code, greedy)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=(u[5],)) for u in unstopped]
    for engine in (Engine(model, tokenizer, CONFIG, None, Controller.off()),
                   Engine(model, tokenizer, CONFIG, NgramProposer(), Controller.static(4))):
        for r, u, p in zip(engine.generate_sync(code, params), unstopped, params):
            end = u.index(u[5]) + 1
            assert r.token_ids == u[:end] and r.finish_reason.value == "stop"
            assert r.text == tokenizer.decode(u[:end], skip_special_tokens=True)
    # min_tokens 12 keeps the stop token out of the first 12 tokens.
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=(u[5],), min_tokens=12)
              for u in unstopped]
    plain = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(code, params)
    for r, p in zip(plain, params):
        assert len(r.token_ids) >= 12 and p.stop_token_ids[0] not in r.token_ids[:11]
    assert [r.token_ids for r in plain] != [u[: u.index(u[5]) + 1] for u in unstopped]
    chains, trees = _speculative_runs(model, tokenizer, code, params, [r.token_ids for r in plain])
    assert chains == [r.token_ids for r in plain] and trees == chains
