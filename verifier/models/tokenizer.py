"""Text <-> token ids for the target model, built from a GGUF file or a local HF directory.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust BPE) and adds what the serving path
needs around it: BOS handling, the set of ids that end generation, and the chat template.
`IncrementalDetokenizer` turns a stream of token ids into a stream of final text deltas,
holding back incomplete UTF-8 and possible stop-string prefixes.

A GGUF stores no `tokenizer.json`: only the vocabulary, the merges, token types and the
name of the pre-tokenizer (`tokenizer.ggml.pre`). The split regexes below are the ones
llama.cpp applies for each name (src/llama-vocab.cpp), written as the tokenizers library
spells them; each regex isolates its matches and the next one splits the pieces further.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from verifier.errors import InvalidRequestError, ModelLoadError
from verifier.models.gguf_file import GGUFFile, open_gguf

logger = logging.getLogger(__name__)

# GPT-2's split: contractions, letters, numbers, other symbols, each with one optional
# leading space; runs of whitespace keep their last space for the following word.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3 (tiktoken cl100k style): case-insensitive contractions, numbers in groups of <= 3,
# newlines kept apart from other whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: as Llama 3 but every digit is its own piece.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Isolate every digit first (HF's `Digits(individual_digits=True)`), then split as GPT-2.
_DIGIT_SPLIT = r"\p{N}"


@dataclasses.dataclass(frozen=True)
class _PreTokenizerSpec:
    """How one `tokenizer.ggml.pre` family cuts text before BPE.

    `splits` are applied in order; `ignore_merges` takes a piece that is itself a token
    whole instead of merging it pair by pair; `add_bos` is the default when the file has
    no `tokenizer.ggml.add_bos_token` (llama.cpp's defaults).
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_PRE_TOKENIZERS: Mapping[str, _PreTokenizerSpec] = {
    "gpt-2": _PreTokenizerSpec((_GPT2_SPLIT,)),
    # Files without a pre-tokenizer name; llama.cpp adds legacy splits here and warns that
    # quality degrades. Such files are GPT-2 style vocabularies, so we split as GPT-2.
    "default": _PreTokenizerSpec((_GPT2_SPLIT,)),
    "smollm": _PreTokenizerSpec((_DIGIT_SPLIT, _GPT2_SPLIT)),
    "qwen2": _PreTokenizerSpec((_QWEN2_SPLIT,)),
    "llama-bpe": _PreTokenizerSpec((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
}
_SUPPORTED_MODELS = ("gpt2",)
# Token types matched whole in the input text instead of being cut by BPE; control and
# unknown tokens are also special (dropped by `skip_special_tokens`).
_SPECIAL_TYPES = frozenset({gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN})
_ADDED_TYPES = frozenset({gguf.TokenType.USER_DEFINED})
# Tokens that end an assistant turn in common chat formats (ChatML, Llama 3, Phi-3, Gemma,
# Llama 3.1 tool calls). One counts as an end of generation only when the model's chat
# template writes it and the vocabulary has it as a single token.
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class Tokenizer:
    """A byte-level BPE tokenizer plus the model's special ids and chat template.

    Build it with `from_gguf` or `from_dir`. `encode` adds BOS only when the model asks
    for it (`add_bos`); SmolLM2 does not, its chat template writes `<|im_start|>` itself:

    >>> tok = Tokenizer.from_gguf(bundled_model_path())          # doctest: +SKIP
    >>> tok.encode("<|im_start|>user\\nhi<|im_end|>")            # doctest: +SKIP
    [1, 4093, 198, 6004, 2]
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        bos_token: str | None,
        eos_token: str | None,
        prefix_token_ids: tuple[int, ...] = (),
        suffix_token_ids: tuple[int, ...] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
        vocab_type: str = "gpt2",
    ) -> None:
        """Prefer the constructors. `prefix_token_ids` / `suffix_token_ids` are added
        around the text by `encode` when the backend has no post-processor doing it."""
        self._backend = backend
        self._vocab_size = vocab_size
        self._bos_token_id = bos_token_id
        self._eos_token_ids = eos_token_ids
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._prefix = prefix_token_ids
        self._suffix = suffix_token_ids
        self._add_bos = add_bos
        self._chat_template = chat_template
        self._vocab_type = vocab_type
        self._compiled_template = compile_chat_template(chat_template) if chat_template else None
        self._token_bytes: dict[int, bytes] = {}

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike[str] | GGUFFile) -> Tokenizer:
        """Build the tokenizer a GGUF file describes; `ModelLoadError` names what is missing
        or unsupported (only `tokenizer.ggml.model == 'gpt2'`, byte-level BPE, is).

        Control, unknown and user-defined tokens become added tokens, so `<|im_end|>` in
        the text is one token, never cut. EOS ids: see `_eos_token_ids`.
        """
        reader = path_or_reader if isinstance(path_or_reader, GGUFFile) else open_gguf(path_or_reader)
        keys = gguf.Keys.Tokenizer
        model = _gguf_value(reader, keys.MODEL)
        if model not in _SUPPORTED_MODELS:
            raise ModelLoadError(
                f"{keys.MODEL}={model!r} is not supported (supported: {list(_SUPPORTED_MODELS)}); "
                "'llama' is a SentencePiece vocabulary"
            )
        pre = _gguf_value(reader, keys.PRE, required=False) or "default"
        spec = _PRE_TOKENIZERS.get(pre)
        if spec is None:
            raise ModelLoadError(f"{keys.PRE}={pre!r} is not supported (supported: {sorted(_PRE_TOKENIZERS)})")
        if pre == "default":
            logger.warning("GGUF names no pre-tokenizer; splitting as GPT-2, which may not match the model")
        tokens: list[str] = _gguf_value(reader, keys.LIST)
        merges: list[str] = _gguf_value(reader, keys.MERGES)
        token_types = _gguf_value(reader, keys.TOKEN_TYPE, required=False) or [gguf.TokenType.NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise ModelLoadError(f"{keys.TOKEN_TYPE} has {len(token_types)} entries for {len(tokens)} tokens")

        backend = _byte_level_bpe(tokens, merges, spec)
        special = [t for t, kind in zip(tokens, token_types) if kind in _SPECIAL_TYPES]
        added = [t for t, kind in zip(tokens, token_types) if kind in _ADDED_TYPES]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])

        bos_id = _gguf_token_id(reader, keys.BOS_ID, len(tokens))
        eos_id = _gguf_token_id(reader, keys.EOS_ID, len(tokens))
        add_bos = _gguf_value(reader, keys.ADD_BOS, required=False)
        add_bos = spec.add_bos if add_bos is None else bool(add_bos)
        add_eos = bool(_gguf_value(reader, keys.ADD_EOS, required=False))
        for flag, key, token_id in ((add_bos, keys.ADD_BOS, bos_id), (add_eos, keys.ADD_EOS, eos_id)):
            if flag and token_id is None:
                raise ModelLoadError(f"{key} is set but the file has no id for that token")
        chat_template = _gguf_value(reader, keys.CHAT_TEMPLATE, required=False)
        declared = [eos_id] + [_gguf_token_id(reader, k, len(tokens)) for k in (keys.EOT_ID, keys.EOM_ID)]
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_token_id=bos_id,
            eos_token_ids=_eos_token_ids(declared, chat_template, backend),
            bos_token=tokens[bos_id] if bos_id is not None else None,
            eos_token=tokens[eos_id] if eos_id is not None else None,
            prefix_token_ids=(bos_id,) if add_bos else (),
            suffix_token_ids=(eos_id,) if add_eos else (),
            add_bos=add_bos,
            chat_template=chat_template,
            vocab_type=model,
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a local HF tokenizer directory, reading files only (never the network).

        Needs `tokenizer.json`; reads `tokenizer_config.json` (bos/eos tokens, chat
        template), `chat_template.jinja` (preferred over the config's template) and
        `generation_config.json` (`eos_token_id`, int or list) when present. BOS/EOS are
        added by the `tokenizer.json` post-processor, as in transformers.
        """
        root = pathlib.Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file} not found (only fast tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read {tokenizer_file}: {e}") from e
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")

        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        generation_eos = generation.get("eos_token_id")
        generation_eos = generation_eos if isinstance(generation_eos, list) else [generation_eos]

        template_file = root / "chat_template.jinja"
        chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default")
        add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=bos_id,
            eos_token_ids=_eos_token_ids([eos_id, *generation_eos], chat_template, backend),
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos=add_bos,
            chat_template=chat_template,
            vocab_type=_vocab_type(backend),
        )

    # --- properties ---------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (vocabulary look-ups, offsets)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the embedding rows for a GGUF)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the declared EOS / end-of-turn ids, plus each of
        `_END_OF_TURN_MARKERS` that the chat template writes and the vocabulary has."""
        return self._eos_token_ids

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS."""
        return self._add_bos

    @property
    def vocab_type(self) -> str:
        """The vocabulary's kind as GGUF names it: "gpt2" for byte-level BPE; for a
        tokenizer directory with another model, that model's name in lower case."""
        return self._vocab_type

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with `template` (Jinja) instead of the model's own chat template,
        as vLLM's `--chat-template`: the vocabulary is shared, and the end-of-turn
        markers the new template writes (`<|im_end|>`, `<|eot_id|>`, ...) end the output
        too, beside the model's EOS ids. `ModelLoadError` when it does not compile. E.g.
        with "{% for m in messages %}{{ m.role }}: {{ m.content }};{% endfor %}" a user's
        "Hi" renders as "user: Hi;"."""
        other = copy.copy(self)
        other._compiled_template = compile_chat_template(template)
        other._chat_template = template
        other._eos_token_ids = _eos_token_ids(self._eos_token_ids, template, self._backend)
        return other

    # --- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text such as `<|im_end|>` is always one token;
        `add_special_tokens` only controls BOS/EOS added around the text."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and (self._prefix or self._suffix):
            return [*self._prefix, *ids, *self._suffix]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; bytes that are not valid UTF-8 (a character cut between
        tokens) become U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own: a byte-level BPE piece mapped back
        from GPT-2's byte alphabet (part of a UTF-8 character, perhaps), a SentencePiece
        piece with its spaces and `<0xNN>` bytes, an added token's own text."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            raise InvalidRequestError("token_id", f"{token_id} is outside the vocabulary [0, {self._vocab_size})")
        added = token_id in self._backend.get_added_tokens_decoder()
        if added:
            out = piece.encode()
        elif all(c in _BYTE_OF_CHAR for c in piece) and self._vocab_type == "gpt2":
            out = bytes(_BYTE_OF_CHAR[c] for c in piece)
        elif (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:
            out = bytes([int(m.group(1), 16)])
        else:
            out = piece.replace("\u2581", " ").encode()
        self._token_bytes[token_id] = out
        return out

    def token_text(self, token_id: int) -> str:
        """`token_bytes` as text, as OpenAI shows a token: bytes that are not whole UTF-8
        characters are written as `\\xNN` escapes (the `bytes` field keeps them exact)."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Render `messages` with the model's chat template, as transformers does (sandboxed
        jinja2, `trim_blocks`/`lstrip_blocks`, `bos_token`/`eos_token`, `raise_exception`).
        `tools` (OpenAI's tool definitions) reach the template as its `tools` variable, as
        transformers passes them; a template that does not read them renders without them.
        `template_kwargs` are more variables (vLLM's `chat_template_kwargs`, e.g.
        `enable_thinking`); they cannot replace the ones named here.

        Raises `InvalidRequestError` (a `ValueError`) when the model has no chat template or
        the template rejects the conversation (e.g. roles that do not alternate, or a
        message the template cannot render).
        """
        if self._compiled_template is None:
            raise InvalidRequestError(
                "messages", "this model has no chat template; send a plain prompt to the completions API"
            )
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                         bos_token=self._bos_token or "", eos_token=self._eos_token or "", tools=tools)
        named = variables.keys() & set(template_kwargs or ())
        if named:
            raise InvalidRequestError("chat_template_kwargs", f"cannot set {sorted(named)}")
        try:
            return self._compiled_template.render(**(template_kwargs or {}), **variables)
        except _TemplateRaised as e:
            raise InvalidRequestError("messages", str(e)) from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            # e.g. a template that adds a message's content to a string, given none
            raise InvalidRequestError("messages", f"the chat template failed: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_special_tokens: bool = False,
                    **options: Any) -> list[int]:
        """The ids of `messages` rendered (`apply_chat_template`, with `options`) as a
        request is prefilled with them: without the tokenizer's special tokens, since the
        template writes its own BOS (as HF transformers and vLLM encode a conversation; a
        Llama 3 tokenizer that adds one would otherwise give two)."""
        return self.encode(self.apply_chat_template(messages, **options), add_special_tokens=add_special_tokens)


# --- helpers ---------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character (`ByteLevel`'s table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


#: The byte each character of GPT-2's byte alphabet stands for.
_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _gguf_value(reader: GGUFFile, key: str, required: bool = True) -> Any:
    if key not in reader.metadata:
        if required:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return None
    return reader.value(key)


def _gguf_token_id(reader: GGUFFile, key: str, num_tokens: int) -> int | None:
    token_id = _gguf_value(reader, key, required=False)
    if token_id is not None and not 0 <= token_id < num_tokens:
        raise ModelLoadError(f"{key}={token_id} is outside the vocabulary of {num_tokens} tokens")
    return token_id


def _byte_level_bpe(tokens: list[str], merges: list[str], spec: _PreTokenizerSpec) -> tokenizers.Tokenizer:
    """BPE over the GPT-2 byte alphabet with the family's splits and a byte-level decoder.

    Duplicate token texts (some files pad with repeats) keep their first id; the others
    are unreachable from text, as in llama.cpp.
    """
    vocab: dict[str, int] = {}
    for token_id, text in enumerate(tokens):
        vocab.setdefault(text, token_id)
    if len(vocab) != len(tokens):
        logger.info("%d duplicate token texts in the GGUF vocabulary", len(tokens) - len(vocab))
    pairs: list[tuple[str, str]] = []
    for rank, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ModelLoadError(f"merge #{rank} {merge!r} is not two tokens separated by one space")
        pairs.append((left, right))
    try:
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges, fuse_unk=False)
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise ModelLoadError(f"inconsistent GGUF vocabulary/merges: {e}") from e
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _eos_token_ids(
    declared: Iterable[int | None], chat_template: str | None, backend: tokenizers.Tokenizer
) -> frozenset[int]:
    """Declared EOS/EOT ids, plus the end-of-turn markers the chat template writes.

    SmolLM2-Instruct: EOS is `<|im_end|>` (2) and the template ends turns with it, so {2}.
    A ChatML model whose EOS is `<|endoftext|>` gets {EOS, id of `<|im_end|>`}.
    """
    ids = {i for i in declared if isinstance(i, int)}
    for marker in _END_OF_TURN_MARKERS:
        token_id = backend.token_to_id(marker)
        if chat_template and marker in chat_template and token_id is not None:
            ids.add(token_id)
    return frozenset(ids)


def _vocab_type(backend: tokenizers.Tokenizer) -> str:
    model = type(backend.model).__name__  # BPE, Unigram, WordPiece, WordLevel
    if model == "BPE" and type(backend.decoder).__name__ == "ByteLevel":
        return "gpt2"
    return model.lower()


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken dict."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


class _TemplateRaised(jinja2.TemplateError):
    """Raised by the template's own `raise_exception(...)`: the conversation is invalid."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    """`tojson` as chat templates expect it: no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Today's date for templates that print it (Llama 3.1: "Today Date: 26 Jul 2024")."""
    return datetime.datetime.now().strftime(fmt)


def read_chat_template(template_or_path: str) -> str:
    """The text of a chat template given as vLLM's `--chat-template` takes one: the
    template itself (it holds a `{{` or `{%`) or the path of a file holding it (a leading
    ~ is the user's home). `ModelLoadError` when it is neither or does not compile."""
    text = template_or_path
    if "{{" not in text and "{%" not in text:
        path = pathlib.Path(os.path.expanduser(text))
        if not path.is_file():
            raise ModelLoadError(f"{text!r} is neither a Jinja template (no '{{{{' or '{{%') nor a file")
        text = path.read_text()
    compile_chat_template(text)
    return text


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as HF transformers compiles one (sandboxed, `tojson`,
    `raise_exception`, `strftime_now`); `ModelLoadError` when it does not compile."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the chat template does not compile: {e}") from e
