"""Streaming detokenization: token ids in, final text deltas out, with stop strings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from verifier.errors import InvalidRequestError
from verifier.models.tokenizer import Tokenizer

# What a byte-level decoder yields for an incomplete UTF-8 sequence at the end of a window.
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids, as they are generated, into text that will not change any more.

    `add(ids)` returns the new final text. It holds back (a) text ending in an incomplete
    UTF-8 character (U+FFFD at the end of the decoded window) and (b) a tail that could be
    the start of a stop string. When a stop string appears, `stopped` becomes True and the
    text ends right before it; later calls return "". `finish()` flushes what is held.
    `text` is everything returned so far.

    Cost per call is bounded: only the window `ids[prefix_offset:]` is decoded, where
    `prefix_offset` trails the last final token boundary by one step (the usual
    prefix/read offset scheme). Decoding from a few tokens back, and diffing against the
    same prefix decoded alone, keeps decoders that strip a leading space consistent.

    >>> d = IncrementalDetokenizer(tok, stop=["\\n\\n"])   # doctest: +SKIP
    >>> d.add(tok.encode("Hi.\\n")), d.add(tok.encode("\\nmore")), d.stopped  # doctest: +SKIP
    ('Hi.', '', True)
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *, skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        """`skip_special_tokens` drops control tokens from the text (default, as an API
        answer should); pass False to see them, as `Tokenizer.decode` does by default.
        `include_stop` (vLLM's `include_stop_str_in_output`): the text ends right after
        the stop string instead."""
        for s in stop:
            if not s:
                raise InvalidRequestError("stop", f"stop strings must be non-empty, got {s!r}")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded only to diff against
        self._read_offset = 0  # text of ids[:read_offset] has been released or held
        self._held = ""  # final text kept back because it may begin a stop string
        self._parts: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All text returned by `add` and `finish` so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append `token_ids`; return the text that became final (possibly "")."""
        if self.stopped:
            return ""
        self._token_ids.extend(token_ids)
        fresh = self._decode_window(final=False)
        return "" if fresh is None else self._release(fresh, final=False)

    def finish(self) -> str:
        """Flush everything held back (an incomplete character comes out as U+FFFD)."""
        if self.stopped:
            return ""
        fresh = self._decode_window(final=True)
        assert fresh is not None, f"{self._read_offset=}"
        return self._release(fresh, final=True)

    def _decode_window(self, final: bool) -> str | None:
        """Text of the tokens after `read_offset`, or None while it ends mid-character."""
        ids = self._token_ids
        skip = self._skip_special_tokens
        prefix_text = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip)
        window_text = self._tokenizer.decode(ids[self._prefix_offset :], skip)
        if not final and window_text.endswith(_REPLACEMENT_CHAR):
            return None
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return window_text[len(prefix_text) :]

    def _release(self, fresh: str, final: bool) -> str:
        """Cut at the first stop string, else keep back a possible stop prefix; emit the rest."""
        pending = self._held + fresh
        cut = first_stop(pending, self._stop)
        if cut is not None:
            self.stopped = True
            if self._include_stop:  # the longest of the stop strings that begin there
                cut += max(len(s) for s in self._stop if pending.startswith(s, cut))
            out, self._held = pending[:cut], ""
        else:
            keep = len(pending) if final else stop_prefix_start(pending, self._stop, self._max_stop_len)
            out, self._held = pending[:keep], pending[keep:]
        if out:
            self._parts.append(out)
        return out


def first_stop(text: str, stop: Iterable[str]) -> int | None:
    """Index where the earliest stop string in `text` begins, or None.

    >>> first_stop("a.b\\n\\nc", ["\\n\\n", "b"])
    2
    """
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def stop_prefix_start(text: str, stop: Iterable[str], max_stop_len: int) -> int:
    """Smallest i such that `text[i:]` is a proper, non-empty prefix of a stop string;
    `len(text)` when no tail of `text` could begin one. Only the last
    `max_stop_len - 1` characters are examined.

    >>> stop_prefix_start("Hello</", ["</s>"], 4)
    5
    """
    stop = tuple(stop)
    for i in range(max(0, len(text) - max_stop_len + 1), len(text)):
        tail = text[i:]
        if any(s.startswith(tail) for s in stop):
            return i
    return len(text)
