"""The public APIs: OpenAI-compatible HTTP and the gRPC `splitspec.v1.Generate` service.

Both parse a request into a `verifier.server.GenerateInput`, make one streaming call to
the verifier deployment, and map its events back. The first event decides the status:
an `error` event becomes 400 / INVALID_ARGUMENT (naming the field) or 429 /
RESOURCE_EXHAUSTED with `Retry-After`; anything else starts the response. When the client
goes away, Serve cancels this call and the cancellation reaches the verifier, which
aborts the sequence and frees its KV slot.

No `from __future__ import annotations` here: FastAPI must see `Request` as a class, not
a string, in the routes of a Serve class-based ingress.
"""

import asyncio
import collections
import dataclasses
import json
import math
import time
import uuid
from typing import Any, AsyncIterator, Literal, Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from opentelemetry import trace
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError

from cluster.tool_calls import CallDeltas, Calls, call_finish_reason, read_output, tool_choice_output
from protos import trace_context
from protos.splitspec.v1 import generate_pb2
from verifier.errors import InvalidRequestError
from verifier.sampling_params import MAX_LOGPROBS
from verifier.server import GenerateInput
from verifier.structured_output import StructuredOutput

#: Import path of the gRPC servicer Serve's gRPC proxy registers.
GENERATE_SERVICER = "protos.splitspec.v1.generate_pb2_grpc.add_GenerateServicer_to_server"

#: `splitspec.ingress`, one span per request, under Serve's proxy span when Serve traces.
tracer = trace.get_tracer("splitspec.ingress")

# FastAPI's own request spans are off: they would continue the client's traceparent beside
# Serve's proxy span instead of under it (cluster/tracing.py has the span tree).
app = FastAPI(title="splitspec", description="OpenAI-compatible API with disaggregated speculative decoding",
              telemetry={"tracing": False})


# ---------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    # Unknown OpenAI fields are ignored, as vLLM does; known ones are type-checked.
    model_config = ConfigDict(extra="ignore")


class SpeculationRequest(_Body):
    mode: Literal["auto", "off", "on"] = "auto"
    method: str | None = None
    max_k: int | None = Field(None, ge=0)


class StreamOptions(_Body):
    include_usage: bool = False
    #: vLLM's: every chunk carries its output's usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Body):
    """vLLM's `structured_outputs`: exactly one of these (`verifier.structured_output`)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    #: JSON's whitespace (json, json_object): none, or matches of this regular expression.
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class _Common(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM extension; -1 also disables
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int = 0  # vLLM extension
    stop_token_ids: list[int] | None = None  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension: the text ends after the stop string
    bad_words: list[str] | None = None  # vLLM extension: words the output never writes
    allowed_token_ids: list[int] | None = None  # vLLM extension: the only tokens the output may hold
    skip_special_tokens: bool = True  # vLLM extension
    truncate_prompt_tokens: int | None = None  # vLLM extension: keep the prompt's last N tokens
    speculation: SpeculationRequest | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM extension
    return_token_ids: bool = False  # vLLM extension: output token ids in each choice
    #: vLLM extension: each prompt token's log probability and this many alternatives'
    #: (not streamed): completions give them per choice, chat in the response.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)


class CompletionBody(_Common):
    #: A text or token ids; a list of either is a batch: prompt i's output j is choice i * n + j.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    #: The chosen token's log probability and this many alternatives', per output token.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Body):
    """A call an assistant message made (sent back with the conversation)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    #: None only for an assistant message (one that made tool calls).
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # role assistant
    tool_call_id: str | None = None  # role tool: the call this message answers
    name: str | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    #: A JSON schema of the arguments (an object); none: the function takes no arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionBody(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True  # vLLM extension: open the assistant's turn
    continue_final_message: bool = False  # vLLM extension: the output continues the last message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension: more template variables
    #: Default: "auto" when tools are given (refused without model.tool_call_parser), else "none".
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: False: "required" makes one call, not one or more.
    parallel_tool_calls: bool = True


class TokenizeBody(_Body):
    """vLLM's `/tokenize`: a prompt, or a conversation as the chat API takes it."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: None: as a request is prefilled (a text with the model's BOS, a conversation without:
    #: its template writes it).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


def _template_message(role: str, content: str, calls: Sequence[tuple[str | None, str, str]] | None,
                      tool_call_id: str | None, name: str | None) -> dict[str, Any]:
    """One message as the chat template reads it, as transformers and vLLM hand it over:
    `calls` are (id, function name, arguments as JSON text), and a call's arguments become
    an object where they parse as one.

    >>> _template_message("assistant", "", [("call-1", "add", '{"a": 1}')], None, None)["tool_calls"]
    [{'id': 'call-1', 'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}}]
    """
    message: dict[str, Any] = {"role": role, "content": content}
    if calls is not None:
        message["tool_calls"] = [{"id": id_, "type": "function", "function": {"name": fn, "arguments": _arguments(args)}}
                                 for id_, fn, args in calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    if name is not None:
        message["name"] = name
    return message


def _chat_messages(chat: list[ChatMessage]) -> tuple[dict[str, Any], ...]:
    """The conversation as the chat template reads it (no content is "")."""
    messages = []
    for i, m in enumerate(chat):
        content = m.content
        if content is None:
            if m.role != "assistant":
                raise ApiError(400, f"messages.{i}.content: required for role {m.role!r}", f"messages.{i}.content")
            content = ""
        elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(part.get("type") != "text" for part in content):
                raise ApiError(400, f"messages.{i}.content: only text parts are supported", f"messages.{i}.content")
            content = "".join(str(part.get("text", "")) for part in content)
        calls = None if m.tool_calls is None else [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
        messages.append(_template_message(m.role, content, calls, m.tool_call_id, m.name))
    return tuple(messages)


def _json_object(text: str, param: str) -> dict[str, Any]:
    """A gRPC field's JSON object text, parsed; a 400 naming `param` when it is not one."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ApiError(400, f"{param}: not JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{param}: must be a JSON object", param)
    return value


#: GenerateRequest's fields that only a conversation takes (the chat template reads them).
_GRPC_CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def _grpc_chat(r: generate_pb2.GenerateRequest) -> dict[str, Any]:
    """A gRPC request's conversation and chat options as `GenerateInput` takes them (a
    proto's empty string is an unset id or name; a message's calls need a function name)."""
    messages = []
    for i, m in enumerate(r.messages.messages):
        for j, c in enumerate(m.tool_calls):
            if not c.name:
                raise ApiError(400, f"messages.{i}.tool_calls.{j}.name: must not be empty",
                               f"messages.{i}.tool_calls.{j}.name")
        calls = [(c.id or None, c.name, c.arguments) for c in m.tool_calls] or None
        messages.append(_template_message(m.role, m.content, calls, m.tool_call_id or None, m.name or None))
    kwargs = _json_object(r.chat_template_kwargs, "chat_template_kwargs") if r.chat_template_kwargs else {}
    return dict(messages=tuple(messages), continue_final_message=r.continue_final_message,
                add_generation_prompt=r.add_generation_prompt if r.HasField("add_generation_prompt") else True,
                chat_template_kwargs=tuple(kwargs.items()))


def _tool_dicts(tools: list[Tool] | None) -> tuple[dict[str, Any], ...] | None:
    """The request's tool definitions as the chat template reads them."""
    return None if tools is None else tuple(t.model_dump(exclude_none=True) for t in tools)


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _tool_calls(tools: Sequence[dict[str, Any]] | None, choice: str | Calls | None, parallel: bool,
                structured_output: StructuredOutput | None,
                parser: str | None) -> tuple[Calls | None, StructuredOutput | None]:
    """What `tools` (as the chat template reads them) and `tool_choice` (None: unset;
    "none", "auto", "required", or `Calls(name)` for a named function) ask of the output:
    the calls it is read as (None: text) and what it must match, with `structured_output`
    (the response_format's). `parser`: the config's `model.tool_call_parser`, which reads
    "auto"'s calls out of free text (None: "auto" is refused)."""
    functions = [t["function"] for t in tools or ()]
    choice = choice if choice is not None else ("auto" if functions else "none")
    if choice == "none":
        return None, structured_output
    if not functions:
        raise ApiError(400, "tool_choice: needs tools to choose from", "tool_choice")
    if choice == "auto" and parser is None:
        raise ApiError(400, 'tool_choice: "auto" (the default with tools) needs a tool-call parser for the model, '
                            'and this service has none (model.tool_call_parser in its config); ask for "required", '
                            'a named function or "none"', "tool_choice")
    if structured_output is not None:
        raise ApiError(400, "tool_choice: a tool call cannot also follow response_format or structured_outputs",
                       "tool_choice")
    if choice == "auto":
        return Calls(None, parser, tuple(f["name"] for f in functions), parallel), None
    if choice == "required":
        try:
            return Calls(None), tool_choice_output(functions, "required", parallel)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), exc.param) from None
    names = [f["name"] for f in functions]
    if choice.name not in names:
        raise ApiError(400, f"tool_choice: function {choice.name!r} is not among the tools {names}", "tool_choice")
    return choice, tool_choice_output(functions, {"type": "function", "function": {"name": choice.name}})


def _grpc_tools(r: generate_pb2.GenerateRequest) -> tuple[tuple[dict[str, Any], ...] | None, str | Calls | None]:
    """A gRPC request's tools (as the chat template reads them) and tool choice."""
    if not r.tools:
        tools = None
    elif r.WhichOneof("input") != "messages":
        raise ApiError(400, "tools: need messages (the chat template renders them)", "tools")
    else:
        functions = []
        for i, t in enumerate(r.tools):
            if not t.name:
                raise ApiError(400, f"tools.{i}.name: must not be empty", f"tools.{i}.name")
            function: dict[str, Any] = {"name": t.name}
            if t.description:
                function["description"] = t.description
            if t.parameters:
                function["parameters"] = _json_object(t.parameters, f"tools.{i}.parameters")
            functions.append({"type": "function", "function": function})
        tools = tuple(functions)
    which = r.tool_choice.WhichOneof("choice")
    if which == "mode" and r.tool_choice.mode not in ("none", "auto", "required"):
        raise ApiError(400, f"tool_choice: mode must be none, auto or required, got {r.tool_choice.mode!r}",
                       "tool_choice")
    if which == "function":
        return tools, Calls(r.tool_choice.function)
    return tools, None if which is None else r.tool_choice.mode


class ApiError(Exception):
    """An error answered as OpenAI does: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses Ray processes (gRPC errors travel back to the proxy)
        return ApiError, (self.status, self.message, self.param, self.retry_after_s)

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(self.status, "error")
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(
            {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}},
            status_code=self.status, headers=headers,
        )


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = [str(x) for x in e["loc"]]
        # Nested objects keep their path (speculation.max_k, messages.0.role); union
        # branches pydantic adds to the location (prompt.list[int]) are dropped.
        depth = {"speculation": 2, "stream_options": 2, "messages": 3, "tools": 4}.get(loc[0] if loc else "", 1)
        param = ".".join(loc[:depth]) or "body"
        raise ApiError(400, f"{param}: {e['msg']} (given: {e.get('input')!r})", param) from None


def _common_input(body: _Common, request_id: str, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed with stream: true", "stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs: not available with stream: true (as in vLLM)", "prompt_logprobs")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    spec = body.speculation or SpeculationRequest()
    return dict(
        request_id=request_id, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=0 if body.top_k == -1 else body.top_k, seed=body.seed, stop=stop, ignore_eos=body.ignore_eos,
        speculation_mode=spec.mode, speculation_method=spec.method, speculation_max_k=spec.max_k,
        logprobs=logprobs, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, n=body.n, logit_bias=_logit_bias(body.logit_bias),
        min_tokens=body.min_tokens, stop_token_ids=tuple(body.stop_token_ids or ()),
        include_stop_str_in_output=body.include_stop_str_in_output, bad_words=tuple(body.bad_words or ()),
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        skip_special_tokens=body.skip_special_tokens, truncate_prompt_tokens=body.truncate_prompt_tokens,
        structured_output=_structured_output(body), prompt_logprobs=body.prompt_logprobs,
    )


def _structured_output(body: _Common) -> StructuredOutput | None:
    """What `response_format` or `structured_outputs` asks the output to match (one of them)."""
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text":
        if so is not None:
            raise ApiError(400, "structured_outputs: give it or response_format, not both", "structured_outputs")
        if fmt.type == "json_object":
            return StructuredOutput(json_object=True, param="response_format")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format: type json_schema needs json_schema.schema", "response_format")
        return StructuredOutput(json=json.dumps(fmt.json_schema.schema_), param="response_format")
    if so is None:
        return None
    schema = so.json_ if so.json_ is None or isinstance(so.json_, str) else json.dumps(so.json_)
    return StructuredOutput(json=schema, json_object=bool(so.json_object), regex=so.regex,
                            choice=None if so.choice is None else tuple(so.choice), grammar=so.grammar,
                            disable_any_whitespace=so.disable_any_whitespace, whitespace_pattern=so.whitespace_pattern)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` map, whose keys are token ids written as strings."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
        pairs.append((token, value))
    return tuple(pairs)


def _completion_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """The completions API's `logprobs` for these tokens, the first at `offset` characters
    into the output text (each token's text advances it). `top_logprobs` holds the chosen
    token beside the alternatives, as OpenAI and vLLM do."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # An echoed prompt's first token has neither (nothing precedes it).
        "top_logprobs": [None if e["logprob"] is None else
                         {**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                         for e in entries],
        "text_offset": offsets,
    }


def _vllm_prompt_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the prompt's first token, then for each token a
    map from token id (a string in JSON) to {"logprob", "rank", "decoded_token"}: the prompt's
    token first, then the alternatives."""
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": e["token"]}

    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e["logprob"] is None:
            out.append(None)
            continue
        entry = {str(e["token_id"]): one(e)}
        for t in e["top_logprobs"]:  # the prompt's token, when among them, stays listed first
            entry.setdefault(str(t["token_id"]), one(t))
        out.append(entry)
    return out


def _pb_logprob(e: dict[str, Any]) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(token_id=e["token_id"], token=e["token"], bytes=bytes(e["bytes"]),
                                     logprob=e["logprob"], rank=e["rank"],
                                     top_logprobs=[_pb_logprob(t) for t in e.get("top_logprobs", ())])


class _Output:
    """One output of a whole (not streamed) response, gathered from its events."""

    def __init__(self, logprobs: bool, prompt_logprobs: bool) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self._keep_prompt_logprobs = prompt_logprobs  # asked for as such, not only for an echo
        self.prompt_logprobs: list[dict[str, Any]] | None = None
        self.final: dict[str, Any] | None = None

    def add(self, event: dict[str, Any]) -> None:
        # An echo's prompt comes first (and its logprobs, the first token's None).
        self.text += [event.get("prompt_text", ""), event.get("text", "")]
        self.token_ids.extend(event.get("token_ids", []))
        if "prompt_logprobs" in event and self._keep_prompt_logprobs:
            self.prompt_logprobs = event["prompt_logprobs"]
        if self.logprobs is not None:
            self.logprobs += [*(event.get("prompt_logprobs", []) if "prompt_text" in event else []),
                              *event.get("logprobs", [])]
        if event["event"] == "final":
            self.final = event


def _without_output(event: dict[str, Any]) -> dict[str, Any]:
    """`event` with its output taken out, the prompt it may echo kept: what echo with
    max_tokens 0 answers (one token is generated and dropped). A final event then ends
    for `length` having counted no completion tokens."""
    out = {**event, "text": "", "token_ids": []}
    if "logprobs" in event:
        out["logprobs"] = []
    if event["event"] == "final":
        prompt = event["usage"]["prompt_tokens"]
        out.update(finish_reason="length",
                   usage={"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt})
    return out


def _usage(finals: list[dict[str, Any]]) -> dict[str, int]:
    """A request's usage from its outputs' final events: each prompt once (a batch's
    events carry their "prompt_index"), every output."""
    prompt = sum({f.get("prompt_index", 0): f["usage"]["prompt_tokens"] for f in finals}.values())
    completion = sum(f["usage"]["completion_tokens"] for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _speculation(finals: list[dict[str, Any]]) -> dict[str, Any]:
    """A request's speculation stats from its outputs': one output's as they are; for
    several, the counts summed (tokens_per_second too: the outputs run side by side) and
    the rates worked out again from the sums."""
    if len(finals) == 1:
        return finals[0]["speculation"]
    specs = [f["speculation"] for f in finals]
    out: dict[str, Any] = {"mode": specs[0]["mode"]}
    for key in ("rounds", "rounds_with_drafts", "drafted", "accepted", "num_output_tokens"):
        out[key] = sum(s[key] for s in specs)
    out["tokens_per_second"] = round(sum(s["tokens_per_second"] for s in specs), 2)
    out["acceptance_rate"] = round(out["accepted"] / out["drafted"], 4) if out["drafted"] else 0.0
    out["mean_acceptance_length"] = (round(1 + out["accepted"] / out["rounds_with_drafts"], 4)
                                     if out["rounds_with_drafts"] else 1.0)
    for key in ("rounds_by_method", "rounds_off"):
        out[key] = {}
        for s in specs:
            for name, count in s[key].items():
                out[key][name] = out[key].get(name, 0) + count
    return out


def _chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat API's `logprobs`: `content`, one entry per token, with `top_logprobs`."""
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]} for e in entries],
            "refusal": None}


def _error_from_event(event: dict[str, Any]) -> ApiError:
    if event["kind"] == "overloaded":
        return ApiError(429, event["message"], None, event.get("retry_after_s", 1.0))
    return ApiError(400, event["message"], event.get("param"))


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body: not valid JSON: {exc}", "body") from None


async def _ending(span, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, ending `span` when the stream ends or the client goes away."""
    try:
        async for event in events:
            yield event
    finally:
        span.end()


def _node_metrics_url() -> str | None:
    """The Prometheus endpoint of the Ray node this process runs on, or None."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


async def _merged(opened: list[tuple[dict[str, Any], Any]], counts: list[int],
                  ) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
    """The events of a batch's streams (prompt i's first event and stream, and its number
    of outputs) as one stream, in arrival order: output j of prompt i becomes output
    `sum(counts[:i]) + j`, with its "prompt_index". Closing it cancels every stream."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    offsets = [sum(counts[:i]) for i in range(len(counts))]

    async def pump(i: int, first: dict[str, Any], stream) -> None:
        try:
            event = first
            while True:
                await queue.put({**event, "index": offsets[i] + event.get("index", 0), "prompt_index": i})
                try:
                    event = await stream.__anext__()
                except StopAsyncIteration:
                    break
        except Exception as exc:  # a replica lost mid-stream: the whole response fails
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, first, stream)) for i, (first, stream) in enumerate(opened)]

    async def events() -> AsyncIterator[dict[str, Any]]:
        finished = 0
        try:
            while finished < len(tasks):
                item = await queue.get()
                if item is done:
                    finished += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    stream = events()
    return await stream.__anext__(), stream


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------- the deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, verifier, model_name: str, max_model_len: int, tool_call_parser: str | None = None) -> None:
        self._verifier = verifier.options(stream=True)
        self._plain = verifier
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tool_call_parser = tool_call_parser
        self.created = int(time.time())
        self._metrics_url: str | None = None

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise ApiError(400, f"model: {model!r} is not served here; available: [{self.model_name!r}]", "model")

    async def _open(self, inp: GenerateInput, span=None) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
        """Start the verifier stream; return its first event and the rest (errors raised).
        The verifier's spans continue `span`'s trace (W3C context in the input)."""
        if span is not None and span.is_recording():
            inp = dataclasses.replace(inp, trace_context=tuple(trace_context.inject(span).items()))
        try:
            stream = self._verifier.generate.remote(inp)
            first = await stream.__anext__()
        except BackPressureError as exc:
            raise ApiError(503, f"the verifier is at capacity: {exc}", None, 1.0) from None
        if first["event"] == "error":
            raise _error_from_event(first)
        return first, stream

    async def _open_batch(self, inps: list[GenerateInput], span) -> tuple[dict[str, Any], AsyncIterator]:
        """`_open` for each prompt of a batch, side by side, as one stream (`_merged`); the
        first error cancels the rest and is the response."""
        if len(inps) == 1:
            return await self._open(inps[0], span)
        opened = await asyncio.gather(*(self._open(inp, span) for inp in inps), return_exceptions=True)
        errors = [r for r in opened if isinstance(r, BaseException)]
        if errors:
            for r in opened:
                if not isinstance(r, BaseException):
                    r[1].cancel()
            raise errors[0]
        return await _merged(opened, [inp.n for inp in inps])

    async def _run(self, body: _Common, inp: GenerateInput | list[GenerateInput], chat: bool, drop: bool = False,
                   calls: Calls | None = None):
        """`inp`: one request, or a batch of prompts (completions). `drop`: echo with
        max_tokens 0, so the response holds the prompt and no output. `calls`: the output
        is read as tool calls."""
        inps = inp if isinstance(inp, list) else [inp]
        inp, total = inps[0], sum(i.n for i in inps)
        rid = inp.request_id
        span = tracer.start_span("splitspec.ingress", attributes={
            "splitspec.api": "chat.completions" if chat else "completions", "splitspec.request_id": rid,
            "splitspec.stream": body.stream})
        try:
            with trace.use_span(span, end_on_exit=False):
                first, stream = await self._open_batch(inps, span)
        except ApiError as exc:
            span.set_attribute("splitspec.status", exc.status)
            span.end()
            return exc.response()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
            return StreamingResponse(
                _ending(span, self._sse_stream(rid, first, stream, chat, include_usage, body.return_token_ids, total,
                                               drop, calls, continuous)),
                media_type="text/event-stream")
        outputs: dict[int, _Output] = {}
        try:
            event = first
            while True:
                out = outputs.setdefault(event.get("index", 0),
                                         _Output(inp.logprobs is not None, body.prompt_logprobs is not None))
                out.add(_without_output(event) if drop else event)
                if sum(o.final is not None for o in outputs.values()) == total:
                    break
                event = await stream.__anext__()
        finally:
            span.end()
        return JSONResponse(self._full_response(rid, [outputs[i] for i in sorted(outputs)], chat,
                                                body.return_token_ids, calls))

    def _full_response(self, rid: str, outputs: list["_Output"], chat: bool, token_ids: bool,
                       calls: Calls | None = None) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outputs):
            text = "".join(out.text)
            made: list[dict[str, Any]] = []
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if calls is not None:
                    message["content"], made = read_output(calls, text)
                    if made or calls.parser is None:
                        message["tool_calls"] = made
                choice = {"index": i, "message": message,
                          "logprobs": None if out.logprobs is None else _chat_logprobs(out.logprobs)}
            else:
                choice = {"index": i, "text": text,
                          "logprobs": None if out.logprobs is None else _completion_logprobs(out.logprobs, 0)}
            choice["finish_reason"] = call_finish_reason(calls, out.final["finish_reason"], len(made))
            if token_ids:
                choice["token_ids"] = out.token_ids
            if out.prompt_logprobs is not None and not chat:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_logprobs)
            if len(outputs) > 1:  # each output's own; the response's sums them
                choice["speculation"] = out.final["speculation"]
            choices.append(choice)
        finals = [o.final for o in outputs]
        response = {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": _usage(finals),
            "speculation": _speculation(finals),
        }
        if chat and outputs[0].prompt_logprobs is not None:  # one conversation: the same for each output
            response["prompt_logprobs"] = _vllm_prompt_logprobs(outputs[0].prompt_logprobs)
        return response

    async def _sse_stream(self, rid: str, first: dict[str, Any], stream, chat: bool,
                          include_usage: bool, token_ids: bool, n: int, drop: bool,
                          calls: Calls | None = None, continuous: bool = False) -> AsyncIterator[str]:
        """`continuous`: each chunk carries its output's usage so far (the prompt's tokens,
        as each output's first event gives them, and the output's tokens)."""
        created = int(time.time())
        num_prompt = [first.get("num_prompt_tokens", 0)] * n  # a batch's other prompts: from their first events
        num_output = [0] * n

        def usage(i: int) -> dict[str, int]:
            return {"prompt_tokens": num_prompt[i], "completion_tokens": num_output[i],
                    "total_tokens": num_prompt[i] + num_output[i]}

        obj = "chat.completion.chunk" if chat else "text_completion"
        text_offset = [0] * n  # the completions API's, per output: characters of tokens streamed so far
        call_deltas = [CallDeltas(calls) for _ in range(n)] if calls is not None else None

        def chunk(i: int, text: str | None, finish: str | None, role: bool = False,
                  logprobs: list[dict[str, Any]] | None = None, read: tuple | None = None) -> dict[str, Any]:
            """`read`: the text as tool calls read it, `(content, tool_calls)`."""
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if read is not None:
                    content, tool_calls = read
                    if content:
                        delta["content"] = content
                    if tool_calls:
                        delta["tool_calls"] = tool_calls
                elif text is not None:
                    delta["content"] = text
                choice = {"index": i, "delta": delta,
                          "logprobs": None if logprobs is None else _chat_logprobs(logprobs), "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
                if logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(logprobs, text_offset[i])
                    text_offset[i] += sum(len(e["token"]) for e in logprobs)
            data = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if continuous:
                data["usage"] = usage(i)
            return data

        if chat:  # OpenAI opens a chat stream with the role, for each output
            for i in range(n):
                yield _sse(chunk(i, "", None, role=True))
        event = first
        finals = []
        while True:
            final = event["event"] == "final"
            i = event.get("index", 0)
            num_prompt[i] = event.get("num_prompt_tokens", num_prompt[i])
            if "prompt_text" in event:  # an echo: the prompt first, as its own chunk
                yield _sse(chunk(i, event["prompt_text"], None, logprobs=event.get("prompt_logprobs")))
            if drop:
                event = _without_output(event)
            num_output[i] += len(event.get("token_ids", []))
            if event.get("text") or event.get("token_ids") or final:
                read = None if call_deltas is None else call_deltas[i](event.get("text", ""), final)
                finish = None if not final else call_finish_reason(
                    calls, event["finish_reason"], 0 if call_deltas is None else call_deltas[i].count)
                data = chunk(i, event.get("text", ""), finish, logprobs=event.get("logprobs"), read=read)
                if token_ids:
                    data["choices"][0]["token_ids"] = event.get("token_ids", [])
                if final:
                    data["speculation"] = event["speculation"]
                yield _sse(data)
            if final:
                finals.append(event)
                if len(finals) == n:
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                    "choices": [], "usage": _usage(finals), "speculation": _speculation(finals)})
                    break
            try:
                event = await stream.__anext__()
            except StopAsyncIteration:
                break
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ HTTP routes
    @app.get("/health")
    async def health(self):
        try:
            state = await self._plain.health.remote()
        except Exception as exc:  # the verifier is not up
            return JSONResponse({"status": "unavailable", "detail": repr(exc)}, status_code=503)
        status = 200 if state["ready"] else 503
        return JSONResponse({"status": "ok" if state["ready"] else "starting", **state}, status_code=status)

    @app.get("/metrics")
    async def metrics(self):
        """The `ray_splitspec_*` series of this node's Ray metrics exporter (Prometheus text).
        On one machine that is every replica; on a cluster scrape each node's metrics port."""
        import urllib.request

        if self._metrics_url is None:  # fixed for this process: one GCS lookup
            self._metrics_url = await asyncio.to_thread(_node_metrics_url)
        url = self._metrics_url
        if url is None:
            return PlainTextResponse("# this node exports no Ray metrics\n", status_code=503)
        try:
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        except OSError as exc:
            return PlainTextResponse(f"# {url}: {exc}\n", status_code=503)
        keep = [line for line in text.splitlines()
                if line.startswith(("ray_splitspec_", "# HELP ray_splitspec_", "# TYPE ray_splitspec_"))]
        return PlainTextResponse("\n".join(keep) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "splitspec",
            "max_model_len": self.max_model_len,
        }]}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            body = _parse(CompletionBody, await _json(request))
            self._check_model(body.model)
            prompt = body.prompt
            if isinstance(prompt, list) and not prompt:
                raise ApiError(400, "prompt: must not be empty", "prompt")
            # A list of texts or of id lists is a batch; a list of ids is one prompt.
            prompts = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
            rid = f"cmpl-{uuid.uuid4().hex}"
            # Echo with max_tokens 0 scores the prompt alone (as OpenAI's API allows): one
            # token is generated and dropped.
            drop = body.echo and body.max_tokens == 0
            fields = _common_input(body, rid, 1 if drop else body.max_tokens, body.logprobs)
            # vLLM's rule: an echo's logprobs are prompt_logprobs', or as many as logprobs asks.
            fields.update(echo=body.echo, prompt_logprobs=body.prompt_logprobs if body.prompt_logprobs is not None
                          else body.logprobs if body.echo else None)
            inps = [GenerateInput(prompt_token_ids=tuple(p), **fields) if isinstance(p, list) else
                    GenerateInput(prompt=p, **fields) for p in prompts]
        except ApiError as exc:
            return exc.response()
        return await self._run(body, inps, chat=False, drop=drop)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            body = _parse(ChatCompletionBody, await _json(request))
            self._check_model(body.model)
            messages = _chat_messages(body.messages)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if body.top_logprobs is not None and not body.logprobs:
                raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            common = _common_input(body, rid, max_tokens, logprobs)
            choice = body.tool_choice
            if isinstance(choice, NamedToolChoice):
                choice = Calls(choice.function.name)
            tools = _tool_dicts(body.tools)
            calls, common["structured_output"] = _tool_calls(tools, choice, body.parallel_tool_calls,
                                                             common["structured_output"], self.tool_call_parser)
            inp = GenerateInput(messages=messages, tools=tools,
                                add_generation_prompt=body.add_generation_prompt,
                                continue_final_message=body.continue_final_message,
                                chat_template_kwargs=tuple((body.chat_template_kwargs or {}).items()), **common)
        except ApiError as exc:
            return exc.response()
        return await self._run(body, inp, chat=True, calls=calls)

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's: the ids a prompt or conversation is prefilled with, and their count."""
        try:
            body = _parse(TokenizeBody, await _json(request))
            self._check_model(body.model)
            out = await self._plain.tokenize.remote({  # which checks that one of prompt, messages is given
                "prompt": body.prompt,
                "messages": None if body.messages is None else _chat_messages(body.messages),
                "tools": _tool_dicts(body.tools),
                "add_generation_prompt": body.add_generation_prompt, "add_special_tokens": body.add_special_tokens,
                "continue_final_message": body.continue_final_message,
                "chat_template_kwargs": body.chat_template_kwargs})
            if "error" in out:
                raise ApiError(400, out["error"]["message"], out["error"]["param"])
        except ApiError as exc:
            return exc.response()
        if not body.return_token_strs:
            out["token_strs"] = None
        return out

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's: the text of token ids."""
        try:
            body = _parse(DetokenizeBody, await _json(request))
            self._check_model(body.model)
            out = await self._plain.detokenize.remote(body.tokens)
            if "error" in out:
                raise ApiError(400, out["error"]["message"], out["error"]["param"])
        except ApiError as exc:
            return exc.response()
        return out

    # ------------------------------------------------------------------ gRPC
    async def Generate(self, request: generate_pb2.GenerateRequest, grpc_context=None):
        """`splitspec.v1.Generate/Generate` through Serve's gRPC proxy."""
        rid = request.request_id or f"gen-{uuid.uuid4().hex}"
        span = tracer.start_span("splitspec.ingress", attributes={"splitspec.api": "grpc.Generate",
                                                                  "splitspec.request_id": rid})
        try:
            with trace.use_span(span, end_on_exit=False):
                inp, calls = self._grpc_input(request, rid)
                first, stream = await self._open(inp, span)
        except ApiError as exc:
            span.set_attribute("splitspec.status", exc.status)
            span.end()
            if grpc_context is not None:
                code = grpc.StatusCode.INVALID_ARGUMENT if exc.status == 400 else grpc.StatusCode.RESOURCE_EXHAUSTED
                grpc_context.set_code(code)
                grpc_context.set_details(exc.message)
                if exc.retry_after_s is not None:
                    grpc_context.set_trailing_metadata([("retry-after", str(max(1, math.ceil(exc.retry_after_s))))])
            raise
        async for message in _ending(span, self._grpc_messages(rid, first, stream, inp.n, calls)):
            yield message

    async def _grpc_messages(self, rid: str, first: dict[str, Any], stream, n: int,
                             calls: Calls | None = None) -> AsyncIterator[Any]:
        """`calls`: the output is read as tool calls, given on each output's last message."""
        event = first
        finals = 0
        texts: dict[int, list[str]] = collections.defaultdict(list)  # per output, when it is read as calls
        while True:
            message = generate_pb2.GenerateResponse(request_id=rid, token_ids=event.get("token_ids", []),
                                                    text=event.get("text", ""), index=event.get("index", 0))
            message.logprobs.extend(_pb_logprob(e) for e in event.get("logprobs", ()))
            message.prompt_logprobs.extend(_pb_logprob(e) for e in event.get("prompt_logprobs", ()))
            if calls is not None:
                texts[message.index].append(message.text)
            if event["event"] == "final":
                made: list[dict[str, Any]] = []
                if calls is not None:
                    content, made = read_output(calls, "".join(texts[message.index]))
                    message.tool_calls.extend(
                        generate_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                        for c in made)
                    if calls.parser is not None:
                        message.content = content or ""
                message.finish_reason = call_finish_reason(calls, event["finish_reason"], len(made))
                message.usage.CopyFrom(generate_pb2.Usage(**event["usage"]))
                s = event["speculation"]
                message.speculation.CopyFrom(generate_pb2.SpeculationStats(
                    rounds=s["rounds"], rounds_with_drafts=s["rounds_with_drafts"], drafted=s["drafted"],
                    accepted=s["accepted"], mean_acceptance_length=s["mean_acceptance_length"],
                    rounds_by_method=s["rounds_by_method"], rounds_off=s["rounds_off"], mode=s["mode"],
                    acceptance_rate=s["acceptance_rate"], tokens_per_second=s["tokens_per_second"],
                    num_output_tokens=s["num_output_tokens"],
                ))
                finals += 1
                yield message
                if finals == n:
                    return
            else:
                yield message
            try:
                event = await stream.__anext__()
            except StopAsyncIteration:
                return

    def _grpc_input(self, r: generate_pb2.GenerateRequest, rid: str) -> tuple[GenerateInput, Calls | None]:
        """The request as the verifier takes it, and the calls its output is read as (None: text)."""
        self._check_model(r.model)
        which = r.WhichOneof("input")
        if which is None:
            raise ApiError(400, "prompt: give one of prompt, messages, prompt_token_ids", "prompt")
        spec = r.speculation
        # Unset optional fields keep GenerateInput's defaults; max_tokens defaults to 16 as
        # in /v1/completions.
        fields: dict[str, Any] = dict(
            request_id=rid, max_tokens=16, stop=tuple(r.stop), ignore_eos=r.ignore_eos,
            include_stop_str_in_output=r.include_stop_str_in_output,
            speculation_mode=spec.mode or "auto", speculation_method=spec.method or None,
        )
        fields.update({name: getattr(r, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                                            "logprobs", "presence_penalty", "frequency_penalty",
                                                            "repetition_penalty", "n", "min_tokens", "prompt_logprobs")
                       if r.HasField(name)})
        fields["logit_bias"] = tuple(r.logit_bias.items())
        fields["stop_token_ids"] = tuple(r.stop_token_ids)
        fields["bad_words"] = tuple(r.bad_words)
        if r.allowed_token_ids:
            fields["allowed_token_ids"] = tuple(r.allowed_token_ids)
        for name in ("skip_special_tokens", "truncate_prompt_tokens"):
            if r.HasField(name):
                fields[name] = getattr(r, name)
        if r.HasField("structured_outputs"):
            so, kind = r.structured_outputs, r.structured_outputs.WhichOneof("kind")
            fields["structured_output"] = StructuredOutput(**(
                {"choice": tuple(so.choice.choices)} if kind == "choice" else
                {"json_object": so.json_object} if kind == "json_object" else
                {} if kind is None else {kind: getattr(so, kind)}), disable_any_whitespace=so.disable_any_whitespace,
                whitespace_pattern=so.whitespace_pattern if so.HasField("whitespace_pattern") else None)
        if spec.HasField("max_k"):
            fields["speculation_max_k"] = spec.max_k
        tools, choice = _grpc_tools(r)
        calls, fields["structured_output"] = _tool_calls(
            tools, choice, r.parallel_tool_calls if r.HasField("parallel_tool_calls") else True,
            fields.get("structured_output"), self.tool_call_parser)
        if which == "messages":
            return GenerateInput(tools=tools, **_grpc_chat(r), **fields), calls
        chat_options = [f.name for f, _ in r.ListFields() if f.name in _GRPC_CHAT_OPTIONS]
        if chat_options:
            raise ApiError(400, f"{chat_options[0]}: needs messages (the chat template reads it)", chat_options[0])
        if which == "prompt":
            return GenerateInput(prompt=r.prompt, **fields), calls
        return GenerateInput(prompt_token_ids=tuple(r.prompt_token_ids.ids), **fields), calls
