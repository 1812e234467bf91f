"""A chat completion that max_tokens cuts (finish_reason "length") inside a tool call: streamed
and not, the message is the same, with finish_reason "length" (never "tool_calls"). It keeps what
was produced, as OpenAI answers a cut call: the content before the calls and each call whose name
was written, its arguments as far as they go (unfinished JSON); with no call name yet, all the
text is content.

1. Recorded cut outputs through the serving layer (`OpenAIServing`'s streaming and non-streaming
   chat code, no model step): tool_choice "auto" with each parser, "required", a named function.
2. The default model, tool_choice "required" and a named function, cut by max_tokens.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_server_faults import _Borrowed
from test_server_tools import MODEL, TOOLS, _outputs, _stream_chunks

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.openai.protocol import ChatCompletionRequest, validate_request
from jaxserve.server.openai.serving import OpenAIServing
from jaxserve.server.openai.sse import SSE_DONE

NAMED = {"type": "function", "function": {"name": "get_weather"}}
PARIS = '{"city": "Paris"}'

# (id, tool_choice, --tool-call-parser, the output up to the cut, content, [(name, arguments)])
CUT = [
    ("hermes", "auto", "hermes",
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     "Let me check.", [("get_weather", '{"city": "Pa')]),
    ("hermes-second-call", "auto", "hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "run_sql", "arguments": {"query": "SELECT',
     None, [("get_weather", PARIS), ("run_sql", '{"query": "SELECT')]),
    ("hermes-unclosed", "auto", "hermes",       # the call is whole, its closing tag cut off
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     None, [("get_weather", PARIS)]),
    ("hermes-no-name-yet", "auto", "hermes",
     'Let me check.\n<tool_call>\n{"na', 'Let me check.\n<tool_call>\n{"na', []),
    ("llama3_json", "auto", "llama3_json",
     '{"name": "get_weather", "parameters": {"city": "Pa', None, [("get_weather", '{"city": "Pa')]),
    ("mistral", "auto", "mistral",
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', None, [("get_weather", '{"city": "Pa')]),
    ("mistral-array", "auto", "mistral",
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa',
     None, [("get_weather", '{"city": "Pa')]),
    ("pythonic", "auto", "pythonic",
     '[get_weather(city="Paris"), run_sql(query="SEL', None,
     [("get_weather", PARIS), ("run_sql", "")]),
    ("required", "required", None,
     '[{"name":"get_weather","parameters":{"city":"Pa', None, [("get_weather", '{"city": "Pa')]),
    ("required-no-arguments-yet", "required", None,
     '[{"name":"get_weather","parameters":', None, [("get_weather", "")]),
    ("named", NAMED, None, '{"city":"Pa', None, [("get_weather", '{"city":"Pa')]),   # verbatim
]


def _joined(chunks: list[dict]) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, calls, finish_reason) as the openai client assembles the stream; checks that a
    call's first delta announces it and the later ones carry argument text only."""
    state, announced = ChatCompletionStreamState(), set()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
        for choice in chunk["choices"]:
            for tc in choice["delta"].get("tool_calls") or []:
                if tc["index"] not in announced:
                    announced.add(tc["index"])
                    assert tc["id"] and tc["function"]["arguments"] == ""
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
    choice = state.current_completion_snapshot.choices[0]   # (final raises on "length")
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content or None, calls, choice.finish_reason


def _unstreamed(response: dict) -> tuple[str | None, list[tuple[str, str]], str]:
    ChatCompletion.model_validate(response)
    choice = response["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in choice["message"]["tool_calls"]]
    return choice["message"]["content"], calls, choice["finish_reason"]


# -- 1. recorded cut outputs ---------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice,parser,text,content,calls", [c[1:] for c in CUT],
                         ids=[c[0] for c in CUT])
def test_call_cut_by_max_tokens_streams_to_the_same_message(llm, tool_choice, parser, text,
                                                            content, calls):
    serving = OpenAIServing(AsyncLLM(engine=llm.llm_engine), [MODEL], enable_auto_tools=True,
                            tool_parser=parser or "hermes")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 10}
    outputs = _outputs(llm.get_tokenizer(), text, "length")
    final = RequestOutput("r", None, [1, 2], None, [CompletionOutput(
        0, text, [t for o in outputs for t in o.outputs[0].token_ids], None, None, "length")],
        True)
    response = serving._chat_response(validate_request(ChatCompletionRequest, body), MODEL,
                                      "chatcmpl-r", 0, final)
    chunks = asyncio.run(_stream_chunks(
        serving, validate_request(ChatCompletionRequest, {**body, "stream": True}), outputs))
    assert _unstreamed(response) == (content, calls, "length")
    assert _joined(chunks) == (content, calls, "length")


# -- 2. the default model ------------------------------------------------------------------------
def test_default_model_cut_by_max_tokens_streams_its_response(llm):
    async def main():
        engine = AsyncLLM(engine=_Borrowed(llm.llm_engine))
        await engine.start()
        try:
            serving, answers = OpenAIServing(engine, [MODEL]), []
            for tool_choice, max_tokens in (("required", 10), (NAMED, 4)):   # cut mid-call
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in "
                                                      "Paris?"}], "tools": TOOLS,
                        "tool_choice": tool_choice, "max_tokens": max_tokens, "temperature": 0}
                response = await serving.create_chat_completion(
                    validate_request(ChatCompletionRequest, body))
                stream = await serving.create_chat_completion(
                    validate_request(ChatCompletionRequest, {**body, "stream": True}))
                lines = [line async for line in stream]
                assert lines[-1] == SSE_DONE
                answers.append((response, [json.loads(line[len("data: "):])
                                           for line in lines[:-1]]))
            return answers
        finally:
            await engine.shutdown()

    for response, chunks in asyncio.run(main()):
        content, calls, finish = _unstreamed(response)
        assert finish == "length" and content is None
        assert [name for name, _ in calls] == ["get_weather"]
        with pytest.raises(ValueError):      # the cut arguments are unfinished JSON
            json.loads(calls[0][1])
        assert _joined(chunks) == (content, calls, finish)
