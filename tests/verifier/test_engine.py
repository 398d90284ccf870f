"""Engine behaviour on the real model: validation, stop rules, abort, overload, fail-open."""

from __future__ import annotations

import asyncio
import collections
import random
import time

import numpy as np
import pytest

from cluster.workloads import load_prompts
from proposers.ngram import NgramProposer
from verifier.engine import Engine, EngineConfig, profile_grid
from verifier.errors import InvalidRequestError, OverloadedError
from protos.proposal import Proposal
from verifier.controller import Controller, ControllerSettings, Decision
from verifier.sampling_params import SamplingParams
from verifier.sequence import FinishReason

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def chat_prompt(tokenizer):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))


@pytest.fixture(scope="module")
def code_prompt(tokenizer):
    """"Add type hints ... reply with the full code": the answer quotes the prompt."""
    return load_prompts("code_edit", tokenizer)[0]


@pytest.fixture(scope="module")
def plain(model, tokenizer):
    return Engine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=256), None, Controller.off())


def _first(engine, prompt, params, **kw):
    return engine.generate_sync([prompt], params, **kw)[0]


@pytest.mark.parametrize(
    "prompt_len, params, field",
    [
        (0, GREEDY, "prompt"),
        (256, GREEDY, "prompt"),  # the context holds 256 tokens: no room for any output
        (250, SamplingParams(max_tokens=10), "max_tokens"),  # 250 + 10 > 256
        (5, SamplingParams(max_tokens=0), "max_tokens"),
        (5, SamplingParams(temperature=-0.5), "temperature"),
        (5, SamplingParams(top_p=0.0), "top_p"),
        (5, SamplingParams(stop=("",)), "stop"),
    ],
)
def test_bad_input_names_the_field(plain, prompt_len, params, field):
    with pytest.raises(InvalidRequestError) as info:
        _first(plain, [100] * prompt_len, params)
    assert info.value.param == field
    assert str(info.value).startswith(f"{field}: ")
    assert plain.num_running == 0 and plain.num_waiting == 0 and plain.cache.num_used_slots == 0


def test_token_id_outside_vocabulary_is_rejected(plain, model):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        _first(plain, [1, model.config.vocab_size], GREEDY)


def test_eos_ends_the_output(plain, chat_prompt, tokenizer):
    r = _first(plain, chat_prompt, SamplingParams(max_tokens=40, temperature=0.0))
    assert r.finish_reason == FinishReason.STOP
    assert r.token_ids[-1] in tokenizer.eos_token_ids
    assert len(r.token_ids) < 40
    assert "Paris" in r.text and "<|im_end|>" not in r.text
    assert r.text == tokenizer.decode(r.token_ids[:-1])


def test_max_tokens_and_stop_strings(plain, code_prompt, tokenizer):
    full = _first(plain, code_prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert full.finish_reason == FinishReason.LENGTH and len(full.token_ids) == 20
    assert full.stats.num_output_tokens == 20
    # Stop on a string that the greedy output contains: everything before it, nothing after.
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and text.index(stop) > 0
    r = _first(plain, code_prompt, SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,), ignore_eos=True))
    assert r.finish_reason == FinishReason.STOP
    assert r.text == text[: text.index(stop)]
    assert r.token_ids == full.token_ids[: len(r.token_ids)] and len(r.token_ids) < 20
    # vLLM's include_stop_str_in_output: the same tokens, the text up to the stop's end.
    included = _first(plain, code_prompt, SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,),
                                                         ignore_eos=True, include_stop_str_in_output=True))
    assert included.text == text[: text.index(stop) + len(stop)] and included.token_ids == r.token_ids


def test_max_tokens_one_finishes_after_prefill(plain, code_prompt):
    r = _first(plain, code_prompt, SamplingParams(max_tokens=1, temperature=0.0))
    assert len(r.token_ids) == 1 and r.finish_reason == FinishReason.LENGTH and r.stats.rounds == 0


def test_client_abort_frees_kv_and_proposer_state(model, tokenizer, code_prompt):
    proposer = NgramProposer()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512), proposer, Controller.static(4))

    async def consume_two_events_then_leave():
        stream = engine.generate(code_prompt, SamplingParams(max_tokens=200, temperature=0.0))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()
        assert engine.num_running == 1  # not reaped until the loop runs again
        for _ in range(100):
            if engine.num_running == 0:
                break
            await asyncio.sleep(0.05)

    asyncio.run(consume_two_events_then_leave())
    assert engine.num_running == 0 and engine.cache.num_used_slots == 0
    assert proposer.num_sequences == 0


def test_overload_is_refused_not_queued_forever(model, tokenizer, code_prompt):
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512, max_waiting=1), None)

    async def run():
        first = engine.generate(code_prompt, SamplingParams(max_tokens=30, temperature=0.0))
        second = engine.generate(code_prompt, SamplingParams(max_tokens=2, temperature=0.0))
        await first.__anext__()  # first is running
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(second.__anext__())  # second waits for the slot
        await asyncio.sleep(0)
        third = engine.generate(code_prompt, SamplingParams(max_tokens=2, temperature=0.0))
        with pytest.raises(OverloadedError):
            await third.__anext__()
        await first.aclose()
        assert (await waiting).token_ids  # the waiting request was not lost
        async for _ in second:
            pass

    asyncio.run(run())
    assert engine.cache.num_used_slots == 0


class _FailingProposer:
    method = "failing"

    def __init__(self):
        self.calls = 0

    async def propose(self, requests):
        self.calls += 1
        raise RuntimeError("proposer replica went away")

    def release(self, seq_ids):
        pass


class _ForgetfulProposer(NgramProposer):
    """An n-gram proposer that loses its state every third call (a restarted replica)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def propose_sync(self, requests):
        self.calls += 1
        if self.calls % 3 == 0:
            self.release([r.seq_id for r in requests])
        return super().propose_sync(requests)


def test_failed_proposer_fails_open(model, tokenizer, code_prompt, plain):
    expected = _first(plain, code_prompt, GREEDY).token_ids
    proposer = _FailingProposer()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512), proposer, Controller.static(4))
    r = _first(engine, code_prompt, GREEDY)
    assert r.token_ids == expected
    assert proposer.calls > 0 and engine.stats.num_proposer_failures == proposer.calls
    assert r.stats.drafted == 0


def test_a_failing_fallback_fails_open(model, tokenizer, code_prompt, chat_prompt, plain):
    """N-gram with a fallback that fails: the rounds without a match ask it, get nothing,
    emit one token; the output stays exact and n-gram's own rounds still draft."""
    prompts = [code_prompt, chat_prompt]
    expected = [r.token_ids for r in plain.generate_sync(prompts, GREEDY)]
    fallback = _FailingProposer()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512),
                    {"ngram": NgramProposer(), "failing": fallback}, Controller.static(4, ("ngram",)),
                    fallbacks={"ngram": "failing"})
    results = engine.generate_sync(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert fallback.calls > 0 and engine.stats.num_proposer_failures == fallback.calls
    assert engine.stats.num_fallback_rounds >= fallback.calls
    assert sum(r.stats.rounds_by_method.get("ngram", 0) for r in results) > 0
    assert sum(r.stats.rounds_off.get("proposer_failed", 0) for r in results) == engine.stats.num_fallback_rounds


def test_a_configured_fallback_reaches_the_engine(model, tokenizer, tmp_path):
    from cluster.config import load_config
    from cluster.local import engine_from_config

    path = tmp_path / "c.yaml"
    path.write_text("proposers: [{method: ngram, fallback: eagle}, {method: eagle}]\n"
                    "controller: {policy: static, k: 2}\nverifier: {max_num_seqs: 1, max_model_len: 64}\n")
    # Two n-gram sources stand in for the deployments' clients: only the wiring is tested.
    engine = engine_from_config(load_config(path), model, tokenizer, {"ngram": NgramProposer(), "eagle": NgramProposer()})
    assert engine.fallbacks == {"ngram": "eagle"}


def test_resync_recovers_exactly(model, tokenizer, code_prompt, plain):
    expected = _first(plain, code_prompt, GREEDY).token_ids
    proposer = _ForgetfulProposer()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512), proposer, Controller.static(4))
    r = _first(engine, code_prompt, GREEDY)
    assert r.token_ids == expected
    assert engine.stats.num_resyncs > 0 and r.stats.accepted > 0


class _CatchUpRecorder(Controller):
    """A static k = 4 that records, per proposer call, whether the engine flagged it as a
    catch-up."""

    def __init__(self):
        super().__init__(ControllerSettings(policy="static", k=4))
        self.catch_ups: list[bool] = []

    def observe_proposer(self, method, seconds, k=None, catch_up=False):
        self.catch_ups.append(catch_up)
        super().observe_proposer(method, seconds, k, catch_up)


def test_calls_that_catch_up_on_context_are_flagged(model, tokenizer, code_prompt, plain):
    # One sequence whose proposer loses its state every third call: calls 1, 4, 7, ... send
    # the whole context (the first call, then the resync after each loss), the others what
    # a round emitted, at most k + 1 = 5 tokens. Only the former are catch-ups, which the
    # controller's latency model leaves out (`ProposerLatency`).
    expected = _first(plain, code_prompt, GREEDY).token_ids
    controller = _CatchUpRecorder()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512), _ForgetfulProposer(),
                    controller)
    assert _first(engine, code_prompt, GREEDY).token_ids == expected
    flags = controller.catch_ups
    assert len(flags) >= 4 and flags == [i % 3 == 0 for i in range(len(flags))]


class _RandomProposer:
    """Drafts uniformly random token ids: nearly always rejected, sometimes a long draft."""

    method = "random"

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    async def propose(self, requests):
        return [Proposal(r.seq_id, self.rng.integers(0, self.vocab_size, r.k, dtype=np.int32)) for r in requests]

    def release(self, seq_ids):
        pass


class _FlippingController(Controller):
    """A controller that changes its mind every round: method and k drawn at random per
    sequence, 0 included, whatever the acceptance."""

    def __init__(self, seed: int):
        super().__init__(ControllerSettings(policy="static"))
        self.rng = random.Random(seed)
        self.seen: set[tuple[str | None, int]] = set()

    def plan(self, seqs, available=None, num_prefill_tokens=0, num_prefill_seqs=0):
        out = []
        for _ in seqs:
            k = self.rng.choice([0, 1, 3, 8])
            method = self.rng.choice(self.methods) if k else None
            self.seen.add((method, k))
            out.append(Decision(method, k, "static"))
        return out


def test_controller_flipping_method_and_k_every_round_stays_exact(model, tokenizer, code_prompt, chat_prompt, plain):
    prompts = [code_prompt, chat_prompt, code_prompt[:40]]
    expected = [r.token_ids for r in plain.generate_sync(prompts, GREEDY)]
    controller = _FlippingController(seed=7)
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512),
                    {"ngram": NgramProposer(), "random": _RandomProposer(model.config.vocab_size, seed=3)},
                    controller)
    start = time.perf_counter()
    results = engine.generate_sync(prompts, GREEDY)
    wall = time.perf_counter() - start
    assert [r.token_ids for r in results] == expected
    # The time split: passes and proposer waits both happened, inside the call's wall time.
    assert engine.stats.pass_s > 0 and engine.stats.propose_s > 0
    assert engine.stats.pass_s + engine.stats.propose_s < wall
    # Both methods and every k were really used, and drafts were accepted.
    assert {m for m, _ in controller.seen} == {None, "ngram", "random"}
    assert {k for _, k in controller.seen} == {0, 1, 3, 8}
    assert engine.stats.num_accepted > 0
    assert sum(r.stats.rounds_by_method.get("random", 0) for r in results) > 0


class _OracleTreeProposer:
    """Knows each prompt's greedy output and drafts a token tree whose accepted path is
    never the first-child chain: the root's children are [wrong, true 1, wrong], true 1's
    [wrong, true 2], true 2's [true 3]. `malformed` lists a child before its parent."""

    method = "oracle"

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], vocab_size: int, malformed: bool = False):
        self.outputs, self.vocab_size, self.malformed = outputs, vocab_size, malformed
        self.context: dict[str, list[int]] = {}

    def _wrong(self, token: int, i: int) -> int:
        return (token + 1000 + i) % self.vocab_size

    async def propose(self, requests):
        out = []
        for r in requests:
            ctx = self.context.setdefault(r.seq_id, [])
            del ctx[r.base_len:]
            ctx.extend(np.asarray(r.append_token_ids).tolist())
            prompt = next(p for p in self.outputs if tuple(ctx[: len(p)]) == p)
            ahead = self.outputs[prompt][len(ctx) - len(prompt):][: min(r.k, 3)]
            if len(ahead) < 3:
                out.append(Proposal(r.seq_id, np.zeros(0, np.int32)))
                continue
            t1, t2, t3 = ahead
            tokens = [self._wrong(t1, 0), t1, self._wrong(t1, 1), self._wrong(t2, 2), t2, t3]
            parents = [-1, -1, -1, 1, 1, 4] if not self.malformed else [-1, 4, -1, 1, 1, 4]
            out.append(Proposal(r.seq_id, np.asarray(tokens, np.int32), draft_parents=np.asarray(parents, np.int32)))
        return out

    def release(self, seq_ids):
        for seq_id in seq_ids:
            self.context.pop(seq_id, None)


def test_token_trees_accept_off_chain_paths_exactly(model, tokenizer, code_prompt, chat_prompt, plain):
    """Each round's tree holds the target's next three tokens on a path that leaves the
    first-child chain at once; every full round accepts all three (their K/V moved from
    tree indices 1, 4, 5 into place), and the output is plain decoding's. A malformed
    tree is refused (no drafts, still exact); a sampled request verifies the whole tree
    too (`sample_accept_tree`; its distribution: tests/verifier/test_token_tree.py and
    tests/proposers/test_draft_model.py)."""
    prompts = [code_prompt, chat_prompt]
    expected = [r.token_ids for r in plain.generate_sync(prompts, GREEDY)]
    outputs = {tuple(p): e for p, e in zip(prompts, expected)}
    source = _OracleTreeProposer(outputs, model.config.vocab_size)
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512), {"oracle": source},
                    Controller.static(3, ("oracle",)))
    results = engine.generate_sync(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    for r in results:
        assert r.stats.rounds_with_drafts >= 2 and r.stats.drafted == 6 * r.stats.rounds_with_drafts
        assert r.stats.accepted == 3 * r.stats.rounds_with_drafts  # every tree round: all 3 depths

    bad = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512),
                 {"oracle": _OracleTreeProposer(outputs, model.config.vocab_size, malformed=True)},
                 Controller.static(3, ("oracle",)))
    results = bad.generate_sync(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.drafted == 0 and r.stats.rounds_off.get("proposer_failed", 0) > 0 for r in results)

    sampled = SamplingParams(max_tokens=24, temperature=0.7, seed=5)
    r = _first(engine, code_prompt, sampled)
    assert len(r.token_ids) == 24
    assert r.stats.rounds_with_drafts > 0 and r.stats.drafted == 6 * r.stats.rounds_with_drafts
    assert r.stats.accepted > 0  # the target's likely tokens sit off the first-child chain


class _ShadowOnlyController(Controller):
    """Never verifies a draft; asks n-gram for a shadow draft of 4 every round (the engine
    asks only when none is pending) and records what the engine reports back."""

    def __init__(self, **settings):
        super().__init__(ControllerSettings(policy="goodput", **settings), ("ngram",))
        self.observed: list[tuple[int, int]] = []

    def plan(self, seqs, available=None, num_prefill_tokens=0, num_prefill_seqs=0):
        return [Decision(None, 0, "low_acceptance", "ngram", 4) for _ in seqs]

    def observe_round(self, seq_id, method, num_drafted, num_accepted):
        self.observed.append((num_drafted, num_accepted))


class _RecordingNgram(NgramProposer):
    def __init__(self):
        super().__init__()
        self.asks: list[tuple[int, list[int]]] = []  # (context length, drafts)

    def propose_sync(self, requests):
        proposals = super().propose_sync(requests)
        for r, p in zip(requests, proposals):
            if not p.resync:
                self.asks.append((r.base_len + len(r.append_token_ids), [int(t) for t in p.draft_token_ids]))
        return proposals


def _shadow_run(model, tokenizer, prompt, plain, controller):
    """Plain decoding's 40 tokens, and the n-gram proposer (recording every ask) and engine
    of a run of `controller` that verified no draft and so emitted the same tokens."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = _first(plain, prompt, params).token_ids
    proposer = _RecordingNgram()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512), proposer, controller)
    r = _first(engine, prompt, params)
    assert r.token_ids == expected and r.stats.drafted == 0
    return expected, proposer, engine


def _scored(drafts: list[int], following: list[int]) -> tuple[int, int]:
    """(tokens seen, tokens matched) of a shadow draft against the tokens that followed its
    context: seen up to the first mismatch included, or as many as there were."""
    matched = next((i for i, (a, b) in enumerate(zip(drafts, following)) if a != b), len(following))
    return min(matched + 1, len(following)), matched


def test_shadow_drafts_are_scored_against_the_output(model, tokenizer, code_prompt, plain):
    """Shadow drafts are never verified, so the output is plain decoding's; each one is
    reported as the matching prefix of the tokens that followed its context, worked out
    here from the final output."""
    controller = _ShadowOnlyController()
    expected, proposer, engine = _shadow_run(model, tokenizer, code_prompt, plain, controller)
    want = []
    for context_len, drafts in proposer.asks:
        if not drafts:
            want.append((0, 0))
            continue
        seen, matched = _scored(drafts, expected[context_len - len(code_prompt):][: len(drafts)])
        if seen:
            want.append((seen, matched))
    assert controller.observed == want
    assert sum(n for n, _ in want) > 0 and sum(m for _, m in want) > 0  # the prompt is quoted: drafts match
    assert engine.stats.num_shadow_tokens == sum(n for n, _ in want)


def test_a_call_for_shadow_drafts_only_comes_once_every_shadow_interval_passes(model, tokenizer, code_prompt,
                                                                                plain):
    """Called for shadows alone, the proposer is asked once every `shadow_interval` passes
    at most (each pass here emits one token, so the asks' contexts grow by the interval at
    least); at interval 1 it is asked whenever no shadow is pending, closer together."""
    gaps = {}
    for interval in (1, 3):
        _, proposer, _ = _shadow_run(model, tokenizer, code_prompt, plain, _ShadowOnlyController(shadow_interval=interval))
        lengths = [n for n, _ in proposer.asks]
        assert len(lengths) >= 5
        gaps[interval] = [b - a for a, b in zip(lengths, lengths[1:])]
    assert min(gaps[3]) >= 3
    assert min(gaps[1]) < 3


class _CutEverythingController(_ShadowOnlyController):
    """Asks n-gram for 4 drafts to verify every round, then cuts them all in `trim`."""

    def plan(self, seqs, available=None, num_prefill_tokens=0, num_prefill_seqs=0):
        return [Decision("ngram", 4, "goodput") for _ in seqs]

    def trim(self, rounds, num_prefill_tokens=0, num_prefill_seqs=0, levels=None):
        return [0] * len(rounds)


def test_drafts_cut_whole_are_scored_as_shadows(model, tokenizer, code_prompt, plain):
    """Drafts asked for but cut to none in `trim` measure acceptance like shadow drafts:
    while no shadow is pending, the round's drafts become one, and it is reported as the
    matching prefix of the tokens that followed its context. Each round emits one token,
    so a shadow that saw `seen` tokens is resolved `seen` rounds after it was asked."""
    controller = _CutEverythingController()
    expected, proposer, engine = _shadow_run(model, tokenizer, code_prompt, plain, controller)
    want, free_at = [], 0  # free_at: the context length from which a new shadow may start
    for context_len, drafts in proposer.asks:
        if not drafts:
            want.append((0, 0))  # "no draft": the share of asks with drafts learns from it
            continue
        if context_len < free_at:
            continue  # a shadow is pending: these drafts are dropped
        seen, matched = _scored(drafts, expected[context_len - len(code_prompt):][: len(drafts)])
        if seen:
            want.append((seen, matched))
        free_at = context_len + max(seen, 1)
    assert sorted(controller.observed) == sorted(want)
    assert sum(m for _, m in want) > 0 and len(want) < len(proposer.asks)  # matches, and drafts dropped
    assert engine.stats.num_shadow_tokens == sum(n for n, _ in want)


def test_request_max_k_caps_speculation(model, tokenizer, code_prompt):
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512), NgramProposer(),
                    Controller.static(8))
    capped = engine.generate_sync([code_prompt], GREEDY, max_k=2)[0]
    assert capped.stats.rounds_with_drafts > 0 and capped.stats.drafted <= 2 * capped.stats.rounds_with_drafts
    off = engine.generate_sync([code_prompt], GREEDY, max_k=0)[0]
    assert off.stats.drafted == 0 and off.token_ids == capped.token_ids


def test_seeded_sampling_is_reproducible(model, tokenizer, code_prompt):
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512), NgramProposer(),
                    Controller.static(4))
    p = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234)
    a, b = engine.generate_sync([code_prompt, code_prompt], p)
    assert a.token_ids == b.token_ids  # same seed, same output, even batched together
    c = _first(engine, code_prompt, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=99))
    assert c.token_ids != a.token_ids
    assert np.all(np.asarray(a.token_ids) < model.config.vocab_size)


def test_streaming_events_add_up(model, tokenizer, code_prompt, plain):
    expected = _first(plain, code_prompt, GREEDY)
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512), NgramProposer(),
                    Controller.static(4))

    async def collect():
        events = [out async for out in engine.generate(code_prompt, GREEDY)]
        return events

    events = asyncio.run(collect())
    assert [t for e in events for t in e.token_ids] == expected.token_ids
    assert "".join(e.text for e in events) == expected.text
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    # Rounds that accepted drafts emit several tokens in one event.
    assert max(len(e.token_ids) for e in events) > 1
    s = events[-1].stats
    assert s.mean_acceptance_length == pytest.approx(1 + s.accepted / s.rounds_with_drafts)


def test_a_proposer_answering_inline_keeps_the_loop_until_the_pass(model, tokenizer, code_prompt, plain):
    """Between an in-process proposer's answer and the pass, the engine does not hand the
    event loop to other tasks (a served replica's token streams): their work would run in
    series with the pass instead of beside it. Other tasks do run during the pass."""
    expected = _first(plain, code_prompt, GREEDY)
    proposer = NgramProposer()
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512), proposer,
                    Controller.static(4))
    window = {"open": False, "entered": 0, "passes": 0, "beside": 0}
    answer, execute = proposer.propose, engine._execute

    async def propose(requests):
        out = await answer(requests)
        window["open"] = True  # until the pass starts
        return out

    def timed_execute(works):
        window["passes"] += 1
        time.sleep(0.002)  # room for the other task to run beside the pass
        return execute(works)

    class Worker:  # the engine's thread, noting when a pass is handed to it
        def __init__(self, executor):
            self.executor = executor

        def submit(self, fn, *args):
            window["open"] = False
            return self.executor.submit(fn, *args)

    proposer.propose, engine._execute, engine._worker = propose, timed_execute, Worker(engine._worker)

    async def main():
        done = False

        async def other():
            while not done:
                window["entered"] += window["open"]
                window["beside"] += 1
                await asyncio.sleep(0)

        spinner = asyncio.ensure_future(other())
        out = [t async for e in engine.generate(code_prompt, GREEDY) for t in e.token_ids]
        done = True
        await spinner
        return out

    assert asyncio.run(main()) == expected.token_ids
    assert window["passes"] > 3 and window["beside"] >= window["passes"]
    assert window["entered"] == 0


class _BrokenController(Controller):
    """A controller with a bug: the step fails; every client must hear about it, none may hang."""

    def plan(self, seqs, available=None, num_prefill_tokens=0, num_prefill_seqs=0):
        raise RuntimeError("controller bug")


def test_a_failing_step_fails_its_requests_and_frees_them(model, tokenizer, code_prompt, chat_prompt):
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512), NgramProposer(),
                    _BrokenController())
    with pytest.raises(RuntimeError, match="controller bug"):
        engine.generate_sync([code_prompt, chat_prompt], GREEDY)  # the second one is still waiting
    assert engine.num_running == 0 and engine.num_waiting == 0 and engine.cache.num_used_slots == 0


def test_profile_grid_times_every_padded_size_up_to_twice_the_batch():
    from verifier.models.llama import gemm_rows

    # By hand: 1, 2, 4, 8, 16, then +8 while below 2 x 32 = 64, then x1.5 (96, 144, 216,
    # 324 > 288 dropped); padded, 2 becomes 4 and every other point is already a fast size.
    assert profile_grid(32, 288, gemm_rows) == [1, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 144, 216]
    # Batch 8: +8 stops at 16 = 2 x 8, then 24, 36 -> 40, 54 -> 56, 81 > 72 dropped.
    assert profile_grid(8, 72, gemm_rows) == [1, 4, 8, 16, 24, 40, 56]
    assert profile_grid(8, 72) == [1, 2, 4, 8, 16, 24, 36, 54]  # no padding (a GPU model)
    assert profile_grid(4, 0) == [1]


class _SlowedModel:
    """The real model, with passes of one sequence slowed by `SLOW_S`: those of size
    `always`, and those whose place among all single-sequence passes is in `spell` (a slow
    spell of the machine)."""

    SLOW_S = 0.25

    def __init__(self, model, always: int, spell: range) -> None:
        self._model, self.always, self.spell = model, always, spell
        self.calls: collections.Counter[int] = collections.Counter()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, token_ids, slots, num_tokens, *args, **kwargs):
        out = self._model.forward(token_ids, slots, num_tokens, *args, **kwargs)
        if len(num_tokens) == 1:
            self.calls[num_tokens[0]] += 1
            if num_tokens[0] == self.always or sum(self.calls.values()) in self.spell:
                time.sleep(self.SLOW_S)
        return out


def test_the_profile_takes_each_size_at_its_fastest_sweep_and_never_falls(model, tokenizer):
    """A slow spell as long as three passes costs no size its figure (each size's fastest
    pass over sweeps of the whole grid: timed one after another, a size's passes would
    all fall in it), and a size slowed on every pass is priced at the next size's figure:
    more tokens never take less time, and the machine only ever slows a pass."""
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512), NgramProposer(),
                    Controller(ControllerSettings(policy="goodput", max_k=4)))
    grid = profile_grid(2, 10, model.gemm_rows)
    assert len(grid) == 3
    # Passes 1-3 warm up, 4-6 are the first timed sweep: the spell covers every size once.
    slowed = _SlowedModel(model, always=grid[0], spell=range(4, 7))
    engine.model = slowed
    try:
        t = engine.profile_step_time(repeats=2)
    finally:
        engine.model = model
    assert all(slowed.calls[n] == 3 for n in grid)  # a warm-up sweep and two timed ones
    times = dict(t.points())
    assert list(times) == grid
    assert max(times.values()) < _SlowedModel.SLOW_S
    assert times[grid[0]] == times[grid[1]] <= times[grid[2]]  # slowed on every pass: the next size's figure
    assert engine.cache.num_used_slots == 0
    with pytest.raises(ValueError, match="repeats"):
        engine.profile_step_time(repeats=0)


def test_goodput_controller_on_the_real_model(model, tokenizer, code_prompt, chat_prompt, plain):
    """The default policy end to end: it profiles the step time before the first request,
    stays exact, drafts where the answer quotes the prompt, and gives every round a reason."""
    from verifier.controller import REASONS

    prompts = [code_prompt, chat_prompt]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    expected = [r.token_ids for r in plain.generate_sync(prompts, params)]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512), NgramProposer(),
                    Controller(ControllerSettings(policy="goodput")))
    assert engine.controller.needs_step_time
    results = engine.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == expected
    t = engine.controller.step_time
    # The grid 1, 2, 4, 8, 16 at the row counts the model runs its GEMMs at (packed for
    # oneDNN: one row pads to two; MKL: 2 pads to 4, 9 to 16), and the model prices a pass's
    # tokens at its padded size (what the passes taught it, S(1) and X(1), comes on top).
    grid = sorted({model.gemm_rows(n) for n in (1, 2, 4, 8, 16)})
    assert model.gemm_rows(1) == 2 if model.packed else model.gemm_rows(2) == 4
    assert t is not None and [n for n, _ in t.points()][: len(grid)] == grid and t(1) > 0
    assert all(t.tokens_s(n) == t.tokens_s(model.gemm_rows(n)) for n in (1, 2, 3, 9))
    code = results[0].stats
    assert code.accepted > 0 and code.rounds_by_method == {"ngram": code.rounds_with_drafts}
    for r in results:
        assert set(r.stats.rounds_off) <= set(REASONS)
        assert sum(r.stats.rounds_off.values()) + r.stats.rounds_with_drafts == r.stats.rounds
    assert engine.cache.num_used_slots == 0 and engine.proposers["ngram"].num_sequences == 0
