"""The ingress's reading of a request, without a cluster: a conversation as the chat
template reads it, from HTTP's JSON and from gRPC's messages."""

from __future__ import annotations

import pytest

from cluster.ingress import ApiError, ChatMessage, _chat_messages, _grpc_chat
from protos.splitspec.v1 import generate_pb2

#: A tool conversation as transformers hands it to a chat template (written by hand): the
#: call's arguments an object since they parse as one, no content as "".
TEMPLATE_READS = (
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}},
        {"id": None, "type": "function", "function": {"name": "note", "arguments": "not json"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "call-1", "name": "add"},
)


def test_a_grpc_conversation_reads_as_the_http_one_and_as_the_template_reads_it():
    http = _chat_messages([ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "What is 12 plus 30?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 30}'}},
            {"type": "function", "function": {"name": "note", "arguments": "not json"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call-1", "name": "add"})])
    request = generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages(messages=[
        generate_pb2.ChatMessage(role="user", content="What is 12 plus 30?"),
        generate_pb2.ChatMessage(role="assistant", tool_calls=[
            generate_pb2.ToolCall(id="call-1", name="add", arguments='{"a": 12, "b": 30}'),
            generate_pb2.ToolCall(name="note", arguments="not json")]),
        generate_pb2.ChatMessage(role="tool", content="42", tool_call_id="call-1", name="add")]))
    grpc_chat = _grpc_chat(request)
    assert http == grpc_chat["messages"] == TEMPLATE_READS
    # The chat options' defaults, as the HTTP route's.
    assert (grpc_chat["add_generation_prompt"], grpc_chat["continue_final_message"],
            grpc_chat["chat_template_kwargs"]) == (True, False, ())
    request.add_generation_prompt = False
    request.continue_final_message = True
    request.chat_template_kwargs = '{"enable_thinking": false, "n": [1]}'
    grpc_chat = _grpc_chat(request)
    assert (grpc_chat["add_generation_prompt"], grpc_chat["continue_final_message"],
            grpc_chat["chat_template_kwargs"]) == (False, True, (("enable_thinking", False), ("n", [1])))


@pytest.mark.parametrize("kwargs, param", [
    ({"chat_template_kwargs": "[1]"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "{"}, "chat_template_kwargs"),
    ({"tool_calls": [generate_pb2.ToolCall(id="c", arguments="{}")]}, "messages.0.tool_calls.0.name"),
])
def test_bad_grpc_chat_fields_are_refused_by_name(kwargs, param):
    calls = kwargs.pop("tool_calls", ())
    request = generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages(messages=[
        generate_pb2.ChatMessage(role="assistant", tool_calls=calls)]), **kwargs)
    with pytest.raises(ApiError) as info:
        _grpc_chat(request)
    assert info.value.status == 400 and info.value.param == param
