"""`cluster/tool_calls.py`: the schema of `tool_choice: "required"`, reading calls back
out of a growing output, and `"auto"`'s Hermes, Llama 3 JSON and pythonic parsers (expectations written
by hand). The calls served over HTTP
are tested in tests/cluster/test_serve.py."""

from __future__ import annotations

import json

import pytest

from cluster.tool_calls import (NO_PARAMETERS, CallDeltas, CallReader, Calls, HermesReader, Llama3JsonReader,
                                PythonicReader, call_finish_reason, read_output, required_schema, tool_choice_output)
from verifier.errors import InvalidRequestError

ADD = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Int"}, "b": {"$ref": "#/$defs/Int"}},
       "$defs": {"Int": {"type": "integer"}}}


def test_the_required_schema_is_an_array_of_calls_with_their_defs_at_the_top():
    functions = [{"name": "add", "parameters": json.loads(json.dumps(ADD))}, {"name": "now"}]
    schema = required_schema(functions)
    assert schema == {
        "type": "array", "minItems": 1, "$defs": {"Int": {"type": "integer"}},
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["add"]},
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/Int"},
                                                                            "b": {"$ref": "#/$defs/Int"}}}},
             "required": ["name", "parameters"], "additionalProperties": False},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"], "additionalProperties": False},
        ]}}
    assert functions[0]["parameters"] == ADD  # the request's tools are left as they were


def test_two_tools_may_share_a_def_but_not_give_it_two_schemas():
    same = [{"name": n, "parameters": json.loads(json.dumps(ADD))} for n in ("add", "sub")]
    assert required_schema(same)["$defs"] == {"Int": {"type": "integer"}}
    other = {**ADD, "$defs": {"Int": {"type": "number"}}}
    with pytest.raises(InvalidRequestError, match=r"tools\.1\.function\.parameters: \$defs\.Int") as info:
        required_schema([{"name": "add", "parameters": ADD}, {"name": "sub", "parameters": other}])
    assert info.value.param == "tools"


def test_tool_choice_output():
    functions = [{"name": "add", "parameters": ADD}, {"name": "now"}]
    assert tool_choice_output(functions, "none") is None
    named = tool_choice_output(functions, {"type": "function", "function": {"name": "add"}})
    assert json.loads(named.json) == ADD and named.param == "tools"
    assert json.loads(tool_choice_output(functions, {"function": {"name": "now"}}).json) == NO_PARAMETERS
    required = json.loads(tool_choice_output(functions, "required").json)
    assert required["minItems"] == 1 and "maxItems" not in required
    assert json.loads(tool_choice_output(functions, "required", parallel=False).json)["maxItems"] == 1


TEXT = '[ {"name": "add", "parameters": {"a": 12, "b": {"c": "}"}}},\n {"name":"now","parameters":{}}\n]'


def test_calls_are_read_once_each_as_soon_as_their_json_is_whole():
    reader = CallReader()
    seen = [(i, call) for i in range(len(TEXT)) for call in reader.feed(TEXT[i])]
    first_end = TEXT.index("}}}") + 3  # the "}" inside the string does not end the call
    assert seen == [(first_end - 1, ("add", '{"a": 12, "b": {"c": "}"}}')),
                    (TEXT.index("{}}") + 2, ("now", "{}"))]


def test_text_cut_short_keeps_the_calls_it_completed():
    cut = TEXT[:TEXT.index('"now"') + 3]
    assert CallReader().feed(cut) == [("add", '{"a": 12, "b": {"c": "}"}}')]
    assert CallReader().feed("[") == [] and CallReader().feed("") == []
    assert CallReader().feed('[{"name": "é", "parameters": {"x": "ü"}}]') == [("é", '{"x": "ü"}')]


NAMES = ("get_weather", "add")
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Lyon", "unit": "celsius"}}\n</tool_call>'
ADD_CALL = '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>'
WEATHER_ARGS, ADD_ARGS = '{"location": "Lyon", "unit": "celsius"}', '{"a": 1, "b": 2}'

#: (text, its content, its calls): Hermes blocks read by hand.
HERMES = [
    # Content before the calls; the whitespace around them dropped.
    (f"Let me look.\n{WEATHER_CALL}\n{ADD_CALL}\n", "Let me look.", [("get_weather", WEATHER_ARGS), ("add", ADD_ARGS)]),
    (f"{ADD_CALL}", "", [("add", ADD_ARGS)]),
    # Content after a call joins the content before it with the whitespace before the call.
    (f"Sure.\n\n{ADD_CALL}\n Done. ", "Sure.\n\nDone.", [("add", ADD_ARGS)]),
    # Not calls: text as written (bad JSON, a function not offered, arguments not an
    # object, no name), and so are a "<tool" that opens nothing and a block cut short.
    ("a <tool or <tool_call", "a <tool or <tool_call", []),
    ('x\n<tool_call>{"name": "weather", "arguments": {"t": 25C}}</tool_call>\n',
     'x\n<tool_call>{"name": "weather", "arguments": {"t": 25C}}</tool_call>\n', []),
    ('<tool_call>{"name": "sub", "arguments": {}}</tool_call>', '<tool_call>{"name": "sub", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>', '<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>', []),
    ('<tool_call>["add"]</tool_call> \n', '<tool_call>["add"]</tool_call> \n', []),
    ('<tool_call>{"name": "add", "argu', '<tool_call>{"name": "add", "argu', []),
    ("Hello,\n\n  world.\n\n", "Hello,\n\n  world.\n\n", []),
    # A block not a call stays in the content beside one that is; a last block left open
    # is a call if it is whole; a call without arguments takes none.
    (f'{ADD_CALL} <tool_call>{{"name": 3}}</tool_call>\n<tool_call>{{"name": "get_weather"}}',
     '<tool_call>{"name": 3}</tool_call>', [("add", ADD_ARGS), ("get_weather", "{}")]),
    ('<tool_call>{"name": "add", "arguments": {"s": "é"}}</tool_call>', "", [("add", '{"s": "é"}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_blocks_are_calls_and_the_rest_is_content(text, content, calls):
    assert HermesReader(NAMES).feed(text, final=True) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_streamed_in_any_pieces_reads_the_same_and_each_call_when_its_block_closes(text, content, calls):
    for size in (1, 2, 5):
        reader = HermesReader(NAMES)
        got, seen = "", []
        for i in range(0, len(text), size):
            piece, found = reader.feed(text[i:i + size])
            got += piece
            seen += [(i + size, call) for call in found]
        piece, found = reader.feed("", final=True)
        assert got + piece == content
        assert [c for _, c in seen] + found == calls
        # A closed call comes with the piece that closes its block.
        closes = [m + len("</tool_call>") for m in _find_all(text, "</tool_call>")]
        assert all(any(at - size < c <= at for c in closes) for at, _ in seen), seen
        if "<tool_call>" not in text:  # held back only what may open a block, and whitespace before it
            assert content.startswith(got)
            assert "<tool_call>".startswith(content[len(got):].lstrip()), (got, content)


def _find_all(text: str, sub: str) -> list[int]:
    return [i for i in range(len(text)) if text.startswith(sub, i)]


def test_hermes_without_parallel_calls_gives_the_first_call():
    text = f"{WEATHER_CALL}\n{ADD_CALL}"
    assert HermesReader(NAMES, parallel=False).feed(text, final=True) == ("", [("get_weather", WEATHER_ARGS)])


def test_auto_output_and_finish_reason():
    auto = Calls(None, "hermes", NAMES)
    content, calls = read_output(auto, f"Let me look.\n{ADD_CALL}")
    assert content == "Let me look." and [c["function"] for c in calls] == [{"name": "add", "arguments": ADD_ARGS}]
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert read_output(auto, ADD_CALL)[0] is None  # OpenAI: no content
    assert read_output(auto, "Hi.\n") == ("Hi.\n", [])
    assert [call_finish_reason(auto, f, n) for f, n in (("stop", 1), ("stop", 0), ("length", 1))] == [
        "tool_calls", "stop", "length"]
    assert call_finish_reason(Calls(None), "stop") == "tool_calls"  # "required"
    assert call_finish_reason(Calls("add"), "stop") == "stop"  # a named function
    deltas = CallDeltas(auto)
    assert deltas("Sure.\n<tool_c", False) == ("Sure.", [])
    content, made = deltas('all>{"name": "add"}</tool_call>', True)
    assert content is None and [(d["index"], d["function"]) for d in made] == [(0, {"name": "add", "arguments": "{}"})]
    assert deltas.count == 1


WEATHER_JSON = '{"name": "get_weather", "parameters": {"location": "Lyon", "unit": "celsius"}}'
ADD_JSON = '{"name": "add", "arguments": {"a": 1, "b": 2}}'

#: (text, its content, its calls): Llama 3 JSON outputs read by hand.
LLAMA3 = [
    (WEATHER_JSON, "", [("get_weather", WEATHER_ARGS)]),
    # Around the calls: whitespace, and the python tag; between them ";".
    (f"\n <|python_tag|>{WEATHER_JSON}; {ADD_JSON}\n", "", [("get_weather", WEATHER_ARGS), ("add", ADD_ARGS)]),
    (f"{ADD_JSON};\n{ADD_JSON}", "", [("add", ADD_ARGS), ("add", ADD_ARGS)]),
    (f"<|python_tag|> \n{ADD_JSON}", "", [("add", ADD_ARGS)]),
    ('{"name": "add"}', "", [("add", "{}")]),
    ('{"name": "add", "parameters": {"s": "é}"}}', "", [("add", '{"s": "é}"}')]),
    # Not calls: the whole text as written (text around them, a function not offered,
    # arguments not an object, bad JSON, no separator, a trailing ";", cut short, a list,
    # plain text, text that starts like the python tag but is not).
    (f"Here: {WEATHER_JSON}", f"Here: {WEATHER_JSON}", []),
    (f"{WEATHER_JSON}\nDone.", f"{WEATHER_JSON}\nDone.", []),
    (f"{ADD_JSON}; {{\"name\": \"sub\"}}", f"{ADD_JSON}; {{\"name\": \"sub\"}}", []),
    ('{"name": "add", "parameters": [1, 2]}', '{"name": "add", "parameters": [1, 2]}', []),
    ('{"name": "add", "parameters": {"a": 1,}}', '{"name": "add", "parameters": {"a": 1,}}', []),
    (f"{ADD_JSON} {ADD_JSON}", f"{ADD_JSON} {ADD_JSON}", []),
    (f"{ADD_JSON};", f"{ADD_JSON};", []),
    ('{"name": "add", "argu', '{"name": "add", "argu', []),
    (f"[{ADD_JSON}]", f"[{ADD_JSON}]", []),
    ("  Hello,\n\n  world.\n", "  Hello,\n\n  world.\n", []),
    ("<|pyth", "<|pyth", []),
    ("<b>bold</b>", "<b>bold</b>", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3)
def test_llama3_json_output_is_calls_or_content(text, content, calls):
    assert Llama3JsonReader(NAMES).feed(text, final=True) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3)
def test_llama3_json_streamed_holds_back_only_what_may_be_calls(text, content, calls):
    may_be_calls = text.lstrip()[:1] in ("{", "<") and "<b>" not in text
    for size in (1, 2, 5):
        reader = Llama3JsonReader(NAMES)
        got = ""
        for i in range(0, len(text), size):
            piece, found = reader.feed(text[i:i + size])
            assert found == []  # the calls are known only at the end
            got += piece
        piece, found = reader.feed("", final=True)
        assert (got + piece, found) == (content, calls)
        if not may_be_calls:  # content streams as it comes, after any leading whitespace
            assert len(got) >= len(text) - size - (len(text) - len(text.lstrip()))
        else:
            assert got == ""


def test_llama3_json_without_parallel_calls_gives_the_first_call():
    assert Llama3JsonReader(NAMES, parallel=False).feed(f"{WEATHER_JSON}; {ADD_JSON}", final=True) == (
        "", [("get_weather", WEATHER_ARGS)])
    auto = Calls(None, "llama3_json", NAMES)
    content, calls = read_output(auto, ADD_JSON)
    assert content is None and [c["function"] for c in calls] == [{"name": "add", "arguments": ADD_ARGS}]
    assert read_output(auto, "Hi.") == ("Hi.", [])
    deltas = CallDeltas(auto)
    assert deltas(ADD_JSON[:10], False) == (None, [])
    content, made = deltas(ADD_JSON[10:], True)
    assert content is None and [(d["index"], d["function"]) for d in made] == [(0, {"name": "add", "arguments": ADD_ARGS})]


WEATHER_PY = 'get_weather(location="Lyon", unit=\'celsius\')'
ADD_PY = "add(a=1, b=2)"
#: (text, content, calls): the calls' arguments as JSON text, written by hand.
PYTHONIC = [
    (f"[{WEATHER_PY}]", "", [("get_weather", WEATHER_ARGS)]),
    # Whitespace around and inside, two calls, Llama 4's tags, no arguments.
    (f"\n [ {WEATHER_PY},\n  {ADD_PY} ]\n", "", [("get_weather", WEATHER_ARGS), ("add", ADD_ARGS)]),
    (f"<|python_start|>[{ADD_PY}]<|python_end|>", "", [("add", ADD_ARGS)]),
    ("[add()]", "", [("add", "{}")]),
    # Every literal JSON holds: signs, floats, None, True, nested lists and dicts, unicode.
    ('[add(a=-1, b=+2.5, c=None, d=True, e=[1, {"k": [False]}], s="é]")]', "",
     [("add", '{"a": -1, "b": 2.5, "c": null, "d": true, "e": [1, {"k": [false]}], "s": "é]"}')]),
    # Not calls: the whole text as written (text around, a function not offered, a
    # positional argument, a repeated argument, a ** spread, an expression, a name, a
    # tuple, a set, bytes, a non-string key, JSON's true, infinity, a sign on a non-number, an empty list, a list of a
    # non-call, a method, a bare call, cut short, bad syntax, plain text, a partial tag).
    (f"Here: [{ADD_PY}]", f"Here: [{ADD_PY}]", []),
    (f"[{ADD_PY}] Done.", f"[{ADD_PY}] Done.", []),
    ("[sub(a=1)]", "[sub(a=1)]", []),
    ("[add(1, b=2)]", "[add(1, b=2)]", []),
    ("[add(a=1, a=2)]", "[add(a=1, a=2)]", []),
    ("[add(**x)]", "[add(**x)]", []),
    ("[add(a=1 + 2)]", "[add(a=1 + 2)]", []),
    ("[add(a=x)]", "[add(a=x)]", []),
    ("[add(a=(1, 2))]", "[add(a=(1, 2))]", []),
    ("[add(a={1})]", "[add(a={1})]", []),
    ("[add(a=b'1')]", "[add(a=b'1')]", []),
    ("[add(a={1: 2})]", "[add(a={1: 2})]", []),
    ("[add(a=true)]", "[add(a=true)]", []),
    ("[add(a=1e999)]", "[add(a=1e999)]", []),
    ("[add(a=-True)]", "[add(a=-True)]", []),
    ('[add(a=-"1")]', '[add(a=-"1")]', []),
    ("[]", "[]", []),
    ("[2 + 3]", "[2 + 3]", []),
    ("[math.add(a=1)]", "[math.add(a=1)]", []),
    (ADD_PY, ADD_PY, []),
    ("[add(a=1, b=", "[add(a=1, b=", []),
    ("[add(a=1)) ]", "[add(a=1)) ]", []),
    ("  Hello,\n  world.\n", "  Hello,\n  world.\n", []),
    ("<|python_st", "<|python_st", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), PYTHONIC)
def test_pythonic_output_is_calls_or_content(text, content, calls):
    assert PythonicReader(NAMES).feed(text, final=True) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), PYTHONIC)
def test_pythonic_streamed_holds_back_only_what_may_be_calls(text, content, calls):
    may_be_calls = text.lstrip()[:1] in ("[", "<")
    for size in (1, 2, 5):
        reader = PythonicReader(NAMES)
        got = ""
        for i in range(0, len(text), size):
            piece, found = reader.feed(text[i:i + size])
            assert found == []  # the calls are known only at the end
            got += piece
        piece, found = reader.feed("", final=True)
        assert (got + piece, found) == (content, calls)
        if may_be_calls:
            assert got == ""
        else:  # content streams as it comes, after any leading whitespace
            assert len(got) >= len(text) - size - (len(text) - len(text.lstrip()))


def test_pythonic_without_parallel_calls_gives_the_first_call_and_serves_as_auto():
    assert PythonicReader(NAMES, parallel=False).feed(f"[{WEATHER_PY}, {ADD_PY}]", final=True) == (
        "", [("get_weather", WEATHER_ARGS)])
    auto = Calls(None, "pythonic", NAMES)
    content, calls = read_output(auto, f"[{ADD_PY}]")
    assert content is None and [c["function"] for c in calls] == [{"name": "add", "arguments": ADD_ARGS}]
    assert read_output(auto, "[2 + 3]") == ("[2 + 3]", [])
    deltas = CallDeltas(auto)
    assert deltas("[add(a=1", False) == (None, [])
    content, made = deltas(", b=2)]", True)
    assert content is None and [(d["index"], d["function"]) for d in made] == [(0, {"name": "add", "arguments": ADD_ARGS})]


def test_pythonic_refuses_a_nesting_too_deep_for_the_parser_as_content():
    text = "[add(a=" + "[" * 100_000 + "]" * 100_000 + ")]"
    assert PythonicReader(NAMES).feed(text, final=True) == (text, [])
