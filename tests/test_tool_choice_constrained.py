"""tool_choice "required" and a named function end to end: `jaxserve serve` with the default
model and the official openai client. The output is constrained by structured output to the
call schema (tool_choice.py), so every answer is a valid call whose arguments validate against
the tool's JSON schema, streamed and not, and the streamed deltas join to the non-streamed
response."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_fixtures import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                  "unit": {"enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object",
                   "properties": {"tz": {"type": "string", "maxLength": 12}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().start()
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _valid_calls(calls, names=SCHEMAS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **kwargs):
    state = ChatCompletionStreamState()
    first_seen = set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                if tc.index not in first_seen:
                    first_seen.add(tc.index)
                    assert tc.id and tc.type == "function" and tc.function.name
                    assert tc.function.arguments == ""
                else:
                    assert tc.id is None and tc.function.name is None
    return state.current_completion_snapshot.choices[0]


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_required_always_gives_valid_calls(client, seed):
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=160,
              temperature=0 if seed is None else 1.0, seed=seed)
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    _valid_calls(choice.message.tool_calls)
    streamed = _streamed(client, **kw)
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_without_parallel_calls_gives_one_call(client):
    out = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=160, temperature=0)
    assert len(out.choices[0].message.tool_calls) == 1
    _valid_calls(out.choices[0].message.tool_calls)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_always_gives_that_call(client, name):
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=160, temperature=0,
              tool_choice={"type": "function", "function": {"name": name}})
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"       # OpenAI's answer to a forced function
    assert [c.function.name for c in choice.message.tool_calls] == [name]
    _valid_calls(choice.message.tool_calls, {name})
    streamed = _streamed(client, **kw)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(name, choice.message.tool_calls[0].function.arguments)]
