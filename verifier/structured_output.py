"""Structured outputs: the output must match a JSON schema, any JSON object, a regular
expression, one of given strings or a Lark grammar (vLLM's `structured_outputs`, OpenAI's
`response_format`).

The grammar is llguidance's (the engine behind vLLM's `guidance` backend). Each sequence
holds a matcher at the end of its committed output. Every verified row is masked to the
tokens the grammar allows after that row's own context, the committed output plus the
drafts on its path (`verifier.logits_processors`), so acceptance reads what a plain
constrained decode step would at that position and speculation stays exact:

- row 0 is masked at the committed state; row i of a chain after d_0..d_{i-1}; a token
  tree's row after the drafts from the root down to its node;
- a row whose path holds a draft the grammar refuses, or a token that ends the output,
  is never read: the row before that draft gives it probability 0 (greedy: it is not the
  argmax; sampled: p(d) = 0 rejects it), so such a row is left unmasked;
- once the grammar is complete, only the end-of-sequence ids are allowed, and the output
  ends with one of them (whatever `ignore_eos`).

The matcher consumes the paths' drafts to mask their rows and rolls them back after; the
committed tokens are consumed when the round's output is appended (`GrammarMatcher.accept`).
A matcher that fails (`GrammarError`) fails its own request, not the batch.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from verifier.errors import InvalidRequestError, SplitspecError

if TYPE_CHECKING:
    import torch

#: Compiled grammars kept per engine (a schema compiles in about a millisecond; a large
#: one can take 100 ms and more, so repeated requests should not pay it again).
_CACHE_SIZE = 64


class GrammarError(SplitspecError):
    """A sequence's matcher is in llguidance's error state (one of its limits hit, or a
    bug): it would allow only the end of sequence, which would end the output silently.
    The engine ends that sequence alone with this error instead."""


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: exactly one of `json` (a JSON schema, as JSON text),
    `json_object` (any JSON object), `regex`, `choice` (one of these strings, exactly) and
    `grammar` (a Lark grammar in llguidance's dialect). `param` is the request field that
    asked for it (`structured_outputs` or `response_format`), which errors name.

    JSON's whitespace between tokens (`json`, `json_object`; vLLM's options): any run of
    spaces, tabs and newlines by default; none with `disable_any_whitespace`; each a match
    of the regular expression `whitespace_pattern` if given.

    >>> StructuredOutput(choice=("yes", "no")).kind
    'choice'
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def _given(self) -> list[str]:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        return given + ["json_object"] if self.json_object is True else given

    @property
    def kind(self) -> str:
        """The kind given ("" unless exactly one is: `validate` refuses that)."""
        given = self._given()
        return given[0] if len(given) == 1 else ""

    def validate(self) -> StructuredOutput:
        """Raise `InvalidRequestError` naming `param` unless exactly one kind is given and
        well typed (the grammar itself is checked when it is compiled); return self."""
        given = self._given()
        if len(given) != 1:
            raise InvalidRequestError(self.param, "give exactly one of json, json_object, regex, choice, grammar; "
                                                  f"got {', '.join(given) or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, str):
                raise InvalidRequestError(self.param, f"the JSON schema must be JSON text, got {self.json!r}")
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequestError(self.param, f"the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(self.param, f"the JSON schema must be an object, got {schema!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(self.param, f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and not (
                self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(self.param, f"choice must be non-empty strings, got {self.choice!r}")
        if self.disable_any_whitespace is not False or self.whitespace_pattern is not None:
            if given[0] not in ("json", "json_object"):
                raise InvalidRequestError(self.param, "disable_any_whitespace and whitespace_pattern apply to json "
                                                      f"and json_object only, not {given[0]}")
            if self.disable_any_whitespace is not False and self.whitespace_pattern is not None:
                raise InvalidRequestError(self.param, "give disable_any_whitespace or whitespace_pattern, not both")
            if self.whitespace_pattern is not None and not (
                    isinstance(self.whitespace_pattern, str) and self.whitespace_pattern):
                raise InvalidRequestError(self.param, "whitespace_pattern must be a non-empty regular expression, "
                                                      f"got {self.whitespace_pattern!r}")
        return self

    def source(self) -> str:
        """The llguidance grammar (not yet checked: `GrammarCompiler.compile` does)."""
        from llguidance import LLMatcher

        kind = self.kind
        whitespace: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.whitespace_pattern is not None:
            whitespace["whitespace_pattern"] = self.whitespace_pattern
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(self.json, defaults=whitespace)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=whitespace)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":  # Lark string literals take JSON's escapes
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert kind == "grammar", f"{self=}"
        return LLMatcher.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer and makes each sequence's matcher.

    `end_token_ids` are the ids that end the output (the model's end-of-sequence ids):
    the only ones allowed once a grammar is complete."""

    def __init__(self, tokenizer, end_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.end_token_ids = frozenset(end_token_ids)
        self._lltokenizer = None
        self._compiled: dict[StructuredOutput, Any] = {}
        self._lock = threading.Lock()

    def _lltok(self):
        # Built once, on first use (about 0.3 s for a 49,152-token vocabulary).
        with self._lock:
            if self._lltokenizer is None:
                from llguidance import LLTokenizer

                self._lltokenizer = LLTokenizer(self._tokenizer.backend.to_str(),
                                                n_vocab=self._tokenizer.vocab_size,
                                                eos_token=sorted(self.end_token_ids))
            return self._lltokenizer

    def is_compiled(self, spec: StructuredOutput) -> bool:
        return spec in self._compiled

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar for `spec` (an llguidance matcher at its start, which
        `matcher` copies); `InvalidRequestError` naming `spec.param` with llguidance's
        message when it is not a valid schema, regex or grammar. llguidance releases the
        GIL while it compiles, so this may run on a thread."""
        from llguidance import LLMatcher

        cached = self._compiled.get(spec)
        if cached is not None:
            return cached
        spec.validate()
        try:
            source = spec.source()
        except ValueError as exc:
            raise InvalidRequestError(spec.param, f"invalid {spec.kind}: {exc}") from None
        compiled = LLMatcher(self._lltok(), source, log_level=0)
        if compiled.is_error():
            raise InvalidRequestError(spec.param, f"invalid {spec.kind}: {_first_lines(compiled.get_error())}")
        with self._lock:
            if len(self._compiled) >= _CACHE_SIZE:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = compiled
        return compiled

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A new sequence's matcher, at the start of its output."""
        return GrammarMatcher(self.compile(spec).deep_copy(), self._tokenizer.vocab_size, self.end_token_ids)


class GrammarMatcher:
    """One sequence's place in its grammar: where its committed output has brought it."""

    def __init__(self, matcher: Any, vocab_size: int, end_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._end = end_token_ids

    @property
    def complete(self) -> bool:
        """Whether the grammar is complete: only an end-of-sequence id may follow."""
        return self._matcher.is_stopped()

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: the
        tokenization of the bytes no other continuation allows, stopped where the next
        token could merge with what follows), e.g. a JSON key's after its opening quote."""
        return [] if self._matcher.is_error() else self._matcher.compute_ff_tokens()

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return bits[: self._vocab_size].view(np.bool_)

    def mask_rows(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Set to -inf, in `logits` (float32 [n, V]), what the grammar refuses after each
        row's path (the drafts between the committed output and that row); rows no decode
        can reach (module docstring) are left as they are."""
        assert logits.shape[0] == len(paths), f"{logits.shape=} {len(paths)=}"
        m = self._matcher
        if m.is_error():  # it would allow only the end of sequence: `accept` fails the sequence instead
            return
        consumed: list[int] = []
        try:
            for row, path in zip(logits, paths):
                common = 0
                while common < min(len(consumed), len(path)) and consumed[common] == path[common]:
                    common += 1
                if len(consumed) > common:
                    m.rollback(len(consumed) - common)
                    del consumed[common:]
                rest = list(path[common:])
                if any(t in self._end for t in rest) or m.validate_tokens(rest) < len(rest):
                    continue
                if rest:
                    ok = m.consume_tokens(rest)
                    assert ok, f"{rest=} {m.get_error()=}"
                    consumed.extend(rest)
                # numpy's putmask, not torch's masked_fill_: on the engine's worker thread
                # torch splits this 49k-entry fill over its threads, which took 5-15 ms a
                # row on 2 busy cores against 0.4 ms in one thread.
                np.putmask(row.numpy(), ~self.allowed(), np.float32("-inf"))
        finally:
            if consumed:
                m.rollback(len(consumed))

    def accept(self, token_ids: Sequence[int]) -> None:
        """Consume committed tokens (each chosen from a masked row, so allowed unless the
        matcher failed: `GrammarError`)."""
        for t in token_ids:
            if not self._matcher.consume_token(int(t)) or self._matcher.is_error():
                raise GrammarError(f"the output's grammar failed at token {int(t)}: "
                                   f"{_first_lines(self._matcher.get_error(), 2)}")


def _first_lines(message: str, limit: int = 6) -> str:
    lines = message.strip().splitlines()
    return "\n".join(lines[:limit]) + ("\n..." if len(lines) > limit else "")
