"""Per-request sampling parameters, validated once at the boundary."""

from __future__ import annotations

import dataclasses
import math

from verifier.errors import InvalidRequestError
from verifier.structured_output import StructuredOutput

#: The most alternatives a request may ask for per token (`SamplingParams.logprobs`), as
#: vLLM's default `max_logprobs` and OpenAI's chat `top_logprobs` limit.
MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    `temperature == 0` means greedy (argmax). `top_k <= 0` and `top_p == 1` disable those
    filters. `seed` makes sampling reproducible for this request alone. `stop` strings end
    the output before the stop string (it is not included, unless
    `include_stop_str_in_output`, vLLM's: then right after it); EOS ends it unless
    `ignore_eos`. A token of `stop_token_ids` (vLLM's) ends it too, included (its text as
    well, unless it is a special token), whatever `ignore_eos`.

    `logprobs` None returns no log probabilities; N >= 0 returns, with every output token,
    its log probability and the N most likely tokens' at that position (`TokenLogprob`).
    They are the target's own, from its raw logits (before the processing below and
    temperature, top-k and top-p, as vLLM's default `raw_logprobs`), whether the token was
    drafted and accepted or decoded. `prompt_logprobs` N returns the same for every prompt
    token but the first (from the prefill's rows), once, with the first output token.

    `presence_penalty` and `frequency_penalty` (OpenAI's, in [-2, 2]) lower the logit of
    every token the output already holds, by a constant and by its count;
    `repetition_penalty` (vLLM's and HF's, > 0; 1 is off) scales the logits of every token
    of the prompt or the output; `logit_bias` ((token id, bias in [-100, 100]) pairs,
    OpenAI's) adds to those tokens' logits; `min_tokens` (vLLM's) keeps the end-of-sequence
    ids and `stop_token_ids` from being chosen before that many tokens (`verifier.logits_processors`).

    `bad_words` (vLLM's) are never written whole: the last token of a word's tokens is
    refused where the output ends with the ones before it (a one-token word, anywhere);
    each word counts as tokenised alone and after a space (`verifier.logits_processors`).

    `allowed_token_ids` (vLLM's; None: all) are the only tokens the output may hold.
    `skip_special_tokens` False keeps control tokens in the text (the end of sequence that
    ends it excepted), as vLLM's.

    `structured_output` makes the output match a JSON schema, a regex, one of given strings
    or a grammar (`verifier.structured_output`); it excludes `min_tokens`, which could hold
    back the end that a complete grammar requires.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether the logits are processed before acceptance (`verifier.logits_processors`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words or self.allowed_token_ids is not None
                    or self.structured_output is not None)

    def validate(self) -> "SamplingParams":
        """Raise `InvalidRequestError` naming the first bad field; return self."""
        if not _is_int(self.max_tokens):
            raise InvalidRequestError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise InvalidRequestError("temperature", f"must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not _is_int(self.top_k):
            raise InvalidRequestError("top_k", f"must be an integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError("seed", f"must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
                raise InvalidRequestError(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(name, f"must be a number in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if not (_is_number(r) and math.isfinite(r) and r > 0):
            raise InvalidRequestError("repetition_penalty", f"must be a finite number > 0, got {r!r}")
        for token, bias in self.logit_bias:
            if not (_is_int(token) and token >= 0):
                raise InvalidRequestError("logit_bias", f"keys must be token ids >= 0, got {token!r}")
            if not (_is_number(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequestError("logit_bias", f"biases must be numbers in [-100, 100], got {bias!r} "
                                                        f"for token {token}")
        m = self.min_tokens
        if not (_is_int(m) and 0 <= m <= self.max_tokens):
            raise InvalidRequestError("min_tokens", f"must be an integer in [0, max_tokens = {self.max_tokens}], "
                                                    f"got {m!r}")
        for t in self.stop_token_ids:
            if not (_is_int(t) and t >= 0):
                raise InvalidRequestError("stop_token_ids", f"must be token ids >= 0, got {t!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", f"stop strings must be non-empty strings, got {s!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids", "must not be empty (leave it out to allow every token)")
            for t in self.allowed_token_ids:
                if not (_is_int(t) and t >= 0):
                    raise InvalidRequestError("allowed_token_ids", f"must be token ids >= 0, got {t!r}")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise InvalidRequestError("bad_words", f"must be strings with a non-space character, got {w!r}")
        if self.structured_output is not None:
            self.structured_output.validate()
            if m:
                raise InvalidRequestError("min_tokens", f"cannot be combined with {self.structured_output.param}: "
                                                        "a complete grammar allows only the end of the output")
        return self


def check_truncate_prompt_tokens(keep: int | None) -> None:
    """vLLM's `truncate_prompt_tokens`: None, an integer >= 1, or -1."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or not (keep >= 1 or keep == -1)):
        raise InvalidRequestError("truncate_prompt_tokens", f"must be an integer >= 1, or -1, got {keep!r}")


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (-1: as many as the context holds; None: all)."""
    check_truncate_prompt_tokens(keep)
    return ids if keep is None else ids[-(max_model_len if keep == -1 else keep):]
