"""Tool calling: `tools` and `tool_choice` of the chat API.

A named function and `"required"` are structured outputs: the grammar makes the output a
call, as vLLM's named and "required" tool choices did up to its 0.11 (later versions
refuse them without a parser). `"auto"` is free text read by a tool-call parser, as
vLLM's `--enable-auto-tool-choice --tool-call-parser`:

- a named function (`{"type": "function", "function": {"name": N}}`): the output is
  N's arguments, a JSON object matching N's `parameters` schema;
- `"required"`: the output is a JSON array of one or more calls, each
  `{"name": N, "parameters": {...}}` for one of the tools (`required_schema`);
- `"none"`: free text (the tools still reach the chat template);
- `"auto"` (OpenAI's default when tools are given): free text, read by the parser the
  config names (`model.tool_call_parser`; none set: a 400). `"hermes"` (`HermesReader`):
  each `<tool_call>{"name": N, "arguments": {...}}</tool_call>` block naming one of the
  tools is a call, the rest of the text is the content; `"llama3_json"`
  (`Llama3JsonReader`): an output that is all `{"name": N, "parameters": {...}}` objects
  separated by `;` is those calls, any other is content; `"pythonic"` (`PythonicReader`)
  likewise for an output that is a Python list of calls `[N(ARG=VALUE, ...), ...]`. The
  bundled SmolLM2's template knows no tools, so it writes such calls only when the
  conversation shows it how (or a `model.chat_template` that renders the tools does).

The output is decoded like any other (exact under speculation); this module builds the
schemas and reads the calls back out of the text.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
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


def _skip_space(text: str, i: int) -> int:
    """The first index from i on in `text` that is not JSON whitespace (or its end)."""
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


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
        return _skip_space(self._text, i)


#: Hermes's call markers (NousResearch's Hermes 2 Pro format, which Qwen2.5 and many
#: fine-tunes write too).
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class HermesReader:
    """Reads Hermes-style calls out of free text as it grows (`tool_choice: "auto"`).

    A `<tool_call>...</tool_call>` block is a call when it holds a JSON object with a
    `name` among `names` and `arguments` (or `parameters`) an object, or none; any other
    block (bad JSON, a function not offered) stays in the content as written, and so does
    a block left open at the end unless what it holds is a whole call. The whitespace
    around calls is dropped, except the run before the first call when content follows
    the calls (it joins the content before them to the content after); without calls the
    content is the text as written. `parallel` False (`parallel_tool_calls: false`): the
    first call only.

    `feed` returns the content and the calls the new text completes, so a stream gives
    each piece once: content is held back only while it may still open a block (a
    trailing `<tool`) or be whitespace before one.

    >>> r = HermesReader(["add"])
    >>> r.feed('Sure. <tool'), r.feed('_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    (('Sure.', []), ('', [('add', '{"a": 1}')]))
    >>> HermesReader(["add"]).feed('<tool_call>{"name": "sub"}</tool_call> no', final=True)
    ('<tool_call>{"name": "sub"}</tool_call> no', [])
    """

    def __init__(self, names, parallel: bool = True) -> None:
        self.names = frozenset(names)
        self.parallel = parallel
        self.count = 0  # calls returned
        self._buf = ""  # text not yet returned: an open block, or what may start one
        self._held = ""  # whitespace after the content returned, until what follows decides
        self._in_block = False
        self._after_call = False  # no content since the last call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[tuple[str, str]]]:
        self._buf += text
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        while True:
            if self._in_block:
                end = self._buf.find(CALL_CLOSE)
                if end < 0 and not final:
                    break
                block, rest = (self._buf, "") if end < 0 else (self._buf[:end], self._buf[end + len(CALL_CLOSE):])
                self._buf, self._in_block = rest, False
                call = self._call(block)
                if call is None:
                    content.append(self._content(CALL_OPEN + block + ("" if end < 0 else CALL_CLOSE)))
                else:
                    self._after_call = True
                    if self.parallel or not self.count:
                        calls.append(call)
                        self.count += 1
                continue
            start = self._buf.find(CALL_OPEN)
            if start >= 0:
                content.append(self._content(self._buf[:start]))
                self._buf, self._in_block = self._buf[start + len(CALL_OPEN):], True
                continue
            keep = 0 if final else next(
                (n for n in range(min(len(CALL_OPEN) - 1, len(self._buf)), 0, -1)
                 if self._buf.endswith(CALL_OPEN[:n])), 0)
            content.append(self._content(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            if final:
                if not self.count:
                    content.append(self._held)
                self._held = ""
            break
        return "".join(content), calls

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._held + text
        shown = text.rstrip()
        self._held = text[len(shown):]
        return shown

    def _call(self, block: str) -> tuple[str, str] | None:
        try:
            value = json.loads(block)
        except ValueError:
            return None
        return _named_call(value, self.names)


def _named_call(value: Any, names: frozenset[str]) -> tuple[str, str] | None:
    """`value` as a call (name, arguments as JSON text): an object whose `name` is one of
    `names` and whose `arguments` (or `parameters`) is an object, or absent; else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


#: What Llama 3.1+ writes before a call in its JSON format (a special token: gone from the
#: text when special tokens are skipped, as they are by default).
PYTHON_TAG = "<|python_tag|>"
#: What Llama 4 writes around its pythonic calls (special tokens too).
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class WholeOutputReader:
    """A parser for which an output is calls only when it is, whole, calls: `OPENER`, the
    first character of the calls, after any whitespace and an optional `TAG`. Any other
    output is content, as written, calls-like text and all (nothing is dropped).
    `parallel` False: the first call only. `_calls` reads the text after the tag.

    The calls can be known only at the end, so `feed` holds the text back for as long as
    it may still be calls (from a first `OPENER` or `TAG` on, after any whitespace) and
    streams any other output as content as it comes."""

    OPENER = ""
    TAG = ""

    def __init__(self, names, parallel: bool = True) -> None:
        self.names = frozenset(names)
        self.parallel = parallel
        self.count = 0  # calls returned
        self._buf = ""  # text held back while it may be calls
        self._start: int | None = None  # where in it the whitespace before the text ends
        self._content = False  # the output is content: stream it

    def feed(self, text: str, final: bool = False) -> tuple[str, list[tuple[str, str]]]:
        if self._content:
            return text, []
        self._buf += text
        if self._start is None and self._buf.strip(" \t\r\n"):
            self._start = len(self._buf) - len(self._buf.lstrip(" \t\r\n"))
        s = self._start
        if s is not None and not (self._buf.startswith(self.OPENER, s)
                                  or self.TAG.startswith(self._buf[s : s + len(self.TAG)])):
            self._content = True
        elif final:
            body = "" if s is None else self._buf[s + len(self.TAG) if self._buf.startswith(self.TAG, s) else s:]
            calls = self._calls(body)
            if calls:
                self._buf = ""
                calls = calls if self.parallel else calls[:1]
                self.count += len(calls)
                return "", calls
            self._content = True
        else:
            return "", []
        out, self._buf = self._buf, ""
        return out, []

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


class Llama3JsonReader(WholeOutputReader):
    """Llama 3's JSON tool calls (`tool_choice: "auto"`, vLLM's `llama3_json`): an output
    that is, whole, one or more `{"name": N, "parameters": {...}}` objects (`arguments`
    read too) separated by `;`, after an optional `<|python_tag|>` (whitespace before and
    after it), each naming one of `names`, is those calls, with no content; any other
    output is content, as written (`WholeOutputReader`).

    >>> r = Llama3JsonReader(["add"])
    >>> r.feed('{"name": "add", "parameters": {"a": 1}}'), r.feed('; {"name": "add"}', final=True)
    (('', []), ('', [('add', '{"a": 1}'), ('add', '{}')]))
    >>> Llama3JsonReader(["add"]).feed('{"name": "add"} and more', final=True)
    ('{"name": "add"} and more', [])
    """

    OPENER = "{"
    TAG = PYTHON_TAG

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        decoder = json.JSONDecoder()
        calls, i = [], _skip_space(text, 0)  # whitespace after the tag
        while True:
            try:
                value, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            call = _named_call(value, self.names)
            if call is None:
                return None
            calls.append(call)
            i = _skip_space(text, i)
            if i == len(text):
                return calls
            if text[i] != ";":
                return None
            i = _skip_space(text, i + 1)


class PythonicReader(WholeOutputReader):
    """Pythonic tool calls (`tool_choice: "auto"`, vLLM's `pythonic`, as Llama 3.2 and 4
    write them): an output that is, whole, a Python list of one or more calls
    `[N(ARG=VALUE, ...), ...]`, each naming one of `names` with keyword arguments only,
    each given once, whose values are literals JSON can hold (strings, numbers, True,
    False, None, and lists and dicts of them with string keys), is those calls, the
    arguments as a JSON object; Llama 4's `<|python_start|>` ... `<|python_end|>` around
    it is allowed. Any other output is content, as written (`WholeOutputReader`): a list
    that is not all calls, a positional argument, an expression for a value. The text is
    parsed by `ast`, never evaluated.

    >>> PythonicReader(["add"]).feed('[add(a=1, b=-2.5), add()]', final=True)
    ('', [('add', '{"a": 1, "b": -2.5}'), ('add', '{}')])
    >>> PythonicReader(["add"]).feed('[add(1, 2)]', final=True)
    ('[add(1, 2)]', [])
    """

    OPENER = "["
    TAG = PYTHON_START

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        text = text.rstrip(" \t\r\n")
        if text.endswith(PYTHON_END):
            text = text[: -len(PYTHON_END)]
        try:
            tree = ast.parse(text.strip(" \t\r\n"), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.names
                    and not node.args):
                return None
            arguments: dict[str, Any] = {}
            for keyword in node.keywords:
                if keyword.arg is None or keyword.arg in arguments:  # **spread, or a repeated name
                    return None
                try:
                    arguments[keyword.arg] = _json_literal(keyword.value)
                except ValueError:
                    return None
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls


def _json_literal(node: ast.expr) -> Any:
    """The value of a literal JSON can hold, else `ValueError`: a string, a finite number
    (a sign allowed), True, False, None, or a list or dict (string keys) of those."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        value = _json_literal(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List):
        return [_json_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            raise ValueError("dict keys must be strings")  # a None key is a ** spread
        return {k.value: _json_literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


#: `model.tool_call_parser` -> its reader.
PARSERS = {"hermes": HermesReader, "llama3_json": Llama3JsonReader, "pythonic": PythonicReader}


@dataclasses.dataclass(frozen=True)
class Calls:
    """The output is tool calls: one call of the function `name` (its arguments are the
    text), or, for name None, `tool_choice: "required"`'s array, or, with a `parser`,
    `"auto"`'s free text, read by that parser for calls of the functions `names`."""

    name: str | None
    parser: str | None = None
    names: tuple[str, ...] = ()
    parallel: bool = True

    def reader(self) -> HermesReader | WholeOutputReader:
        return PARSERS[self.parser](self.names, self.parallel)


def _call_dicts(found: list[tuple[str, str]], first: int | None = None) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` entries; `first`: a stream's deltas, indexed from it."""
    return [{**({} if first is None else {"index": first + j}), "id": tool_call_id(), "type": "function",
             "function": {"name": name, "arguments": arguments}} for j, (name, arguments) in enumerate(found)]


def read_output(calls: Calls, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output's content and `tool_calls`. Forced calls have no content (OpenAI's
    have none); a "required" output cut short gives the calls it completed; "auto" gives
    the text outside the calls (None when there is none), or, without calls, the text."""
    if calls.parser is not None:
        content, found = calls.reader().feed(text, final=True)
        return (content or None) if found else content, _call_dicts(found)
    found = [(calls.name, text)] if calls.name is not None else CallReader().feed(text)
    return None, _call_dicts(found)


def call_finish_reason(calls: Calls | None, finish: str, made: int = 0) -> str:
    """OpenAI ends a forced call of a named function with "stop", and calls the model
    chose ("required", or "auto" that made `made` > 0 calls) with "tool_calls"."""
    if calls is None or calls.name is not None or finish != "stop" or (calls.parser is not None and not made):
        return finish
    return "tool_calls"


class CallDeltas:
    """A streamed output's deltas: `(content, tool_calls)` for each new piece of text. A
    named call opens with its id and name and streams its arguments as written;
    "required" calls, and "auto"'s, come each whole, once read, and "auto"'s content
    streams as it is written (held back only while it may open a call)."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.count = 0
        self.reader = CallReader()
        self.hermes = calls.reader() if calls.parser is not None else None

    def __call__(self, text: str, final: bool) -> tuple[str | None, list[dict[str, Any]]]:
        content = None
        if self.hermes is not None:
            content, found = self.hermes.feed(text, final)
        elif self.calls.name is None:
            found = self.reader.feed(text)
        elif not (text or (final and self.count == 0)):
            return None, []
        elif self.count:
            return None, [{"index": 0, "function": {"arguments": text}}]
        else:
            found = [(self.calls.name, text)]
        deltas = _call_dicts(found, self.count)
        self.count += len(found)
        return content or None, deltas
