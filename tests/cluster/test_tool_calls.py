"""`cluster/tool_calls.py`: the schema of `tool_choice: "required"` and reading calls
back out of a growing output (expectations written by hand). The calls served over HTTP
are tested in tests/cluster/test_serve.py."""

from __future__ import annotations

import json

import pytest

from cluster.tool_calls import NO_PARAMETERS, CallReader, required_schema, tool_choice_output
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
