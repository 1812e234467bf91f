"""`/v1/responses` (OpenAI's Responses API) through the official openai client against a real
`jaxserve serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`
(conftest's tools_server) with the default model: text, the streamed events, conversations
chained with previous_response_id, stored responses, function tools, json_schema output,
reasoning items, and the errors; then the input translation and the store on their own."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel

from jaxserve.server.openai.protocol import OpenAIError
from jaxserve.server.openai.responses import ResponseStore
from jaxserve.server.openai.responses_protocol import input_messages

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"     # the default model answers it and stops
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
# Few-shot turns make the model open a <think> block, reason and close it by itself (as in
# test_structured_output_reasoning.py), written as Responses input items.
SHOTS = [("Is the sky blue?", '<think>The sky is blue.</think>{"answer": "yes"}'),
         ("Is grass red?", '<think>Grass is green, not red.</think>{"answer": "no"}'),
         ("Is fire hot?", '<think>Fire is hot.</think>{"answer": "yes"}')]
REASONING_INPUT = [item for q, a in SHOTS for item in (
    {"role": "user", "content": [{"type": "input_text", "text": q}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": a}]})
] + [{"role": "user", "content": "Is snow white?"}]


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="none", max_retries=0)


def _create(client, **kw) -> Response:
    return client.responses.create(**{"model": MODEL, "temperature": 0,
                                      "max_output_tokens": 60, **kw})


def _stream(client, **kw):
    """The events of client.responses.stream and its final response."""
    with client.responses.stream(**{"model": MODEL, "temperature": 0,
                                    "max_output_tokens": 60, **kw}) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def _prompt_tokens(server, messages) -> int:
    r = requests.post(server.base_url + "/tokenize", json={"messages": messages}, timeout=30)
    r.raise_for_status()
    return r.json()["count"]


# -- text ---------------------------------------------------------------------------------------
def test_text_response_is_the_chat_answer_with_responses_usage(client, tools_server):
    r = _create(client, input=QUESTION, metadata={"case": "text"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.metadata == {"case": "text"} and r.model == MODEL
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=60,
                                          messages=[{"role": "user", "content": QUESTION}])
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens == _prompt_tokens(
        tools_server, [{"role": "user", "content": QUESTION}])
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_ends_the_response_incomplete(client):
    r = _create(client, input="Write a long story about a dragon.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"
    events = list(_create(client, input="Write a long story about a dragon.",
                          max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == r.output_text
    assert events[-1].response.output[0].status == "incomplete"


def _raw_events(server, body: dict) -> list[dict]:
    with requests.post(server.base_url + "/v1/responses", stream=True, timeout=120,
                       json={"temperature": 0, "max_output_tokens": 60, "stream": True,
                             **body}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]       # each event names its type twice
    return events


def test_bodies_and_events_validate_against_the_openai_types(tools_server):
    """Strict validation with the openai package's own models (the client itself builds them
    leniently), for text, function call and reasoning outputs, streamed and not."""
    from pydantic import TypeAdapter
    events_type = TypeAdapter(ResponseStreamEvent)
    for body in ({"input": QUESTION, "metadata": {"k": "v"}},
                 {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required"},
                 {"input": REASONING_INPUT, "reasoning": {"effort": "low"}}):
        r = requests.post(tools_server.base_url + "/v1/responses", timeout=120,
                          json={"temperature": 0, "max_output_tokens": 60, **body})
        Response.model_validate(r.json())
        for event in _raw_events(tools_server, body):
            events_type.validate_python(event)


# -- streaming ----------------------------------------------------------------------------------
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.completed"]


def _squeezed(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event written once."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]
            or not t.endswith(".delta")]


def test_stream_events_in_order_join_to_the_unstreamed_response(client):
    plain = _create(client, input=QUESTION)
    events, final = _stream(client, input=QUESTION)
    assert _squeezed([e.type for e in events]) == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert "".join(e.delta for e in deltas) == final.output_text == plain.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas)
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.status == "completed" and events[-1].response.id == events[0].response.id
    # stream=True on create: the same events, one by one (as many deltas as the engine's steps
    # gave the stream: a consumer behind the engine core gets several tokens merged in one)
    raw = list(_create(client, input=QUESTION, stream=True))
    assert _squeezed([e.type for e in raw]) == _squeezed([e.type for e in events])
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == plain.output_text
    assert raw[-1].response.output_text == plain.output_text


# -- previous_response_id and the store ---------------------------------------------------------
def test_previous_response_id_continues_the_conversation(client, tools_server):
    first = _create(client, input=QUESTION, instructions="Answer in one sentence.")
    second = _create(client, input="And of Germany?", previous_response_id=first.id,
                     instructions="Be brief.")
    assert second.previous_response_id == first.id and second.status == "completed"
    # the second prompt is its instructions, the first turn and its answer, then the new input
    # (OpenAI does not carry the first response's instructions over)
    seen = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Germany?"}]
    assert second.usage.input_tokens == _prompt_tokens(tools_server, seen)
    streamed = list(_create(client, input="And of Germany?", previous_response_id=first.id,
                            instructions="Be brief.", stream=True))
    assert streamed[-1].response.usage.input_tokens == second.usage.input_tokens
    assert streamed[-1].response.output_text == second.output_text
    third = _create(client, input="And of Italy?", previous_response_id=second.id)
    assert third.usage.input_tokens == _prompt_tokens(tools_server, seen[1:] + [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And of Italy?"}])


def test_stored_responses_are_retrieved_deleted_and_unknown_ids_are_404(client):
    r = _create(client, input=QUESTION)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    _, streamed = _stream(client, input=QUESTION)
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id" and r.id in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        _create(client, input="Hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = _create(client, input=QUESTION, store=False)
    assert unstored.status == "completed"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


# -- tools ----------------------------------------------------------------------------------------
def test_named_function_tool_gives_a_function_call_item(client):
    r = _create(client, input="What's the weather in Paris?", tools=[WEATHER],
                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert call.status == "completed" and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the tool's result goes back as an input item of the next turn
    follow = _create(client, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": call.call_id,
                             "output": '{"temperature_c": 21, "sky": "clear"}'}])
    assert follow.status in ("completed", "incomplete")
    assert follow.output[0].type == "message"
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens


def test_required_tool_streams_function_call_argument_events(client):
    events, final = _stream(client, input="What's the weather in Paris?", tools=[WEATHER],
                            tool_choice="required")
    assert _squeezed([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    (call,) = final.output
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments and done.name == call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


# -- structured output ----------------------------------------------------------------------------
class Person(BaseModel):
    name: str
    age: int


def test_json_schema_text_format_constrains_the_output(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = _create(client, input="Invent a person.", text={"format": fmt})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    parsed = client.responses.parse(model=MODEL, input="Invent a person.", temperature=0,
                                    max_output_tokens=60, text_format=Person)
    assert isinstance(parsed.output_parsed, Person)
    _, streamed = _stream(client, input="Invent a person.", text={"format": fmt})
    assert streamed.output_text == r.output_text


# -- reasoning ------------------------------------------------------------------------------------
def test_reasoning_parser_output_is_a_reasoning_item(client):
    r = _create(client, input=REASONING_INPUT, reasoning={"effort": "low"})
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message"
    text = reasoning.content[0].text
    assert "snow" in text.lower() and "<think>" not in text and "</think>" not in r.output_text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert r.reasoning.effort == "low"
    events, final = _stream(client, input=REASONING_INPUT, reasoning={"effort": "low"})
    types = _squeezed([e.type for e in events])
    assert types[2:7] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.done",
                          "response.content_part.done"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
    assert final.output[0].content[0].text == text and final.output_text == r.output_text


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input.0.type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input.0.content.0"),
    (dict(input=[{"role": "tool", "content": "x"}]), "input.0.role"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools.0.type"),
    (dict(input="x", tools=[{"type": "function", "parameters": {}}]), "tools.0.name"),
    (dict(input="x", tools=[WEATHER], tool_choice={"type": "web_search_preview"}), "tool_choice"),
    (dict(input="x", text={"format": {"type": "xml"}}), "text.format.type"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "p", "schema": 3}}),
     "text.format.schema"),
    (dict(input="x", max_output_tokens=0), "max_output_tokens"),
    (dict(input="x", max_output_tokens=100_000), "max_output_tokens"),
    (dict(input="x", metadata={str(i): "v" for i in range(17)}), "metadata"),
    (dict(input="x", background=True), "background"),
    (dict(input=""), "input"),
])
def test_bad_requests_are_400s_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **kw)
    assert set(e.value.body) == {"message", "type", "param", "code"}
    assert e.value.body["param"] == param and e.value.body["code"] == 400


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-4o", input="x")
    assert e.value.body["param"] == "model"


# -- the input translation and the store ----------------------------------------------------------
def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Use tools."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather in"},
                                          {"type": "input_text", "text": "Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather",
              "arguments": "not json"},
             {"type": "function_call_output", "call_id": "c1", "output": "21 C"}]
    assert input_messages(items) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in\nParis?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    with pytest.raises(OpenAIError) as e:
        input_messages([{"type": "function_call", "name": "f", "arguments": "{}"}])
    assert e.value.param == "input.0.call_id"


def test_store_evicts_the_least_recently_used():
    store = ResponseStore(max_size=2)
    for rid in ("a", "b"):
        store.put({"id": rid}, [])
    store.get("a")                     # a is now the most recent
    store.put({"id": "c"}, [])
    assert store.get("a")[0] == {"id": "a"} and store.get("c")[0] == {"id": "c"}
    with pytest.raises(OpenAIError) as e:
        store.get("b", "previous_response_id")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    assert len(store) == 2


# -- a client that goes away ----------------------------------------------------------------------
@pytest.mark.parametrize("events_read", [0, 4])
def test_closing_the_event_stream_aborts_the_engine_request(events_read):
    """Closing a streamed response (the client went away) aborts its engine request, also
    before the first event was read (an unstarted generator skips its `finally`)."""
    import asyncio

    from test_server_async import FakeEngine, FakeTokenizer

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.server.openai.protocol import validate_request
    from jaxserve.server.openai.responses import ResponsesServing
    from jaxserve.server.openai.responses_protocol import ResponsesRequest
    from jaxserve.server.openai.serving import OpenAIServing

    class ChatTokenizer(FakeTokenizer):
        chat_template = None

        def apply_chat_template(self, messages, tokenize=False, **kw):
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    async def main():
        engine = FakeEngine(tokens=1000)
        engine.tokenizer = ChatTokenizer()
        llm = AsyncLLM(engine=engine)
        await llm.start()
        serving = ResponsesServing(OpenAIServing(llm, ["fake"]))
        request = validate_request(ResponsesRequest, {"input": "Hi", "stream": True,
                                                      "max_output_tokens": 500})
        stream = await serving.create_response(request, "r1")
        lines = stream.__aiter__()
        for _ in range(events_read):
            assert (await lines.__anext__()).startswith("event: response.")
        await stream.aclose()
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["r1"] and not engine.requests
        assert len(serving.store) == 0            # an unfinished response is not stored
        await llm.shutdown()
    asyncio.run(main())
