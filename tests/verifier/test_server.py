"""`VerifierServer` on the real model: request validation, the event stream, overload."""

from __future__ import annotations

import asyncio

import pytest

from proposers.ngram import NgramProposer
from verifier.engine import Engine, EngineConfig
from verifier.controller import Controller
from verifier.sampling_params import SamplingParams
from verifier.server import GenerateInput, VerifierServer

PROMPT_TEXT = ("Repeat after me exactly: the quick brown fox jumps over the lazy dog. "
               "the quick brown fox jumps over the lazy dog. the quick")
MAX_TOKENS = 12


def _engine(model, tokenizer, max_waiting: int) -> Engine:
    return Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256, max_waiting=max_waiting),
                  NgramProposer(), Controller.static(4))


@pytest.fixture(scope="module")
def server(model, tokenizer):
    return VerifierServer(_engine(model, tokenizer, max_waiting=2), "smollm2-135m")


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tuple(tokenizer.encode(PROMPT_TEXT))


@pytest.fixture(scope="module")
def plain_greedy(model, tokenizer, prompt):
    """The target's own greedy output, from an engine that never speculates."""
    plain = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=256), None, Controller.off())
    r = plain.generate_sync([list(prompt)], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    assert plain.stats.num_drafted == 0 and len(r.token_ids) == MAX_TOKENS  # no EOS within 12 tokens
    return r.token_ids


def _collect(server: VerifierServer, req: GenerateInput) -> list[dict]:
    async def run():
        return [event async for event in server.generate(req)]

    return asyncio.run(run())


# ---------------------------------------------------------------------- invalid requests
IDS = (1, 2, 3)


@pytest.mark.parametrize(
    "req, param",
    [
        (GenerateInput(prompt_token_ids=IDS, speculation_mode="sometimes"), "speculation.mode"),
        (GenerateInput(prompt_token_ids=IDS, speculation_method="eagle"), "speculation.method"),
        (GenerateInput(prompt_token_ids=IDS, speculation_max_k=-1), "speculation.max_k"),
        (GenerateInput(prompt_token_ids=(100,) * 257), "prompt"),  # the context holds 256
        (GenerateInput(prompt_token_ids=(100,) * 256, max_tokens=1), "prompt"),
        (GenerateInput(prompt_token_ids=(100,) * 250, max_tokens=7), "max_tokens"),  # 250 + 7 > 256
        (GenerateInput(prompt_token_ids=IDS, max_tokens=0), "max_tokens"),
        (GenerateInput(prompt_token_ids=IDS, temperature=-1.0), "temperature"),
        (GenerateInput(prompt_token_ids=IDS, top_p=0.0), "top_p"),
        (GenerateInput(prompt="hello", prompt_token_ids=IDS), "prompt"),  # two of three
        (GenerateInput(prompt="hi", messages=({"role": "user", "content": "hi"},)), "prompt"),
        (GenerateInput(), "prompt"),  # none of three
        (GenerateInput(prompt=""), "prompt"),
        (GenerateInput(messages=()), "messages"),
        (GenerateInput(messages=({"role": "user"},)), "messages[0]"),
        (GenerateInput(prompt_token_ids=IDS, n=0), "n"),
        (GenerateInput(prompt_token_ids=IDS, n=3), "n"),  # more than the 2 slots
    ],
)
def test_invalid_request_is_one_error_event(server, req, param):
    events = _collect(server, req)
    assert len(events) == 1, events
    (event,) = events
    assert event["event"] == "error" and event["kind"] == "invalid_request"
    assert event["param"] == param
    assert event["message"].startswith(f"{param}: ")
    e = server.engine
    assert e.num_running == 0 and e.num_waiting == 0 and e.cache.num_used_slots == 0


# ---------------------------------------------------------------------- generation
def _check_stream(events: list[dict]) -> dict:
    """Deltas then one final event, last; return the final event with the stream's totals."""
    assert events and events[-1]["event"] == "final"
    assert all(e["event"] == "delta" for e in events[:-1])
    return {
        "token_ids": [t for e in events for t in e["token_ids"]],
        "text": "".join(e["text"] for e in events),
        "final": events[-1],
    }


def test_greedy_request_matches_plain_greedy(server, tokenizer, prompt, plain_greedy):
    events = _collect(server, GenerateInput(request_id="g", prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0.0))
    out = _check_stream(events)
    final = out["final"]
    assert len(events) >= 2  # streamed, not one blob
    assert out["token_ids"] == plain_greedy
    assert out["text"] == tokenizer.decode(plain_greedy)
    assert final["finish_reason"] == "length"
    assert final["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                              "total_tokens": len(prompt) + MAX_TOKENS}
    spec = final["speculation"]
    assert spec["mode"] == "auto" and spec["rounds_by_method"]["ngram"] == spec["rounds_with_drafts"]
    # The output repeats the prompt, so n-gram drafts were verified (the check above means something).
    assert spec["drafted"] > 0 and spec["accepted"] > 0 and spec["num_output_tokens"] == MAX_TOKENS


def test_speculation_off_drafts_nothing(server, prompt, plain_greedy):
    events = _collect(server, GenerateInput(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                            speculation_mode="off"))
    out = _check_stream(events)
    assert out["token_ids"] == plain_greedy
    spec = out["final"]["speculation"]
    assert spec["mode"] == "off" and spec["rounds_by_method"] == {}
    assert spec["drafted"] == 0 and spec["rounds_with_drafts"] == 0 and spec["rounds"] == MAX_TOKENS - 1
    assert spec["rounds_off"] == {"request_off": MAX_TOKENS - 1}
    assert len(events) == MAX_TOKENS  # one token per pass: prefill + 11 rounds


def test_chat_request(server, tokenizer):
    messages = ({"role": "user", "content": "What is the capital of France?"},)
    text = tokenizer.apply_chat_template(list(messages))
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt is part of the prompt
    events = _collect(server, GenerateInput(messages=messages, max_tokens=8, temperature=0.0))
    out = _check_stream(events)
    usage = out["final"]["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode(text))
    assert usage["completion_tokens"] == len(out["token_ids"]) and 1 <= len(out["token_ids"]) <= 8
    assert "Paris" in out["text"]


def test_n_outputs_stream_side_by_side_each_as_its_own_request(model, tokenizer, prompt, plain_greedy):
    """n = 2: each output's events carry its index and it ends with its own final event;
    sampled with seed s, output i is what a request of its own with seed s + i gives."""
    engine = _engine(model, tokenizer, max_waiting=2)
    server = VerifierServer(engine, "smollm2-135m")
    common = dict(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    events = _collect(server, GenerateInput(**common, temperature=0.9, seed=11, n=2))
    assert {e["index"] for e in events} == {0, 1}
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        out = _check_stream(mine)
        alone = _check_stream(_collect(server, GenerateInput(**common, temperature=0.9, seed=11 + i)))
        assert out["token_ids"] == alone["token_ids"] and len(out["token_ids"]) == MAX_TOKENS
        assert out["final"]["usage"]["completion_tokens"] == MAX_TOKENS
    # Interleaved: the second output's events do not wait for the first's end.
    first_final = next(j for j, e in enumerate(events) if e["event"] == "final")
    assert any(e["index"] != events[first_final]["index"] for e in events[:first_final])
    assert events[-1]["event"] == "final"
    # Greedy: the same output twice, both speculated.
    events = _collect(server, GenerateInput(**common, temperature=0.0, n=2))
    for i in (0, 1):
        out = _check_stream([e for e in events if e["index"] == i])
        assert out["token_ids"] == plain_greedy and out["final"]["speculation"]["accepted"] > 0
    assert engine.num_running == 0 and engine.cache.num_used_slots == 0


def test_n_outputs_are_admitted_or_refused_together_and_aborted_together(model, tokenizer, prompt):
    """3 slots and 1 queue place, 2 requests running: n = 3 does not fit and is refused
    whole, n = 2 does (one runs, one waits); leaving its stream aborts both."""
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=256, max_waiting=1),
                    NgramProposer(), Controller.static(4))
    server = VerifierServer(engine, "smollm2-135m")

    async def run():
        running = [server.generate(_long(prompt)) for _ in range(2)]
        try:
            for stream in running:
                assert (await stream.__anext__())["event"] == "delta"
            refused = [e async for e in server.generate(_long(prompt, n=3))]
            assert [e["kind"] for e in refused] == ["overloaded"], refused
            assert "no room for 3 sequences" in refused[0]["message"]
            assert engine.num_running == 2 and engine.num_waiting == 0  # nothing of it was admitted
            pair = server.generate(_long(prompt, n=2))
            assert (await pair.__anext__())["event"] == "delta"
            assert engine.num_running == 3 and engine.num_waiting == 1
            await pair.aclose()
            for _ in range(100):  # the next step reaps both
                if engine.num_running == 2 and engine.num_waiting == 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.num_running == 2 and engine.num_waiting == 0 and engine.cache.num_used_slots == 2
        finally:
            await _close_all_then_idle(engine, running)

    asyncio.run(run())


# ---------------------------------------------------------------------- overload
def _long(prompt, n: int = 1) -> GenerateInput:
    return GenerateInput(prompt_token_ids=prompt, max_tokens=200, temperature=0.0, ignore_eos=True, n=n)


async def _wait_idle(engine: Engine) -> None:
    for _ in range(200):
        if engine.num_running == 0 and engine.num_waiting == 0:
            return
        await asyncio.sleep(0.05)


async def _close_all_then_idle(engine: Engine, streams) -> None:
    """Leave every stream; then nothing runs and every KV slot is free."""
    for stream in streams:
        await stream.aclose()
    await _wait_idle(engine)
    assert engine.num_running == 0 and engine.cache.num_used_slots == 0


def test_overload_with_no_queue(model, tokenizer, prompt):
    engine = _engine(model, tokenizer, max_waiting=0)
    server = VerifierServer(engine, "smollm2-135m")

    async def run():
        running = [server.generate(_long(prompt)) for _ in range(2)]
        try:
            for stream in running:
                first = await stream.__anext__()
                assert first["event"] == "delta", first
            third = [e async for e in server.generate(_long(prompt))]
            assert len(third) == 1 and third[0]["event"] == "error" and third[0]["kind"] == "overloaded"
        finally:
            await _close_all_then_idle(engine, running)

    asyncio.run(run())


def test_overload_when_the_queue_is_full(model, tokenizer, prompt):
    """2 slots and 1 queue place: 2 requests run, a third waits, a fourth is refused."""
    engine = _engine(model, tokenizer, max_waiting=1)
    server = VerifierServer(engine, "smollm2-135m")

    async def run():
        running = [server.generate(_long(prompt)) for _ in range(2)]
        waiting_stream = server.generate(_long(prompt))
        waiting = None
        try:
            for stream in running:
                first = await stream.__anext__()
                assert first["event"] == "delta" and first["token_ids"]
            assert engine.num_running == 2 and engine.cache.num_free_slots == 0
            waiting = asyncio.ensure_future(waiting_stream.__anext__())
            for _ in range(5):
                await asyncio.sleep(0)
            assert engine.num_waiting == 1 and not waiting.done()

            refused = [e async for e in server.generate(_long(prompt))]
            assert len(refused) == 1, refused
            assert refused[0]["event"] == "error" and refused[0]["kind"] == "overloaded"
            assert refused[0]["retry_after_s"] > 0 and refused[0]["param"] is None
            assert engine.num_running == 2 and engine.num_waiting == 1  # the refusal changed nothing
        finally:
            if waiting is not None:
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
            await waiting_stream.aclose()
            for stream in running:
                await stream.aclose()
        # Closing the streams aborts the requests; their slots are freed before the next step.
        await _wait_idle(engine)
        assert engine.num_running == 0 and engine.num_waiting == 0
        assert engine.cache.num_used_slots == 0 and engine.proposers["ngram"].num_sequences == 0

    asyncio.run(run())
