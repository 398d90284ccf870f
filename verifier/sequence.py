"""Per-request state inside the engine, and what the engine reports back."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time

import numpy as np
import torch

from verifier.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens (or the context) reached
    ABORT = "abort"  # the client went away


@dataclasses.dataclass
class SequenceStats:
    """Speculation figures for one request (glossary in DESIGN.md).

    `rounds` counts verifier passes after prefill; `rounds_with_drafts` those that
    verified at least one draft token. Mean acceptance length includes the bonus or
    recovered token: 1 + accepted / rounds_with_drafts (1.0 when nothing was drafted).
    """

    rounds: int = 0
    rounds_with_drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    num_output_tokens: int = 0
    prefill_s: float = 0.0
    elapsed_s: float = 0.0
    #: Rounds that drafted, per method.
    rounds_by_method: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Rounds without drafts, per reason (`verifier.controller.REASONS`).
    rounds_off: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.rounds_with_drafts if self.rounds_with_drafts else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "rounds_with_drafts": self.rounds_with_drafts,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "num_output_tokens": self.num_output_tokens,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "rounds_by_method": dict(self.rounds_by_method),
            "rounds_off": dict(self.rounds_off),
        }


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One output token's log probability under the target, and the most likely tokens'
    at its position (`SamplingParams.logprobs` of them, most likely first). `rank`: how
    many tokens of the vocabulary are at least as likely as it there (1: the most likely),
    as vLLM counts it."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclasses.dataclass
class RequestOutput:
    """One streamed event: the tokens and text a round added for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stats: SequenceStats | None = None  # set on the final event
    #: One per token of `token_ids` when the request asked for them (`SamplingParams.logprobs`).
    logprobs: list[TokenLogprob] | None = None
    #: On the first event when the request asked for them (`SamplingParams.prompt_logprobs`):
    #: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class Sequence:
    """A request being served. The KV slot holds every context token but the last."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_k: int | None
    generator: torch.Generator
    detokenizer: object | None
    outputs: asyncio.Queue
    arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    # The request's speculation object: auto | off | on, and a pinned method (or None).
    mode: str = "auto"
    method: str | None = None
    # Per method: how many leading context tokens its proposer holds for this sequence
    # (delta contract). A method is a key once the sequence has been sent to it.
    synced_len: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: SequenceStats = dataclasses.field(default_factory=SequenceStats)
    finish_reason: FinishReason | None = None
    aborted: bool = False
    #: Final hidden states (bfloat16 [capacity, hidden]) of the first `num_hidden` context
    #: positions, kept only when a proposer reads them (EAGLE).
    hidden: torch.Tensor | None = None
    num_hidden: int = 0
    #: The request's recording OpenTelemetry span (`splitspec.request`), None when untraced.
    span: object = None
    #: A pending shadow draft (`verifier.controller`): its method, its tokens, and how many
    #: of them the emitted tokens have matched so far.
    shadow_method: str | None = None
    shadow_token_ids: list[int] = dataclasses.field(default_factory=list)
    shadow_matched: int = 0
    #: What processing its logits reads, when the request asks for it (`verifier.logits_processors`).
    row_context: object = None
    #: Prompt tokens in the KV slot so far: a prompt longer than a pass's token budget
    #: (`EngineConfig.max_num_batched_tokens`) is prefilled in chunks over several passes.
    num_prefilled: int = 0
    #: The prompt logprobs of the chunks prefilled so far, when the request asked for them.
    prompt_logprobs: list | None = None

    def add_hidden(self, rows: torch.Tensor) -> None:
        n = self.num_hidden + rows.shape[0]
        if self.hidden is None or self.hidden.shape[0] < n:
            grown = torch.empty(max(2 * n, 256), rows.shape[1], dtype=torch.bfloat16)
            if self.hidden is not None:
                grown[: self.num_hidden] = self.hidden[: self.num_hidden]
            self.hidden = grown
        self.hidden[self.num_hidden : n] = rows
        self.num_hidden = n

    @property
    def num_context_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def context_slice(self, start: int) -> np.ndarray:
        """int32 [num_context_tokens - start]: context tokens from `start` on."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return np.asarray(self.output_token_ids[start - p :], dtype=np.int32)
        return np.asarray(self.prompt_token_ids[start:] + self.output_token_ids, dtype=np.int32)
