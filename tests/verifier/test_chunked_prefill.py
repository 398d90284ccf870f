"""Chunked prefill (`EngineConfig.max_num_batched_tokens`) on the real model: how a pass's
tokens are shared out (counted by hand), the prompt's logprobs against HF transformers,
seeded sampling, the EAGLE-3 head's hidden states, an abort mid-prompt, the limits.
Greedy exactness against HF `generate` is in test_exactness.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.workloads import load_prompts
from proposers.draft_model import DraftModelConfig
from proposers.eagle import EagleProposer, load_eagle
from proposers.ngram import NgramProposer
from proposers.train import BUNDLED_EAGLE3_DIR
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.models.vocab import VocabFingerprint
from verifier.observer import EngineObserver
from verifier.sampling_params import SamplingParams
from tests.verifier.test_logprobs import assert_prompt_logprobs_are_hf


class PassLog(EngineObserver):
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.emitted: list[int] = []

    def on_step(self, num_tokens: int, num_seqs: int, seconds: float, num_output_tokens: int) -> None:
        self.tokens.append(num_tokens)
        self.emitted.append(num_output_tokens)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return load_prompts("code_edit", tokenizer)[:2] + load_prompts("chat", tokenizer)[:2]


def test_a_long_prompt_is_prefilled_beside_a_decoding_sequence(model, tokenizer, prompts):
    """Budget 10 a pass, A a 5-token prompt (8 tokens out), B a 23-token one (3 out), both
    waiting at the first pass. By hand:
      pass 1: A's prompt (5, A's first token) + B's first 5       = 10 tokens, 1 emitted
      pass 2: A's round (1) + B's next 9 (14 of 23)               = 10, 1
      pass 3: A (1) + B's last 9 (B's first token)                = 10, 2
      passes 4-5: A and B (B ends at 3 tokens)                    = 2 each, 2 each
      passes 6-8: A alone (A ends at 8)                           = 1 each, 1 each
    so A gets a token in every pass while B's prompt goes in; whole, B's 23 tokens would
    have gone into pass 1."""
    a, b = prompts[2][:5], prompts[0][:23]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    log = PassLog()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=10),
                    None, Controller.off(), log)
    chunked = engine.generate_sync([a, b], params)
    assert log.tokens == [10, 10, 10, 2, 2, 1, 1, 1]
    assert log.emitted == [1, 1, 2, 2, 2, 1, 1, 1]
    assert [r.stats.rounds for r in chunked] == [7, 2]  # rounds after the prefill's pass
    whole_log = PassLog()
    whole = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256), None, Controller.off(),
                   whole_log).generate_sync([a, b], params)
    assert whole_log.tokens[0] == 28
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]
    assert engine.cache.num_used_slots == 0


def test_speculating_sequences_keep_their_drafts_while_prompts_are_chunked(model, tokenizer, prompts):
    """n-gram drafts (k = 4) ride on top of the budget: every pass holds at most 12 tokens
    besides the drafts, and the outputs are plain decoding's."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512), None,
                   Controller.off()).generate_sync(prompts, params)
    log = PassLog()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512, max_num_batched_tokens=12),
                    NgramProposer(), Controller.static(4), log)
    results = engine.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert engine.stats.num_accepted > 0
    drafted = engine.stats.num_drafted
    assert max(log.tokens) <= 12 + 4 * 3 and sum(log.tokens) == sum(map(len, prompts)) + sum(
        r.stats.rounds for r in results) + drafted
    # Some prompt (36-132 tokens) took several passes: more passes than rounds plus prompts.
    assert len(log.tokens) > max(r.stats.rounds for r in results) + 1


def test_prompt_logprobs_of_chunks_equal_hf(model, tokenizer, hf_model, prompts):
    """A prompt's logprobs gathered over its chunks (budget 16: 5 to 8 passes for prompts
    of 89-119 tokens beside other sequences), against HF's log_softmax of the whole prompt."""
    two = prompts[:2]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512, max_num_batched_tokens=16),
                    None, Controller.off())
    results = engine.generate_sync(two, SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2,
                                                        logprobs=1))
    for prompt, r in zip(two, results):
        # The output's own logprobs come from its rows only, the chunks' giving none.
        assert [lp.token_id for lp in r.logprobs] == r.token_ids and len(r.token_ids) == 4
        assert_prompt_logprobs_are_hf(hf_model, prompt, r.prompt_logprobs)


def test_seeded_sampling_draws_the_same_tokens_chunked(model, tokenizer, prompts):
    """A chunk samples nothing, so a seed gives the same tokens however the prompt is cut."""
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7)

    def run(limit):
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512,
                                                       max_num_batched_tokens=limit), NgramProposer(),
                        Controller.static(3))
        return [r.token_ids for r in engine.generate_sync(prompts[:2], params)]

    assert run(8) == run(None)


class Recording(EagleProposer):
    """Keeps the target states each sequence's first call brings: its prompt's."""

    def propose_sync(self, requests):
        for r in requests:
            if r.base_len == 0:
                self.prompt_states[len(r.append_token_ids)] = r.hidden_states.float().clone()
        return super().propose_sync(requests)


@pytest.mark.slow
def test_eagle3_head_reads_the_hidden_states_of_every_chunk(model, tokenizer, prompts):
    """The committed EAGLE-3 head drafts from the target's states of the whole prompt: cut
    into chunks of at most 9 tokens, they reach it as the whole prompt's pass computes
    them, in order, and it accepts as much (about 0.4 of its drafts on these prompts).
    Outputs stay plain decoding's."""
    vocab = VocabFingerprint.of(tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def run(limit):
        eagle = Recording(load_eagle(BUNDLED_EAGLE3_DIR, model, vocab), vocab, DraftModelConfig(max_num_seqs=3))
        eagle.prompt_states = {}
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512,
                                                       max_num_batched_tokens=limit), {"eagle": eagle},
                        Controller.static(4, ("eagle",)))
        return engine.generate_sync(prompts, params), engine.stats, eagle.prompt_states

    whole, whole_stats, whole_states = run(None)
    chunked, stats, states = run(11)
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]
    assert sorted(states) == sorted(whole_states) == sorted(len(p) + 1 for p in prompts)
    for n, want in whole_states.items():
        assert states[n].shape == want.shape == (n - 1, 3 * model.config.hidden_size)
        # Rows of one position agree to bfloat16's rounding (8 bits of mantissa).
        assert torch.allclose(states[n], want, rtol=2 ** -6, atol=1e-2), n
    assert whole_stats.num_accepted > 0.2 * whole_stats.num_drafted
    assert abs(stats.num_accepted - whole_stats.num_accepted) <= 0.1 * whole_stats.num_accepted
    assert stats.num_resyncs == 0


def test_an_abort_mid_prompt_frees_its_slot(model, tokenizer, prompts):
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512, max_num_batched_tokens=4),
                    None, Controller.off())
    prompt = prompts[0]

    async def leave_during_the_prompt():
        task = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=8)).__anext__())
        while engine.stats.num_steps < 3:
            await asyncio.sleep(0.01)
        assert not task.done() and engine.cache.num_used_slots == 1  # 12 of its tokens in, no event yet
        task.cancel()
        for _ in range(200):
            if engine.num_running == 0:
                break
            await asyncio.sleep(0.02)

    asyncio.run(leave_during_the_prompt())
    assert engine.num_running == 0 and engine.cache.num_used_slots == 0
    # The slot takes the next request from its first token.
    again = engine.generate_sync([prompt[:20]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert len(again.token_ids) == 2


def test_limits_name_the_field():
    from cluster.config import SplitspecConfig

    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=7)
    EngineConfig(max_num_seqs=8, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be at least max_num_seqs \(32\)"):
        SplitspecConfig.model_validate({"verifier": {"max_num_seqs": 32, "max_num_batched_tokens": 16}})
    assert SplitspecConfig.model_validate({}).verifier.max_num_batched_tokens == 2048
    assert SplitspecConfig.model_validate({"verifier": {"max_num_batched_tokens": None}}).verifier \
        .max_num_batched_tokens is None


def test_the_config_reaches_the_engine(model, tokenizer, tmp_path):
    from cluster.config import load_config
    from cluster.local import engine_from_config

    path = tmp_path / "c.yaml"
    path.write_text("controller: {policy: off}\nverifier: {max_num_seqs: 2, max_model_len: 64, "
                    "max_num_batched_tokens: 6}\n")
    assert engine_from_config(load_config(path), model, tokenizer, {}).config.max_num_batched_tokens == 6
    path.write_text("controller: {policy: off}\nverifier: {max_num_seqs: 2, max_model_len: 64}\n")
    assert engine_from_config(load_config(path), model, tokenizer, {}).config.max_num_batched_tokens == 2048
