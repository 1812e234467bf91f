"""Tool calling and reasoning on the server.

1. The serving layer's chat stream on recorded model outputs (the default model's tokens through
   the real incremental detokenizer, fed to `OpenAIServing`'s streaming and non-streaming chat
   code): the openai client's own stream accumulator joins the chunks to the non-streamed
   response.
2. `jaxserve serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`
   with the default model and the official openai client: tool_choice "auto" answers have a
   valid shape whether or not the small model calls a tool, tool results go through the chat
   template, and bad tool requests are 400s with vLLM's messages.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from jaxserve.engine.async_llm import AsyncLLM, RequestStream
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import RequestOutputKind
from jaxserve.server.openai.protocol import ChatCompletionRequest, validate_request
from jaxserve.server.openai.serving import OpenAIServing
from jaxserve.tokenizer.tokenizer import IncrementalDetokenizer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SQL = {"type": "function", "function": {
    "name": "run_sql", "description": "Run a query",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SQL]
ARGS_SQL = {"query": 'SELECT "name" FROM t WHERE x = "}" AND y = \'{\'', "note": "über\n😀"}

RECORDED = [
    # Qwen3: thinking, a sentence, two calls
    ("<think>\nThe user wants the weather and a query. I'll call both.\n</think>\n\n"
     "Let me check.\n<tool_call>\n"
     + json.dumps({"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
                  ensure_ascii=False)
     + "\n</tool_call>\n<tool_call>\n"
     + json.dumps({"name": "run_sql", "arguments": ARGS_SQL}, ensure_ascii=False)
     + "\n</tool_call>", "tool_calls"),
    ("Paris is sunny today; no tool needed.", "stop"),
]


# -- 1. the serving layer on recorded outputs ----------------------------------------------------
@pytest.fixture(scope="module")
def serving(llm):
    return OpenAIServing(AsyncLLM(engine=llm.llm_engine), [MODEL], enable_auto_tools=True,
                         tool_parser="hermes", reasoning_parser="qwen3")


def _outputs(tokenizer, text: str, finish: str = "stop") -> list[RequestOutput]:
    """The engine's DELTA outputs for `text`, one token each, the last with `finish`."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, None, skip_special_tokens=False)
    outs = []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        delta = detok.add_tokens([t]) + (detok.flush() if last else "")
        outs.append(RequestOutput("r", None, [1, 2], None, [CompletionOutput(
            0, delta, [t], None, None, finish if last else None)], last))
    assert "".join(o.outputs[0].text for o in outs) == text
    return outs


async def _stream_chunks(serving, request, outputs) -> list[dict]:
    stream = RequestStream(serving.engine, "r", RequestOutputKind.DELTA)
    lines: list[str] = []

    async def produce():
        for out in outputs:
            stream.put(out)
            while stream.has_pending:    # one engine output per chunk, as a fast client sees
                await asyncio.sleep(0)

    async def consume():
        async for line in serving._chat_stream(request, MODEL, "chatcmpl-r", 0, [stream]):
            lines.append(line)

    await asyncio.gather(produce(), consume())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("text,finish", RECORDED, ids=["calls", "plain"])
def test_serving_streams_recorded_tool_calls_that_join_to_the_response(llm, serving, text,
                                                                      finish):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Zürich?"}],
            "tools": TOOLS}
    outputs = _outputs(llm.get_tokenizer(), text)
    final = RequestOutput("r", None, [1, 2], None, [CompletionOutput(
        0, text, [t for o in outputs for t in o.outputs[0].token_ids], None, None, "stop")],
        True)
    response = serving._chat_response(validate_request(ChatCompletionRequest, body), MODEL,
                                      "chatcmpl-r", 0, final)
    ChatCompletion.model_validate(response)
    message = response["choices"][0]["message"]
    assert response["choices"][0]["finish_reason"] == finish

    chunks = asyncio.run(_stream_chunks(
        serving, validate_request(ChatCompletionRequest, {**body, "stream": True}), outputs))
    state = ChatCompletionStreamState()
    reasoning, announced = "", set()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
            for tc in delta.get("tool_calls") or []:
                if tc["index"] not in announced:   # first delta: id, type, name, "" arguments
                    announced.add(tc["index"])
                    assert tc["id"].startswith("chatcmpl-tool-") and tc["type"] == "function"
                    assert tc["function"]["name"] and tc["function"]["arguments"] == ""
                else:                              # then argument text only
                    assert set(tc) == {"index", "function"}
                    assert set(tc["function"]) == {"arguments"}
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == finish
    assert (streamed.message.content or None) == message["content"]
    assert (reasoning or None) == message["reasoning"]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] \
        == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    if finish == "tool_calls":
        assert message["reasoning"].startswith("\nThe user wants")
        assert message["content"] == "\n\nLet me check."   # as vLLM: the text after </think>
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in message["tool_calls"]]
        assert calls == [("get_weather", {"city": "Zürich", "unit": "celsius"}),
                         ("run_sql", ARGS_SQL)]
    else:
        assert message["content"] == text and message["tool_calls"] == []


# -- 2. the real server and the openai client --------------------------------------------------
@pytest.fixture(scope="module")
def client(tools_server):      # conftest.py: --enable-auto-tool-choice --tool-call-parser hermes
    return openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="none", max_retries=0)


def _check_tool_calls(calls, names):
    for call in calls or []:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        assert call.function.name in names
        assert isinstance(json.loads(call.function.arguments), dict)


def test_auto_tool_choice_answers_have_a_valid_shape_streamed_and_not(client):
    msgs = [{"role": "system", "content": "You can call get_weather to know the weather."},
            {"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                         max_tokens=24, temperature=0)
    choice = out.choices[0]
    _check_tool_calls(choice.message.tool_calls, {"get_weather", "run_sql"})
    assert choice.finish_reason == ("tool_calls" if choice.message.tool_calls
                                    else choice.finish_reason)
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.tool_calls or choice.message.content
    assert choice.message.model_extra.get("reasoning") is None   # qwen3: no <think>, no reasoning

    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                            max_tokens=24, temperature=0, stream=True)
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]   # (final raises on "length")
    assert streamed.finish_reason == choice.finish_reason
    assert (streamed.message.content or None) == choice.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] \
        == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def test_tool_results_and_assistant_tool_calls_go_through_the_template(client):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "chatcmpl-tool-1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"temp_c": 21}'}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                         tool_choice="none", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].message.tool_calls in (None, [])


BAD = [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
     "does not match any of the specified `tools`"),
    (dict(tool_choice="sometimes"), "Invalid value for `tool_choice`"),
    (dict(tool_choice={"type": "function", "function": {}}), "Expected field `name`"),
    (dict(tools=[]), "must not be an empty array"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
     "tools.0.function.name"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages.0.tool_calls.0.function.arguments is not valid JSON"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_tool_requests_are_400_with_vllm_messages(client, extra, needle):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert needle in e.value.body["message"]
    assert e.value.status_code == 400


def test_llm_chat_passes_tools_and_tool_messages_to_the_template(llm):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "t1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "21 degrees and sunny"}]
    from jaxserve import SamplingParams
    (out,) = llm.chat(msgs, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False,
                      tools=TOOLS)
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert "21 degrees and sunny" in prompt and len(out.outputs[0].token_ids) <= 2
