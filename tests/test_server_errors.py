"""Bad requests to the real `jaxserve serve` (default model, CPU): each an OpenAI error JSON with
the right status naming the field (never a 500, a stall or a silent 200), and the server keeps
serving."""

from __future__ import annotations

try:                     # the openai client's HTTP library (httpx2 in openai >= 3)
    import httpx2 as httpx
except ImportError:
    import httpx
import openai
import pytest
from server_fixtures import MODEL, assert_still_serves, post

# -- errors -----------------------------------------------------------------------------------
LONG = "hello " * 400

ERROR_CASES = [
    ("context_length", "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 300},
     None, 400, "maximum context length is 512 tokens. However, you requested"),
    ("empty_prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, None, 400,
     "cannot be empty"),
    ("out_of_vocab", "/v1/completions", {"model": MODEL, "prompt": [99999999]}, None, 400,
     "out of vocabulary"),
    ("bad_temperature", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1},
     None, 400, "temperature"),
    ("bad_top_p", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 2}, None, 400,
     "top_p"),
    ("greedy_n2", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "temperature": 0},
     None, 400, "n must be 1"),
    ("logprobs_over_20", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21},
     None, 400, "logprobs"),
    ("top_logprobs_over_20", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": 21}, None, 400, "top_logprobs"),
    ("stream_options_without_stream", "/v1/completions",
     {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, None, 400,
     "stream=True"),
    ("json_schema_invalid", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {
          "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}},
     None, 400, "Invalid type: strnig"),
    ("guided_json_unsupported_keyword", "/v1/completions",
     {"model": MODEL, "prompt": "x", "guided_json": {"type": "object", "if": {}}}, None, 400,
     "Unimplemented keys"),
    ("guided_regex_invalid", "/v1/completions",
     {"model": MODEL, "prompt": "x", "guided_regex": "a(b"}, None, 400, "unclosed group"),
    ("response_format_unknown_type", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "xml"}}, None, 400, "response_format type 'xml'"),
    ("two_structured_forms", "/v1/completions",
     {"model": MODEL, "prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}},
     None, 400, "not several"),
    ("tool_choice_auto", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, None, 400,
     "--enable-auto-tool-choice"),
    ("tool_choice_without_tools", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     None, 400, "`tools` must be set"),
    ("invalid_json", "/v1/completions", None, b"{not json", 400, "Invalid JSON"),
    ("wrong_content_type", "/v1/completions", None, b"prompt=x", 400, "Content-Type"),
    ("pydantic_type", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"},
     None, 400, "max_tokens"),
    ("missing_prompt", "/v1/completions", {"model": MODEL}, None, 400, "prompt"),
    ("unknown_model", "/v1/completions", {"model": "gpt-17", "prompt": "x"}, None, 404,
     "does not exist"),
    ("unknown_route", "/v1/nothing", {"model": MODEL}, None, 404, ""),
    # hostile input (issue 11): each a 400 naming the field, never a 500, a stall or a silent 200
    ("lone_surrogate", "/v1/completions", None,
     b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(), 400, "surrogate"),
    ("lone_surrogate_tokenize", "/tokenize", None,
     b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(), 400, "surrogate"),
    ("deep_json", "/v1/completions", None,
     b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested"),
    ("deep_chat_messages", "/v1/chat/completions", None,
     b'{"messages": [{"role": "user", "content": ' + b'{"a": ' * 100 + b"1" + b"}" * 100
     + b"}]}", 400, "nested"),
    ("huge_n", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 1000000,
                                   "temperature": 1.0}, None, 400, "n must be at most"),
    ("seed_over_64_bits", "/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**70},
     None, 400, "seed"),
    ("logit_bias_out_of_vocab", "/v1/completions",
     {"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 5}}, None, 400, "logit_bias"),
    ("nan_temperature", "/v1/completions", None,
     b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(), 400, "temperature"),
    ("infinite_repetition_penalty", "/v1/completions", None,
     b'{"model": "%s", "prompt": "x", "repetition_penalty": Infinity}' % MODEL.encode(), 400,
     "repetition_penalty"),
    ("nan_logit_bias", "/v1/completions", None,
     b'{"model": "%s", "prompt": "x", "logit_bias": {"5": NaN}}' % MODEL.encode(), 400,
     "logit_bias"),
    ("image_part_for_a_text_model", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [
         {"type": "text", "text": "What is in this picture?"},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     None, 400, "content part type 'image_url' is not supported"),
    ("body_over_limit", "/v1/completions", None,
     b'{"prompt": "' + b"x" * (9 << 20) + b'"}', 413, ""),
]


@pytest.mark.parametrize("name,path,body,raw,status,needle", ERROR_CASES,
                         ids=[c[0] for c in ERROR_CASES])
def test_errors_have_openai_shape_and_server_keeps_serving(server, name, path, body, raw,
                                                           status, needle):
    headers = {"Content-Type": "text/plain" if name == "wrong_content_type"
               else "application/json"}
    r = post(server, path, body, raw=raw, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and needle in err["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_openai_client_raises_bad_request_then_serves(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=300)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert_still_serves(client)
