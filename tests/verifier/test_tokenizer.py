"""Tokenizer and IncrementalDetokenizer on the bundled SmolLM2 GGUF and on tiny GGUFs.

The independent reference is HF transformers' own GGUF tokenizer loader (test-time only).
It has no entry for `tokenizer.ggml.pre == 'smollm'` and falls back to plain GPT-2
splitting, whereas SmolLM2's own tokenizer.json (and llama.cpp) isolate every digit
first. The two differ only where whitespace precedes a number character ("a  1", " ½"):
of the samples below, 2 of 32. So the reference gets the model's original pre-tokenizer
back, and one hand-computed test pins the "a  1" case.
"""

from __future__ import annotations

import doctest
import json
import os
import random

import gguf
import pytest

from verifier.errors import InvalidRequestError, ModelLoadError
from verifier.models import detokenizer as detokenizer_module
from verifier.models import tokenizer as tokenizer_module
from verifier.models.bundled import bundled_model_path
from verifier.models.detokenizer import IncrementalDetokenizer
from verifier.models.tokenizer import Tokenizer

os.environ["HF_HUB_OFFLINE"] = "1"  # the reference must never reach a hub

SAMPLES = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n",
    "for i in range(10):\n\tprint(i)\t# tab\n\t\tnested\n",
    "12345",
    "3.14159 and 2.71828",
    "Call 555-0100 or +1 (800) 123-4567.",
    "x =  42;  y=\t7\n    1\n\t2\n   \n",
    "café naïve résumé Ångström",
    "Grüße aus Köln, ça va?",
    "日本語のテキストです。",
    "中文测试，你好世界！",
    "한국어 문장입니다",
    "Ελληνικά и русский текст",
    "مرحبا بالعالم",
    "emoji 🎉🚀👍🏽 and 👨\u200d👩\u200d👧\u200d👦 family",
    "multiple   spaces    here",
    "lines\n\n\nthree newlines\r\nCRLF",
    "   leading and trailing   ",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>x<file_sep>",
    "not special: <|im_start and im_end|>",
    "I'm sure they'll say we've done it, isn't it? I'D SAY",
    "https://example.com/path?q=1&r=two#frag",
    '{"key": [1, 2.5, null], "nested": {"a": "b"}}',
    "Ω≈ç√∫ ∑ ∞ ≠ ± × ÷",
    "a\u00a0b\u2003c\u200bd",
    "½ cup, x² and ٣ are numbers too",
    "\x00\x01 control \x7f chars",
    "```python\nprint('hi')\n```",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Comment ça va ?\n  Bien ?"},
    ],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_model_path())


@pytest.fixture(scope="module")
def hf_reference():
    """HF's GGUF tokenizer with SmolLM2's original pre-tokenizer (see the module docstring)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    path = bundled_model_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return reference


# --- Tokenizer on the bundled model ------------------------------------------------------


def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})  # <|im_end|>: EOS and the template's end of turn
    assert tok.add_bos is False
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_hf_and_round_trips(tok: Tokenizer, hf_reference, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_reference.encode(text, add_special_tokens=True)
    assert tok.encode(text, add_special_tokens=False) == hf_reference.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_digits_are_isolated_from_whitespace(tok: Tokenizer) -> None:
    # Digits first: "a  1" -> "a  " | "1" -> "a", "ĠĠ", "1". Plain GPT-2 splitting would
    # give "a", "Ġ", "Ġ1" and, with no "Ġ1" merge in this vocabulary, "a", "Ġ", "Ġ", "1".
    tokens = tok.backend.get_vocab()
    assert tok.encode("a  1") == [tokens["a"], tokens["ĠĠ"], tokens["1"]]
    assert tok.encode("12345") == [tokens[d] for d in "12345"]


def test_special_tokens_stay_whole_and_can_be_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["no_system", "system_multi_turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tok: Tokenizer, hf_reference, messages, add_generation_prompt: bool) -> None:
    expected = hf_reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_by_hand(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_errors(tok: Tokenizer) -> None:
    def with_template(template: str | None) -> Tokenizer:
        return Tokenizer(
            tok.backend, vocab_size=tok.vocab_size, bos_token_id=1, eos_token_ids=frozenset({2}),
            bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=template,
        )  # fmt: skip

    with pytest.raises(InvalidRequestError, match="no chat template"):
        with_template(None).apply_chat_template([{"role": "user", "content": "hi"}])
    strict = with_template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}ok"
    )
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="must start with user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ModelLoadError, match="does not compile"):
        with_template("{% if %}")
    sandboxed = with_template("{{ messages.append(1) }}")
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        sandboxed.apply_chat_template([])
    # SmolLM2's template adds the content to a string: a 400, not a server error.
    with pytest.raises(InvalidRequestError, match="chat template failed: TypeError"):
        tok.apply_chat_template([{"role": "assistant", "content": None}])


TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}{{ t.function.name }}: {{ t.function.parameters | tojson }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
)


@pytest.mark.slow
def test_tools_reach_the_template_as_hf_passes_them(tok: Tokenizer, hf_reference) -> None:
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    messages = [{"role": "user", "content": "12 + 30?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    ours = Tokenizer(tok.backend, vocab_size=tok.vocab_size, bos_token_id=1, eos_token_ids=frozenset({2}),
                     bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=TOOLS_TEMPLATE)
    expected = hf_reference.apply_chat_template(messages, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                                add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, tools=tools) == expected
    assert expected.startswith('add: {"type": "object", "properties": {"a": {"type": "integer"}') and \
        '[add {"a": 12, "b": 30}]' in expected and "tool: 42 (c1)" in expected
    # No tools: the loop over them renders nothing (trim_blocks takes the newline after endif).
    assert ours.apply_chat_template(messages[:1], add_generation_prompt=False) == "user: 12 + 30?"


# --- Tokenizer.from_dir -----------------------------------------------------------------


def _write_dir(tmp_path, tok: Tokenizer, *, post_processor=None, generation_eos=None) -> None:
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(tok.backend.to_str())
    backend.post_processor = post_processor
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "chat_template": tok.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))


def test_from_dir(tmp_path, tok: Tokenizer) -> None:
    _write_dir(tmp_path, tok, generation_eos=[2, 0])
    loaded = Tokenizer.from_dir(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.add_bos) == (1, frozenset({0, 2}), False)
    assert loaded.vocab_size == tok.vocab_size
    for text in SAMPLES:
        assert loaded.encode(text) == tok.encode(text)
    messages = CONVERSATIONS[1]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_dir_bos_comes_from_the_post_processor(tmp_path, tok: Tokenizer) -> None:
    from tokenizers import processors

    prepend_bos = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    _write_dir(tmp_path, tok, post_processor=prepend_bos)
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.add_bos is True
    assert loaded.encode("hi") == [1, *tok.encode("hi")]
    assert loaded.encode("hi", add_special_tokens=False) == tok.encode("hi")


def test_from_dir_without_tokenizer_json(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# --- tiny GGUFs: pre-tokenizer families and errors ----------------------------------------

# "1234" and "12345" are not tokens; the merges build "12" -> "123" -> "1234" and "45".
TINY_TOKENS = ["<|endoftext|>", *"12345", "12", "123", "1234", "45", *"abc", "abc", "<think>", "<|im_end|>"]
TINY_TYPES = [3] + [1] * 13 + [4, 3]
TINY_MERGES = ["1 2", "12 3", "123 4", "4 5"]


def _tiny_gguf(tmp_path, *, model="gpt2", pre="gpt-2", merges=TINY_MERGES, chat_template=None, add_bos=None) -> str:
    path = str(tmp_path / f"{model}-{pre}.gguf")
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types(TINY_TYPES)
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "pre, expected, add_bos",
    [
        ("gpt-2", ["1234", "5"], False),  # " ?\p{N}+": one piece, merged by rank
        ("default", ["1234", "5"], False),
        ("llama-bpe", ["<|endoftext|>", "123", "45"], True),  # \p{N}{1,3}; BOS on by default
        ("qwen2", ["1", "2", "3", "4", "5"], False),  # \p{N}: one digit per piece
        ("smollm", ["1", "2", "3", "4", "5"], False),
    ],
)
def test_pre_tokenizer_families(tmp_path, pre: str, expected: list[str], add_bos: bool) -> None:
    tiny = Tokenizer.from_gguf(_tiny_gguf(tmp_path, pre=pre))
    assert tiny.add_bos is add_bos
    assert tiny.encode("12345") == [TINY_TOKENS.index(t) for t in expected]


def test_llama_bpe_takes_whole_tokens_without_merges(tmp_path) -> None:
    ids = lambda *ts: [TINY_TOKENS.index(t) for t in ts]  # noqa: E731
    assert Tokenizer.from_gguf(_tiny_gguf(tmp_path, pre="llama-bpe", add_bos=False)).encode("abc") == ids("abc")
    assert Tokenizer.from_gguf(_tiny_gguf(tmp_path, pre="gpt-2")).encode("abc") == ids("a", "b", "c")


def test_user_defined_tokens_are_whole_but_not_special(tmp_path) -> None:
    tiny = Tokenizer.from_gguf(_tiny_gguf(tmp_path))
    ids = tiny.encode("a<think>b<|endoftext|>")
    assert ids == [TINY_TOKENS.index(t) for t in ("a", "<think>", "b", "<|endoftext|>")]
    assert tiny.decode(ids, skip_special_tokens=True) == "a<think>b"


def test_chat_options(tok: Tokenizer) -> None:
    """vLLM's continue_final_message leaves the last message open (the text stops right
    after its content); chat_template_kwargs reach the template as variables."""
    from verifier.server import prompt_token_ids

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello, I am")
    ids = prompt_token_ids(tok, None, chat, add_generation_prompt=False, continue_final_message=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="add_generation_prompt") as info:
        prompt_token_ids(tok, None, chat, continue_final_message=True)
    assert info.value.param == "continue_final_message"
    thinking = Tokenizer(tok.backend, vocab_size=tok.vocab_size, bos_token_id=1, eos_token_ids=frozenset({2}),
                         bos_token="<|im_start|>", eos_token="<|im_end|>",
                         chat_template="{% if enable_thinking %}think{% else %}answer{% endif %}")
    assert thinking.apply_chat_template([], template_kwargs={"enable_thinking": True}) == "think"
    assert thinking.apply_chat_template([]) == "answer"
    with pytest.raises(InvalidRequestError) as info:
        thinking.apply_chat_template([], template_kwargs={"messages": []})
    assert info.value.param == "chat_template_kwargs"


def test_a_conversation_starts_with_the_templates_bos_alone(tmp_path) -> None:
    # A Llama 3 style tokenizer adds a BOS, and its template writes one: a conversation is
    # encoded without the tokenizer's, as HF and vLLM do; a text keeps it.
    from verifier.server import prompt_token_ids

    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    tiny = Tokenizer.from_gguf(_tiny_gguf(tmp_path, pre="llama-bpe", chat_template=template))
    bos, n123 = TINY_TOKENS.index("<|endoftext|>"), TINY_TOKENS.index("123")
    assert tiny.add_bos and prompt_token_ids(tiny, None, [{"role": "user", "content": "123"}]) == [bos, n123]
    assert prompt_token_ids(tiny, "123", None) == [bos, n123]
    assert prompt_token_ids(tiny, "123", None, add_special_tokens=False) == [n123]
    assert prompt_token_ids(tiny, None, [{"role": "user", "content": "123"}], add_special_tokens=True) == [
        bos, bos, n123]


def test_end_of_turn_marker_from_the_template(tmp_path) -> None:
    chatml = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    assert Tokenizer.from_gguf(_tiny_gguf(tmp_path, chat_template=chatml)).eos_token_ids == {0, 15}
    assert Tokenizer.from_gguf(_tiny_gguf(tmp_path)).eos_token_ids == {0}


def test_a_chat_template_given_instead_of_the_models(tmp_path) -> None:
    """vLLM's --chat-template: the new template renders (with the calls of TOOLS_TEMPLATE,
    by hand), the vocabulary and the model's EOS stay, and an end-of-turn marker the new
    template writes ends the output too; a file's path reads as its text."""
    from verifier.models.tokenizer import read_chat_template

    tiny = Tokenizer.from_gguf(_tiny_gguf(tmp_path))
    assert tiny.eos_token_ids == {0}
    chat = tiny.with_chat_template(TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "123"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}]
    assert chat.apply_chat_template(messages, add_generation_prompt=False) == 'user: 123assistant: [add {"a": 1}]'
    assert chat.eos_token_ids == {0} and chat.encode("123") == tiny.encode("123") and chat.vocab_size == tiny.vocab_size
    assert tiny.chat_template is None and chat.chat_template == TOOLS_TEMPLATE  # the model's own tokenizer unchanged
    chatml = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    assert tiny.with_chat_template(chatml).eos_token_ids == {0, 15}
    path = tmp_path / "chat.jinja"
    path.write_text(chatml)
    assert read_chat_template(str(path)) == chatml == read_chat_template(chatml)
    for bad, message in ((str(tmp_path / "missing.jinja"), "neither a Jinja template"), ("{% if %}", "does not compile")):
        with pytest.raises(ModelLoadError, match=message):
            read_chat_template(bad)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": "llama"}, "'llama'"),
        ({"pre": "mystery"}, "'mystery'"),
        ({"merges": None}, "tokenizer.ggml.merges"),
        ({"merges": ["1 2 3"]}, "merge #0"),
    ],
)
def test_unsupported_or_broken_gguf(tmp_path, kwargs, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path, **kwargs))


# --- IncrementalDetokenizer ---------------------------------------------------------------

STREAMS = [
    "Hello world. This is a longer answer with numbers 3.14 and 2024.",
    "emoji 🎉🚀👍🏽 and 👨\u200d👩\u200d👧\u200d👦 and 日本語",
    "def f(x):\n\treturn x ** 2  # café\n",
    "<|im_start|>assistant\nSure!<|im_end|>",
]


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.add(ids[start : start + size]))
        start += size
    assert start == len(ids)
    return deltas


@pytest.mark.parametrize("text", STREAMS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode(tok: Tokenizer, text: str, skip_special_tokens: bool) -> None:
    ids = tok.encode(text)
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    rng = random.Random(len(text))
    random_chunks = []
    while sum(random_chunks) < len(ids):
        random_chunks.append(min(rng.randint(1, 4), len(ids) - sum(random_chunks)))
    for chunks in ([1] * len(ids), random_chunks, [len(ids)]):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        deltas = _stream(detok, ids, chunks)
        tail = detok.finish()
        assert "".join(deltas) + tail == expected == detok.text
        assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_is_held(tok: Tokenizer) -> None:
    ids = tok.encode(" 🎉")
    assert len(ids) == 3 and tok.decode(ids[:1]).endswith("\ufffd")  # the emoji's bytes span 3 tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["", "", " 🎉"]
    cut = IncrementalDetokenizer(tok)
    assert cut.add(ids[:2]) == "" and cut.finish() == " \ufffd"  # flushed as a replacement char


def _run_stop(tok: Tokenizer, text: str, stop: list[str],
              include: bool = False) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, stop=stop, include_stop=include)
    ids = tok.encode(text)
    deltas = _stream(detok, ids, [1] * len(ids))
    return deltas, detok.finish(), detok


def test_stop_spanning_tokens(tok: Tokenizer) -> None:
    text = "Hello world. The end"
    spans = [tok.decode([i]) for i in tok.encode(text)]
    assert spans == ["Hello", " world", ".", " The", " end"]  # "d. Th" spans 3 tokens
    deltas, tail, detok = _run_stop(tok, text, ["d. Th"])
    assert "".join(deltas) == "Hello worl" == detok.text and tail == ""
    assert detok.stopped and detok.add(tok.encode(" more")) == ""


def test_stop_included_in_the_output(tok: Tokenizer) -> None:
    # vLLM's include_stop_str_in_output: the text ends right after the stop string.
    deltas, tail, detok = _run_stop(tok, "Hello world. The end", ["d. Th"], include=True)
    assert "".join(deltas) == "Hello world. Th" == detok.text and tail == "" and detok.stopped
    _, _, detok = _run_stop(tok, "Hello world", ["world", "lo w"], include=True)
    assert detok.text == "Hello w"  # the earliest stop, as without include
    _, _, detok = _run_stop(tok, "Hello world", ["wor", "world"], include=True)
    assert detok.text == "Hello world"  # of two at one place, the longer


def test_stop_at_start(tok: Tokenizer) -> None:
    deltas, tail, detok = _run_stop(tok, "Hello world", ["Hello"])
    assert deltas[0] == "" and detok.text == "" and tail == "" and detok.stopped


def test_stop_never_appears(tok: Tokenizer) -> None:
    deltas, tail, detok = _run_stop(tok, "Hello world", ["xyz"])
    assert "".join(deltas) + tail == "Hello world" and not detok.stopped


def test_earliest_stop_wins(tok: Tokenizer) -> None:
    _, _, detok = _run_stop(tok, "Hello world", ["world", "lo w"])
    assert detok.text == "Hel" and detok.stopped


def test_partial_stop_is_held_then_flushed(tok: Tokenizer) -> None:
    deltas, tail, detok = _run_stop(tok, "The answer is 42</ans", ["</answer>"])
    assert "".join(deltas) == "The answer is 42" and tail == "</ans"
    assert detok.text == "The answer is 42</ans" and not detok.stopped


def test_false_stop_prefix_is_released(tok: Tokenizer) -> None:
    deltas, tail, _ = _run_stop(tok, "a</b> then </c>", ["</s>"])
    assert "".join(deltas) == "a</b> then </c>" and tail == ""


def test_empty_stop_is_rejected(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="stop"):
        IncrementalDetokenizer(tok, stop=["ok", ""])


class _CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.sizes = inner, []

    def decode(self, token_ids, skip_special_tokens=False):
        self.sizes.append(len(token_ids))
        return self.inner.decode(token_ids, skip_special_tokens)


def test_decode_window_is_bounded(tok: Tokenizer) -> None:
    text = "Streaming a long answer, token by token, with emoji 🎉 and CJK 日本語. " * 50
    ids = tok.encode(text)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, stop=["never appears"])  # type: ignore[arg-type]
    for i in ids:
        detok.add([i])
    detok.finish()
    assert detok.text == text
    # The window is the last final step plus tokens still mid-character: 3 for "🎉" here.
    assert len(ids) > 1000 and max(counting.sizes) <= 4


def test_doctests() -> None:
    assert doctest.testmod(tokenizer_module).failed == 0
    result = doctest.testmod(detokenizer_module)
    assert result.failed == 0 and result.attempted > 0
