"""Structured outputs (`verifier.structured_output`): each verified row masked to what the
grammar allows after its own path, so speculation stays exact.

References: the masks by hand from the vocabulary's bytes; a greedy decoding loop written
here over HF transformers' logits, masked by an llguidance matcher the test builds itself;
and the outputs checked by `jsonschema`, Python's `re` and plain membership.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from proposers.ngram import NgramProposer
from tests.verifier.test_logits_processors import CONFIG, _speculative_runs
from tests.verifier.test_logits_processors import _reference as decoding_loop  # HF's greedy loop, adjusted
from verifier.controller import Controller
from verifier.engine import Engine
from verifier.errors import InvalidRequestError
from verifier.sampling_params import SamplingParams
from verifier.structured_output import GrammarCompiler, StructuredOutput

MAX_TOKENS = 40
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 2, "maxItems": 2}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ("yes", "no", "it depends")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.eos_token_ids)


def _single(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {ids}"
    return ids[0]


def _prefix_tokens(tokenizer, strings) -> set[int]:
    """By hand: the tokens whose bytes are a non-empty prefix of one of `strings`."""
    special = set(tokenizer.backend.get_added_tokens_decoder())
    out = set()
    for t in range(tokenizer.vocab_size):
        b = tokenizer.token_bytes(t)
        if t not in special and b and any(s.encode().startswith(b) for s in strings):
            out.add(t)
    return out


def test_choice_masks_by_hand(tokenizer, compiler):
    choices = ("yes", 'no "quoted"\n', "é")  # a quote, a newline and a 2-byte character
    m = compiler.matcher(StructuredOutput(choice=choices))
    first = set(np.flatnonzero(m.allowed()).tolist())
    assert first == _prefix_tokens(tokenizer, choices)
    assert _single(tokenizer, "yes") in first and _single(tokenizer, "n") in first
    m.accept([_single(tokenizer, "ye")])
    assert set(np.flatnonzero(m.allowed()).tolist()) == _prefix_tokens(tokenizer, ["s"])
    assert not m.complete
    m.accept([_single(tokenizer, "s")])
    assert m.complete  # "yes" is whole: only the end of sequence may follow
    assert set(np.flatnonzero(m.allowed()).tolist()) == set(tokenizer.eos_token_ids)


def test_rows_are_masked_after_their_own_paths(tokenizer, compiler):
    """Chain and tree paths: each row gets the mask after its path; a row after a refused
    draft or after the end of sequence is left unmasked; the matcher is back where it was."""
    m = compiler.matcher(StructuredOutput(choice=("ab", "cd")))
    a, b, c, d = (_single(tokenizer, x) for x in "abcd")
    eos = min(tokenizer.eos_token_ids)
    paths = [[], [a], [a, b], [a, b, eos], [c], [c, c], [c, c, d], [c, d]]
    logits = torch.zeros(len(paths), tokenizer.vocab_size)
    m.mask_rows(logits, paths)
    allowed = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    everything = set(range(tokenizer.vocab_size))
    assert allowed == [_prefix_tokens(tokenizer, ["ab", "cd"]), _prefix_tokens(tokenizer, ["b"]), {eos},
                       everything, _prefix_tokens(tokenizer, ["d"]), everything, everything, {eos}]
    assert set(np.flatnonzero(m.allowed()).tolist()) == allowed[0]  # rolled back
    m.accept([c])  # the committed output moves on; the next round's rows start there
    logits = torch.zeros(2, tokenizer.vocab_size)
    m.mask_rows(logits, [[], [d]])
    assert [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits] == [
        _prefix_tokens(tokenizer, ["d"]), {eos}]


def _starts(tokenizer, allowed: np.ndarray) -> set[bytes]:
    """The first bytes of the allowed tokens (end of sequence aside)."""
    return {tokenizer.token_bytes(t)[:1] for t in np.flatnonzero(allowed).tolist()
            if t not in tokenizer.eos_token_ids}


def test_json_whitespace_by_hand(tokenizer, compiler):
    """After a JSON object's `{`: by default a key's quote, the closing brace or whitespace
    may follow; with disable_any_whitespace no whitespace; with whitespace_pattern " " a
    space but no newline."""
    brace = _single(tokenizer, "{")
    starts = {}
    for name, spec in (("default", StructuredOutput(json_object=True)),
                       ("none", StructuredOutput(json_object=True, disable_any_whitespace=True)),
                       ("space", StructuredOutput(json_object=True, whitespace_pattern=" "))):
        m = compiler.matcher(spec)
        m.accept([brace])
        starts[name] = _starts(tokenizer, m.allowed())
    assert {b'"', b"}", b" ", b"\n"} <= starts["default"]
    assert starts["none"] == {b'"', b"}"}
    assert starts["space"] == {b'"', b"}", b" "}


@pytest.mark.parametrize("spec, param", [
    (StructuredOutput(), "structured_outputs"),
    (StructuredOutput(regex="a", choice=("a",)), "structured_outputs"),
    (StructuredOutput(json="{not json", param="response_format"), "response_format"),
    (StructuredOutput(json="[1, 2]"), "structured_outputs"),
    (StructuredOutput(json='{"type": "foo"}'), "structured_outputs"),
    (StructuredOutput(regex=""), "structured_outputs"),
    (StructuredOutput(regex="(ab"), "structured_outputs"),
    (StructuredOutput(choice=()), "structured_outputs"),
    (StructuredOutput(choice=("a", "")), "structured_outputs"),
    (StructuredOutput(grammar="start: undefined_rule", param="grammar"), "grammar"),
    (StructuredOutput(regex="a+", disable_any_whitespace=True), "structured_outputs"),  # JSON only
    (StructuredOutput(choice=("a",), whitespace_pattern=" ", param="response_format"), "response_format"),
    (StructuredOutput(json_object=True, disable_any_whitespace=True, whitespace_pattern=" "), "structured_outputs"),
    (StructuredOutput(json_object=True, whitespace_pattern=""), "structured_outputs"),
    (StructuredOutput(json_object=True, whitespace_pattern="(ab"), "structured_outputs"),
])
def test_bad_specs_are_refused_naming_the_field(compiler, spec, param):
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    assert info.value.param == param


def test_min_tokens_is_refused_beside_a_grammar():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(min_tokens=2, structured_output=StructuredOutput(choice=("a",))).validate()
    assert info.value.param == "min_tokens"


# ------------------------------------------------------------------ on the real model
def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def cases(tokenizer):
    """(prompt, spec, check of the output text, max_tokens): the people's details are in
    the prompt and the second object repeats the first's keys, so n-gram drafts quote."""
    return [
        (_chat(tokenizer, "Reply with JSON giving name, age and city of each. Alice Martin is 34 and lives in "
                          "Lyon, France; her brother Tom Martin is 31 and lives in Paris."),
         StructuredOutput(json=json.dumps(PEOPLE)),
         lambda text: jsonschema.validate(json.loads(text), PEOPLE), 64),
        (_chat(tokenizer, "Write a phone number for the Lyon office of Martin & Sons."),
         StructuredOutput(regex=PHONE), lambda text: re.fullmatch(PHONE, text) or pytest.fail(text), MAX_TOKENS),
        (_chat(tokenizer, "Is Lyon in France? Answer yes, no or it depends."),
         StructuredOutput(choice=CHOICES), lambda text: text in CHOICES or pytest.fail(text), MAX_TOKENS),
    ]


def _params(cases, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, structured_output=spec, **{"temperature": 0.0, **kw})
            for _, spec, _, n in cases]


def _reference(hf_model, tokenizer, prompt: list[int], spec: StructuredOutput, max_tokens: int) -> list[int]:
    """Greedy decoding over HF's logits, each step masked by a matcher built here from
    the output so far."""
    import llguidance

    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=sorted(tokenizer.eos_token_ids))
    matcher = llguidance.LLMatcher(lltok, spec.source())

    def mask(logits, out):
        if out:
            assert matcher.consume_token(out[-1])
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        logits[torch.from_numpy(bits[: tokenizer.vocab_size] == 0)] = float("-inf")

    return decoding_loop(hf_model, tokenizer, prompt, mask, max_tokens)


@pytest.mark.slow
def test_constrained_greedy_is_the_reference_and_matches(model, tokenizer, hf_model, cases):
    prompts = [p for p, *_ in cases]
    results = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(prompts, _params(cases))
    free = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for (prompt, spec, check, max_tokens), r, unconstrained in zip(cases, results, free):
        assert r.token_ids == _reference(hf_model, tokenizer, prompt, spec, max_tokens)
        assert r.finish_reason.value == "stop" and r.token_ids[-1] in tokenizer.eos_token_ids
        check(r.text)
        assert unconstrained.token_ids[:len(r.token_ids)] != r.token_ids  # the grammar mattered


@pytest.mark.slow
def test_constrained_output_is_exact_under_speculation(model, tokenizer, cases):
    """n-gram chains (drafts the grammar refuses among them) and oracle token trees whose
    wrong branches the grammar mostly refuses: plain decoding's output exactly."""
    prompts, params = [p for p, *_ in cases], _params(cases)
    plain = [r.token_ids for r in Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(prompts, params)]
    # The trees need three tokens ahead: the JSON and the phone number; the one-word
    # choice goes through n-gram chains alone.
    chains, trees = _speculative_runs(model, tokenizer, prompts[:2], params[:2], plain[:2])
    assert chains == plain[:2] and trees == plain[:2]
    short = Engine(model, tokenizer, CONFIG, NgramProposer(), Controller.static(4)).generate_sync(prompts[2:], params[2:])
    assert [r.token_ids for r in short] == plain[2:]


@pytest.mark.slow
def test_compact_json_is_the_reference_and_exact_under_speculation(model, tokenizer, hf_model, cases):
    """disable_any_whitespace: the people's JSON written without whitespace between tokens
    (the text is its own compact serialization), the HF loop's output, and plain decoding's
    with n-gram drafts."""
    prompt, spec, check, max_tokens = cases[0]
    compact = StructuredOutput(json=spec.json, disable_any_whitespace=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=compact)
    (plain,) = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync([prompt], params)
    assert plain.finish_reason.value == "stop" and plain.token_ids == _reference(
        hf_model, tokenizer, prompt, compact, max_tokens)
    check(plain.text)
    assert plain.text == json.dumps(json.loads(plain.text), separators=(",", ":"), ensure_ascii=False)
    engine = Engine(model, tokenizer, CONFIG, NgramProposer(), Controller.static(4))
    assert engine.generate_sync([prompt], params)[0].token_ids == plain.token_ids
    assert engine.stats.num_accepted > 0
    # By default the same request writes whitespace between tokens (newlines among it);
    # with whitespace_pattern " ", only single spaces.
    outside = re.compile(r'"(?:[^"\\]|\\.)*"')  # JSON strings, cut out
    spaced = StructuredOutput(json=spec.json, whitespace_pattern=" ")
    default, single = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        [prompt] * 2, [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=s)
                       for s in (spec, spaced)])
    assert "\n" in outside.sub("", default.text)
    check(single.text)
    assert set(re.findall(r"\s+", outside.sub("", single.text))) == {" "}


@pytest.mark.slow
def test_sampled_constrained_outputs_match_and_top_k_1_is_greedy(model, tokenizer, cases):
    """Sampling reads the masked rows: every sampled output matches, with n-gram drafts,
    and top-k 1 sampling with speculation gives the greedy output."""
    engine = Engine(model, tokenizer, CONFIG, NgramProposer(), Controller.static(4))
    prompt, spec, check, max_tokens = cases[0]
    sampled = engine.generate_sync([prompt] * 4, [SamplingParams(max_tokens=max_tokens + 16, temperature=0.8, seed=s,
                                                                 structured_output=spec) for s in range(4)])
    finished = [r for r in sampled if r.finish_reason.value == "stop"]
    assert len(finished) >= 2  # the others ran out of tokens inside the JSON
    for r in finished:
        check(r.text)
    assert len({r.text for r in sampled}) > 1
    assert engine.stats.num_accepted > 0
    greedy = engine.generate_sync(cases[0][:1] * 2, _params(cases[:1]) + _params(cases[:1], temperature=1.0, top_k=1,
                                                                               seed=3))
    assert greedy[1].token_ids == greedy[0].token_ids


@pytest.mark.slow
def test_a_complete_grammar_ends_the_output_whatever_ignore_eos(model, tokenizer, cases):
    prompt, spec, _, _ = cases[2]
    r = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, structured_output=spec))[0]
    assert r.text in CHOICES and r.finish_reason.value == "stop" and r.token_ids[-1] in tokenizer.eos_token_ids


@pytest.mark.slow
def test_a_failed_matcher_ends_its_own_sequence_alone(model, tokenizer, cases):
    """A matcher that llguidance put in its error state (here by a token it refuses)
    allows nothing: the sequence's next token fails it, and that request alone gets the
    `GrammarError`; the request beside it in the batch finishes as it would alone."""
    import asyncio

    from verifier.structured_output import GrammarError

    engine = Engine(model, tokenizer, CONFIG, None, Controller.off())
    (prompt, spec, _, n), (other, other_spec, _, m) = cases[0], cases[2]
    broken = StructuredOutput(json=spec.json, param="response_format")  # its own cache entry
    make = engine._grammars.matcher

    def matcher(s):
        g = make(s)
        if s == broken:
            assert not g._matcher.consume_token(min(tokenizer.eos_token_ids))  # refused at the start
        return g

    engine._grammars.matcher = matcher

    async def run():
        async def collect(p, params):
            out = []
            try:
                async for o in engine.generate(p, params):
                    out.extend(o.token_ids)
            except GrammarError as exc:
                return out, exc
            return out, None

        return await asyncio.gather(
            collect(prompt, SamplingParams(max_tokens=n, temperature=0.0, structured_output=broken)),
            collect(other, SamplingParams(max_tokens=m, temperature=0.0, structured_output=other_spec)))

    (failed, error), (fine, none) = asyncio.run(run())
    assert isinstance(error, GrammarError) and "grammar failed" in str(error) and failed == []
    assert none is None and fine == engine.generate_sync([other], _params(cases[2:]))[0].token_ids
    assert engine.cache.num_used_slots == 0


@pytest.mark.slow
def test_forced_tokens_are_drafted_and_stay_exact(model, tokenizer):
    """Without a proposer, a round drafts what the grammar forces: a JSON schema's long
    keys and enum values. The output is plain decoding's, in fewer passes; with the
    request's speculation off, or the policy off, nothing is drafted."""
    order = {"type": "object", "additionalProperties": False,
             "required": ["customer_full_name", "customer_postal_address", "order_status"],
             "properties": {"customer_full_name": {"type": "string"}, "customer_postal_address": {"type": "string"},
                            "order_status": {"enum": ["awaiting_payment", "shipped_to_customer"]}}}
    prompt = _chat(tokenizer, "Reply with JSON for this order: Ann Lee of 1 Main Street, Springfield ordered a lamp; "
                              "it has shipped.")
    params = SamplingParams(max_tokens=64, temperature=0.0, structured_output=StructuredOutput(json=json.dumps(order)))
    plain = Engine(model, tokenizer, CONFIG, None, Controller.off()).generate_sync([prompt], params)[0]
    jsonschema.validate(json.loads(plain.text), order)
    engine = Engine(model, tokenizer, CONFIG, None, Controller.static(4))
    forced = engine.generate_sync([prompt], params)[0]
    assert forced.token_ids == plain.token_ids
    assert forced.stats.rounds_by_method.get("grammar", 0) >= 3  # a key or value each
    assert forced.stats.accepted >= 8 and forced.stats.rounds <= plain.stats.rounds - 8
    off = engine.generate_sync([prompt], params, mode="off")[0]
    assert off.token_ids == plain.token_ids and off.stats.drafted == 0
