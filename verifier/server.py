"""The verifier's request front: text or chat in, a stream of plain-dict events out.

`VerifierServer` owns one engine. It applies the chat template, tokenizes, hands the
per-request `speculation` object to the engine's controller, and streams events that
cross process boundaries as plain dicts (a Ray Serve handle pickles them). It has no Ray
or HTTP imports: `cluster` wraps it in a Serve deployment and maps events to the HTTP
and gRPC APIs.

Events, in order:
  {"event": "error", "kind": "invalid_request" | "overloaded", "param", "message", "retry_after_s"}
      only as the first and only event: nothing was generated;
  {"event": "delta", "token_ids": [...], "text": "..."}     zero or more;
  {"event": "final", "token_ids", "text", "finish_reason", "usage", "speculation"}.
A request for n > 1 outputs (`GenerateInput.n`) streams them side by side: each event
carries its output's "index", and each output ends with a "final" event of its own (its
"usage" counts the prompt and that output); the stream ends after the n-th.
When the request asks for log probabilities (`GenerateInput.logprobs`), deltas and the
final event also carry "logprobs": one entry per token of "token_ids",
  {"token_id", "token", "bytes", "logprob", "rank",
   "top_logprobs": [{"token_id", "token", "bytes", "logprob", "rank"}]}
("token": the token's text, `Tokenizer.token_text`; "bytes": its bytes as ints; "rank":
how many tokens were at least as likely, 1 for the most likely, an alternative's its
place in the list). An
output's first event also carries "num_prompt_tokens", "prompt_text" when the request
asks for `echo`, and "prompt_logprobs" (entries as above, one per prompt token, the
first's logprob None) when it asks for `prompt_logprobs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from typing import Any, AsyncIterator, Mapping, Sequence

from verifier.engine import Engine
from verifier.errors import InvalidRequestError, OverloadedError
from verifier.sampling_params import SamplingParams, truncate_prompt
from verifier.sequence import TokenLogprob
from verifier.structured_output import StructuredOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerateInput:
    """One request, already parsed from HTTP or gRPC. Exactly one of `prompt`,
    `messages`, `prompt_token_ids` is set. `max_tokens` None = the rest of the context."""

    request_id: str = ""
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    #: OpenAI tool definitions the chat template renders with `messages` (the calls
    #: themselves are a `structured_output`: `cluster.tool_calls`).
    tools: tuple[dict[str, Any], ...] | None = None
    #: vLLM's chat options (`prompt_token_ids`): the assistant's turn opened after the
    #: messages, or the last message left open; more variables for the chat template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    speculation_mode: str = "auto"
    speculation_method: str | None = None
    speculation_max_k: int | None = None
    #: None: no log probabilities; N: each output token's and the N most likely tokens'
    #: (`SamplingParams.logprobs`).
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: (token id, bias) pairs added to those tokens' logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = True
    #: N > 0: only the prompt's last N tokens are kept (vLLM's); -1: as many as the
    #: context holds.
    truncate_prompt_tokens: int | None = None
    #: Outputs to generate for the prompt, each its own sequence (seeded: seed + i).
    n: int = 1
    #: Each output's first event carries the prompt's text ("prompt_text").
    echo: bool = False
    #: None, or N: each output's first event carries "prompt_logprobs", one entry per
    #: prompt token (the first's logprob None), as "logprobs" are.
    prompt_logprobs: int | None = None
    #: What the output must match (`verifier.structured_output`); None: free text.
    structured_output: StructuredOutput | None = None
    #: W3C Trace Context of the caller's span ({"traceparent": ...}): the request's spans
    #: continue that trace (`protos.trace_context`). Empty = the current context.
    trace_context: tuple[tuple[str, str], ...] = ()


def logprob_entries(tokenizer, logprobs: Sequence[TokenLogprob | None],
                    token_ids: Sequence[int]) -> list[dict[str, Any]]:
    """The "logprobs" entries of events (module docstring) for `token_ids`; a None (a
    prompt's first token) gives the token with a None logprob and rank and no alternatives."""

    def entry(token_id: int, logprob: float | None, rank: int | None) -> dict[str, Any]:
        # -9999 stands for -inf, which JSON cannot carry (as vLLM does).
        return {"token_id": token_id, "token": tokenizer.token_text(token_id),
                "bytes": list(tokenizer.token_bytes(token_id)),
                "logprob": None if logprob is None else max(logprob, -9999.0), "rank": rank}

    return [{**entry(t, None, None), "top_logprobs": []} if lp is None else
            {**entry(lp.token_id, lp.logprob, lp.rank),
             "top_logprobs": [entry(i, v, place) for place, (i, v) in enumerate(lp.top, 1)]}
            for t, lp in zip(token_ids, logprobs)]


def prompt_token_ids(tokenizer, prompt: str | None, messages: Sequence[dict[str, Any]] | None,
                     tools: Sequence[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                     add_special_tokens: bool | None = None, continue_final_message: bool = False,
                     template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The ids a prompt is prefilled with. A text is encoded with the tokenizer's special
    tokens (a BOS where the model adds one); a conversation is rendered by the chat
    template, which writes its own (`bos_token`), and encoded without them, as HF
    transformers and vLLM do: a Llama 3 prompt starts with one BOS, not two.
    `add_special_tokens` None keeps those defaults.

    vLLM's chat options: `continue_final_message` leaves the last message open (the
    rendering is cut right after its content, so the output continues it; it excludes
    `add_generation_prompt`), and `template_kwargs` are more variables for the template
    (e.g. `enable_thinking`)."""
    if messages is not None:
        if not messages:
            raise InvalidRequestError("messages", "must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}]", "needs a string 'role' and a string 'content'")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message", "cannot be combined with add_generation_prompt "
                                                                "(set it to false)")
        options = dict(add_generation_prompt=add_generation_prompt, tools=None if tools is None else list(tools),
                       template_kwargs=template_kwargs)
        last = messages[-1]["content"] if continue_final_message else ""
        if not last:
            return tokenizer.encode_chat([dict(m) for m in messages], bool(add_special_tokens), **options)
        text = tokenizer.apply_chat_template([dict(m) for m in messages], **options)
        end = text.rfind(last)
        if end < 0:
            raise InvalidRequestError("continue_final_message", "the chat template does not write the final "
                                                                "message's content as it is")
        return tokenizer.encode(text[:end + len(last)], add_special_tokens=bool(add_special_tokens))
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)


def _per_batch_ms(values: dict[int, float], digits: int) -> dict[int, float]:
    """A step-time term learned per batch size, in ms, by batch size."""
    return {b: round(t * 1e3, digits) for b, t in sorted(values.items())}


class VerifierServer:
    """Serve `GenerateInput`s with one engine (whose controller and proposers decide how
    `speculation` is honoured)."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, req: GenerateInput) -> list[int]:
        given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("prompt", "give exactly one of prompt, messages, prompt_token_ids")
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        else:
            ids = prompt_token_ids(self.engine.tokenizer, req.prompt, req.messages, req.tools,
                                   req.add_generation_prompt, None, req.continue_final_message,
                                   dict(req.chat_template_kwargs))
        return truncate_prompt(ids, req.truncate_prompt_tokens, self.engine.config.max_model_len)

    def tokenize(self, prompt: str | None = None, messages: Sequence[dict[str, Any]] | None = None,
                 tools: Sequence[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                 add_special_tokens: bool | None = None, continue_final_message: bool = False,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What a request with this prompt or conversation is prefilled with (vLLM's
        `/tokenize`): {"count", "max_model_len", "tokens", "token_strs"}."""
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt, messages")
        tok = self.engine.tokenizer
        ids = prompt_token_ids(tok, prompt, messages, tools, add_generation_prompt, add_special_tokens,
                               continue_final_message, chat_template_kwargs)
        return {"count": len(ids), "max_model_len": self.engine.config.max_model_len, "tokens": ids,
                "token_strs": [tok.token_text(t) for t in ids]}

    def detokenize(self, token_ids: Sequence[int]) -> dict[str, Any]:
        """The text of `token_ids` (vLLM's `/detokenize`), special tokens included."""
        vocab = self.engine.model.config.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError("tokens", f"must be token ids in [0, {vocab}), got {t!r}")
        return {"prompt": self.engine.tokenizer.decode(list(token_ids))}

    def _params(self, req: GenerateInput, num_prompt_tokens: int) -> SamplingParams:
        max_tokens = req.max_tokens
        if max_tokens is None:  # as vLLM: whatever the context leaves
            max_tokens = max(self.engine.config.max_model_len - num_prompt_tokens, 1)
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed, stop=tuple(req.stop), stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, bad_words=tuple(req.bad_words),
            allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
            skip_special_tokens=req.skip_special_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=tuple(req.logit_bias), min_tokens=req.min_tokens,
            structured_output=req.structured_output,
        ).validate()

    async def generate(self, req: GenerateInput) -> AsyncIterator[dict[str, Any]]:
        """Stream events for one request (see the module docstring)."""
        # Engine ids double as proposer seq_ids, shared by every verifier replica: unique.
        engine_id = f"{req.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        try:
            prompt_ids = self._prompt_ids(req)
            self.engine.validate_speculation(req.speculation_mode, req.speculation_method, req.speculation_max_k)
            params = self._params(req, len(prompt_ids))
            n, most = req.n, self.engine.config.max_num_seqs
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
                raise InvalidRequestError("n", f"must be an integer in [1, {most}] (the server's max_num_seqs), "
                                               f"got {n!r}")
            choices = [params] if n == 1 else [
                dataclasses.replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)]
            stream = self.engine.generate_choices(prompt_ids, choices, request_id=engine_id,
                                                  max_k=req.speculation_max_k, mode=req.speculation_mode,
                                                  method=req.speculation_method, trace_context=dict(req.trace_context))
            tok = self.engine.tokenizer
            prompt_text = None
            if req.echo:
                prompt_text = (req.prompt if req.prompt is not None and req.truncate_prompt_tokens is None
                               else tok.decode(prompt_ids))
            started: set[int] = set()
            async with contextlib.aclosing(stream):
                async for i, out in stream:
                    extra = {} if out.logprobs is None else {"logprobs": logprob_entries(tok, out.logprobs,
                                                                                         out.token_ids)}
                    if i not in started:  # an output's first event: its prompt's length, the prompt where asked
                        started.add(i)
                        extra["num_prompt_tokens"] = len(prompt_ids)
                        if prompt_text is not None:
                            extra["prompt_text"] = prompt_text
                        if out.prompt_logprobs is not None:
                            extra["prompt_logprobs"] = logprob_entries(tok, out.prompt_logprobs, prompt_ids)
                    index = {} if n == 1 else {"index": i}
                    if not out.finished:
                        yield {"event": "delta", **index, "token_ids": out.token_ids, "text": out.text, **extra}
                        continue
                    stats = out.stats
                    yield {
                        "event": "final",
                        **index,
                        "token_ids": out.token_ids,
                        "text": out.text,
                        "finish_reason": out.finish_reason.value,
                        "usage": {
                            "prompt_tokens": len(prompt_ids),
                            "completion_tokens": stats.num_output_tokens,
                            "total_tokens": len(prompt_ids) + stats.num_output_tokens,
                        },
                        "speculation": {"mode": req.speculation_mode, **stats.as_dict()},
                        **extra,
                    }
        except InvalidRequestError as exc:
            # Raised only before the first event (parsing, engine.validate).
            yield {"event": "error", "kind": "invalid_request", "param": exc.param, "message": str(exc)}
        except OverloadedError as exc:
            yield {"event": "error", "kind": "overloaded", "param": None, "message": str(exc),
                   "retry_after_s": exc.retry_after_s}

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        e = self.engine
        step_time = e.controller.step_time
        return {
            "num_running": e.num_running,
            "num_waiting": e.num_waiting,
            "num_free_slots": e.cache.num_free_slots,
            "max_num_seqs": e.config.max_num_seqs,
            "engine": dataclasses.asdict(e.stats),
            "controller": {
                "policy": e.controller.settings.policy,
                "decisions": dict(e.controller.decisions),
                "proposer_latency_ms": {m: round(e.controller.latency_s(m) * 1e3, 3) for m in e.proposers},
                # What each further draft adds to a method's call, once learned (ProposerLatency).
                "proposer_ms_per_draft": {m: None if (b := e.controller.proposer_slope_s(m)) is None
                                          else round(b * 1e3, 3) for m in e.proposers},
                "step_time_ms": None if step_time is None else [(n, round(t * 1e3, 2)) for n, t in step_time.points()],
                # S(b): what b sequences add to a pass, learned per batch size (StepTimeModel).
                "batch_step_ms": None if step_time is None else _per_batch_ms(step_time.seq_s_by_batch, 2),
                # X(b): what a draft token adds beyond the token curve's slope at b sequences.
                "draft_token_ms": None if step_time is None else _per_batch_ms(step_time.draft_s_by_batch, 3),
                # Z(b): what verifying any draft adds once to a pass of b sequences.
                "drafts_step_ms": None if step_time is None else _per_batch_ms(step_time.drafts_step_s_by_batch, 3),
            },
        }
