"""Property tests (hypothesis) for the inputs users control: SamplingParams fields, chat messages,
token ids that decode to invalid UTF-8, and run-batch's JSONL lines.

Each property is "a clear error or a well-formed answer, never anything else": a `ValueError` for
SamplingParams, an `OpenAIError` 400 naming a field for chat messages, a per-line 400 in batch
output. Host side only (the tokenizer is the default model's, no engine is built).
"""

from __future__ import annotations

import asyncio
import io
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.batch.jsonl import JsonlWriter
from jaxserve.server.batch.runner import ENDPOINTS, BatchRunner
from jaxserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    check_json_body,
    validate_request,
)
from jaxserve.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

# Anything JSON can carry, plus the numbers JSON cannot (NaN, inf) that Python callers can pass.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=4), inner,
                                                                       max_size=3)),
                      max_leaves=6)
# Values near each field's valid range, so many examples pass validation and check the invariants.
near = {
    "n": st.integers(-2, 4), "best_of": st.one_of(st.none(), st.integers(-1, 5)),
    "temperature": st.one_of(st.floats(-1, 3), st.just(math.nan)),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.just(math.nan)),
    "top_k": st.integers(-3, 50), "min_p": st.floats(-0.5, 1.5),
    "presence_penalty": st.one_of(st.floats(-3, 3), st.just(math.inf)),
    "frequency_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3),
    "seed": st.one_of(st.none(), st.integers(-2**64, 2**65)),
    "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(-2, 10), max_size=3)),
    "max_tokens": st.one_of(st.none(), st.integers(-2, 100)), "min_tokens": st.integers(-2, 100),
    "logprobs": st.one_of(st.none(), st.integers(-2, 30)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(
        st.one_of(st.integers(-5, 100), st.text(max_size=3)),
        st.floats(allow_nan=True, allow_infinity=True), max_size=3)),
}


@SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(near)), values, max_size=4),
       st.fixed_dictionaries({}, optional=near))
def test_sampling_params_is_valid_or_a_value_error(wild, plausible):
    kwargs = {**plausible, **wild}
    try:
        p = SamplingParams(**kwargs)
    except ValueError as e:
        assert str(e)                        # a message, naming what is wrong
        return
    # Accepted: the invariants the sampler relies on hold.
    assert isinstance(p.n, int) and p.n >= 1
    assert p.top_k >= 0 and 0.0 < p.top_p <= 1.0 and 0.0 <= p.min_p <= 1.0
    assert math.isfinite(p.temperature) and p.temperature >= 0.0
    assert p.repetition_penalty > 0.0 and math.isfinite(p.repetition_penalty)
    assert isinstance(p.stop, list) and all(isinstance(s, str) and s for s in p.stop)
    assert all(isinstance(t, int) and t >= 0 for t in p.stop_token_ids)
    assert p.max_tokens is None or p.max_tokens >= max(1, p.min_tokens)
    assert p.seed is None or -2**63 <= p.seed < 2**64
    for tok, bias in (p.logit_bias or {}).items():
        assert isinstance(tok, int) and tok >= 0 and -100.0 <= bias <= 100.0
    if p.is_greedy:
        assert p.top_k == 0 and p.top_p == 1.0 and p.n == 1


# -- chat messages ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.default_model import default_model_path
    return Tokenizer.from_model(str(default_model_path()))


class _TokenizerOnly:
    """What `_chat_prompt` reads from the engine: its tokenizer (the real one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


# Odd roles, content as a string, as parts (text or not), or as something else entirely; text with
# non-BMP characters and lone surrogates; nesting a few levels deep.
texts = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
parts = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                           st.fixed_dictionaries({"type": st.sampled_from(
                               ["image_url", "input_audio", "file", "text"]), "x": values}),
                           values), max_size=3)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
plausible_message = st.fixed_dictionaries({"role": roles, "content": st.one_of(texts, parts)})
wild_message = st.fixed_dictionaries({"role": st.one_of(roles, texts, values)},
                                     optional={"content": st.one_of(texts, parts, values),
                                               "name": values})
messages = st.lists(st.one_of(plausible_message, plausible_message, wild_message),
                    min_size=1, max_size=4)


@SETTINGS
@given(messages, st.booleans())
def test_chat_messages_render_or_are_a_400_naming_the_field(tokenizer, msgs, add_generation_prompt):
    from jaxserve.server.openai.serving import OpenAIServing
    serving = OpenAIServing(_TokenizerOnly(tokenizer))
    body = {"messages": msgs, "add_generation_prompt": add_generation_prompt}
    try:
        check_json_body(body)
        request = validate_request(ChatCompletionRequest, body)
        prompt = serving._chat_prompt(request)
    except OpenAIError as e:
        assert e.status == 400
        assert e.to_dict()["error"]["message"]
        return
    assert prompt.token_ids and all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size
                                    for t in prompt.token_ids)


@SETTINGS
@given(st.data())
def test_any_token_ids_detokenize_to_valid_text(tokenizer, data):
    """Token ids straight from a client (or a sampled byte-fallback token) can end mid-way through
    a UTF-8 sequence: every delta is still valid text, and the deltas add up to `decode`."""
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=24))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tokenizer, None, skip_special_tokens=skip)
    deltas = [detok.add_tokens([t]) for t in ids] + [detok.flush()]
    for d in deltas:
        d.encode("utf-8")                    # no lone surrogates
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


# -- run-batch lines -------------------------------------------------------------------------------
def _validating_routes():
    """Each route runs the server's own body checks and request models, then answers with what it
    validated (the model is not run: these properties are about the line handling)."""
    def route(model_cls):
        async def answer(body):
            check_json_body(body)
            request = validate_request(model_cls, body)
            return {"id": "cmpl-x", "object": type(request).__name__, "choices": [],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        return answer
    return {ENDPOINTS[0]: route(CompletionRequest), ENDPOINTS[1]: route(ChatCompletionRequest)}


envelopes = st.fixed_dictionaries(
    {}, optional={"custom_id": st.one_of(st.text(min_size=1, max_size=3), values),
                  "method": st.sampled_from(["POST", "GET", "post"]),
                  "url": st.one_of(st.sampled_from(ENDPOINTS), st.text(max_size=6)),
                  "body": st.one_of(values, st.fixed_dictionaries(
                      {"prompt": st.one_of(texts, st.lists(st.integers(-5, 50000), max_size=4)),
                       "messages": messages},
                      optional={"max_tokens": values, "temperature": values, "n": values}))})
lines = st.lists(st.one_of(envelopes.map(json.dumps), texts, values.map(json.dumps)), max_size=12)


@SETTINGS
@given(lines)
def test_every_batch_line_gets_one_answer(input_lines):
    stream = io.StringIO()
    runner = BatchRunner(_validating_routes(), JsonlWriter(stream, close=False), max_in_flight=3)
    stats = asyncio.run(runner.run(input_lines))
    out = [json.loads(x) for x in stream.getvalue().splitlines()]
    non_blank = [x for x in input_lines if x.strip()]
    assert len(out) == len(non_blank) == stats.lines and stats.stopped_by is None
    for line in out:
        status = line["response"]["status_code"]
        assert status in (200, 400), line
        if status == 400:
            error = line["response"]["body"]["error"]
            assert error["message"] and error["type"]
