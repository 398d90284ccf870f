"""The service on a real local Ray cluster: OpenAI HTTP (the `openai` client) and gRPC.

Expected outputs come from the in-process engine with speculation off, i.e. plain greedy
decoding, which tests/verifier/test_exactness.py checks against HF transformers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import os
import re
import shutil
import signal
import time

import grpc
import httpx
import openai
import pytest

from protos.splitspec.v1 import generate_pb2, generate_pb2_grpc

pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 40


# ---------------------------------------------------------------------- references
@pytest.fixture(scope="module")
def greedy(model, tokenizer):
    """greedy(list of prompt id lists, max_tokens) -> list of output id lists (plain decoding)."""
    from verifier.engine import Engine, EngineConfig
    from verifier.controller import Controller
    from verifier.sampling_params import SamplingParams

    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=10, max_model_len=1024), None, Controller.off())
    cache: dict[tuple, list[int]] = {}

    def run(prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        todo = [p for p in prompts if (tuple(p), max_tokens) not in cache]
        if todo:
            results = engine.generate_sync(todo, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            for p, r in zip(todo, results):
                cache[(tuple(p), max_tokens)] = r.token_ids
        return [cache[(tuple(p), max_tokens)] for p in prompts]

    return run


@pytest.fixture(scope="module")
def edit_conversations():
    from cluster.workloads import load_conversations

    return load_conversations("code_edit")[:2]


def _text(tokenizer, ids: list[int]) -> str:
    """The text of an output: EOS ends it and is not part of it (as in OpenAI's API)."""
    if ids and ids[-1] in tokenizer.eos_token_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids)


def _client(app, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key="unused", timeout=120, **kw)


def _parallel(fn, items):
    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def _stream_completion(client, stream_kw) -> tuple[str, list[int], dict, dict | None]:
    """Consume a streamed completion or chat completion: text, token ids, usage, speculation."""
    text, ids, usage, spec = [], [], None, None
    for chunk in stream_kw:
        extra = chunk.model_extra or {}
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
            spec = extra.get("speculation")
        for choice in chunk.choices:
            piece = getattr(choice, "text", None)
            if piece is None and getattr(choice, "delta", None) is not None:
                piece = choice.delta.content
            text.append(piece or "")
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
    return "".join(text), ids, usage, spec


# ---------------------------------------------------------------------- basics
def test_health_and_models(main_app):
    r = httpx.get(main_app.health_url, timeout=10)
    assert r.status_code == 200
    assert r.json()["ready"] is True and r.json()["proposers"] == {"ngram": 1}
    models = _client(main_app).models.list()
    assert [m.id for m in models.data] == [MODEL]


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("speculation", ["on", "off"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_http_greedy_equals_local_engine(main_app, tokenizer, greedy, edit_conversations, endpoint, stream, speculation):
    client = _client(main_app)
    common = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"speculation": {"mode": speculation}, "return_token_ids": True})
    if stream:
        common["stream"] = True
        common["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in edit_conversations]
        call = lambda c: client.chat.completions.create(messages=c, **common)  # noqa: E731
        inputs = edit_conversations
    else:  # the chat-rendered text as a raw prompt: the answer quotes the code
        texts = [tokenizer.apply_chat_template(c) for c in edit_conversations]
        prompts = [tokenizer.encode(t) for t in texts]
        call = lambda t: client.completions.create(prompt=t, **common)  # noqa: E731
        inputs = texts
    expected = greedy(prompts)

    def one(x):
        r = call(x)
        if stream:
            return _stream_completion(client, r)
        choice = r.choices[0]
        text = choice.message.content if endpoint == "chat" else choice.text
        return text, choice.model_extra["token_ids"], r.usage.model_dump(), r.model_extra["speculation"]

    results = _parallel(one, inputs)
    drafted = accepted = 0
    for (text, ids, usage, spec), want, prompt in zip(results, expected, prompts):
        assert ids == want
        assert text == _text(tokenizer, want)
        assert usage["prompt_tokens"] == len(prompt)
        assert usage["completion_tokens"] == len(want)
        assert spec["mode"] == speculation
        drafted += spec["drafted"]
        accepted += spec["accepted"]
    if speculation == "off":
        assert drafted == 0
    else:  # the edit answers quote their prompts: the n-gram proposer must have helped
        assert accepted > 0


def test_speculation_object_is_honoured_and_reported(main_app, tokenizer, greedy, edit_conversations):
    """`mode: on` + `max_k` is a fixed cap, `auto` is the controller's choice; both exact, and
    every round is either a drafting round of a method or an off round with a reason."""
    from verifier.controller import REASONS

    client = _client(main_app)
    conversation = edit_conversations[0]
    want = greedy([tokenizer.encode(tokenizer.apply_chat_template(conversation))])[0]
    for speculation in ({"mode": "on", "max_k": 2}, {"mode": "auto"}, {"mode": "auto", "max_k": 1}):
        r = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"speculation": speculation, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == want
        spec = r.model_extra["speculation"]
        assert spec["mode"] == speculation["mode"]
        drafted = spec["rounds_with_drafts"] > 0 and spec["accepted"] > 0  # the answer quotes its prompt
        if speculation["mode"] == "on":
            assert drafted, spec
        else:  # the controller's choice: it may judge drafts not to pay while the machine is loaded
            assert drafted or set(spec["rounds_off"]) <= {"proposer_slow", "batch_compute_bound", "low_acceptance",
                                                          "length"}, spec
        assert spec["drafted"] <= speculation.get("max_k", 8) * spec["rounds_with_drafts"]
        assert spec["rounds_by_method"] == {"ngram": spec["rounds_with_drafts"]}
        assert set(spec["rounds_off"]) <= set(REASONS)
        assert sum(spec["rounds_off"].values()) + spec["rounds_with_drafts"] == spec["rounds"]
        if speculation["mode"] == "on":  # fixed k: only the proposer or the length can stop a round drafting
            assert set(spec["rounds_off"]) <= {"no_draft", "length", "resync", "proposer_failed"}
    # The same maps over gRPC.
    last = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        model=MODEL, messages=generate_pb2.ChatMessages(messages=[
            generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]),
        max_tokens=MAX_TOKENS, temperature=0.0, speculation=generate_pb2.Speculation(mode="off")))[-1]
    assert dict(last.speculation.rounds_off) == {"request_off": last.speculation.rounds}
    assert dict(last.speculation.rounds_by_method) == {}
    assert last.speculation.mode == "off" and last.speculation.acceptance_rate == 0.0
    assert last.speculation.num_output_tokens == last.usage.completion_tokens > 0
    assert last.speculation.tokens_per_second > 0


def _grpc_generate(app, request: generate_pb2.GenerateRequest, timeout: float = 120):
    with grpc.insecure_channel(app.grpc) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        return list(stub.Generate(request, metadata=app.grpc_metadata, timeout=timeout))


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_grpc_greedy_equals_local_engine(main_app, tokenizer, greedy, edit_conversations, speculation):
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in edit_conversations]
    expected = greedy(prompts)

    def one(conversation):
        return _grpc_generate(main_app, generate_pb2.GenerateRequest(
            model=MODEL, messages=generate_pb2.ChatMessages(messages=[
                generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]),
            max_tokens=MAX_TOKENS, temperature=0.0, speculation=generate_pb2.Speculation(mode=speculation),
        ))

    accepted = 0
    for messages, want, prompt in zip(_parallel(one, edit_conversations), expected, prompts):
        ids = [t for m in messages for t in m.token_ids]
        assert ids == want
        assert "".join(m.text for m in messages) == _text(tokenizer, want)
        last = messages[-1]
        assert last.finish_reason in ("stop", "length")
        assert all(not m.finish_reason for m in messages[:-1])
        assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == len(want)
        accepted += last.speculation.accepted
        assert last.speculation.mode == speculation
        assert last.speculation.num_output_tokens == len(want)
        if last.speculation.drafted:
            assert last.speculation.acceptance_rate == pytest.approx(
                last.speculation.accepted / last.speculation.drafted, abs=1e-4)
        if speculation == "off":
            assert last.speculation.drafted == 0
    if speculation == "on":
        assert accepted > 0


def test_grpc_prompt_token_ids(main_app, greedy):
    prompt = [1, 4093, 314, 253, 1789, 30, 2]  # any in-vocabulary ids
    messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=12, temperature=0.0))
    assert [t for m in messages for t in m.token_ids] == greedy([prompt], 12)[0]


# ---------------------------------------------------------------------- log probabilities
@pytest.fixture(scope="module")
def with_logprobs(model, tokenizer, edit_conversations):
    """The local engine's greedy outputs with 3 alternatives a token, speculation off, for
    the edit conversations rendered by the chat template: (prompt ids, GenerationResult)."""
    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams

    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in edit_conversations]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=1024), None, Controller.off())
    return list(zip(prompts, engine.generate_sync(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                           logprobs=3))))


def _check_logprobs(tokenizer, want, ids, tokens, logprobs, tops) -> None:
    """Served logprobs against the local engine's: per token its text, its logprob and
    the alternatives' (text -> logprob), the chosen token most likely (greedy)."""
    assert ids == want.token_ids
    assert tokens == [tokenizer.token_text(t) for t in ids]
    assert logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    for top, lp in zip(tops, want.logprobs):
        assert top == pytest.approx({tokenizer.token_text(t): v for t, v in lp.top}, abs=1e-4)
        assert max(top, key=top.get) == tokenizer.token_text(lp.token_id)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_are_the_targets_own(main_app, tokenizer, edit_conversations, with_logprobs, stream):
    client = _client(main_app)
    for conversation, (_, want) in zip(edit_conversations, with_logprobs):
        r = client.chat.completions.create(
            model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3,
            stream=stream, extra_body={"speculation": {"mode": "on"}, "return_token_ids": True})
        if stream:
            chunks = list(r)
            content = [c for chunk in chunks for choice in chunk.choices if choice.logprobs
                       for c in choice.logprobs.content]
            ids = [t for chunk in chunks for choice in chunk.choices for t in choice.model_extra.get("token_ids") or []]
            text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
            spec = chunks[-1].model_extra["speculation"]
        else:
            content, ids = r.choices[0].logprobs.content, r.choices[0].model_extra["token_ids"]
            text, spec = r.choices[0].message.content, r.model_extra["speculation"]
        assert spec["accepted"] > 0  # drafted tokens among them
        assert all(len(c.top_logprobs) == 3 for c in content)
        _check_logprobs(tokenizer, want, ids, [c.token for c in content], [c.logprob for c in content],
                        [{t.token: t.logprob for t in c.top_logprobs} for c in content])
        # The bytes are exact: the answer's text is theirs, EOS aside.
        pieces = [bytes(c.bytes) for c, t in zip(content, ids) if t not in tokenizer.eos_token_ids]
        assert b"".join(pieces).decode() == text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_are_the_targets_own(main_app, tokenizer, edit_conversations, with_logprobs, stream):
    client = _client(main_app)
    for conversation, (_, want) in zip(edit_conversations, with_logprobs):
        r = client.completions.create(
            model=MODEL, prompt=tokenizer.apply_chat_template(conversation), max_tokens=MAX_TOKENS, temperature=0,
            logprobs=3, stream=stream, extra_body={"speculation": {"mode": "on"}, "return_token_ids": True})
        choices = [choice for chunk in r for choice in chunk.choices] if stream else r.choices
        parts = [c.logprobs for c in choices if c.logprobs is not None]
        tokens = [t for p in parts for t in p.tokens]
        offsets = [o for p in parts for o in p.text_offset]
        ids = [t for c in choices for t in c.model_extra.get("token_ids") or []]
        # top_logprobs holds the chosen token beside the 3 alternatives (here among them).
        _check_logprobs(tokenizer, want, ids, tokens, [v for p in parts for v in p.token_logprobs],
                        [top for p in parts for top in p.top_logprobs])
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_echo_scores_the_prompt_and_continues_it(main_app, model, tokenizer, greedy):
    """Completions' echo: with max_tokens 0 and logprobs, the prompt alone with its tokens'
    logprobs (the first's None), as an evaluation harness asks; with max_tokens 8, the
    prompt then the output, streamed too; over gRPC, prompt_logprobs."""
    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams

    text = "The capital of France is Paris. The capital of Italy is"
    prompt = tokenizer.encode(text)
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=1024), None, Controller.off())
    want = engine.generate_sync([prompt], SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=2))[0]
    client = _client(main_app)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.token_text(t) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in want.prompt_logprobs[1:]], abs=1e-4)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(prompt))]
    # With output, whole and streamed: the prompt, then what plain decoding continues with.
    continued = text + tokenizer.decode(want.token_ids)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=8, echo=True, temperature=0,
                                  extra_body={"speculation": {"mode": "on"}})
    assert r.choices[0].text == continued and r.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=8, echo=True, temperature=0,
                                            stream=True, logprobs=0))
    assert "".join(c.choices[0].text for c in chunks) == continued
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == [tokenizer.token_text(t) for t in prompt + want.token_ids]
    # gRPC: the prompt's logprobs on the first message, the first token's unset.
    messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        prompt=text, max_tokens=4, temperature=0.0, prompt_logprobs=2))
    entries = messages[0].prompt_logprobs
    assert [e.token_id for e in entries] == prompt and not entries[0].HasField("logprob")
    assert [e.logprob for e in entries[1:]] == pytest.approx([e.logprob for e in want.prompt_logprobs[1:]], abs=1e-4)
    assert all(not m.prompt_logprobs for m in messages[1:])


def _check_prompt_logprobs(tokenizer, hf_model, prompt: list[int], got: list, num_top: int) -> None:
    """vLLM's `prompt_logprobs` for `prompt`, checked against HF transformers' logits on the
    same weights: the prompt's token first with its log probability and rank, then the
    `num_top` most likely tokens' (ranked 1 to `num_top`), the prompt's token listed once."""
    import torch

    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    assert len(got) == len(prompt) and got[0] is None
    for j, entry in enumerate(got[1:]):
        token, row = prompt[j + 1], ref[j]
        (first_id, first), *alternatives = ((int(k), v) for k, v in entry.items())
        assert first_id == token and first["decoded_token"] == tokenizer.token_text(token)
        assert first["logprob"] == pytest.approx(float(row[token]), abs=1e-4), j
        # Its rank: how many tokens are at least as likely (within the two models' rounding).
        assert int((row > row[token] + 1e-3).sum()) < first["rank"] <= int((row >= row[token] - 1e-3).sum()), j
        assert len(alternatives) == num_top - (first["rank"] <= num_top), j
        assert len({e["rank"] for _, e in alternatives}) == len(alternatives)
        lowest = float(torch.topk(row, num_top).values[-1]) if num_top else 0.0
        for t, e in alternatives:
            assert 1 <= e["rank"] <= num_top and e["decoded_token"] == tokenizer.token_text(t)
            assert e["logprob"] == pytest.approx(float(row[t]), abs=1e-4) and e["logprob"] >= lowest - 1e-3, j


def test_prompt_logprobs_over_http_are_hf_transformers_own(main_app, tokenizer, hf_model):
    """vLLM's `prompt_logprobs` extension: per choice on completions (a batch's prompts each
    their own), once on chat (n = 2 shares one prompt); over gRPC the same ranks."""
    client = _client(main_app)
    texts = ["The capital of France is Paris. The capital of Italy is", "def add(a, b):\n    return a"]
    r = client.completions.create(model=MODEL, prompt=texts, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    assert len(r.choices) == 2
    for text, choice in zip(texts, r.choices):
        _check_prompt_logprobs(tokenizer, hf_model, tokenizer.encode(text), choice.model_extra["prompt_logprobs"], 2)
    # Not asked (an echo's logprobs included): no prompt_logprobs.
    r = client.completions.create(model=MODEL, prompt=texts[0], max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert "prompt_logprobs" not in r.choices[0].model_extra and r.choices[0].logprobs.token_logprobs[0] is None
    # Chat: the rendered conversation's tokens, once for both outputs.
    chat = [{"role": "user", "content": "Name a colour."}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False)
    r = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, n=2, temperature=0.8,
                                       extra_body={"prompt_logprobs": 0})
    assert r.usage.prompt_tokens == len(ids) and len(r.choices) == 2
    got = r.model_extra["prompt_logprobs"]
    _check_prompt_logprobs(tokenizer, hf_model, ids, got, 0)
    # gRPC: every TokenLogprob carries its rank, the same as HTTP's.
    messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        prompt=texts[0], max_tokens=1, temperature=0.0, prompt_logprobs=2))
    entries = messages[0].prompt_logprobs
    http = client.completions.create(model=MODEL, prompt=texts[0], max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    assert not entries[0].HasField("rank")
    assert [e.rank for e in entries[1:]] == [d[str(e.token_id)]["rank"] for e, d in zip(entries[1:], http[1:])]
    assert [[t.rank for t in e.top_logprobs] for e in entries[1:]] == [[1, 2]] * (len(entries) - 1)


def test_grpc_logprobs_are_the_targets_own(main_app, tokenizer, edit_conversations, with_logprobs):
    for conversation, (_, want) in zip(edit_conversations, with_logprobs):
        messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
            model=MODEL, messages=generate_pb2.ChatMessages(messages=[
                generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]),
            max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3, speculation=generate_pb2.Speculation(mode="on")))
        assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
        entries = [e for m in messages for e in m.logprobs]
        assert [e.bytes for e in entries] == [tokenizer.token_bytes(e.token_id) for e in entries]
        _check_logprobs(tokenizer, want, [e.token_id for e in entries], [e.token for e in entries],
                        [e.logprob for e in entries], [{t.token: t.logprob for t in e.top_logprobs} for e in entries])
    # Not asked: none.
    plain = _grpc_generate(main_app, generate_pb2.GenerateRequest(prompt="Hi", max_tokens=4, temperature=0.0))
    assert all(not m.logprobs for m in plain)


def test_logits_processing_is_honoured_exactly_over_http_and_grpc(main_app, model, tokenizer, edit_conversations):
    """OpenAI's presence and frequency penalties and logit bias, vLLM's repetition penalty,
    min_tokens and bad_words, with speculation on: the local engine's plain decoding with the same
    settings (which tests/verifier/test_logits_processors.py checks against HF transformers)."""
    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams

    # Mild enough that the answers still quote their prompts (n-gram drafts are accepted);
    # a newline favoured; and a one-word answer kept going to 12 tokens.
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    settings = {"presence_penalty": 0.3, "frequency_penalty": 0.3, "repetition_penalty": 1.05,
                "logit_bias": ((newline, 1.0),)}
    short = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    conversations = [*edit_conversations, short]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in conversations]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=1024), None, Controller.off())
    want = [r.token_ids for r in engine.generate_sync(prompts, [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **settings),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **settings),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=12)])]
    assert len(want[2]) >= 12
    client = _client(main_app)
    for i, (conversation, expected) in enumerate(zip(conversations, want)):
        if i < 2:
            openai_kw = dict(presence_penalty=0.3, frequency_penalty=0.3, logit_bias={str(newline): 1.0})
            extra = {"repetition_penalty": 1.05}
            grpc_kw = dict(presence_penalty=0.3, frequency_penalty=0.3, repetition_penalty=1.05,
                           logit_bias={newline: 1.0})
        else:
            openai_kw, extra, grpc_kw = {}, {"min_tokens": 12}, {"min_tokens": 12}
        r = client.chat.completions.create(
            model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0, **openai_kw,
            extra_body={**extra, "speculation": {"mode": "on"}, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == expected
        if i < 2:
            assert r.model_extra["speculation"]["accepted"] > 0
        messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
            model=MODEL, messages=generate_pb2.ChatMessages(messages=[
                generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]),
            max_tokens=MAX_TOKENS, temperature=0.0, speculation=generate_pb2.Speculation(mode="on"), **grpc_kw))
        assert [t for m in messages for t in m.token_ids] == expected
    # Without them the outputs differ: the settings were applied.
    assert greedy_ids(main_app, conversations[0]) != want[0]
    assert len(greedy_ids(main_app, short)) < 12
    # vLLM's bad_words: a word of the plain answer's, never written.
    plain, = engine.generate_sync(prompts[1:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    word = next(w for w in (tokenizer.decode([t]).strip() for t in plain.token_ids) if len(w) > 3 and w.isalpha())
    expected, = engine.generate_sync(prompts[1:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                  bad_words=(word,)))
    assert expected.token_ids != plain.token_ids
    r = client.chat.completions.create(model=MODEL, messages=conversations[1], max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"bad_words": [word], "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == expected.token_ids
    messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompts[1]), max_tokens=MAX_TOKENS, temperature=0.0,
        bad_words=[word]))
    assert [t for m in messages for t in m.token_ids] == expected.token_ids
    # vLLM's allowed_token_ids, truncate_prompt_tokens and skip_special_tokens: the
    # last 30 prompt tokens, three tokens, all forced to <|im_start|> (the one allowed),
    # shown or skipped in the text.
    start = tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    for skip, text in ((True, ""), (False, "<|im_start|>" * 3)):
        r = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=3, temperature=0, extra_body={
            "allowed_token_ids": [start], "truncate_prompt_tokens": 30, "skip_special_tokens": skip,
            "return_token_ids": True})
        assert r.choices[0].text == text and r.choices[0].model_extra["token_ids"] == [start] * 3
        assert r.usage.prompt_tokens == 30
        messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
            prompt_token_ids=generate_pb2.TokenIds(ids=prompts[0]), max_tokens=3, temperature=0.0,
            allowed_token_ids=[start], truncate_prompt_tokens=30, skip_special_tokens=skip))
        assert "".join(m.text for m in messages) == text and messages[-1].usage.prompt_tokens == 30
    cut, = engine.generate_sync([prompts[0][-30:]], SamplingParams(max_tokens=8, temperature=0.0))
    r = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 30, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == cut.token_ids


def test_stop_token_ids_over_http_and_grpc(main_app, tokenizer, greedy, edit_conversations):
    """vLLM's stop_token_ids: the output ends at the first of them, included, with
    speculation on; over gRPC too. A stop string with vLLM's include_stop_str_in_output:
    the text ends right after it."""
    prompt = tokenizer.encode(tokenizer.apply_chat_template(edit_conversations[0]))
    want = greedy([prompt])[0]
    end = want.index(want[6]) + 1
    r = _client(main_app).completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"stop_token_ids": [want[6]], "speculation": {"mode": "on"}, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want[:end] and r.choices[0].finish_reason == "stop"
    messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, temperature=0.0,
        stop_token_ids=[want[6]]))
    assert [t for m in messages for t in m.token_ids] == want[:end] and messages[-1].finish_reason == "stop"
    text = _text(tokenizer, want)
    stop = text[len(text) // 2: len(text) // 2 + 4]
    r = _client(main_app).completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
        extra_body={"include_stop_str_in_output": True, "speculation": {"mode": "on"}})
    assert r.choices[0].text == text[: text.index(stop) + len(stop)] and r.choices[0].finish_reason == "stop"
    messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop],
        include_stop_str_in_output=True))
    assert "".join(m.text for m in messages) == text[: text.index(stop) + len(stop)]


def test_structured_outputs_over_http_and_grpc(main_app, model, tokenizer):
    """OpenAI's response_format (a JSON schema, streamed too) and vLLM's structured_outputs
    (choice, regex) over HTTP, and structured_outputs over gRPC, with speculation on: the
    local engine's plain constrained decoding (tests/verifier/test_structured_output.py
    checks it against HF transformers) and outputs that match."""
    import jsonschema

    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams
    from verifier.structured_output import StructuredOutput

    person = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    conversations = [[{"role": "user", "content": f"Reply with JSON: name and age. {text}"}] for text in
                     ("Alice Martin is 34 and lives in Lyon.", "Tom Martin, 31, lives in Paris.")]
    conversations.append([{"role": "user", "content": "Is Lyon in France? Answer yes or no."}])
    conversations.append([{"role": "user", "content": "Write the phone number of the Lyon office."}])
    specs = [StructuredOutput(json=json.dumps(person))] * 2 + [StructuredOutput(choice=("yes", "no")),
                                                               StructuredOutput(regex=phone)]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in conversations]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=1024), None, Controller.off())
    want = [r.token_ids for r in engine.generate_sync(
        prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=s) for s in specs])]
    client = _client(main_app)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
    extra = {"speculation": {"mode": "on"}, "return_token_ids": True}
    r = client.chat.completions.create(model=MODEL, messages=conversations[0], max_tokens=MAX_TOKENS, temperature=0,
                                       response_format=fmt, extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == want[0] and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), person)
    assert r.model_extra["speculation"]["drafted"] > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=conversations[1], max_tokens=MAX_TOKENS,
                                                 temperature=0, response_format=fmt, stream=True, extra_body=extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _text(tokenizer, want[1])
    jsonschema.validate(json.loads(text), person)
    for conversation, spec, expected in zip(conversations[2:], specs[2:], want[2:]):
        so = {"choice": list(spec.choice)} if spec.choice else {"regex": spec.regex}
        r = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={**extra, "structured_outputs": so})
        assert r.choices[0].model_extra["token_ids"] == expected
        content = r.choices[0].message.content
        assert content in spec.choice if spec.choice else re.fullmatch(phone, content), content
    grpc_specs = [generate_pb2.StructuredOutputs(json=json.dumps(person)),
                  generate_pb2.StructuredOutputs(choice=generate_pb2.Choices(choices=["yes", "no"]))]
    for prompt, so, expected in zip(prompts[1:3], grpc_specs, want[1:3]):
        messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
            prompt_token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, temperature=0.0,
            speculation=generate_pb2.Speculation(mode="on"), structured_outputs=so))
        assert [t for m in messages for t in m.token_ids] == expected and messages[-1].finish_reason == "stop"
    # JSON's whitespace: none over HTTP, single spaces over gRPC (vLLM's options).
    compact, spaced = (StructuredOutput(json=json.dumps(person), **kw) for kw in (
        {"disable_any_whitespace": True}, {"whitespace_pattern": " "}))
    want = [r.token_ids for r in engine.generate_sync(
        prompts[:2], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=s)
                      for s in (compact, spaced)])]
    r = client.chat.completions.create(model=MODEL, messages=conversations[0], max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={**extra, "structured_outputs": {
                                           "json": person, "disable_any_whitespace": True}})
    content = r.choices[0].message.content
    assert r.choices[0].model_extra["token_ids"] == want[0] and " " not in content.replace("Alice Martin", "")
    messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompts[1]), max_tokens=MAX_TOKENS, temperature=0.0,
        speculation=generate_pb2.Speculation(mode="on"),
        structured_outputs=generate_pb2.StructuredOutputs(json=json.dumps(person), whitespace_pattern=" ")))
    assert [t for m in messages for t in m.token_ids] == want[1]


WEATHER = {"type": "object", "additionalProperties": False, "required": ["location", "unit"],
           "properties": {"location": {"type": "string"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]


def _streamed_calls(chunks) -> tuple[list[dict], str]:
    """The tool calls a chat stream's deltas make up (each call's fragments joined by
    its index; the id, type and name come once, first), and its finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            assert not choice.delta.content, choice.delta
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id.startswith("chatcmpl-tool-") and d.type == "function" and d.function.name, d
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_tool_calls_named_and_required_over_http(main_app, model, tokenizer, greedy):
    """tools with a named tool_choice: the call's arguments are the local engine's plain
    decoding under the function's parameters schema; with "required": under a schema
    written here by hand (an array of {name, parameters} objects, one branch per tool),
    read back into calls by json.loads here. Whole and streamed, speculation on.
    SmolLM2's template ignores tools, so the prompt is the conversation's alone."""
    import jsonschema

    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams
    from verifier.structured_output import StructuredOutput

    def call(name, parameters):
        return {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"], "additionalProperties": False}

    required = {"type": "array", "minItems": 1,
                "items": {"type": "object", "anyOf": [call("get_weather", WEATHER), call("add", ADD)]}}
    weather_chat = [{"role": "user", "content": "What is the weather in Lyon, in celsius?"}]
    add_chat = [{"role": "user", "content": "What is 12 plus 30? Call the add function."}]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in (weather_chat, add_chat)]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=1024), None, Controller.off())
    named, = engine.generate_sync(prompts[:1], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, structured_output=StructuredOutput(json=json.dumps(WEATHER))))
    cut, whole = engine.generate_sync(prompts, SamplingParams(
        max_tokens=48, temperature=0.0, structured_output=StructuredOutput(json=json.dumps(required))))
    one, = engine.generate_sync(prompts[:1], SamplingParams(max_tokens=48, temperature=0.0, structured_output=(
        StructuredOutput(json=json.dumps({**required, "maxItems": 1})))))
    client = _client(main_app)
    extra = {"speculation": {"mode": "on"}, "return_token_ids": True}
    common = dict(model=MODEL, tools=TOOLS, temperature=0, extra_body=extra)

    # A named function: one call, its arguments the text; OpenAI ends it with "stop".
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(messages=weather_chat, max_tokens=MAX_TOKENS, tool_choice=choice, **common)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == named.token_ids and c.finish_reason == "stop"
    assert c.message.content is None and len(c.message.tool_calls) == 1
    tc = c.message.tool_calls[0]
    assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function" and tc.function.name == "get_weather"
    assert tc.function.arguments == _text(tokenizer, named.token_ids)
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER)
    assert r.usage.prompt_tokens == len(prompts[0]) and r.model_extra["speculation"]["drafted"] > 0
    calls, finish = _streamed_calls(client.chat.completions.create(
        messages=weather_chat, max_tokens=MAX_TOKENS, tool_choice=choice, stream=True, **common))
    assert calls == [{"name": "get_weather", "arguments": tc.function.arguments}] and finish == "stop"

    # "required": the calls of the array; one cut short by max_tokens is left out.
    for conversation, out in ((weather_chat, cut), (add_chat, whole)):
        text = _text(tokenizer, out.token_ids)
        if out.finish_reason.value == "stop":
            want, finish_want = json.loads(text), "tool_calls"
        else:  # the calls before the last ", {" of the array
            want, finish_want = json.loads(text[:text.rindex("{")].rstrip().removesuffix(",") + "]"), "length"
        assert want, text
        r = client.chat.completions.create(messages=conversation, max_tokens=48, tool_choice="required", **common)
        c = r.choices[0]
        assert c.model_extra["token_ids"] == out.token_ids and c.finish_reason == finish_want
        got = [{"name": t.function.name, "parameters": json.loads(t.function.arguments)}
               for t in c.message.tool_calls]
        assert got == want and c.message.content is None
        assert len({t.id for t in c.message.tool_calls}) == len(got)
        calls, finish = _streamed_calls(client.chat.completions.create(
            messages=conversation, max_tokens=48, tool_choice="required", stream=True, **common))
        assert [{"name": x["name"], "parameters": json.loads(x["arguments"])} for x in calls] == want
        assert finish == finish_want
    for call_ in got:
        jsonschema.validate(call_["parameters"], ADD)
    # parallel_tool_calls false: one call, where the weather answer went on to a second.
    r = client.chat.completions.create(messages=weather_chat, max_tokens=48, tool_choice="required",
                                       parallel_tool_calls=False, **common)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == one.token_ids and c.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        (x["name"], x["parameters"]) for x in json.loads(_text(tokenizer, one.token_ids))]
    assert len(c.message.tool_calls) == 1

    # "none": text, as without tools; a conversation that carries a call and its result
    # (an assistant message without content) renders as the template renders it.
    r = client.chat.completions.create(messages=add_chat, max_tokens=4, tool_choice="none", **common)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].model_extra["token_ids"] == greedy(prompts[1:], 4)[0]
    made = {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 30}'}}
    history = [*add_chat, {"role": "assistant", "content": None, "tool_calls": [made]},
               {"role": "tool", "tool_call_id": "call-1", "content": "42"}]
    r = client.chat.completions.create(messages=history, max_tokens=1, model=MODEL)
    rendered = [*add_chat, {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]
    assert r.usage.prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(rendered)))


#: A conversation that shows the bundled model how to call a tool (SmolLM2's template
#: renders no tools): Hermes's <tool_call> blocks, each after a sentence.
HERMES_SYSTEM = ('You can call functions. To call one, write <tool_call>{"name": NAME, "arguments": {...}}'
                 '</tool_call>. Functions: get_weather(location, unit), add(a, b).')
HERMES_SHOTS = [
    {"role": "system", "content": HERMES_SYSTEM},
    {"role": "user", "content": "What is the weather in Berlin, in celsius?"},
    {"role": "assistant", "content": 'I will look it up.\n<tool_call>{"name": "get_weather", "arguments": '
                                     '{"location": "Berlin", "unit": "celsius"}}</tool_call>'},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": 'I will add them.\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
                                     '</tool_call>'},
]


def _hermes_by_hand(text: str, names) -> tuple[str | None, list[tuple[str, dict]]]:
    """The content and calls of a text that is a sentence and at most one block: the
    block is a call when its JSON is an object naming one of `names` with object
    arguments; else the whole text is content."""
    m = re.fullmatch(r"(.*?)\n<tool_call>(.*)</tool_call>", text, re.S)
    if m:
        try:
            call = json.loads(m[2])
        except ValueError:
            call = None
        if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict):
            return m[1], [(call["name"], call["arguments"])]
    return text, []


def _auto_calls_are(client, conversations, plain, want):
    """Each conversation served with the tools and tool_choice "auto" (speculation on),
    whole and streamed: plain decoding's tokens `plain`, and `want`'s (content, calls)
    with finish_reason tool_calls where there are calls. Returns the last whole response."""
    extra = {"speculation": {"mode": "on"}, "return_token_ids": True}
    for conversation, out, (content, calls) in zip(conversations, plain, want):
        r = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=60,
                                           temperature=0, extra_body=extra)
        c = r.choices[0]
        assert c.model_extra["token_ids"] == out.token_ids
        assert c.message.content == content
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []] == calls
        assert c.message.tool_calls is None if not calls else all(
            t.id.startswith("chatcmpl-tool-") and t.type == "function" for t in c.message.tool_calls)
        assert c.finish_reason == ("tool_calls" if calls else "stop")
        streamed, got_calls, finish = "", [], None
        for chunk in client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=60,
                                                    temperature=0, tool_choice="auto", stream=True, extra_body=extra):
            delta = chunk.choices[0].delta
            streamed += delta.content or ""
            got_calls += [(d.index, d.function.name, json.loads(d.function.arguments)) for d in delta.tool_calls or []]
            finish = chunk.choices[0].finish_reason or finish
        assert streamed == (content or "") and got_calls == [(i, *call) for i, call in enumerate(calls)]
        assert finish == c.finish_reason
    return r


def test_tool_choice_auto_reads_hermes_calls_out_of_free_text(main_app, model, tokenizer):
    """main_app's config has model.tool_call_parser: hermes, so "auto" (the default with
    tools) is free text: the output is plain decoding's, and a <tool_call> block naming
    one of the tools is a call (finish_reason tool_calls), the sentence before it the
    content; a block with bad JSON or naming no tool stays text. Read back here by a
    regex and json.loads. Whole, streamed (content and calls), and over gRPC."""
    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams

    questions = ["What is 7 plus 5?", "What is the weather in Lyon, in fahrenheit?",
                 "What is the weather in Paris, in celsius?", "Hi! How are you?"]
    conversations = [[*HERMES_SHOTS, {"role": "user", "content": q}] for q in questions]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in conversations]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=1024), None, Controller.off())
    plain = engine.generate_sync(prompts, SamplingParams(max_tokens=60, temperature=0.0))
    names = [t["function"]["name"] for t in TOOLS]
    want = [_hermes_by_hand(_text(tokenizer, out.token_ids), names) for out in plain]
    # The conversations cover a call, blocks that are not calls, and text without blocks.
    assert [bool(calls) for _, calls in want] == [True, False, False, False], want
    assert ["<tool_call>" in _text(tokenizer, out.token_ids) for out in plain] == [True, True, True, False]
    assert all(out.finish_reason.value == "stop" for out in plain)
    client = _client(main_app)
    r = _auto_calls_are(client, conversations, plain, want)
    assert r.model_extra["speculation"]["drafted"] > 0
    # parallel_tool_calls false keeps the one call; over gRPC the last message carries the
    # calls and the content.
    r = client.chat.completions.create(model=MODEL, messages=conversations[0], tools=TOOLS, max_tokens=60,
                                       temperature=0, parallel_tool_calls=False)
    assert [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls] == want[0][1]
    tools = [generate_pb2.Tool(name=t["function"]["name"], parameters=json.dumps(t["function"]["parameters"]))
             for t in TOOLS]
    for conversation, out, (content, calls) in list(zip(conversations, plain, want))[::3]:
        messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
            messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in conversation]),
            max_tokens=60, temperature=0.0, tools=tools, tool_choice=generate_pb2.ToolChoice(mode="auto")))
        last = messages[-1]
        assert [t for m in messages for t in m.token_ids] == out.token_ids
        assert "".join(m.text for m in messages) == _text(tokenizer, out.token_ids)
        assert last.HasField("content") and last.content == content
        assert [(t.name, json.loads(t.arguments)) for t in last.tool_calls] == calls
        assert last.finish_reason == ("tool_calls" if calls else "stop")
        assert not any(m.HasField("content") or m.tool_calls for m in messages[:-1])


LLAMA3_SYSTEM = ('You can call functions. To call one, reply with only {"name": NAME, "parameters": {...}}. '
                 'Functions: get_weather(location, unit), add(a, b).')
LLAMA3_SHOTS = [
    {"role": "system", "content": LLAMA3_SYSTEM},
    {"role": "user", "content": "What is the weather in Berlin, in celsius?"},
    {"role": "assistant", "content": '{"name": "get_weather", "parameters": {"location": "Berlin", "unit": "celsius"}}'},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": '{"name": "add", "parameters": {"a": 2, "b": 3}}'},
]


def _llama3_by_hand(text: str, names) -> tuple[str | None, list[tuple[str, dict]]]:
    """The content and calls of a text that holds at most one call: the whole text is a
    call when it parses as a JSON object naming one of `names` with object parameters."""
    try:
        call = json.loads(text)
    except ValueError:
        call = None
    if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("parameters"), dict):
        return None, [(call["name"], call["parameters"])]
    return text, []


def test_tool_choice_auto_reads_llama3_json_calls(model_proposers_app, model, tokenizer):
    """model_proposers_app's config has model.tool_call_parser: llama3_json: an output
    that is a JSON call of one of the tools is that call (no content, finish_reason
    tool_calls), any other output is text, JSON naming no tool included. The expectation:
    plain decoding's text, read back here by json.loads. Whole (the model proposers
    drafting) and streamed."""
    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams

    questions = ["What is 7 plus 5?", "Hi! How are you?", "Write a haiku about the sea."]
    conversations = [[*LLAMA3_SHOTS, {"role": "user", "content": q}] for q in questions]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in conversations]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=1024), None, Controller.off())
    plain = engine.generate_sync(prompts, SamplingParams(max_tokens=60, temperature=0.0))
    names = [t["function"]["name"] for t in TOOLS]
    texts = [_text(tokenizer, out.token_ids) for out in plain]
    want = [_llama3_by_hand(t, names) for t in texts]
    # A call, JSON that is no call, and plain text.
    assert [bool(calls) for _, calls in want] == [True, False, False], want
    assert [t.lstrip().startswith("{") for t in texts] == [True, True, False], texts
    _auto_calls_are(_client(model_proposers_app), conversations, plain, want)


def greedy_ids(app, conversation) -> list[int]:
    r = _client(app).chat.completions.create(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"return_token_ids": True})
    return r.choices[0].model_extra["token_ids"]


def test_a_batch_of_prompts_in_one_completions_request(main_app, tokenizer, greedy, edit_conversations):
    """A list of prompts (token id lists, or texts) is a batch: prompt i's output j is
    choice i * n + j, each plain decoding's; usage counts each prompt once. Streamed, the
    chunks of the outputs interleave, each with its index. One bad prompt refuses all."""
    client = _client(main_app)
    texts = [tokenizer.apply_chat_template(c) for c in edit_conversations]
    prompts = [tokenizer.encode(t) for t in texts]
    want = greedy(prompts)
    extra = {"speculation": {"mode": "on"}, "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2,
                                  extra_body=extra)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in r.choices] == [want[0], want[0], want[1], want[1]]
    assert [c.text for c in r.choices] == [_text(tokenizer, w) for w in (want[0], want[0], want[1], want[1])]
    assert r.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])
    assert r.usage.completion_tokens == 2 * (len(want[0]) + len(want[1]))
    # vLLM's continuous_usage_stats: each chunk has its output's usage so far.
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=texts, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options=options, extra_body=extra))
    got: dict[int, list[int]] = collections.defaultdict(list)
    for chunk in chunks[:-1]:
        c, = chunk.choices
        got[c.index] += c.model_extra.get("token_ids") or []
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (len(prompts[c.index]),
                                                                              len(got[c.index]))
    assert dict(got) == {0: want[0], 1: want[1]}
    assert chunks[-1].usage.prompt_tokens == len(prompts[0]) + len(prompts[1]) and not chunks[-1].choices
    chat = list(client.chat.completions.create(model=MODEL, messages=edit_conversations[0], max_tokens=8,
                                               temperature=0, stream=True, extra_body=extra,
                                               stream_options={"continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chat] == [0, *itertools.accumulate(
        len(c.choices[0].model_extra["token_ids"]) for c in chat[1:])]
    assert {c.usage.prompt_tokens for c in chat} == {len(prompts[0])} and chat[-1].usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError) as info:
        _client(main_app, max_retries=0).completions.create(model=MODEL, prompt=[texts[0], "word " * 1100],
                                                            max_tokens=4)
    assert info.value.body["param"] == "prompt"
    _wait_for(lambda: httpx.get(main_app.health_url, timeout=10).json()["num_running"] == 0, 30,
              "the batch's other prompt to be cancelled")


def test_n_choices_over_http_and_grpc(main_app, tokenizer, greedy, edit_conversations):
    """n outputs of one request: greedy, each is plain decoding's; sampled with a seed s,
    choice i is a request of its own with seed s + i; usage counts the prompt once and
    every output, and the response's speculation sums the choices' own."""
    client = _client(main_app)
    conversation = edit_conversations[0]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(conversation))
    want = greedy([prompt])[0]
    common = dict(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS)
    extra = {"speculation": {"mode": "on"}, "return_token_ids": True}
    r = client.chat.completions.create(**common, temperature=0, n=2, extra_body=extra)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.model_extra["token_ids"] for c in r.choices] == [want, want]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 2 * len(want)
    spec, own = r.model_extra["speculation"], [c.model_extra["speculation"] for c in r.choices]
    assert spec["accepted"] == sum(o["accepted"] for o in own) > 0
    assert spec["rounds"] == sum(o["rounds"] for o in own)
    # Sampled, streamed.
    chunks = list(client.chat.completions.create(**common, temperature=0.9, seed=5, n=3, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra))
    ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = []
    for chunk in chunks:
        for c in chunk.choices:
            ids[c.index].extend(c.model_extra.get("token_ids") or [])
            if c.finish_reason:
                finished.append(c.index)
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == sum(map(len, ids.values()))
    for i in range(3):
        alone = client.chat.completions.create(**common, temperature=0.9, seed=5 + i, extra_body=extra)
        assert alone.choices[0].model_extra["token_ids"] == ids[i], i
    # gRPC: each message names its output.
    messages = _grpc_generate(main_app, generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, temperature=0.0, n=2))
    for i in (0, 1):
        mine = [m for m in messages if m.index == i]
        assert [t for m in mine for t in m.token_ids] == want
        assert mine[-1].finish_reason and mine[-1].usage.completion_tokens == len(want)


# ---------------------------------------------------------------------- concurrency
def test_ten_concurrent_streams(main_app, tokenizer, greedy):
    from cluster.workloads import load_conversations

    conversations = (load_conversations("chat") + load_conversations("code_edit"))[:10]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in conversations]
    expected = greedy(prompts, 24)
    client = _client(main_app)

    def one(c):
        return _stream_completion(client, client.chat.completions.create(
            model=MODEL, messages=c, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))

    results = _parallel(one, conversations)
    assert len(results) == 10
    for (text, ids, usage, _), want in zip(results, expected):
        assert ids == want and text == _text(tokenizer, want)
        assert usage["completion_tokens"] == len(want)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, param", [
    ({"prompt": "word " * 1100}, "prompt"),  # more tokens than max_model_len = 1024
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": "gpt-4"}, "model"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"extra_body": {"speculation": {"mode": "sometimes"}}}, "speculation.mode"),
    ({"extra_body": {"speculation": {"method": "eagle"}}}, "speculation.method"),
    ({"max_tokens": 1000, "prompt": "word " * 100}, "max_tokens"),  # prompt + max_tokens > 1024
    ({"logprobs": 21}, "logprobs"),
    ({"n": 0}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # beyond the vocabulary
    ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # more than max_tokens = 8
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ({"extra_body": {"stop_token_ids": [49152]}}, "stop_token_ids"),  # beyond the vocabulary
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"n": 9}, "n"),  # more than the verifier's 8 slots
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "foo"}}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}}, "structured_outputs"),
    ({"extra_body": {"response_format": {"type": "json_schema"}}}, "response_format"),
    ({"extra_body": {"response_format": {"type": "xml"}}}, "response_format"),
    ({"extra_body": {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}},
     "structured_outputs"),
    ({"extra_body": {"response_format": {"type": "json_object"}, "min_tokens": 2}}, "min_tokens"),
    ({"extra_body": {"bad_words": ["  "]}}, "bad_words"),
    ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ({"extra_body": {"allowed_token_ids": [49152]}}, "allowed_token_ids"),  # beyond the vocabulary
    ({"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ({"extra_body": {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"json_object": True, "whitespace_pattern": "(a"}}}, "structured_outputs"),
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": "2"}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": 2}, "stream": True}, "prompt_logprobs"),
])
def test_bad_input_is_400_naming_the_field(main_app, kwargs, param):
    client = _client(main_app, max_retries=0)
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    error = info.value.body
    assert error["param"] == param, error
    assert error["message"].startswith(param), error


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),  # "auto" by default
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "required"}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": t}}}}}
        for n, t in (("f", "string"), ("g", "integer"))], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
])
def test_bad_tool_calls_are_400_naming_the_field(main_app, kwargs, param):
    client = _client(main_app, max_retries=0)
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    error = info.value.body
    assert error["param"] == param and error["message"].startswith(param), error


def test_tokenize_and_detokenize(main_app, tokenizer, greedy):
    """vLLM's /tokenize gives the ids a request is prefilled with (a chat's count is its
    usage.prompt_tokens); /detokenize gives the text back, special tokens included."""
    root = main_app.base_url.removesuffix("/v1")
    chat = [{"role": "user", "content": "What is 2+2?"}]
    rendered = tokenizer.apply_chat_template(chat)
    want = tokenizer.encode(rendered, add_special_tokens=False)
    r = httpx.post(f"{root}/tokenize", json={"model": MODEL, "messages": chat}, timeout=30)
    assert r.status_code == 200 and r.json() == {"count": len(want), "max_model_len": 1024, "tokens": want,
                                                 "token_strs": None}
    usage = _client(main_app).chat.completions.create(model=MODEL, messages=chat, max_tokens=1).usage
    assert usage.prompt_tokens == len(want)
    r = httpx.post(f"{root}/tokenize", json={"messages": chat, "add_generation_prompt": False}, timeout=30).json()
    assert r["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=False))
    r = httpx.post(f"{root}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}, timeout=30).json()
    assert r["token_strs"] == ["Hello", " world"] and r["count"] == 2
    # vLLM's continue_final_message: the output continues the last message, left open.
    opened = [*chat, {"role": "assistant", "content": "The answer is"}]
    ids = tokenizer.encode(rendered + "The answer is", add_special_tokens=False)
    r = httpx.post(f"{root}/tokenize", json={"messages": opened, "add_generation_prompt": False,
                                             "continue_final_message": True}, timeout=30).json()
    assert r["tokens"] == ids
    r = _client(main_app).chat.completions.create(model=MODEL, messages=opened, max_tokens=6, temperature=0,
                                                  extra_body={"add_generation_prompt": False,
                                                              "continue_final_message": True,
                                                              "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == greedy([ids], 6)[0] and r.usage.prompt_tokens == len(ids)
    r = httpx.post(f"{root}/detokenize", json={"model": MODEL, "tokens": want}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": rendered}
    for path, body, param in (("tokenize", {}, "prompt"), ("tokenize", {"prompt": "a", "messages": chat}, "prompt"),
                              ("tokenize", {"prompt": "a", "model": "gpt-4"}, "model"),
                              ("tokenize", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
                              ("detokenize", {"tokens": [49152]}, "tokens"),
                              ("detokenize", {"tokens": "abc"}, "tokens"),
                              ("tokenize", {"messages": chat, "continue_final_message": True},
                               "continue_final_message"),
                              ("tokenize", {"messages": chat, "chat_template_kwargs": {"tools": []}},
                               "chat_template_kwargs")):
        r = httpx.post(f"{root}/{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_bad_chat_input_and_bad_json(main_app):
    client = _client(main_app, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=4)
    assert info.value.body["param"] == "messages.0.content"
    for kwargs in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           **kwargs)
        assert info.value.body["param"] == "top_logprobs", kwargs
        assert info.value.body["message"].startswith("top_logprobs"), kwargs
    r = httpx.post(f"{main_app.base_url}/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_tool_calls_over_grpc(main_app, model, tokenizer):
    """gRPC's tools and tool_choice: the output is the local engine's plain decoding under
    the named function's parameters schema, or under a "required" schema of one call
    written here by hand; the last message carries the calls read back (json.loads here
    gives the expected ones). Bad tools are INVALID_ARGUMENT naming the field."""
    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams
    from verifier.structured_output import StructuredOutput

    one_call = {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, schema in (("get_weather", WEATHER), ("add", ADD))]}}
    weather_chat = [{"role": "user", "content": "What is the weather in Lyon, in celsius?"}]
    add_chat = [{"role": "user", "content": "What is 12 plus 30? Call the add function."}]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in (weather_chat, add_chat)]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=1024), None, Controller.off())
    named, required = engine.generate_sync(prompts, [SamplingParams(
        max_tokens=48, temperature=0.0, structured_output=StructuredOutput(json=json.dumps(schema)))
        for schema in (WEATHER, one_call)])
    tools = [generate_pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                               parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]

    def request(chat, **kw):
        return generate_pb2.GenerateRequest(
            messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in chat]),
            max_tokens=48, temperature=0.0, speculation=generate_pb2.Speculation(mode="on"), **kw)

    messages = _grpc_generate(main_app, request(weather_chat, tools=tools,
                                                tool_choice=generate_pb2.ToolChoice(function="get_weather")))
    assert [t for m in messages for t in m.token_ids] == named.token_ids and messages[-1].finish_reason == "stop"
    (call,) = messages[-1].tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.name == "get_weather"
    assert call.arguments == _text(tokenizer, named.token_ids) and not any(m.tool_calls for m in messages[:-1])
    messages = _grpc_generate(main_app, request(add_chat, tools=tools, parallel_tool_calls=False,
                                                tool_choice=generate_pb2.ToolChoice(mode="required")))
    assert [t for m in messages for t in m.token_ids] == required.token_ids
    assert messages[-1].finish_reason == "tool_calls"
    assert [{"name": c.name, "parameters": json.loads(c.arguments)} for c in messages[-1].tool_calls] == json.loads(
        _text(tokenizer, required.token_ids))
    # "none": text, the tools only shown to the template.
    messages = _grpc_generate(main_app, request(add_chat, tools=tools, tool_choice=generate_pb2.ToolChoice(mode="none")))
    assert messages[-1].finish_reason in ("stop", "length") and not messages[-1].tool_calls
    for kw, param in (
            ({"tool_choice": generate_pb2.ToolChoice(mode="auto")}, "tool_choice"),  # no tools
            ({"tools": tools, "tool_choice": generate_pb2.ToolChoice(function="nowhere")}, "tool_choice"),
            ({"tools": tools, "tool_choice": generate_pb2.ToolChoice(mode="sometimes")}, "tool_choice"),
            ({"tool_choice": generate_pb2.ToolChoice(mode="required")}, "tool_choice"),  # no tools
            ({"tools": [generate_pb2.Tool(name="f", parameters="{not json")],
              "tool_choice": generate_pb2.ToolChoice(mode="required")}, "tools.0.parameters"),
            ({"tools": [generate_pb2.Tool(name="")], "tool_choice": generate_pb2.ToolChoice(mode="required")},
             "tools.0.name"),
            ({"tools": tools, "tool_choice": generate_pb2.ToolChoice(mode="required"),
              "structured_outputs": generate_pb2.StructuredOutputs(json_object=True)}, "tool_choice")):
        with pytest.raises(grpc.RpcError) as info:
            _grpc_generate(main_app, request(add_chat, **kw))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(param), kw
    with pytest.raises(grpc.RpcError) as info:  # a prompt has no chat template to show tools to
        _grpc_generate(main_app, generate_pb2.GenerateRequest(
            prompt="Hi", tools=tools, tool_choice=generate_pb2.ToolChoice(mode="required")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("tools")


def test_a_tool_conversation_and_chat_options_over_grpc(main_app, tokenizer, greedy):
    """gRPC's messages carry an assistant's calls, a tool's answer and names, and the
    request vLLM's chat options: the prompt is the conversation rendered here as the
    template reads it (SmolLM2's ignores calls, so an assistant message that made them
    renders with its empty content), and the output is plain decoding's from it, so the
    turn after a call's result is served over gRPC. add_generation_prompt false leaves the
    turn closed; continue_final_message continues the last message. Bad chat options are
    INVALID_ARGUMENT naming the field."""
    add_chat = [{"role": "user", "content": "What is 12 plus 30? Call the add function."}]
    history = [generate_pb2.ChatMessage(**add_chat[0]),
               generate_pb2.ChatMessage(role="assistant", tool_calls=[
                   generate_pb2.ToolCall(id="call-1", name="add", arguments='{"a": 12, "b": 30}')]),
               generate_pb2.ChatMessage(role="tool", tool_call_id="call-1", name="add", content="42")]
    rendered = [*add_chat, {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(rendered))

    def generate(messages, max_tokens=6, **kw):
        out = _grpc_generate(main_app, generate_pb2.GenerateRequest(
            messages=generate_pb2.ChatMessages(messages=messages), max_tokens=max_tokens, temperature=0.0, **kw))
        return [t for m in out for t in m.token_ids], out[-1].usage.prompt_tokens

    want = (greedy([ids], 6)[0], len(ids))
    assert generate(history) == want
    # A variable the template does not read changes nothing; its own names are refused (below).
    assert generate(history, chat_template_kwargs='{"enable_thinking": true}') == want
    closed = tokenizer.encode(tokenizer.apply_chat_template(rendered, add_generation_prompt=False))
    assert generate(history, 1, add_generation_prompt=False)[1] == len(closed) < len(ids)
    opened = [*add_chat, {"role": "assistant", "content": "The answer is"}]
    cont = tokenizer.encode(tokenizer.apply_chat_template(opened[:1]) + "The answer is", add_special_tokens=False)
    assert generate([generate_pb2.ChatMessage(**m) for m in opened], add_generation_prompt=False,
                    continue_final_message=True) == (greedy([cont], 6)[0], len(cont))
    for kw, param in (({"chat_template_kwargs": '{"messages": []}'}, "chat_template_kwargs"),
                      ({"chat_template_kwargs": "[1]"}, "chat_template_kwargs"),
                      ({"chat_template_kwargs": "{not json"}, "chat_template_kwargs"),
                      ({"continue_final_message": True}, "continue_final_message"),
                      ({"prompt": "Hi", "add_generation_prompt": False}, "add_generation_prompt"),
                      ({"prompt": "Hi", "continue_final_message": True}, "continue_final_message"),
                      ({"prompt_token_ids": generate_pb2.TokenIds(ids=[1, 2]), "chat_template_kwargs": "{}"},
                       "chat_template_kwargs")):
        request = generate_pb2.GenerateRequest(**({} if "prompt" in kw or "prompt_token_ids" in kw else {
            "messages": generate_pb2.ChatMessages(messages=history)}), **kw)
        with pytest.raises(grpc.RpcError) as info:
            _grpc_generate(main_app, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(param), kw
    with pytest.raises(grpc.RpcError) as info:
        _grpc_generate(main_app, generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages(messages=[
            generate_pb2.ChatMessage(role="assistant", tool_calls=[generate_pb2.ToolCall(id="c", arguments="{}")])])))
    assert info.value.details().startswith("messages.0.tool_calls.0.name")


def test_grpc_bad_input_is_invalid_argument(main_app):
    with pytest.raises(grpc.RpcError) as info:
        _grpc_generate(main_app, generate_pb2.GenerateRequest(prompt="Hi", max_tokens=0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("max_tokens")
    with pytest.raises(grpc.RpcError) as info:
        _grpc_generate(main_app, generate_pb2.GenerateRequest(model="other", prompt="Hi"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("model")
    with pytest.raises(grpc.RpcError) as info:
        _grpc_generate(main_app, generate_pb2.GenerateRequest(prompt="Hi", logprobs=21))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("logprobs")
    for so in (generate_pb2.StructuredOutputs(regex="(ab"), generate_pb2.StructuredOutputs()):
        with pytest.raises(grpc.RpcError) as info:
            _grpc_generate(main_app, generate_pb2.GenerateRequest(prompt="Hi", structured_outputs=so))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("structured_outputs")


# ---------------------------------------------------------------------- overload, disconnect
def _open_stream(app, max_tokens: int):
    """Start a streamed greedy completion; return (client, response) once its first chunk arrived."""
    client = httpx.Client(timeout=120)
    request = client.build_request("POST", f"{app.base_url}/completions", json={
        "model": MODEL, "prompt": "Count from one to one hundred in words:", "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "ignore_eos": True})
    response = client.send(request, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            break
    return client, response, lines


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_overload_is_429_with_retry_after(tight_app):
    client, response, _ = _open_stream(tight_app, 200)  # holds the only slot
    try:
        r = httpx.post(f"{tight_app.base_url}/completions", timeout=30,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(grpc.RpcError) as info:
            _grpc_generate(tight_app, generate_pb2.GenerateRequest(prompt="Hello", max_tokens=4))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        response.close()
        client.close()
    # The disconnect freed the slot: a new request is served again.
    verifier = tight_app.verifier()
    _wait_for(lambda: verifier.stats.remote().result()["num_running"] == 0, 30, "the aborted request to leave")
    r = httpx.post(f"{tight_app.base_url}/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    # No proposer configured: requests run without speculation.
    assert r.json()["speculation"]["drafted"] == 0


def test_a_chat_template_from_the_config_renders_the_conversations(tight_app, tokenizer, greedy):
    """model.chat_template replaces the model's template in the served verifier: /tokenize,
    chat over HTTP and gRPC's messages all prefill the conversation as that template
    writes it (here by hand), and the output is plain decoding's from those ids."""
    chat = [{"role": "user", "content": "What is 2+2?"}]
    want = tokenizer.encode("<|im_start|>user\nWHAT IS 2+2?<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
    assert "WHAT" not in tokenizer.apply_chat_template(chat)  # the model's own template keeps the case
    root = tight_app.base_url.removesuffix("/v1")
    assert httpx.post(f"{root}/tokenize", json={"messages": chat}, timeout=30).json()["tokens"] == want
    r = _client(tight_app).chat.completions.create(model=MODEL, messages=chat, max_tokens=6, temperature=0,
                                                   extra_body={"return_token_ids": True})
    assert r.usage.prompt_tokens == len(want) and r.choices[0].model_extra["token_ids"] == greedy([want], 6)[0]
    messages = _grpc_generate(tight_app, generate_pb2.GenerateRequest(
        messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**chat[0])]), max_tokens=6,
        temperature=0.0))
    assert [t for m in messages for t in m.token_ids] == greedy([want], 6)[0]


def test_tool_choice_auto_without_a_parser_is_400_naming_it(tight_app):
    """tight_app's config names no model.tool_call_parser: "auto", tools' default, is a
    400 / INVALID_ARGUMENT naming tool_choice, as vLLM without --enable-auto-tool-choice."""
    client = _client(tight_app, max_retries=0)
    chat = [{"role": "user", "content": "Hi"}]
    for kwargs in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4, **kwargs)
        error = info.value.body
        assert error["param"] == "tool_choice" and "model.tool_call_parser" in error["message"], error
    with pytest.raises(grpc.RpcError) as info:
        _grpc_generate(tight_app, generate_pb2.GenerateRequest(
            messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**chat[0])]), max_tokens=4,
            tools=[generate_pb2.Tool(name="add")]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("tool_choice")


def test_disconnect_aborts_and_frees_kv(main_app):
    verifier = main_app.verifier()
    before = verifier.stats.remote().result()
    assert before["num_running"] == 0
    client, response, lines = _open_stream(main_app, 500)
    try:
        for _ in range(3):
            next(lines)
        stats = verifier.stats.remote().result()
        assert stats["num_running"] == 1
        assert stats["num_free_slots"] == stats["max_num_seqs"] - 1
    finally:
        response.close()
        client.close()
    after = _wait_for(lambda: (s := verifier.stats.remote().result())["num_running"] == 0 and s, 30,
                      "the disconnected sequence to be aborted")
    assert after["num_free_slots"] == after["max_num_seqs"]
    assert after["num_waiting"] == 0
    # Far fewer than the 500 tokens asked for were generated.
    assert after["engine"]["num_output_tokens"] - before["engine"]["num_output_tokens"] < 400
    # The goodput controller's step-time model: its token curve, from a lone decode step at
    # the rows it runs at (2 with oneDNN's packed linears, which pad one row to two; 1 with
    # MKL), and what each batch size adds.
    from verifier.models.llama import onednn_available

    ctl = after["controller"]
    assert ctl["policy"] == "goodput" and ctl["step_time_ms"]
    assert ctl["step_time_ms"][0][0] == (2 if onednn_available() else 1)
    assert all(isinstance(b, int) and 1 <= b <= after["max_num_seqs"] and isinstance(ms, float)
               for b, ms in ctl["batch_step_ms"].items())


# ---------------------------------------------------------------------- proposer failure
def test_killing_the_proposer_replica_loses_nothing(main_app, tokenizer, greedy):
    from cluster.workloads import load_conversations

    conversations = load_conversations("code_edit")[2:6]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in conversations]
    expected = greedy(prompts, 96)
    proposer = main_app.proposer()
    old = proposer.info.remote().result()
    verifier = main_app.verifier()
    failures_before = verifier.stats.remote().result()["proposers"]["ngram"]["num_replica_failures"]
    client = _client(main_app, max_retries=0)

    def one(c):
        # mode on: every round asks the proposer, whatever the controller would choose.
        r = client.chat.completions.create(model=MODEL, messages=c, max_tokens=96, temperature=0,
                                           extra_body={"return_token_ids": True, "speculation": {"mode": "on"}})
        return r.choices[0].model_extra["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, c) for c in conversations]
        _wait_for(lambda: verifier.stats.remote().result()["num_running"] == 4, 60, "4 running sequences")
        time.sleep(1.0)
        os.kill(old["pid"], signal.SIGKILL)  # a process of this test's own Ray cluster
        results = [f.result(timeout=300) for f in futures]
    assert results == expected
    stats = verifier.stats.remote().result()["proposers"]["ngram"]
    assert stats["num_replica_failures"] > failures_before
    # Serve replaces the replica; the verifier discovers it and speculation resumes.
    new = _wait_for(lambda: (i := proposer.info.remote().result())["pid"] != old["pid"] and i, 120,
                    "Serve to restart the proposer replica")
    assert new["address"] != old["address"]
    _wait_for(lambda: verifier.stats.remote().result()["proposers"]["ngram"]["live"] == [new["address"]], 30,
              "the verifier to route to the new replica")
    # mode on: the new replica drafts, whatever auto would judge of its first calls' latency.
    r = client.chat.completions.create(model=MODEL, messages=conversations[0], max_tokens=48, temperature=0,
                                       extra_body={"speculation": {"mode": "on"}})
    assert r.model_extra["speculation"]["accepted"] > 0, r.model_extra["speculation"]


# ---------------------------------------------------------------------- autoscaling
def _running_replicas(app_name: str, deployment: str) -> int:
    from ray import serve

    states = serve.status().applications[app_name].deployments[deployment].replica_states
    return states.get("RUNNING", 0)


def test_proposers_autoscale_with_load_and_back(autoscale_app, tokenizer):
    from cluster.workloads import load_conversations

    verifier = autoscale_app.verifier()
    verifier_replica = verifier.stats.remote().result()["replica_id"]
    assert _running_replicas("auto", "Proposer-ngram") == 1
    assert _running_replicas("auto", "Verifier") == 1
    client = _client(autoscale_app, max_retries=0)
    conversations = load_conversations("code_edit")[:4]

    def one(c):
        return client.chat.completions.create(model=MODEL, messages=c, max_tokens=300, temperature=0,
                                              extra_body={"ignore_eos": True}).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, c) for c in conversations]
        _wait_for(lambda: _running_replicas("auto", "Proposer-ngram") == 2, 120,
                  "the proposer deployment to scale up to 2 replicas")
        live = _wait_for(lambda: len(l := verifier.stats.remote().result()["proposers"]["ngram"]["live"]) == 2 and l,
                         30, "the verifier to route to both replicas")
        assert len(set(live)) == 2
        assert [f.result(timeout=300) for f in futures] == [300] * 4
    assert _running_replicas("auto", "Verifier") == 1
    _wait_for(lambda: _running_replicas("auto", "Proposer-ngram") == 1, 120,
              "the proposer deployment to scale back down to 1 replica")
    assert _running_replicas("auto", "Verifier") == 1
    assert verifier.stats.remote().result()["replica_id"] == verifier_replica


# ---------------------------------------------------------------------- the command
def _descendants(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            for c in children:
                if c not in found:
                    found.add(c)
                    todo.append(c)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class OtlpCollector:
    """A minimal OTLP/HTTP trace collector on a free loopback port: decodes every
    `ExportTraceServiceRequest` POSTed to /v1/traces into plain span dicts."""

    def __init__(self) -> None:
        import http.server
        import threading

        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[dict] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in request.resource_spans:
                    service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            collector.spans.append({
                                "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                                "parent": sp.parent_span_id.hex() or None, "name": sp.name, "service": service,
                            })
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _check_traces(spans: list[dict], trace_ids: list[str]) -> None:
    """One trace per request: Serve's proxy span at the root, then ingress -> request ->
    rounds -> proposer calls (verifier side) -> proposer server spans, by parent links."""
    by_id = {s["span_id"]: s for s in spans}
    for trace_id in trace_ids:
        mine = [s for s in spans if s["trace_id"] == trace_id]
        names = collections.Counter(s["name"] for s in mine)
        assert names["splitspec.ingress"] == 1 and names["splitspec.request"] == 1, names
        assert names["splitspec.proposer_rpc"] >= 1 and names["splitspec.propose"] == names["splitspec.proposer_rpc"], names
        assert all(s["service"] == "splitspec" for s in mine)

        def parent(s):
            assert s["parent"] in by_id, f"{s['name']}: parent {s['parent']} was not exported"
            return by_id[s["parent"]]

        (ingress,) = [s for s in mine if s["name"] == "splitspec.ingress"]
        chain, node = [], ingress
        while node["parent"] is not None and node["parent"] in by_id:
            node = by_id[node["parent"]]
            chain.append(node["name"])
        assert any(n.startswith("proxy_") for n in chain), f"ingress is not under Serve's proxy span: {chain}"
        (request,) = [s for s in mine if s["name"] == "splitspec.request"]
        assert parent(request) is ingress
        assert all(parent(s) is request for s in mine if s["name"] == "splitspec.round")
        assert all(parent(s)["name"] == "splitspec.round" for s in mine if s["name"] == "splitspec.proposer_rpc")
        assert all(parent(s)["name"] == "splitspec.proposer_rpc" for s in mine if s["name"] == "splitspec.propose")


@pytest.mark.slow
def test_splitspec_serve_starts_answers_traces_and_stops_on_sigterm(tmp_path):
    """`splitspec serve CONFIG` on its own Ray cluster: prints the URLs, serves, exports
    Ray metrics and OTLP/HTTP traces (Serve's tracing, our batch span processors) to a real
    collector, and on SIGTERM stops its application and its Ray processes and exits 0."""
    import subprocess
    import sys
    import tempfile
    import threading

    collector = OtlpCollector()
    config = tmp_path / "serve.yaml"
    config.write_text(
        "proposers:\n  - {method: ngram, resources: {num_cpus: 0.25}}\n"
        # A generous proposer deadline: a 2-core machine running two Ray clusters is slow.
        "verifier: {max_num_seqs: 2, max_model_len: 512, num_threads: 2, proposer_deadline_ms: 1000,"
        " resources: {num_cpus: 0.5}}\n"
        "api: {host: 127.0.0.1, http_port: 0, grpc_port: 0}\n"
        f"tracing: {{exporter: otlp_http, endpoint: '{collector.url}', export_delay_ms: 200}}\n"
    )
    ray_tmp = tempfile.mkdtemp(prefix="ray-cli-", dir=tempfile.gettempdir())
    env = dict(os.environ, RAY_TMPDIR=ray_tmp,
               RAY_metrics_report_interval_ms="500")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", str(config)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line:
                ready.set()

    threading.Thread(target=reader, daemon=True).start()
    try:
        assert ready.wait(240), "".join(lines[-30:])
        health = next(line.split()[1] for line in lines if line.strip().startswith("health"))
        metrics = next(line.split()[1] for line in lines if line.strip().startswith("metrics"))
        assert httpx.get(health, timeout=10).status_code == 200
        base = health.rsplit("/health", 1)[0] + "/v1"
        # The first request continues the caller's W3C trace; the second starts its own.
        caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        traceparent = f"00-{caller_trace}-00f067aa0ba902b7-01"
        for headers in ({"traceparent": traceparent}, {}):
            r = httpx.post(f"{base}/chat/completions", timeout=120, headers=headers, json={
                "messages": [{"role": "user", "content": "Repeat: a b c a b c a b c"}], "max_tokens": 8,
                "temperature": 0, "speculation": {"mode": "on", "max_k": 2}})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8
            # The fresh n-gram replica drafts from the first request on: at most one round is
            # lost (a pause of this busy machine past the deadline), and it never sits out.
            off = r.json()["speculation"]["rounds_off"]
            assert "proposer_unavailable" not in off and off.get("proposer_failed", 0) <= 1, off
        _wait_for(lambda: sum(s["name"] == "splitspec.ingress" for s in collector.spans) == 2
                  and len({s["trace_id"] for s in collector.spans if s["name"] == "splitspec.propose"}) == 2,
                  60, "both requests' spans to reach the collector")
        time.sleep(1.0)  # Serve's proxy span ends after the response: one more export
        ingress_traces = [s["trace_id"] for s in collector.spans if s["name"] == "splitspec.ingress"]
        assert caller_trace in ingress_traces
        _check_traces(collector.spans, ingress_traces)
        scraped = httpx.get(metrics, timeout=10).text
        assert re.search(r'^ray_splitspec_rounds_total\{[^}]*application="splitspec"[^}]*\} [1-9]', scraped, re.M)

        started = _descendants(proc.pid)  # Ray's GCS, raylet, workers, ...
        assert len(started) >= 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, "".join(lines[-30:])
        _wait_for(lambda: not [p for p in started if _alive(p)], 60, "the Ray processes it started to exit")
        assert any(line.strip() == "stopped" for line in lines)
        with pytest.raises(httpx.TransportError):
            httpx.get(health, timeout=5)
    finally:
        collector.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started
            proc.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_model_proposers_deploy_and_stay_exact(model_proposers_app, tokenizer, greedy, method):
    """`method: draft` and `method: eagle` deploy like n-gram (own Serve deployment, gRPC);
    a request pinned to one drafts with it only and gets the plain greedy output."""
    from cluster.workloads import load_conversations

    conversation = load_conversations("chat")[1]
    want = greedy([tokenizer.encode(tokenizer.apply_chat_template(conversation))])[0]
    r = _client(model_proposers_app).chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"speculation": {"mode": "on", "method": method, "max_k": 4}, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want
    spec = r.model_extra["speculation"]
    assert spec["rounds_by_method"] == {method: spec["rounds_with_drafts"]}
    assert spec["rounds_with_drafts"] > 0 and spec["accepted"] > 0


def test_a_proposer_placed_in_the_verifier_drafts_in_process_and_stays_exact(model_proposers_app, tokenizer, greedy,
                                                                           edit_conversations):
    """n-gram lookup with `placement: verifier` has no deployment of its own; the verifier
    calls it in-process, and a request pinned to it gets the plain greedy output."""
    from ray import serve

    deployments = serve.status().applications[model_proposers_app.name].deployments
    assert set(deployments) == {"Ingress", "Verifier", "Proposer-draft", "Proposer-eagle"}
    health = httpx.get(model_proposers_app.health_url, timeout=10).json()
    assert health["ready"] is True and health["proposers"] == {"draft": 1, "ngram": 1, "eagle": 1}
    conversation = edit_conversations[0]  # the answer quotes the code: lookup finds drafts
    want = greedy([tokenizer.encode(tokenizer.apply_chat_template(conversation))])[0]
    r = _client(model_proposers_app).chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"speculation": {"mode": "on", "method": "ngram", "max_k": 4}, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want
    spec = r.model_extra["speculation"]
    assert spec["rounds_by_method"] == {"ngram": spec["rounds_with_drafts"]}
    assert spec["rounds_with_drafts"] > 0 and spec["accepted"] > 0
    stats = model_proposers_app.verifier().stats.remote().result()["proposers"]
    assert stats["ngram"]["placement"] == "verifier" and stats["draft"]["placement"] == "deployment"
    assert stats["eagle"]["live"] and "live" not in stats["ngram"]


@pytest.mark.slow
def test_a_model_proposer_placed_in_the_verifier_drafts_as_its_deployment_does(model_proposers_app,
                                                                               eagle_in_verifier_app, tokenizer,
                                                                               greedy):
    """The EAGLE head placed in the verifier (no deployment, the target's hidden states
    handed over in-process) gets the plain greedy output, and drafts and accepts exactly
    as the same head served as its own deployment over gRPC (models app) for the same
    request: where a proposer runs does not change what it proposes."""
    from ray import serve

    from cluster.workloads import load_conversations

    deployments = serve.status().applications[eagle_in_verifier_app.name].deployments
    assert set(deployments) == {"Ingress", "Verifier"}
    assert httpx.get(eagle_in_verifier_app.health_url, timeout=10).json()["proposers"] == {"eagle": 1}
    conversation = load_conversations("chat")[1]
    want = greedy([tokenizer.encode(tokenizer.apply_chat_template(conversation))])[0]
    got = {}
    for app in (eagle_in_verifier_app, model_proposers_app):
        r = _client(app).chat.completions.create(
            model=MODEL, messages=conversation, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"speculation": {"mode": "on", "method": "eagle", "max_k": 4}, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == want, app.name
        spec = r.model_extra["speculation"]
        assert spec["rounds_by_method"] == {"eagle": spec["rounds_with_drafts"]}, app.name
        got[app.name] = (spec["drafted"], spec["accepted"], spec["rounds_with_drafts"])
    assert got[eagle_in_verifier_app.name] == got[model_proposers_app.name]
    assert got[model_proposers_app.name][1] > 0
    stats = eagle_in_verifier_app.verifier().stats.remote().result()["proposers"]
    assert stats == {"eagle": {"placement": "verifier", "active_sequences": 0}}


def test_a_split_target_serves_exactly_and_a_lost_worker_gets_the_replica_replaced(split_app, tokenizer, greedy):
    """`tensor_parallel_size: 2`: the replica starts a worker process holding half of every
    layer; completions equal plain decoding on the whole model, speculating. Killing the
    worker fails the replica's health check, Serve replaces the replica (a new worker with
    it), and the output is exact again."""
    messages = [{"role": "user", "content": "Repeat exactly: the cat sat on the mat, the cat sat on the mat."}]
    want = greedy([tokenizer.encode(tokenizer.apply_chat_template(messages))])[0]

    def complete():
        r = _client(split_app, max_retries=0).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"], r.model_extra["speculation"]

    tokens, spec = complete()
    assert tokens == want and spec["accepted"] > 0
    stats = split_app.verifier().stats.remote().result()
    split = stats["tensor_parallel"]
    assert split["size"] == 2 and len(split["worker_pids"]) == 1 and split["problem"] is None
    os.kill(split["worker_pids"][0], signal.SIGKILL)

    def replaced():
        try:
            s = split_app.verifier().stats.remote().result()
        except Exception:
            return None
        return s if s["pid"] != stats["pid"] else None

    new = _wait_for(replaced, 180, "a new verifier replica")
    assert new["tensor_parallel"]["worker_pids"] != split["worker_pids"]
    tokens, _ = _wait_for(lambda: _quietly(complete), 60, "a completion from the new replica")
    assert tokens == want


def _quietly(f):
    try:
        return f()
    except Exception:
        return None


def test_a_model_proposers_threads_are_configurable(model_proposers_app):
    """`num_threads` sets a model proposer replica's torch threads; without it, the replica
    keeps Ray's cap for its num_cpus of 0.25 (one thread)."""
    draft = model_proposers_app.proposer("draft").info.remote().result()
    eagle = model_proposers_app.proposer("eagle").info.remote().result()
    assert (draft["torch_threads"], eagle["torch_threads"]) == (2, 1)
