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
def client(tools_server):      # conftest.py: --enable-auto-tool-choice --tool-call-parser hermes
    return openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="none", max_retries=0)


def _valid_calls(calls, names=SCHEMAS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **kwargs):
    """The streamed choices as the openai client assembles them; checks each call's deltas."""
    state = ChatCompletionStreamState()
    first_seen = set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                if (choice.index, tc.index) not in first_seen:
                    first_seen.add((choice.index, tc.index))
                    assert tc.id and tc.type == "function" and tc.function.name
                    assert tc.function.arguments == ""
                else:
                    assert tc.id is None and tc.function.name is None
    return state.current_completion_snapshot.choices


def _calls(choice):
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7, n=4),
                                      dict(temperature=1.0, seed=1, n=2,
                                           parallel_tool_calls=False)],
                         ids=["greedy", "seeded-n4", "seeded-n2-one-call"])
def test_required_always_gives_valid_calls_streamed_and_not(client, sampling):
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=128,
              **sampling)
    out = client.chat.completions.create(**kw)
    streamed = _streamed(client, **kw)
    assert len(out.choices) == len(streamed) == sampling.get("n", 1)
    for choice, s in zip(out.choices, streamed):
        assert choice.finish_reason == s.finish_reason == "tool_calls"
        assert choice.message.content is None
        _valid_calls(choice.message.tool_calls)
        assert _calls(s) == _calls(choice)
        if sampling.get("parallel_tool_calls") is False:
            assert len(choice.message.tool_calls) == 1


def test_named_function_always_gives_that_call(client):
    for name in ("get_weather", "get_time"):
        kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=128, temperature=0,
                  tool_choice={"type": "function", "function": {"name": name}})
        out = client.chat.completions.create(**kw)
        choice = out.choices[0]
        assert choice.finish_reason == "stop"       # OpenAI's answer to a forced function
        assert [c.function.name for c in choice.message.tool_calls] == [name]
        _valid_calls(choice.message.tool_calls, {name})
        if name == "get_weather":
            (streamed,) = _streamed(client, **kw)
            assert _calls(streamed) == _calls(choice)
