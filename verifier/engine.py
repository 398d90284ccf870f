"""The speculative decoding engine: continuous batching, prefill, then rounds.

Each step (one verifier forward pass):
  1. admit waiting requests into free KV slots (their prompt is prefilled in this pass);
  2. ask the policy for k per running sequence and the proposer for drafts (deltas only,
     per the contract in `protos.proposal`); a failed proposer means k = 0 (fail open);
  3. one ragged forward pass over every sequence's new tokens: the whole prompt for a new
     sequence, `[last, d1..dk]` for a running one;
  4. accept (greedy match or rejection sampling), emit accepted + 1 tokens per sequence,
     roll the KV cache back past the rejected drafts, stream the text out.
Prefill is the k = 0 case of a round whose input is the prompt, so one code path serves both.

The forward pass and acceptance run in a dedicated worker thread so the event
loop keeps serving clients; everything that adds or removes sequences runs on the loop
between steps, so the worker never races with an abort.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import random
import time
from typing import AsyncIterator, Sequence as Seq

import numpy as np
import torch

from protos.proposal import Proposal, ProposalRequest, ProposalSource
from verifier.errors import InvalidRequestError, OverloadedError
from verifier.models.llama import LlamaModel
from verifier.policy import OffPolicy, SequenceView, SpeculationPolicy
from verifier.rejection_sampler import greedy_accept, rejection_sample
from verifier.sampling import logits_to_probs
from verifier.sampling_params import SamplingParams
from verifier.sequence import FinishReason, RequestOutput, Sequence, SequenceStats

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine (one verifier replica)."""

    #: Sequences decoded together (KV cache slots).
    max_num_seqs: int = 8
    #: Context length per sequence: prompt + output tokens.
    max_model_len: int = 2048
    #: Requests allowed to wait for a slot before new ones are refused as overloaded.
    max_waiting: int = 64
    #: Upper bound on k whatever the policy asks (sizes per-position statistics).
    max_k: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"EngineConfig.max_waiting must be >= 0, got {self.max_waiting}")


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
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GenerationResult:
    """The whole output of one request (the synchronous helpers' return value)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: SequenceStats


@dataclasses.dataclass
class _Work:
    """One sequence's share of a step, prepared on the loop, executed in the worker."""

    seq: Sequence
    input_token_ids: list[int]
    draft_token_ids: np.ndarray  # int32 [k]
    draft_probs: np.ndarray | None  # float32 [k, V] or None
    emitted: list[int] = dataclasses.field(default_factory=list)
    num_accepted: int = 0


class Engine:
    """Serve one model with speculative decoding.

    >>> engine = Engine(model, tokenizer, proposer=NgramProposer(), policy=StaticPolicy(4))
    >>> async for out in engine.generate(tokenizer.encode("def f(x):"), SamplingParams(temperature=0)):
    ...     print(out.text, end="")
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer=None,
        config: EngineConfig | None = None,
        proposer: ProposalSource | None = None,
        policy: SpeculationPolicy | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.proposer = proposer
        self.policy: SpeculationPolicy = policy or OffPolicy()
        self.cache = model.new_cache(self.config.max_num_seqs, self.config.max_model_len)
        self.stats = EngineStats(accepted_per_position=[0] * self.config.max_k)
        self._eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        # One dedicated thread runs every forward pass, so torch keeps one OpenMP team
        # instead of one per executor thread (idle teams spin on the same 2 cores).
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitspec-model")

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

    async def generate(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        max_k: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's output, one event per round that produced something.

        Leaving the iteration early (client disconnect, `break`, cancellation) aborts the
        sequence and frees its KV slot before the next step.
        """
        self.validate(prompt_token_ids, params)
        # Requests that a free KV slot takes at the next step do not wait.
        if len(self._waiting) - self.cache.num_free_slots >= self.config.max_waiting:
            raise OverloadedError(
                f"all {self.config.max_num_seqs} sequence slots are busy and {len(self._waiting)} requests wait "
                f"(limit {self.config.max_waiting})"
            )
        seq = self._new_sequence(list(prompt_token_ids), params, request_id, max_k)
        self._waiting.append(seq)
        self._ensure_loop()
        finished = False
        try:
            while True:
                out = await seq.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(seq.request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request; its KV slot is freed before the next step."""
        for seq in itertools.chain(self._waiting, self._running):
            if seq.request_id == request_id:
                seq.aborted = True
        self._wake()

    async def generate_all(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams], max_k: int | None = None
    ) -> list[GenerationResult]:
        """Run many requests concurrently (continuous batching) and collect their results."""
        per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)

        async def one(prompt: Seq[int], p: SamplingParams) -> GenerationResult:
            token_ids: list[int] = []
            text: list[str] = []
            rid = f"gen-{next(self._ids)}"
            async for out in self.generate(prompt, p, request_id=rid, max_k=max_k):
                token_ids.extend(out.token_ids)
                text.append(out.text)
                if out.finished:
                    return GenerationResult(rid, list(prompt), token_ids, "".join(text), out.finish_reason, out.stats)
            raise AssertionError("stream ended without a final event")

        return list(await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, per_request))))

    def generate_sync(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                      max_k: int | None = None) -> list[GenerationResult]:
        """`generate_all` for callers without an event loop (CLI, benchmark, tests)."""
        return asyncio.run(self.generate_all(prompts, params, max_k))

    # ------------------------------------------------------------------ the loop
    def _new_sequence(self, prompt: list[int], params: SamplingParams, request_id: str | None,
                      max_k: int | None) -> Sequence:
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        detok = None
        if self.tokenizer is not None:
            from verifier.models.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        return Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=prompt,
            params=params,
            max_k=max_k,
            generator=generator,
            detokenizer=detok,
            outputs=asyncio.Queue(),
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
        for seq in [s for s in self._running if s.aborted]:
            self._finish(seq, FinishReason.ABORT)
        self._waiting = [s for s in self._waiting if not s.aborted]

    def _fail_all(self) -> None:
        for seq in list(self._running):
            self._finish(seq, FinishReason.ABORT)
        self._waiting.clear()

    async def step(self) -> None:
        """One verifier pass over every running sequence (plus newly admitted prompts)."""
        running = list(self._running)
        admitted = []
        while self._waiting and self.cache.num_free_slots:
            seq = self._waiting.pop(0)
            seq.slot = self.cache.allocate()
            admitted.append(seq)
        # Running from now on, so that a failing step reaches their clients too.
        self._running.extend(admitted)
        works = [_Work(s, list(s.prompt_token_ids), np.zeros(0, np.int32), None) for s in admitted]
        works += await self._plan_and_propose(running)
        await asyncio.get_running_loop().run_in_executor(self._worker, self._execute, works)
        self.stats.num_steps += 1
        for work in works:
            self._commit(work)

    async def _plan_and_propose(self, running: list[Sequence]) -> list[_Work]:
        """Choose k per sequence and fetch drafts; k = 0 wherever anything fails."""
        if not running:
            return []
        wanted = self.policy.plan([
            SequenceView(s.request_id, s.num_context_tokens, len(s.output_token_ids), s.max_k) for s in running
        ])
        works = []
        requests = []
        for seq, k in zip(running, wanted):
            k = self._clamp_k(seq, k)
            works.append(_Work(seq, [seq.output_token_ids[-1]], np.zeros(0, np.int32), None))
            if k > 0:
                requests.append((len(works) - 1, ProposalRequest(
                    seq_id=seq.request_id,
                    base_len=seq.proposer_synced_len,
                    append_token_ids=seq.context_slice(seq.proposer_synced_len),
                    k=k,
                    temperature=seq.params.temperature,
                )))
        if not requests:
            return works
        try:
            proposals = await self.proposer.propose([r for _, r in requests])
            assert len(proposals) == len(requests), f"{len(proposals)=} {len(requests)=}"
        except Exception:
            logger.warning("proposer %s failed; speculating 0 this round", self.proposer.method, exc_info=True)
            self.stats.num_proposer_failures += 1
            return works
        for (i, request), proposal in zip(requests, proposals):
            self._take_proposal(works[i], request, proposal)
        return works

    def _clamp_k(self, seq: Sequence, k: int) -> int:
        if self.proposer is None:
            return 0
        # A round emits up to k + 1 tokens; drafting past max_tokens would be wasted work
        # (and would write KV past the context limit, which validate() sized for).
        remaining = seq.params.max_tokens - len(seq.output_token_ids)
        k = min(k, remaining - 1, self.config.max_k)
        if seq.max_k is not None:
            k = min(k, seq.max_k)
        return max(k, 0)

    def _take_proposal(self, work: _Work, request: ProposalRequest, proposal: Proposal) -> None:
        seq = work.seq
        if proposal.resync:
            seq.proposer_synced_len = 0
            self.stats.num_resyncs += 1
            return
        seq.proposer_synced_len = seq.num_context_tokens
        drafts = np.asarray(proposal.draft_token_ids, dtype=np.int32)[: request.k]
        vocab = self.model.config.vocab_size
        if drafts.size and (drafts.min() < 0 or drafts.max() >= vocab):
            logger.warning("proposer returned token ids outside [0, %d); ignoring the draft", vocab)
            return
        work.draft_token_ids = drafts
        if proposal.draft_probs is not None:
            work.draft_probs = np.asarray(proposal.draft_probs, dtype=np.float32)[: drafts.size]
        work.input_token_ids.extend(drafts.tolist())

    def _execute(self, works: list[_Work]) -> None:
        """Worker thread: forward pass, then acceptance for every sequence."""
        num_tokens = [len(w.input_token_ids) for w in works]
        # Logits are needed for the last k + 1 inputs of each sequence (k = 0 for a prefill).
        index = []
        offset = 0
        for w, n in zip(works, num_tokens):
            k = w.draft_token_ids.size
            index.extend(range(offset + n - k - 1, offset + n))
            offset += n
        token_ids = torch.tensor(list(itertools.chain.from_iterable(w.input_token_ids for w in works)),
                                 dtype=torch.int64)
        logits = self.model.forward(token_ids, [w.seq.slot for w in works], num_tokens, self.cache,
                                    torch.tensor(index, dtype=torch.int64))  # [R, V] float32
        argmax = logits.argmax(dim=-1).tolist()
        row = 0
        for w in works:
            k = w.draft_token_ids.size
            p = w.seq.params
            if p.greedy:
                w.num_accepted, emitted = greedy_accept(argmax[row : row + k + 1], w.draft_token_ids)
            else:
                probs = logits_to_probs(logits[row : row + k + 1], p.temperature, p.top_k, p.top_p)
                q = None if w.draft_probs is None else torch.from_numpy(w.draft_probs)
                w.num_accepted, emitted = rejection_sample(probs, w.draft_token_ids, q, w.seq.generator)
            w.emitted = [int(t) for t in emitted]
            # Keep the KV of the inputs that were right: the last token and the accepted drafts.
            slot = w.seq.slot
            self.cache.rollback(slot, self.cache.lens[slot] - (k - w.num_accepted))
            row += k + 1

    def _commit(self, work: _Work) -> None:
        """On the loop: append emitted tokens, apply stop rules, stream the event out."""
        seq = work.seq
        k = work.draft_token_ids.size
        is_prefill = not seq.output_token_ids
        now = time.perf_counter()
        if is_prefill:
            seq.stats.prefill_s = now - seq.arrival_s
        else:
            seq.stats.rounds += 1
            self._count_round(seq.stats, k, work.num_accepted)
        new_tokens: list[int] = []
        finish: FinishReason | None = None
        text = []
        for token in work.emitted:
            seq.output_token_ids.append(token)
            new_tokens.append(token)
            if token in self._eos_ids and not seq.params.ignore_eos:
                finish = FinishReason.STOP
                break
            if seq.detokenizer is not None:
                text.append(seq.detokenizer.add([token]))
                if seq.detokenizer.stopped:
                    finish = FinishReason.STOP
                    break
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                finish = FinishReason.LENGTH
                break
        if finish is not None:
            # Tokens after EOS / the stop string were computed but are not part of the output.
            if seq.detokenizer is not None and not seq.detokenizer.stopped:
                text.append(seq.detokenizer.finish())
        seq.stats.num_output_tokens = len(seq.output_token_ids)
        seq.stats.elapsed_s = now - seq.arrival_s
        self.stats.num_output_tokens += len(new_tokens)
        if finish is None:
            seq.outputs.put_nowait(RequestOutput(seq.request_id, new_tokens, "".join(text)))
            return
        seq.outputs.put_nowait(RequestOutput(seq.request_id, new_tokens, "".join(text), True, finish, seq.stats))
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
        if seq in self._running:
            self._running.remove(seq)
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None
        if self.proposer is not None:
            self.proposer.release([seq.request_id])
