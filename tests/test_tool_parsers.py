"""Tool call and reasoning parsers on recorded model outputs: the non-streamed message, and the
streamed deltas (fed character by character and token by token through the default model's
tokenizer and the engine's incremental detokenizer) joining to exactly that message."""

from __future__ import annotations

import json

import pytest

from jaxserve.server.openai.chat_output import ChatOutputParser
from jaxserve.server.openai.reasoning import get_reasoning_parser
from jaxserve.server.openai.tool_choice import (
    NamedToolParser,
    RequiredToolParser,
    tool_choice_schema,
)
from jaxserve.server.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from jaxserve.server.openai.tool_parsers.base import stable_json_prefix
from jaxserve.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

PARIS = {"city": "Paris", "unit": "celsius"}
# arguments with a brace and quotes inside strings, escapes, non-ASCII text and nesting
TRICKY = {"query": 'SELECT "name" FROM t WHERE x = "}" -- {not json}',
          "note": "line1\nline2\t\\ done", "greeting": "こんにちは, Zürich 😀",
          "nested": {"list": [1, 2.5, -3e-2, True, None], "empty": {}}, "n": 12345}

# (parser, recorded output, expected content, expected [(name, arguments dict)])
CASES = [
    # Qwen2.5 / Hermes 2 Pro
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>', None, [("get_weather", PARIS)]),
    ("hermes", "I'll check both for you.\n<tool_call>\n"
               + json.dumps({"name": "run_sql", "arguments": TRICKY}, ensure_ascii=False)
               + "\n</tool_call>\n<tool_call>\n"
               + json.dumps({"name": "get_weather", "arguments": PARIS})
               + "\n</tool_call>", "I'll check both for you.",
     [("run_sql", TRICKY), ("get_weather", PARIS)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None,   # EOS, no end tag
     [("get_time", {})]),
    ("hermes", "The capital of France is Paris. Use <tool_call tags> carefully { }.",
     "The capital of France is Paris. Use <tool_call tags> carefully { }.", []),
    # Llama 3.1 / 3.2 JSON calls, with and without <|python_tag|>
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}', None, [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "run_sql", "parameters": '
                    + json.dumps(TRICKY) + '}; {"name": "get_weather", "parameters": '
                    + json.dumps(PARIS, indent=2) + "}", None,
     [("run_sql", TRICKY), ("get_weather", PARIS)]),
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    # Mistral: the old array format and the v11+ name[ARGS]{...} format
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                '"celsius"}}, {"name": "run_sql", "arguments": '
                + json.dumps(TRICKY, ensure_ascii=False) + "}]", None,
     [("get_weather", PARIS), ("run_sql", TRICKY)]),
    ("mistral", 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                "[TOOL_CALLS]run_sql[ARGS]" + json.dumps(TRICKY), "Let me look.",
     [("get_weather", PARIS), ("run_sql", TRICKY)]),
    ("mistral", "No tools needed: [1, 2] is a list.", "No tools needed: [1, 2] is a list.", []),
    # pythonic (Llama 3.2 / 4, ToolACE)
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), run_sql(query='
                 + repr(TRICKY["query"]) + ", note=" + repr(TRICKY["note"]) + ", greeting="
                 + repr(TRICKY["greeting"]) + ", nested={'list': [1, 2.5, -3e-2, True, None], "
                 "'empty': {}}, n=12345)]", None, [("get_weather", PARIS), ("run_sql", TRICKY)]),
    ("pythonic", "<|python_start|>[get_time()]<|python_end|>", None, [("get_time", {})]),
    ("pythonic", "[1] is a footnote, not a call.", "[1] is a footnote, not a call.", []),
]


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.default_model import default_model_path
    return Tokenizer.from_model(default_model_path())


def reassemble(deltas: list[dict]) -> dict:
    """Join streamed deltas as a client does, checking each delta's shape on the way."""
    content, reasoning, calls = "", "", {}
    for d in deltas:
        assert len(d) == 1, d
        if "content" in d:
            content += d["content"]
        elif "reasoning" in d:
            reasoning += d["reasoning"]
        else:
            (tc,) = d["tool_calls"]
            i = tc["index"]
            if "id" in tc:      # the first delta of a call: id, type, name, empty arguments
                assert i == len(calls) and tc["id"] and tc["type"] == "function"
                assert set(tc["function"]) == {"name", "arguments"}
                assert tc["function"]["arguments"] == ""
                calls[i] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:               # later deltas: argument text only
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                assert tc["function"]["arguments"]
                calls[i]["arguments"] += tc["function"]["arguments"]
    return {"content": content or None, "reasoning": reasoning or None,
            "tool_calls": [calls[i] for i in sorted(calls)]}


def pieces_by_char(text: str) -> list[str]:
    return list(text)


def pieces_by_token(tok: Tokenizer, text: str) -> list[str]:
    """The text as the engine streams it: the default model's tokens through the incremental
    detokenizer (skip_special_tokens=False, as tool parsers ask)."""
    detok = IncrementalDetokenizer(tok, None, skip_special_tokens=False)
    pieces = [detok.add_tokens([t]) for t in tok.encode(text, add_special_tokens=False)]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    return pieces


def stream(make_parser, pieces: list[str]) -> list[dict]:
    parser = make_parser()
    deltas = []
    for k, piece in enumerate(pieces):
        deltas += parser.feed(piece, finished=k == len(pieces) - 1)
    return deltas


def check(make_parser, text: str, tok: Tokenizer) -> dict:
    """The non-streamed message; asserts both streamings join to it."""
    message = make_parser().message(text)
    want = {**message, "tool_calls": [{"name": c["function"]["name"],
                                       "arguments": c["function"]["arguments"]}
                                      for c in message["tool_calls"]]}
    for pieces in (pieces_by_char(text), pieces_by_token(tok, text)):
        got = reassemble(stream(make_parser, pieces))
        got["tool_calls"] = [{"name": c["name"], "arguments": c["arguments"]}
                             for c in got["tool_calls"]]
        assert got == want
    return message


@pytest.mark.parametrize("name,text,content,calls", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_recorded_output_parses_and_streams_to_the_same_message(tokenizer, name, text, content,
                                                                calls):
    parser_cls = get_tool_parser(name)
    message = check(lambda: ChatOutputParser(None, parser_cls()), text, tokenizer)
    assert message["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == calls
    for c in message["tool_calls"]:
        assert c["type"] == "function"
        if name == "mistral":
            assert len(c["id"]) == 9 and c["id"].isalnum()
        else:
            assert c["id"].startswith("chatcmpl-tool-") and len(c["id"]) == 14 + 32
        # arguments are JSON text with non-ASCII kept as is (vLLM's ensure_ascii=False)
        assert c["function"]["arguments"] == json.dumps(json.loads(c["function"]["arguments"]),
                                                        ensure_ascii=False)


def test_argument_deltas_arrive_while_the_call_is_generated():
    text = '<tool_call>\n{"name": "run_sql", "arguments": ' + json.dumps(TRICKY) + "}\n</tool_call>"
    deltas = stream(lambda: ChatOutputParser(None, get_tool_parser("hermes")()), list(text))
    arg_deltas = [d for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert len(arg_deltas) > 20          # streamed piece by piece, not in one go at the end
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "run_sql"


def test_partial_marker_is_held_back_then_released_as_content():
    parser = ChatOutputParser(None, get_tool_parser("hermes")())
    assert parser.feed("Use <tool", False) == [{"content": "Use"}]
    assert parser.feed("box> now", True) == [{"content": " <toolbox> now"}]


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    text = CASES[1][1]
    message = check(lambda: ChatOutputParser(None, get_tool_parser("hermes")(), max_calls=1),
                    text, tokenizer)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["run_sql"]


def test_malformed_call_is_content_not_a_broken_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    message = ChatOutputParser(None, get_tool_parser("hermes")()).message(text)
    assert message == {"content": text, "reasoning": None, "tool_calls": []}


@pytest.mark.parametrize("raw", ['{"a": "x\\', '{"a": "x\\u00', '{"a": "x\\ud83d', '{"ci',
                                 '{"n": 1', '{"n": 1.5e', '{"a": [1, {"b', '{"a": "é}"',
                                 '{"a": tr', '  {"a": {"b": [true, "q'])
def test_stable_prefix_of_partial_json_only_grows(raw):
    full = {'{"a": "x\\': '{"a": "x\\n"}', '{"a": "x\\u00': '{"a": "x\\u00e9"}',
            '{"a": "x\\ud83d': '{"a": "x\\ud83d\\ude00"}', '{"ci': '{"city": "P"}',
            '{"n": 1': '{"n": 1.5e3}', '{"n": 1.5e': '{"n": 1.5e3}',
            '{"a": [1, {"b': '{"a": [1, {"b": 2}]}', '{"a": "é}"': '{"a": "é}", "b": 1}',
            '{"a": tr': '{"a": true}', '  {"a": {"b": [true, "q': '  {"a": {"b": [true, "qq"]}}'}
    final = json.dumps(json.loads(full[raw]), ensure_ascii=False)
    for k in range(len(full[raw]) + 1):
        assert final.startswith(stable_json_prefix(full[raw][:k]))
    assert stable_json_prefix(full[raw]) == final


# -- reasoning ---------------------------------------------------------------------------------
REASONING_CASES = [
    ("qwen3", "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "\nThe user wants 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),                # thinking off
    ("qwen3", "<think>\nStill thinking about 2+2", "\nStill thinking about 2+2", None),  # cut
    ("deepseek_r1", "Let me compute: 2+2=4 </th> not yet.\n</think>\n\n**4**",
     "Let me compute: 2+2=4 </th> not yet.\n", "\n\n**4**"),               # <think> in prompt
    ("deepseek_r1", "<think>Quick: 4.</think>4", "Quick: 4.", "4"),
    ("deepseek_r1", "Hmm, 2+2, carry the", "Hmm, 2+2, carry the", None),   # cut by max_tokens
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING_CASES)
def test_reasoning_split_streamed_and_not(tokenizer, name, text, reasoning, content):
    parser_cls = get_reasoning_parser(name)
    message = check(lambda: ChatOutputParser(parser_cls()), text, tokenizer)
    assert (message["reasoning"], message["content"]) == (reasoning, content)


def test_tool_calls_are_parsed_only_after_the_reasoning(tokenizer):
    text = ("<think>\nMaybe <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call> is "
            "wrong; use get_weather.\n</think>\n\n<tool_call>\n"
            + json.dumps({"name": "get_weather", "arguments": PARIS}) + "\n</tool_call>")
    message = check(lambda: ChatOutputParser(get_reasoning_parser("qwen3")(),
                                             get_tool_parser("hermes")()), text, tokenizer)
    assert "nope" in message["reasoning"] and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


# -- tool_choice "required" and named ----------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"},
                                             "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"], "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}},
         {"type": "function", "function": {"name": "get_time"}}]


def test_required_schema_is_an_array_of_named_calls():
    schema = tool_choice_schema("required", TOOLS)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["required"] == ["name", "parameters"]
    assert first["additionalProperties"] is False
    assert "$defs" not in first["properties"]["parameters"]        # hoisted to the top
    assert schema["$defs"] == {"unit": {"enum": ["celsius", "fahrenheit"]}}
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert tool_choice_schema("required", TOOLS, parallel_tool_calls=False)["maxItems"] == 1
    assert TOOLS[0]["function"]["parameters"]["$defs"]       # the request is left unchanged
    assert tool_choice_schema("auto", TOOLS) is None and tool_choice_schema("none", TOOLS) is None


def test_forced_tool_choice_constrains_the_request_to_compact_json():
    from jaxserve.server.openai.protocol import ChatCompletionRequest
    base = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        params = ChatCompletionRequest.model_validate(
            {**base, "tool_choice": choice}).to_sampling_params(16)
        so = params.structured_outputs
        assert so.json == tool_choice_schema(choice, TOOLS) and so.disable_any_whitespace
    for choice in ("auto", "none"):
        params = ChatCompletionRequest.model_validate(
            {**base, "tool_choice": choice}).to_sampling_params(16)
        assert params.structured_outputs is None


def test_named_schema_is_the_function_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_schema(named, TOOLS) == TOOLS[0]["function"]["parameters"]
    assert tool_choice_schema({"type": "function", "function": {"name": "get_time"}},
                              TOOLS) == {"type": "object", "properties": {}}


def test_required_and_named_outputs_become_tool_calls(tokenizer):
    text = json.dumps([{"name": "get_weather", "parameters": PARIS},
                       {"name": "run_sql", "parameters": TRICKY}], ensure_ascii=False)
    message = check(lambda: ChatOutputParser(None, RequiredToolParser()), text, tokenizer)
    assert message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", PARIS), ("run_sql", TRICKY)]
    text = json.dumps(TRICKY, ensure_ascii=False, indent=1)
    message = check(lambda: ChatOutputParser(None, NamedToolParser("run_sql")), text, tokenizer)
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "run_sql", "arguments": text}   # as generated


def test_registry_has_vllm_names():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        get_reasoning_parser("nope")


# -- chat templates and flags ------------------------------------------------------------------
def test_chat_template_sees_tool_call_arguments_as_a_dict_and_the_tools(tokenizer):
    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}"
                "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %}"
                " {{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "a", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
                    {"id": "b", "type": "function", "function": {"name": "get_time",
                                                                 "arguments": ""}}]},
                {"role": "tool", "tool_call_id": "a", "content": "21 C"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                         chat_template=template, tools=TOOLS)
    assert text == ('[tool get_weather][tool get_time]<user>Weather?<assistant>get_weather '
                    'city=Zürich {"city": "Zürich"}get_time {}<tool>21 C')
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'
    bad = [{**messages[1], "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\.0\.tool_calls\.0\.function\.arguments"):
        tokenizer.apply_chat_template(bad, chat_template=template)


def test_tool_flags_are_checked_before_the_model_loads(capsys):
    from jaxserve.server.cli.main import build_parser, main
    with pytest.raises(SystemExit):
        main(["serve", "--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--tool-call-parser", "nope"])
    assert "invalid choice" in capsys.readouterr().err
    ns = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser",
                                    "llama3_json", "--reasoning-parser", "deepseek_r1",
                                    "--chat-template", "{{ messages }}"])
    assert (ns.enable_auto_tool_choice, ns.tool_call_parser, ns.reasoning_parser,
            ns.chat_template) == (True, "llama3_json", "deepseek_r1", "{{ messages }}")


def test_constrained_output_is_split_as_reasoning_too():
    """The engine applies a grammar (named or required tool_choice, response_format) after the
    reasoning, so a constrained output is split like any other: the call is the text after
    </think>."""
    from jaxserve.server.openai.protocol import ChatCompletionRequest
    r1 = get_reasoning_parser("deepseek_r1")
    base = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    named = ChatCompletionRequest.model_validate(
        {**base, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    message = ChatOutputParser.for_request(named, get_tool_parser("hermes"), r1).message(
        "Time, then.</think>{}")
    assert message["reasoning"] == "Time, then."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert message["tool_calls"][0]["function"]["arguments"] == "{}"
    auto = ChatCompletionRequest.model_validate(base)
    parser = ChatOutputParser.for_request(auto, get_tool_parser("hermes"), r1)
    assert parser.message("thinking</think>hi")["reasoning"] == "thinking"
    assert ChatOutputParser.for_request(
        ChatCompletionRequest.model_validate({**base, "tool_choice": "none"}), None, None) is None
