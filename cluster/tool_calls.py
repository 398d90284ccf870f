"""Tool calling on structured outputs: `tools` and `tool_choice` of the chat API.

There is no tool-call parser for the bundled model (SmolLM2's chat template knows no
tools), so a call is made only when the request asks for one, and the grammar makes the
output a call, as vLLM's named and "required" tool choices did up to its 0.11 (later
versions refuse them without a parser):

- a named function (`{"type": "function", "function": {"name": N}}`): the output is
  N's arguments, a JSON object matching N's `parameters` schema;
- `"required"`: the output is a JSON array of one or more calls, each
  `{"name": N, "parameters": {...}}` for one of the tools (`required_schema`);
- `"none"`: free text (the tools still reach the chat template);
- `"auto"` (OpenAI's default when tools are given) needs a parser: refused with a 400.

The output is decoded like any structured output (exact under speculation); this
module builds the schema and reads the calls back out of the text.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from typing import Any

from verifier.errors import InvalidRequestError
from verifier.structured_output import StructuredOutput

#: A function without `parameters` takes none (OpenAI: "omitting parameters defines a
#: function with an empty parameter list").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    """A call's id, as vLLM writes it."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or NO_PARAMETERS


def required_schema(functions: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of `tool_choice: "required"`: an array of at least one call, each
    naming one of `functions` (OpenAI `function` objects) with that function's parameters
    and nothing else (vLLM's schema lets a call hold more keys, which a small model fills
    with made-up ones while the grammar allows them). `parallel` False (OpenAI's
    `parallel_tool_calls: false`): one call.
    The functions' `$defs` move to the top, where their `$ref`s (`#/$defs/...`) point.

    >>> f = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    >>> required_schema([f])["items"]["anyOf"][0]["properties"]["name"]
    {'type': 'string', 'enum': ['add']}
    """
    defs: dict[str, Any] = {}
    calls = []
    for i, function in enumerate(functions):
        parameters = copy.deepcopy(_parameters(function))
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise InvalidRequestError("tools", f"tools.{i}.function.parameters: $defs.{name} differs from "
                                                   "another tool's; tool_choice 'required' needs one schema per name")
        calls.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_choice_output(functions: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool = True) -> StructuredOutput | None:
    """What the output must match for `tool_choice` (`"none"`, `"required"`, or a named
    function, already checked to be one of `functions`); None for free text."""
    if choice == "none":
        return None
    if choice == "required":
        return StructuredOutput(json=json.dumps(required_schema(functions, parallel)), param="tools")
    name = choice["function"]["name"]
    function = next(f for f in functions if f["name"] == name)
    return StructuredOutput(json=json.dumps(_parameters(function)), param="tools")


class CallReader:
    """Reads the calls of a `"required"` output as its text grows: `feed` returns the
    calls completed by the new text, each once, as `(name, arguments)` with the arguments
    as JSON text. Text the grammar cut short (`max_tokens`) leaves its last call unread.

    >>> r = CallReader()
    >>> r.feed('[{"name": "add", "parameters": {"a"'), r.feed(': 1}}, {"name": "neg", "par')
    ([], [('add', '{"a": 1}')])
    """

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # where the next call (or the '[' / ',' before it) starts
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._text += text
        calls = []
        while True:
            i = self._skip(self._pos)
            if i < len(self._text) and self._text[i] in "[,":
                i = self._skip(i + 1)
            if i >= len(self._text) or self._text[i] != "{":
                return calls
            try:
                call, end = self._decoder.raw_decode(self._text, i)
            except json.JSONDecodeError:  # the call's text is not all here yet
                return calls
            self._pos = end
            calls.append((call["name"], json.dumps(call["parameters"], ensure_ascii=False)))

    def _skip(self, i: int) -> int:
        while i < len(self._text) and self._text[i] in " \t\r\n":
            i += 1
        return i


@dataclasses.dataclass(frozen=True)
class Calls:
    """The output is tool calls: one call of the function `name` (its arguments are the
    text), or, for name None, `tool_choice: "required"`'s array."""

    name: str | None


def message_calls(calls: Calls, text: str) -> list[dict[str, Any]]:
    """A whole response's `tool_calls`; a "required" output cut short gives the calls
    it completed."""
    found = [(calls.name, text)] if calls.name is not None else CallReader().feed(text)
    return [{"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in found]


def call_finish_reason(calls: Calls | None, finish: str) -> str:
    # OpenAI ends a forced call of a named function with "stop", and calls the model
    # chose ("required") with "tool_calls".
    return "tool_calls" if calls is not None and calls.name is None and finish == "stop" else finish


class CallDeltas:
    """A streamed output's `delta.tool_calls`: a named call opens with its id and name
    and streams its arguments as written; "required" calls come each whole, once read."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.count = 0
        self.reader = CallReader()

    def __call__(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self.calls.name is None:
            found = self.reader.feed(text)
        elif not (text or (final and self.count == 0)):
            return []
        elif self.count:
            return [{"index": 0, "function": {"arguments": text}}]
        else:
            found = [(self.calls.name, text)]
        deltas = [{"index": self.count + j, "id": tool_call_id(), "type": "function",
                   "function": {"name": name, "arguments": arguments}} for j, (name, arguments) in enumerate(found)]
        self.count += len(found)
        return deltas
