"""The speculative decoding engine: continuous batching, prefill, then rounds.

Each step (one verifier forward pass):
  1. admit waiting requests into free KV slots (their prompt is prefilled in this pass,
     or, past `EngineConfig.max_num_batched_tokens`, over this pass and the next ones:
     chunked prefill, beside the running sequences' rounds);
  2. ask the controller for (method, k) per running sequence and each method's proposer
     for drafts, all methods in parallel (deltas only, per the contract in
     `protos.proposal`); a failed or late proposer means k = 0 (fail open);
  3. one ragged forward pass over every sequence's new tokens: the whole prompt for a new
     sequence, `[last, d1..dk]` for a running one;
  4. accept (greedy match or rejection sampling), emit accepted + 1 tokens per sequence,
     roll the KV cache back past the rejected drafts, stream the text out;
     the drafts may be a token tree (`verifier.token_tree`): the pass verifies every
     branch, and the path accepted (greedy: the longest matching one; sampled: the walk
     of `sample_accept_tree`) keeps its K/V;
  5. tell the controller what was accepted, how long the pass and the proposers took, and
     the observer (metrics, `verifier.observer`) the same; traced requests get spans
     (`verifier.tracing`).
Prefill is the k = 0 case of a round whose input is the prompt, so one code path serves both.

The forward pass and acceptance run on the process's one model thread
(`verifier.models.threads.cpu_worker`, which in-process proposers share) so the event
loop keeps serving clients; everything that adds or removes sequences runs on the loop
between steps, so the worker never races with an abort.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import random
import time
from typing import AsyncIterator, Callable, Mapping, Sequence as Seq

import numpy as np
import torch

from protos.proposal import Proposal, ProposalRequest, ProposalSource
from verifier.errors import InvalidRequestError, OverloadedError
from verifier.models.llama import LlamaModel
from verifier.models.threads import cpu_worker, release_openmp_threads, run_on_cpu_worker
from verifier.controller import Controller, SequenceView, StepTimeModel, fallback_problem
from verifier.observer import EngineObserver
from verifier.rejection_sampler import greedy_accept, rejection_sample
from verifier.logits_processors import RowContext, bad_word_token_ids, process_rows, row_paths
from verifier.structured_output import GrammarCompiler, GrammarError
from verifier.sampling import logits_to_probs, token_logprobs
from verifier.sampling_params import SamplingParams
from verifier.sequence import FinishReason, RequestOutput, Sequence, SequenceStats, TokenLogprob
from verifier.token_tree import first_chain, greedy_accept_tree, sample_accept_tree, tree_depths, tree_prefix
from verifier import tracing
from verifier.aio import await_all

logger = logging.getLogger(__name__)

#: A request's `speculation.mode`: the controller decides, never, or a fixed k.
SPECULATION_MODES = ("auto", "off", "on")


def hidden_state_layers(source: ProposalSource, num_layers: int) -> tuple[int, ...] | None:
    """The target states `source` reads (its `hidden_state_layers`): None for the final ones;
    raises ValueError for a layer the target does not have."""
    layers = getattr(source, "hidden_state_layers", None)
    if not layers:
        return None
    layers = tuple(int(i) for i in layers)
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"proposer {getattr(source, 'method', '?')!r} reads hidden states of layers {list(layers)}, "
                         f"the target has layers 0..{num_layers - 1} (index {num_layers}: the last one's output)")
    return layers


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine (one verifier replica)."""

    #: Sequences decoded together (KV cache slots).
    max_num_seqs: int = 8
    #: Context length per sequence: prompt + output tokens.
    max_model_len: int = 2048
    #: Requests allowed to wait for a slot before new ones are refused as overloaded.
    max_waiting: int = 64
    #: Upper bound on k whatever the controller asks (sizes per-position statistics).
    max_k: int = 16
    #: Tokens one pass takes before drafts: one per decoding sequence, the rest prompt
    #: tokens (vLLM's max_num_batched_tokens). A prompt that does not fit is prefilled in
    #: chunks over several passes, beside the other sequences' rounds, so a long prompt
    #: does not stall them. None: no limit (every admitted prompt whole in one pass).
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"EngineConfig.max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # Below that a pass of decoding sequences could leave no token for a prompt.
            raise ValueError(f"EngineConfig.max_num_batched_tokens must be >= max_num_seqs ({self.max_num_seqs}), "
                             f"got {self.max_num_batched_tokens}")


@dataclasses.dataclass
class EngineStats:
    """Engine-wide counters since start. `accepted_per_position[i]` counts rounds whose
    first i + 1 drafts were all accepted (so it is non-increasing in i)."""

    num_steps: int = 0
    num_rounds_with_drafts: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_output_tokens: int = 0
    num_proposer_failures: int = 0
    num_resyncs: int = 0
    #: Shadow drafts received and resolved (compared with the output), and their tokens.
    num_shadow_drafts: int = 0
    num_shadow_tokens: int = 0
    num_shadow_matched: int = 0
    #: Rounds whose method had no draft and that asked its fallback instead (`Engine.fallbacks`).
    num_fallback_rounds: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    #: Seconds spent choosing k and waiting for the proposers before each pass, and in the
    #: passes themselves (forward and acceptance): the rest of the wall time is the loop's.
    propose_s: float = 0.0
    pass_s: float = 0.0


@dataclasses.dataclass
class GenerationResult:
    """The whole output of one request (the synchronous helpers' return value)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: SequenceStats
    #: One per token of `token_ids` when the request asked for them (`SamplingParams.logprobs`).
    logprobs: list[TokenLogprob] | None = None
    #: One per prompt token, None for the first (`SamplingParams.prompt_logprobs`).
    prompt_logprobs: list[TokenLogprob | None] | None = None


#: The method name of drafts a structured output's grammar forces (`Engine._draft_forced`).
GRAMMAR_METHOD = "grammar"


@dataclasses.dataclass
class _Work:
    """One sequence's share of a step, prepared on the loop, executed in the worker."""

    seq: Sequence
    input_token_ids: list[int]
    draft_token_ids: np.ndarray  # int32 [k]
    draft_probs: np.ndarray | None  # float32 [k, V] or None
    method: str | None = None
    #: The controller's reason, or why the drafts did not come (resync, proposer_failed, ...).
    reason: str = ""
    emitted: list[int] = dataclasses.field(default_factory=list)
    num_accepted: int = 0
    #: This round's span and its proposer call's, when the request is traced (`verifier.tracing`).
    span: object = None
    rpc_span: object = None
    #: int32 [k]: the drafts form a token tree with these parents (`verifier.token_tree`);
    #: None: a chain. A tree's drafts count as one-hot q (no `draft_probs`).
    draft_parents: np.ndarray | None = None
    #: The k this round asked its method for (0: none asked), and the decision's reason.
    asked_k: int = 0
    decided: str = ""
    #: The emitted tokens' log probabilities, when the request asked for them.
    logprobs: list[TokenLogprob] | None = None
    #: A prefill's prompt tokens' (None for the first), when the request asked for them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: A prefill chunk that ends before its prompt does: its KV (and hidden states) are
    #: kept, nothing is sampled or emitted.
    chunk: bool = False

    def __post_init__(self) -> None:
        self.span = tracing.start_round(self.seq.span, prefill=not self.seq.output_token_ids)

    @property
    def depth(self) -> int:
        """Draft positions: k for a chain, the deepest draft's depth for a tree."""
        return int(self.draft_token_ids.size) if self.draft_parents is None else len(self.levels)

    @property
    def levels(self) -> list[int] | None:
        """A tree's drafts at depths 1, 2, ...; None for a chain."""
        if self.draft_parents is None:
            return None
        return np.bincount(tree_depths(self.draft_parents.tolist())).tolist()


def _chain_of(drafts: np.ndarray, parents: np.ndarray | None) -> np.ndarray:
    """The drafts' first-child chain (`verifier.token_tree.first_chain`); a chain as it is."""
    return drafts if parents is None else drafts[first_chain(parents.tolist())]


def _draft_probs(probs, num_drafts: int, vocab: int) -> np.ndarray | None:
    """A proposal's q as float32 [num_drafts, vocab]. A proposer's vocabulary may be up to
    128 ids smaller or larger (`verifier.models.vocab`): missing columns are 0, extra ones
    (ids the target does not have, never drafted) are dropped. Rows that do not fit give
    None: the draft then counts as one-hot q, which is still exact (rejection sampling with
    a one-hot q follows p whatever distribution the token was drawn from), only accepts less."""
    q = np.asarray(probs, dtype=np.float32)
    if q.ndim != 2 or q.shape[0] < num_drafts:
        logger.warning("proposer returned draft probabilities of shape %s for %d drafts; ignoring them",
                       q.shape, num_drafts)
        return None
    q = q[:num_drafts, :vocab]
    if q.shape[1] < vocab:
        q = np.pad(q, ((0, 0), (0, vocab - q.shape[1])))
    return q


def profile_grid(max_num_seqs: int, limit: int, rows: Callable[[int], int] | None = None) -> list[int]:
    """Token counts at which `Engine.profile_step_time` times a pass: 1 (a lone decode
    step), 2, 4, 8, 16, then steps of 8 up to twice max_num_seqs (a full batch of decode
    steps, the commonest pass under load, and the sizes a few drafts take it to), then x1.5
    steps, none above `limit`; each rounded to the row count the model pads its GEMMs to
    (`rows`, `LlamaModel.gemm_rows`; the step-time model prices every token count at its
    padded size, so T is flat between them).

    >>> profile_grid(32, 300)
    [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 144, 216]
    """
    grid = [1, 2, 4, 8, 16]
    while grid[-1] < limit:
        grid.append(grid[-1] + 8 if grid[-1] < 2 * max_num_seqs else int(grid[-1] * 1.5))
    if rows is not None:
        grid = sorted({rows(n) for n in grid})
    return [n for n in grid if n <= limit] or [1]


class Engine:
    """Serve one model with speculative decoding.

    `proposers` is one `ProposalSource` or a mapping method -> source (the controller
    chooses among them per sequence, in mapping order on ties); the controller defaults
    to policy `off`.

    >>> engine = Engine(model, tokenizer, proposers=NgramProposer(), controller=Controller.static(4))
    >>> async for out in engine.generate(tokenizer.encode("def f(x):"), SamplingParams(temperature=0)):
    ...     print(out.text, end="")
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer=None,
        config: EngineConfig | None = None,
        proposers: ProposalSource | Mapping[str, ProposalSource] | None = None,
        controller: Controller | None = None,
        observer: EngineObserver | None = None,
        fallbacks: Mapping[str, str] | None = None,
    ) -> None:
        self.model = model
        # Every pass runs on the process's one model thread (`verifier.models.threads`);
        # the thread that loaded the model frees its OpenMP team (the last line here).
        self._worker = cpu_worker()
        run_on_cpu_worker(model.pack_weights)  # oneDNN on CPU in float32 (a no-op elsewhere)
        #: Receives step, round, proposer-call and request events (metrics); no-op by default.
        self.observer = observer or EngineObserver()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        if proposers is None:
            proposers = {}
        elif not isinstance(proposers, Mapping):
            proposers = {proposers.method: proposers}
        self.proposers: dict[str, ProposalSource] = dict(proposers)
        #: method -> the method asked, in the same round, for the sequences it had no draft
        #: for (e.g. n-gram without a match -> EAGLE): see `_fall_back`.
        self.fallbacks: dict[str, str] = dict(fallbacks or {})
        problem = fallback_problem(self.fallbacks, list(self.proposers))
        if problem is not None:
            raise ValueError(f"fallbacks: {problem}")
        #: Methods whose proposers read the target's hidden states (EAGLE): the engine keeps
        #: each sequence's final hidden states (bfloat16) and sends the new ones each round.
        self._hidden_methods = {m for m, src in self.proposers.items() if getattr(src, "needs_hidden_states", False)}
        #: Which states those are (`LlamaModel.forward`'s `hidden_layers`): None, the final
        #: ones (EAGLE-1), or the input states of some target layers (EAGLE-3). One kind per engine.
        kinds = {m: hidden_state_layers(self.proposers[m], model.config.num_layers) for m in self._hidden_methods}
        if len(set(kinds.values())) > 1:
            raise ValueError("proposers that read the target's hidden states must read the same ones, got "
                             + ", ".join(f"{m}: {'final' if v is None else list(v)}" for m, v in sorted(kinds.items())))
        self._hidden_layers = next(iter(kinds.values()), None)
        self._shadow_calls: list[asyncio.Future] = []
        self._last_shadow_call: dict[str, int] = {}  # method -> the pass of its last shadow-only call
        self.controller = controller or Controller.off()
        if not self.controller.methods:
            self.controller.set_methods(tuple(self.proposers))
        self.cache = model.new_cache(self.config.max_num_seqs, self.config.max_model_len)
        self.stats = EngineStats(accepted_per_position=[0] * self.config.max_k)
        self._eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        # Structured outputs need the tokens' bytes; a grammar ends with an EOS id.
        self._grammars = GrammarCompiler(tokenizer, self._eos_ids) if tokenizer is not None else None
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        release_openmp_threads()  # after the last torch work here (the KV cache)

    # ------------------------------------------------------------------ public API
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` naming the field if the request cannot be served."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        limit = self.config.max_model_len
        if n >= limit:
            raise InvalidRequestError(
                "prompt", f"has {n} tokens; this model's context holds {limit} (prompt + max_tokens)"
            )
        if n + params.max_tokens > limit:
            raise InvalidRequestError(
                "max_tokens",
                f"{params.max_tokens} + {n} prompt tokens exceeds this model's context of {limit} tokens",
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(name, f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        spec = params.structured_output
        if spec is not None:
            if self._grammars is None or not self._eos_ids:
                raise InvalidRequestError(spec.param, "needs an engine with the model's tokenizer and its "
                                                      "end-of-sequence ids")
            self._grammars.compile(spec)

    async def generate(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        max_k: int | None = None,
        mode: str = "auto",
        method: str | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's output, one event per round that produced something.

        `mode`, `method`, `max_k` are the request's `speculation` object (see
        `verifier.controller`). Leaving the iteration early (client disconnect, `break`,
        cancellation) aborts the sequence and frees its KV slot before the next step.
        `trace_context` (W3C, `protos.trace_context`) parents the request's span; without
        it the span continues the current context.
        """
        async for _, out in self.generate_choices(prompt_token_ids, [params], request_id, max_k, mode, method,
                                                  trace_context):
            yield out

    async def generate_choices(
        self,
        prompt_token_ids: Seq[int],
        params: Seq[SamplingParams],
        request_id: str | None = None,
        max_k: int | None = None,
        mode: str = "auto",
        method: str | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`generate` for several outputs of one prompt (the APIs' `n`), one sequence each
        with its own `params[i]`: (i, event) as the sequences produce them, until every one
        has finished. They are admitted or refused (`OverloadedError`) together; their ids
        are `request_id`-i (just `request_id` for one). Leaving early aborts the unfinished."""
        n = len(params)
        for spec in {p.structured_output for p in params} - {None}:
            if self._grammars is not None and not self._grammars.is_compiled(spec):
                # Off the loop: a large schema takes 100 ms and more (validate() then finds it).
                await asyncio.to_thread(self._grammars.compile, spec)
        for p in params:
            self.validate(prompt_token_ids, p)
        self.validate_speculation(mode, method, max_k)
        # Requests that a free KV slot takes at the next step do not wait.
        if len(self._waiting) + n - 1 - self.cache.num_free_slots >= self.config.max_waiting:
            raise OverloadedError(
                f"all {self.config.max_num_seqs} sequence slots are busy and {len(self._waiting)} requests wait "
                f"(limit {self.config.max_waiting})" + (f"; no room for {n} sequences" if n > 1 else "")
            )
        outputs: asyncio.Queue = asyncio.Queue()  # every sequence's events, in the order they come
        index: dict[str, int] = {}
        for i, p in enumerate(params):
            rid = request_id if n == 1 or request_id is None else f"{request_id}-{i}"
            seq = self._new_sequence(list(prompt_token_ids), p, rid, max_k, mode, method)
            seq.outputs = outputs
            seq.span = tracing.start_request(seq.request_id, len(prompt_token_ids), p.max_tokens, mode, trace_context)
            index[seq.request_id] = i
            self._waiting.append(seq)
        self._ensure_loop()
        unfinished = set(index)
        try:
            while unfinished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    unfinished.discard(out.request_id)
                yield index[out.request_id], out
        finally:
            for rid in unfinished:
                self.abort(rid)

    def validate_speculation(self, mode: str, method: str | None, max_k: int | None) -> None:
        """Raise `InvalidRequestError` naming the `speculation.*` field that is wrong."""
        if mode not in SPECULATION_MODES:
            raise InvalidRequestError("speculation.mode", f"must be one of {list(SPECULATION_MODES)}, got {mode!r}")
        if method is not None and method not in self.proposers:
            served = list(self.proposers) or "none (speculation is not configured)"
            raise InvalidRequestError("speculation.method", f"unknown method {method!r}; served: {served}")
        if max_k is not None and (isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 0):
            raise InvalidRequestError("speculation.max_k", f"must be an integer >= 0, got {max_k!r}")

    def profile_step_time(self, max_tokens: int | None = None, context_len: int = 64,
                          repeats: int = 2) -> StepTimeModel:
        """Measure the verifier's step-time model for the controller (which refreshes it
        online): T_tokens(n) on one sequence for a grid of n, and the cost of each further
        sequence from a pass of max_num_seqs sequences of one token each, every sequence
        holding `context_len` tokens of context. Runs before serving: every KV slot must be
        free. Run on the model thread as the serving passes are.

        The grid is `profile_grid`'s, up to `max_tokens` (default: a full batch at the
        controller's largest k). It is swept `repeats` + 1 times, the first a warm-up, in
        alternating directions, and each figure is its fastest pass over the sweeps: a
        slow spell of this shared machine then lands on one sweep's passes, not on every
        pass of a few neighbouring sizes (a pass is only ever slowed, never sped up, by
        the machine). The curve is then made non-decreasing from the right (T(n) = the
        least figure at n or above): more tokens never take less time, so a figure above
        a larger size's is one a slow spell inflated (`StepTimeModel` alone would raise
        the sizes after it to it instead). The curve's slope prices every draft, and it
        is not refreshed online. Measured here, each size timed twice in a row after a
        warm-up pass (before), 8 profiles in one process: what 16 drafts add to a pass of
        32 sequences ranged 16-62 ms, and 4 drafts beside one decode 0.7-10 ms. Profiles
        alternating before / sweeps, 10 of each: interquartile ranges 28-38 / 30-35 ms
        and 4.9-8.6 / 5.1-6.2 ms, S(b)'s per-sequence cost 0.2-2.1 / 0.3-0.8 ms; a
        second such run (8 each, three sweeps) told them apart no more.
        """
        if repeats < 1:
            raise ValueError(f"repeats: at least one timed sweep after the warm-up, got {repeats}")
        return run_on_cpu_worker(self._profile_step_time, max_tokens, context_len, repeats)

    def _profile_step_time(self, max_tokens: int | None, context_len: int, repeats: int) -> StepTimeModel:
        assert self.cache.num_used_slots == 0, "profile_step_time needs an idle engine"
        s = self.controller.settings
        limit = min(max_tokens or self.config.max_num_seqs * (max(s.max_k, s.k) + 1),
                    self.config.max_model_len - context_len - 1)
        rows = getattr(self.model, "gemm_rows", None)
        grid = profile_grid(self.config.max_num_seqs, limit, rows)
        slots = [self.cache.allocate() for _ in range(self.config.max_num_seqs)]
        b = len(slots)

        def timed(lens: list[int]) -> float:
            """One pass of lens[i] new tokens on slots[i], each after context_len tokens."""
            n = sum(lens)
            start = time.perf_counter()
            self.model.forward(torch.zeros(n, dtype=torch.int64), slots[: len(lens)], lens, self.cache,
                               torch.arange(n, dtype=torch.int64))
            seconds = time.perf_counter() - start
            for slot in slots[: len(lens)]:
                self.cache.rollback(slot, context_len)
            return seconds

        # The passes of a sweep: each grid size on one sequence, then (b > 1) a decode step of b.
        shapes = [[n] for n in grid] + ([[1] * b] if b > 1 else [])
        best = [math.inf] * len(shapes)
        try:
            self.model.forward(torch.zeros(b * context_len, dtype=torch.int64), slots, [context_len] * b, self.cache,
                               torch.tensor([b * context_len - 1], dtype=torch.int64))
            for sweep in range(repeats + 1):
                order = range(len(shapes)) if sweep % 2 == 0 else reversed(range(len(shapes)))
                for i in order:
                    seconds = timed(shapes[i])
                    if sweep:  # the first sweep warms up
                        best[i] = min(best[i], seconds)
            times = best[: len(grid)]
            for i in reversed(range(len(times) - 1)):
                times[i] = min(times[i], times[i + 1])
            points = list(zip(grid, times))
            model = StepTimeModel(points, ewma=s.timing_ewma, rows=rows)
            if b > 1:
                model.per_seq_s = max((best[-1] - model.tokens_s(b)) / (b - 1), 0.0)
        finally:
            for slot in slots:
                self.cache.rollback(slot, 0)
                self.cache.free(slot)
        self.controller.step_time = model
        logger.info("verifier step time: tokens -> ms %s, +%.1f ms per further sequence",
                    [(n, round(t * 1e3, 1)) for n, t in points], model.per_seq_s * 1e3)
        return model

    def abort(self, request_id: str) -> None:
        """Drop a request; its KV slot is freed before the next step."""
        for seq in itertools.chain(self._waiting, self._running):
            if seq.request_id == request_id:
                seq.aborted = True
        self._wake()

    async def generate_all(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams], max_k: int | None = None,
        mode: str = "auto", method: str | None = None,
    ) -> list[GenerationResult]:
        """Run many requests concurrently (continuous batching) and collect their results."""
        per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)

        async def one(prompt: Seq[int], p: SamplingParams) -> GenerationResult:
            token_ids: list[int] = []
            text: list[str] = []
            logprobs: list[TokenLogprob] | None = None if p.logprobs is None else []
            prompt_logprobs = None
            rid = f"gen-{next(self._ids)}"
            async for out in self.generate(prompt, p, request_id=rid, max_k=max_k, mode=mode, method=method):
                token_ids.extend(out.token_ids)
                text.append(out.text)
                if logprobs is not None:
                    logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    return GenerationResult(rid, list(prompt), token_ids, "".join(text), out.finish_reason, out.stats,
                                            logprobs, prompt_logprobs)
            raise AssertionError("stream ended without a final event")

        return list(await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, per_request))))

    def generate_sync(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                      max_k: int | None = None, mode: str = "auto", method: str | None = None,
                      ) -> list[GenerationResult]:
        """`generate_all` for callers without an event loop (CLI, benchmark, tests)."""
        return asyncio.run(self.generate_all(prompts, params, max_k, mode, method))

    # ------------------------------------------------------------------ the loop
    def _new_sequence(self, prompt: list[int], params: SamplingParams, request_id: str | None,
                      max_k: int | None, mode: str, method: str | None) -> Sequence:
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        detok = None
        if self.tokenizer is not None:
            from verifier.models.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                                           include_stop=params.include_stop_str_in_output)
        return Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=prompt,
            params=params,
            max_k=max_k,
            generator=generator,
            mode=mode,
            method=method,
            detokenizer=detok,
            outputs=asyncio.Queue(),
            row_context=(RowContext(prompt, {*params.stop_token_ids, *(() if params.ignore_eos else self._eos_ids)},
                                    None if params.structured_output is None else
                                    self._grammars.matcher(params.structured_output),
                                    bad_word_token_ids(self.tokenizer, params.bad_words) if params.bad_words else (),
                                    params.allowed_token_ids)
                         if params.processed else None),
        )

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop_task is None or self._loop_task.done() or self._loop_task.get_loop() is not loop:
            self._wakeup = asyncio.Event()
            self._loop_task = loop.create_task(self._run_loop(), name="splitspec-engine-loop")
        self._wake()

    async def _run_loop(self) -> None:
        while True:
            self._reap_aborted()
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self.step()
            except Exception as exc:  # a bug in a step must not hang every client
                logger.exception("engine step failed; failing the running and waiting requests")
                for seq in self._waiting + self._running:
                    seq.outputs.put_nowait(exc)
                self._fail_all()

    def _reap_aborted(self) -> None:
        for seq in [s for s in self._running + self._waiting if s.aborted]:
            self._finish(seq, FinishReason.ABORT)
        self._waiting = [s for s in self._waiting if not s.aborted]

    def _fail_all(self) -> None:
        for seq in list(self._running):
            self._finish(seq, FinishReason.ABORT)
        self._waiting.clear()

    async def step(self) -> None:
        """One verifier pass over every running sequence (plus newly admitted prompts)."""
        if self.controller.needs_step_time and not self._running:
            # Once, before the first request takes a slot (the replica may also do it at start).
            await asyncio.get_running_loop().run_in_executor(self._worker, self.profile_step_time)
        # Decoding sequences first, one token each (drafts come on top); then the prompts
        # of this pass, first the ones prefilled in part, then newly admitted ones, while
        # the token budget lasts.
        decoding = [s for s in self._running if s.output_token_ids]
        limit = self.config.max_num_batched_tokens
        budget = math.inf if limit is None else limit - len(decoding)
        works = []
        for seq in self._running:
            if not seq.output_token_ids and budget > 0:
                works.append(self._prefill_work(seq, budget))
                budget -= len(works[-1].input_token_ids)
        admitted = []
        while self._waiting and self.cache.num_free_slots and budget > 0:
            seq = self._waiting.pop(0)
            seq.slot = self.cache.allocate()
            admitted.append(seq)
            works.append(self._prefill_work(seq, budget))
            budget -= len(works[-1].input_token_ids)
        # Running from now on, so that a failing step reaches their clients too.
        self._running.extend(admitted)
        num_prefills = len(works)
        release_openmp_threads()  # should this thread have run torch in parallel (see `__init__`)
        start = time.perf_counter()
        works += await self._plan_and_propose(decoding, sum(len(w.input_token_ids) for w in works), num_prefills)
        self.stats.propose_s += time.perf_counter() - start
        seconds = await asyncio.get_running_loop().run_in_executor(self._worker, self._execute, works)
        self.stats.pass_s += seconds
        for call in self._shadow_calls:  # shadow-only proposer calls made beside the pass
            await call  # done by now, as a rule: then this does not hand the loop over
        self._shadow_calls = []
        self.stats.num_steps += 1
        num_tokens = sum(len(w.input_token_ids) for w in works)
        # A pass without prompts tells the step-time model what its drafts cost.
        num_drafts = None if num_prefills else num_tokens - len(works)
        self.controller.observe_step(num_tokens, len(works), seconds, num_drafts)
        emitted_before = self.stats.num_output_tokens
        for work in works:
            self._commit(work)
        self.observer.on_step(num_tokens, len(works), seconds, self.stats.num_output_tokens - emitted_before)
        cache = self.cache
        self.observer.on_load(len(self._running), len(self._waiting), cache.num_used_slots, cache.num_slots,
                              sum(cache.lens), cache.num_slots * cache.max_len)

    @staticmethod
    def _prefill_work(seq: Sequence, budget: float) -> _Work:
        """The next chunk of `seq`'s prompt, at most `budget` tokens (all that is left of it
        without a budget)."""
        prompt = seq.prompt_token_ids
        end = min(len(prompt), seq.num_prefilled + budget)
        return _Work(seq, prompt[seq.num_prefilled : end], np.zeros(0, np.int32), None, chunk=end < len(prompt))

    async def _plan_and_propose(self, running: list[Sequence], num_prefill_tokens: int,
                                num_prefill_seqs: int) -> list[_Work]:
        """Choose (method, k) per sequence and fetch drafts, one call per method, all methods
        in parallel; k = 0 wherever anything fails."""
        if not running:
            return []
        available = {m: getattr(src, "available", True) for m, src in self.proposers.items()}
        decisions = self.controller.plan([
            SequenceView(s.request_id, s.mode, s.method, s.max_k, s.params.max_tokens - len(s.output_token_ids),
                         s.params.greedy)
            for s in running
        ], available, num_prefill_tokens, num_prefill_seqs)
        assert len(decisions) == len(running), f"{len(decisions)=} {len(running)=}"
        works = []
        by_method: dict[str, list[tuple[int, ProposalRequest]]] = {}
        shadows: dict[str, list[tuple[Sequence, ProposalRequest]]] = {}
        for seq, d in zip(running, decisions):
            work = _Work(seq, [seq.output_token_ids[-1]], np.zeros(0, np.int32), None, d.method, d.reason,
                         decided=d.reason)
            works.append(work)
            if d.shadow_k and seq.shadow_method is None and available.get(d.shadow_method) and d.shadow_method != (
                    d.method if d.k else None):
                k = self._clamp_k(seq, d.shadow_k)
                if k:
                    shadows.setdefault(d.shadow_method, []).append((seq, self._request(seq, d.shadow_method, k)))
            if d.k == 0:
                continue
            if d.method not in self.proposers:
                work.reason = "proposer_unavailable"
                continue
            k = self._clamp_k(seq, d.k)
            if k == 0:
                work.reason = "length"
                continue
            work.rpc_span, carrier = tracing.start_proposer_call(work.span, d.method, k)
            work.asked_k = k
            by_method.setdefault(d.method, []).append((len(works) - 1, self._request(seq, d.method, k, carrier)))
        # Shadow drafts ride along in a method's call when it has one this round; a method
        # asked only for shadows is called beside the pass (`step` awaits it before commit),
        # once every `shadow_interval` passes: the sequences due ask again the next pass.
        interval = self.controller.settings.shadow_interval
        self._shadow_calls = []
        for m, reqs in shadows.items():
            if m in by_method or self.stats.num_steps - self._last_shadow_call.get(m, -interval) < interval:
                continue
            self._last_shadow_call[m] = self.stats.num_steps
            self._shadow_calls.append(asyncio.ensure_future(self._shadow_call(m, reqs)))
        if by_method:
            answers = await await_all([self._propose(m, [r for _, r in reqs] + [r for _, r in shadows.get(m, ())])
                                       for m, reqs in by_method.items()])
            for (method, reqs), proposals in zip(by_method.items(), answers):
                for (i, request), proposal in zip(reqs, proposals or ()):
                    self._take_proposal(works[i], request, proposal)
                if proposals is None:
                    for i, _ in reqs:
                        works[i].reason = "proposer_failed"
                else:
                    self._take_shadows(method, shadows.get(method, ()), proposals[len(reqs):])
            if self.fallbacks:
                await self._fall_back(works, shadows, num_prefill_tokens, num_prefill_seqs)
            self._trim(works, num_prefill_tokens, num_prefill_seqs)
            for work in works:
                if work.rpc_span is not None:
                    tracing.end_proposer_call(work.rpc_span, int(work.draft_token_ids.size), work.reason)
        self._draft_forced(works)
        return works

    def _draft_forced(self, works: list[_Work]) -> None:
        """Structured outputs: a round left without drafts drafts the tokens its grammar
        forces next (method "grammar", reason "grammar_forced"), unless the request or the
        policy turned speculation off. They cost no proposer call, and the target accepts
        them unless it would write the forced text in other tokens: a JSON schema's keys
        and enum values are most of a short object's tokens (19 of 37 in one with three
        long keys), each drafted at once after its opening quote."""
        for work in works:
            context = work.seq.row_context
            # The controller gives policy_off whatever proposers there are (mode on aside).
            if (context is None or context.grammar is None or work.draft_token_ids.size
                    or work.reason in ("request_off", "policy_off", "length")):
                continue
            k = self._clamp_k(work.seq, self.config.max_k)
            forced = context.grammar.forced()[:k] if k else []
            if forced:
                work.draft_token_ids = np.asarray(forced, dtype=np.int32)
                work.draft_parents = work.draft_probs = None
                work.method, work.reason = GRAMMAR_METHOD, "grammar_forced"
                work.input_token_ids.extend(forced)

    async def _fall_back(self, works: list[_Work], shadows: Mapping[str, list], num_prefill_tokens: int,
                         num_prefill_seqs: int) -> None:
        """Ask each method's fallback, one call per fallback, for the same k, for the
        sequences the method had no draft for this round (n-gram finding no match): a round
        that would emit one token gets the fallback's drafts instead. Under `goodput` the
        controller sizes those asks for this pass (`Controller.fallback_ks`; 0: not asked)
        and `_trim` prices its drafts. The method's empty round still counts towards its
        share of asks with drafts; the drafts are the fallback's. A sequence with a shadow
        ask to the fallback this round is left out (one request a sequence a method a round),
        and so is one whose request pinned its method (`speculation.method`: that method only)."""
        wanted: list[tuple[int, str, int]] = []
        for i, work in enumerate(works):
            fallback = self.fallbacks.get(work.method)
            if (work.reason == "no_draft" and fallback is not None and work.seq.method is None
                    and getattr(self.proposers[fallback], "available", True)
                    and not any(s is work.seq for s, _ in shadows.get(fallback, ()))):
                wanted.append((i, fallback, work.asked_k))
        priced = [(i, m, k) for i, m, k in wanted if works[i].decided == "goodput"]
        behind = [self._catches_up(works[i].seq.num_context_tokens - works[i].seq.synced_len.get(m, 0))
                  for i, m, _ in priced]
        ks = dict(zip((i for i, _, _ in priced), self.controller.fallback_ks(
            [(w.seq.request_id, w.method, w.depth, w.reason) for w in works], priced,
            num_prefill_tokens, num_prefill_seqs, behind))) if priced else {}
        asks: dict[str, list[tuple[_Work, ProposalRequest]]] = {}
        for i, fallback, most in wanted:
            work, k = works[i], ks.get(i, most)
            if k == 0:
                continue
            self.controller.observe_round(work.seq.request_id, work.method, 0, 0)
            work.method, work.reason = fallback, work.decided
            asks.setdefault(fallback, []).append((work, self._request(work.seq, fallback, k)))
        answers = await await_all([self._propose(m, [r for _, r in reqs]) for m, reqs in asks.items()])
        for reqs, proposals in zip(asks.values(), answers):
            for (work, request), proposal in zip(reqs, proposals or [None] * len(reqs)):
                if proposal is None:
                    work.reason = "proposer_failed"
                else:
                    self._take_proposal(work, request, proposal)
            self.stats.num_fallback_rounds += len(reqs)

    def _trim(self, works: list[_Work], num_prefill_tokens: int, num_prefill_seqs: int) -> None:
        """Let the controller cut the drafts received to what pays now that it knows which
        sequences have any, then append the kept drafts to the pass's inputs."""
        ks = self.controller.trim([(w.seq.request_id, w.method, w.depth, w.reason) for w in works],
                                  num_prefill_tokens, num_prefill_seqs, [w.levels for w in works])
        for work, k in zip(works, ks):
            if k < work.depth:
                if k == 0:
                    work.reason = "low_acceptance"
                    self._keep_as_shadow(work.seq, work.method, _chain_of(work.draft_token_ids, work.draft_parents))
                if work.draft_parents is not None:  # the nodes at depth <= k: a prefix
                    n = tree_prefix(work.draft_parents.tolist(), k, work.draft_token_ids.size)
                    work.draft_parents = work.draft_parents[:n] if n else None
                else:
                    n = k
                work.draft_token_ids = work.draft_token_ids[:n]
                if work.draft_probs is not None:
                    work.draft_probs = work.draft_probs[:n] if n else None
            work.input_token_ids.extend(work.draft_token_ids.tolist())

    def _keep_as_shadow(self, seq: Sequence, method: str, drafts: np.ndarray) -> None:
        """Drafts received but cut whole still measure acceptance: for a greedy sequence
        without a pending shadow they become its shadow draft (scored as the output comes)."""
        if seq.params.greedy and seq.shadow_method is None and self.controller.settings.shadow:
            seq.shadow_method, seq.shadow_token_ids, seq.shadow_matched = method, drafts.tolist(), 0
            self.stats.num_shadow_drafts += 1

    def _request(self, seq: Sequence, method: str, k: int, trace_context=None) -> ProposalRequest:
        """A round's proposal request for `seq` from `method`, under the delta contract."""
        synced = seq.synced_len.get(method, 0)
        hidden = None
        if method in self._hidden_methods:
            # The hidden states of the context positions the proposer lacks, up to the
            # one before the last token (the last token's comes from this round's pass).
            assert seq.num_hidden == seq.num_context_tokens - 1, (seq.num_hidden, seq.num_context_tokens)
            hidden = seq.hidden[max(synced - 1, 0) : seq.num_hidden]
        seq.synced_len.setdefault(method, 0)  # so that _finish releases it there
        return ProposalRequest(
            seq_id=seq.request_id,
            base_len=synced,
            append_token_ids=seq.context_slice(synced),
            k=k,
            temperature=seq.params.temperature,
            hidden_states=hidden,
            trace_context=trace_context,
        )

    async def _shadow_call(self, method: str, reqs: list[tuple[Sequence, ProposalRequest]]) -> None:
        proposals = await self._propose(method, [r for _, r in reqs])
        if proposals is not None:
            self._take_shadows(method, reqs, proposals)

    def _take_shadows(self, method: str, reqs, proposals: list[Proposal]) -> None:
        """Keep each shadow draft on its sequence; the tokens it emits next resolve it."""
        for (seq, request), proposal in zip(reqs, proposals):
            drafts, parents, why = self._received(seq, method, request, proposal)
            if why == "no_draft":  # the share p of asks with drafts learns from it
                self.controller.observe_round(seq.request_id, method, 0, 0)
            if drafts is None:
                continue
            drafts = _chain_of(drafts, parents)
            seq.shadow_method, seq.shadow_token_ids, seq.shadow_matched = method, drafts.tolist(), 0
            self.stats.num_shadow_drafts += 1

    def _advance_shadow(self, seq: Sequence, emitted: list[int], final: bool) -> None:
        """Compare a pending shadow draft with newly emitted tokens; once a token differs,
        every draft token was seen, or the sequence ends, report it to the controller as a
        round of the drafts seen that accepted the matching prefix."""
        if seq.shadow_method is None:
            return
        drafts = seq.shadow_token_ids
        done = False
        for token in emitted:
            if token != drafts[seq.shadow_matched]:
                seen, done = seq.shadow_matched + 1, True
                break
            seq.shadow_matched += 1
            if seq.shadow_matched == len(drafts):
                seen, done = len(drafts), True
                break
        else:
            seen = seq.shadow_matched
        if done or final:
            if seen:
                self.controller.observe_round(seq.request_id, seq.shadow_method, seen, seq.shadow_matched)
                self.stats.num_shadow_tokens += seen
                self.stats.num_shadow_matched += seq.shadow_matched
            seq.shadow_method, seq.shadow_token_ids, seq.shadow_matched = None, [], 0

    async def _propose(self, method: str, requests: list[ProposalRequest]) -> list[Proposal] | None:
        """One method's drafts for this round, or None if its proposer failed (fail open)."""
        start = time.perf_counter()
        ok = False
        try:
            proposals = await self.proposers[method].propose(requests)
            assert len(proposals) == len(requests), f"{len(proposals)=} {len(requests)=}"
            ok = True
            return proposals
        except Exception:
            logger.warning("proposer %s failed; speculating 0 this round", method, exc_info=True)
            self.stats.num_proposer_failures += 1
            return None
        finally:
            seconds = time.perf_counter() - start
            # A sequence catching up (its first call, a resync, a return after rounds without
            # drafts) makes this call no measure of a round's.
            catch_up = any(self._catches_up(len(r.append_token_ids)) for r in requests)
            self.controller.observe_proposer(method, seconds, max((r.k for r in requests), default=0), catch_up)
            self.observer.on_proposer_call(method, seconds, ok)

    def _catches_up(self, num_new_tokens: int) -> bool:
        """Whether a proposer sent `num_new_tokens` context tokens it lacks is catching up:
        more than a round emits (`ProposerLatency`'s catch-up calls)."""
        return num_new_tokens > self.config.max_k + 1

    def _clamp_k(self, seq: Sequence, k: int) -> int:
        # A round emits up to k + 1 tokens; drafting past max_tokens would be wasted work
        # (and would write KV past the context limit, which validate() sized for).
        remaining = seq.params.max_tokens - len(seq.output_token_ids)
        k = min(k, remaining - 1, self.config.max_k)
        if seq.max_k is not None:
            k = min(k, seq.max_k)
        return max(k, 0)

    def _received(self, seq: Sequence, method: str, request: ProposalRequest,
                  proposal: Proposal) -> tuple[np.ndarray | None, np.ndarray | None, str]:
        """A proposal's drafts for `seq` (at most `request.k` positions) and their tree
        parents (None: a chain), with the delta-sync state updated; (None, None, why) when
        there are none: `resync` (the proposer lost the sequence), `proposer_failed`
        (no answer for it, token ids outside the vocabulary, a malformed tree) or `no_draft`.

        A tree keeps its nodes up to depth k and as many as the cache slot has room for
        (breadth first, so a prefix); its probabilities, if a proposer sent any, are not
        used (a tree's drafts count as one-hot q, `sample_accept_tree`)."""
        if proposal.failed:  # the request may not have arrived: the next delta starts where this one did
            return None, None, "proposer_failed"
        if proposal.resync:
            seq.synced_len[method] = 0
            self.stats.num_resyncs += 1
            return None, None, "resync"
        seq.synced_len[method] = request.base_len + len(request.append_token_ids)
        drafts = np.asarray(proposal.draft_token_ids, dtype=np.int32)
        parents = proposal.draft_parents
        if parents is not None:
            parents = np.asarray(parents, dtype=np.int32)
            try:
                if parents.shape != drafts.shape:
                    raise ValueError(f"{parents.size} parents for {drafts.size} drafts")
                n = tree_prefix(parents.tolist(), request.k, self.cache.max_len - self.cache.lens[seq.slot] - 1)
            except ValueError as exc:
                logger.warning("proposer %s returned a malformed token tree (%s); ignoring the draft", method, exc)
                return None, None, "proposer_failed"
            drafts, parents = drafts[:n], parents[:n]
        else:
            drafts = drafts[: request.k]
        vocab = self.model.config.vocab_size
        if drafts.size and (drafts.min() < 0 or drafts.max() >= vocab):
            logger.warning("proposer returned token ids outside [0, %d); ignoring the draft", vocab)
            return None, None, "proposer_failed"
        return (drafts, parents, "") if drafts.size else (None, None, "no_draft")

    def _take_proposal(self, work: _Work, request: ProposalRequest, proposal: Proposal) -> None:
        drafts, parents, why = self._received(work.seq, work.method, request, proposal)
        if drafts is None:
            work.reason = why
            return
        work.draft_token_ids = drafts
        work.draft_parents = parents
        if proposal.draft_probs is not None and proposal.draft_parents is None:  # a tree's: one-hot q
            work.draft_probs = _draft_probs(proposal.draft_probs, drafts.size, self.model.config.vocab_size)

    def _execute(self, works: list[_Work]) -> float:
        """Worker thread: forward pass, then acceptance for every sequence; returns its seconds."""
        start = time.perf_counter()
        num_tokens = [len(w.input_token_ids) for w in works]
        # Logits are needed for the last k + 1 inputs of each sequence (k = 0 for a prefill),
        # and for every prompt position of a prefill that asks for the prompt's logprobs;
        # starts[i]: the row of works[i]'s first of its last k + 1.
        index, starts = [], []
        offset = 0
        for w, n in zip(works, num_tokens):
            k = w.draft_token_ids.size
            first = offset if self._wants_prompt_rows(w) else offset + n - k - 1
            starts.append(len(index) + offset + n - k - 1 - first)
            index.extend(range(first, offset + n))
            offset += n
        token_ids = torch.tensor(list(itertools.chain.from_iterable(w.input_token_ids for w in works)),
                                 dtype=torch.int64)
        # Every input's hidden state when a proposer reads them; the kept ones are stored below.
        hidden_index = torch.arange(sum(num_tokens)) if self._hidden_methods else None
        trees = None
        if any(w.draft_parents is not None for w in works):  # root (the last token) + the drafts
            trees = [None if w.draft_parents is None else
                     (self.cache.lens[w.seq.slot], [-1] + (w.draft_parents + 1).tolist()) for w in works]
        out = self.model.forward(token_ids, [w.seq.slot for w in works], num_tokens, self.cache,
                                 torch.tensor(index, dtype=torch.int64), hidden_index=hidden_index, trees=trees,
                                 hidden_layers=self._hidden_layers)
        logits, hidden = out if hidden_index is not None else (out, None)  # logits: [R, V] float32
        # What acceptance reads: the logits, each row processed on its own context where a
        # request asks (logprobs stay the raw logits').
        decide = logits
        if any(w.seq.row_context is not None for w in works):
            decide = logits.clone()
            for w, row in zip(works, starts):
                if w.seq.row_context is not None and not w.chunk:
                    process_rows(decide[row : row + w.draft_token_ids.size + 1], w.seq.params, w.seq.row_context,
                                 row_paths(w.draft_token_ids, w.draft_parents))
        argmax = decide.argmax(dim=-1).tolist()
        first = 0
        for w, row in zip(works, starts):
            k = w.draft_token_ids.size
            p = w.seq.params
            if self._wants_prompt_rows(w):  # row j - 1 scores prompt token j
                w.prompt_logprobs = self._chunk_prompt_logprobs(w, logits, row)
            if w.chunk:  # the prompt goes on in a later pass: nothing to sample yet
                accepted, emitted = [], []
            elif w.draft_parents is not None:  # a token tree: the drafts of the accepted path
                if p.greedy:
                    accepted, emitted = greedy_accept_tree(argmax[row : row + k + 1], w.draft_token_ids,
                                                           w.draft_parents)
                else:
                    probs = logits_to_probs(decide[row : row + k + 1], p.temperature, p.top_k, p.top_p)
                    accepted, emitted = sample_accept_tree(probs, w.draft_token_ids, w.draft_parents.tolist(),
                                                           w.seq.generator)
            else:
                if p.greedy:
                    num_accepted, emitted = greedy_accept(argmax[row : row + k + 1], w.draft_token_ids)
                else:
                    probs = logits_to_probs(decide[row : row + k + 1], p.temperature, p.top_k, p.top_p)
                    q = None if w.draft_probs is None else torch.from_numpy(w.draft_probs)
                    num_accepted, emitted = rejection_sample(probs, w.draft_token_ids, q, w.seq.generator)
                accepted = list(range(num_accepted))
            w.num_accepted, w.emitted = len(accepted), [int(t) for t in emitted]
            if p.logprobs is not None and not w.chunk:  # each emitted token from the row that verified it
                rows = [row] + [row + 1 + a for a in accepted]
                w.logprobs = token_logprobs(logits[rows], w.emitted, p.logprobs)
            # Keep the KV of the inputs that were right: those before the drafts (the last
            # token, or a prefill's prompt) and the accepted drafts, a tree's moved into place
            # (a chain's already are: `keep` is then a rollback).
            slot = w.seq.slot
            drafts_at = self.cache.lens[slot] - k
            self.cache.keep(slot, drafts_at, [drafts_at + i for i in accepted])
            if hidden is not None:  # likewise their hidden states
                n = len(w.input_token_ids)
                kept = hidden[first : first + n - k]
                if accepted:
                    kept = torch.cat([kept, hidden[first + n - k + torch.tensor(accepted)]])
                w.seq.add_hidden(kept)
                first += n
        return time.perf_counter() - start

    @staticmethod
    def _chunk_prompt_logprobs(work: _Work, logits: torch.Tensor, row: int) -> list[TokenLogprob | None] | None:
        """Worker thread: the logprobs of the prompt tokens `work`'s prefill rows score (the
        row of position j scores token j + 1; `row` is the chunk's last), added to those of
        the sequence's earlier chunks; the whole prompt's (None for its first token) once
        the last chunk is in, else None."""
        seq, n = work.seq, len(work.input_token_ids)
        start = seq.num_prefilled
        prompt = seq.prompt_token_ids
        scored = prompt[start + 1 : start + n + 1]  # the last chunk's last row scores no prompt token
        got = token_logprobs(logits[row - n + 1 : row - n + 1 + len(scored)], scored, seq.params.prompt_logprobs)
        seq.prompt_logprobs = ([None] if start == 0 else seq.prompt_logprobs) + got
        return None if work.chunk else seq.prompt_logprobs

    @staticmethod
    def _wants_prompt_rows(work: _Work) -> bool:
        """A prefill whose request asks for its prompt's logprobs."""
        return not work.seq.output_token_ids and work.seq.params.prompt_logprobs is not None

    def _commit(self, work: _Work) -> None:
        """On the loop: append emitted tokens, apply stop rules, stream the event out."""
        seq = work.seq
        k = work.draft_token_ids.size
        is_prefill = not seq.output_token_ids
        if is_prefill:
            seq.num_prefilled += len(work.input_token_ids)
        if work.chunk:
            if work.span is not None:
                tracing.end_round(work.span, None, 0, 0, "prefill_chunk", 0)
            return
        now = time.perf_counter()
        if is_prefill:
            seq.stats.prefill_s = now - seq.arrival_s
            self.observer.on_first_token(seq.stats.prefill_s)
        else:
            seq.stats.rounds += 1
            self._count_round(seq.stats, k, work.num_accepted)
            self.observer.on_round(work.method, k, work.num_accepted, work.reason)
            if k:
                seq.stats.rounds_by_method[work.method] = seq.stats.rounds_by_method.get(work.method, 0) + 1
            else:
                seq.stats.rounds_off[work.reason] = seq.stats.rounds_off.get(work.reason, 0) + 1
            if k or work.reason == "no_draft":  # a tree counts as a chain of its depth
                self.controller.observe_round(seq.request_id, work.method, work.depth, work.num_accepted)
        new_tokens: list[int] = []
        finish: FinishReason | None = None
        text = []
        for token in work.emitted:
            seq.output_token_ids.append(token)
            new_tokens.append(token)
            if seq.row_context is not None:
                try:
                    seq.row_context.add((token,))
                except GrammarError as exc:  # this sequence fails, not the batch
                    logger.warning("request %s: %s", seq.request_id, exc)
                    seq.outputs.put_nowait(exc)
                    self._finish(seq, FinishReason.ABORT)
                    return
            # A complete grammar ends with an EOS id, whatever ignore_eos.
            if token in self._eos_ids and (not seq.params.ignore_eos or seq.params.structured_output is not None):
                finish = FinishReason.STOP
                break
            if seq.detokenizer is not None:
                text.append(seq.detokenizer.add([token]))
                if seq.detokenizer.stopped:
                    finish = FinishReason.STOP
                    break
            if token in seq.params.stop_token_ids:
                finish = FinishReason.STOP
                break
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                finish = FinishReason.LENGTH
                break
        self._advance_shadow(seq, new_tokens, final=finish is not None)
        if finish is not None:
            # Tokens after EOS / the stop string were computed but are not part of the output.
            if seq.detokenizer is not None and not seq.detokenizer.stopped:
                text.append(seq.detokenizer.finish())
        seq.stats.num_output_tokens = len(seq.output_token_ids)
        seq.stats.elapsed_s = now - seq.arrival_s
        if work.span is not None:
            tracing.end_round(work.span, work.method, k, work.num_accepted, work.reason, len(new_tokens))
        self.stats.num_output_tokens += len(new_tokens)
        logprobs = None if work.logprobs is None else work.logprobs[: len(new_tokens)]
        if finish is None:
            seq.outputs.put_nowait(RequestOutput(seq.request_id, new_tokens, "".join(text), logprobs=logprobs,
                                                 prompt_logprobs=work.prompt_logprobs))
            return
        seq.outputs.put_nowait(RequestOutput(seq.request_id, new_tokens, "".join(text), True, finish, seq.stats,
                                             logprobs, work.prompt_logprobs))
        self._finish(seq, finish)

    def _count_round(self, stats: SequenceStats, k: int, num_accepted: int) -> None:
        if k == 0:
            return
        stats.rounds_with_drafts += 1
        stats.drafted += k
        stats.accepted += num_accepted
        self.stats.num_rounds_with_drafts += 1
        self.stats.num_drafted += k
        self.stats.num_accepted += num_accepted
        for i in range(num_accepted):
            self.stats.accepted_per_position[i] += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        if reason is FinishReason.ABORT:
            seq.stats.elapsed_s = time.perf_counter() - seq.arrival_s
        self.observer.on_finish(seq.stats, reason)
        if seq.span is not None:
            tracing.end_request(seq.span, seq.stats, reason)
            seq.span = None
        if seq in self._running:
            self._running.remove(seq)
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None
        self.controller.forget(seq.request_id)
        for method in seq.synced_len:
            self.proposers[method].release([seq.request_id])
