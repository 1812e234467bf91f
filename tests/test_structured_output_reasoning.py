"""Structured output after reasoning (`reasoning_parser`): the grammar is not enforced and not
advanced until the output has written the end-of-reasoning marker, then it shapes the rest.

The default model's tokenizer has no `<think>` token: `</think>` is `</` `think` `>`, so these
tests run the multi-token path with the real tokenization."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as SO
from jaxserve.structured_output import StructuredOutputManager
from jaxserve.structured_output.reasoning import Phase, ReasoningMarkers

V = 49152
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}}


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.default_model import default_model_path
    from jaxserve.tokenizer.tokenizer import Tokenizer
    return Tokenizer.from_gguf(str(default_model_path()))


@pytest.fixture(scope="module")
def managers(tokenizer):
    plain = StructuredOutputManager(tokenizer, V, {tokenizer.eos_token_id})
    return plain, {name: StructuredOutputManager(tokenizer, V, {tokenizer.eos_token_id},
                                                 reasoning_parser=name)
                   for name in ("deepseek_r1", "qwen3")}


def _new(manager, tokenizer, prompt: str, spec=SO(json=PERSON)):
    return manager.new_request(SamplingParams(structured_outputs=spec), tokenizer.encode(prompt))


def _allowed(row, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _fresh_row(plain, spec=SO(json=PERSON), feed=()):
    req = plain.new_request(SamplingParams(structured_outputs=spec))
    for t in feed:
        assert req.accept(t)
    return plain.bitmask([req])[0]


def test_grammar_waits_for_an_end_marker_split_over_tokens(tokenizer, managers):
    plain, by_name = managers
    manager = by_name["deepseek_r1"]
    assert len(tokenizer.encode("</think>")) == 3      # the multi-token path
    req = _new(manager, tokenizer, "Question?")     # deepseek_r1: the output starts reasoning
    reasoning = tokenizer.encode("Not JSON at all {{ <b>.</think>")
    for t in reasoning[:-1]:
        assert (manager.bitmask([req]) == -1).all() and not req.constrains
        assert req.accept(t) and req.num_accepted == 0 and not req.is_finished
    assert req.accept(reasoning[-1]) and req.constrains          # the marker's last token
    assert np.array_equal(manager.bitmask([req])[0], _fresh_row(plain))
    for t in tokenizer.encode('{"name": "Ann", "age": 7}'):
        assert req.accept(t), req.error
    assert req.is_finished
    # The same marker tokenized differently ("</thi" + "nk>") ends it as well.
    req = _new(manager, tokenizer, "Question?")
    for t in tokenizer.encode("ok </thi") + tokenizer.encode("nk>"):
        assert req.accept(t)
    assert req.gate.ended
    assert not req.accept(tokenizer.encode("x")[0])             # now the grammar's


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_the_prompt_says_where_the_output_starts(tokenizer, managers, name):
    plain, by_name = managers
    manager = by_name[name]
    # Qwen3's enable_thinking=False template: the reasoning is over before the output starts.
    closed = _new(manager, tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed.gate.ended
    assert np.array_equal(manager.bitmask([closed])[0], _fresh_row(plain))
    # DeepSeek-R1's template ends with the start tag: the output is reasoning.
    opened = _new(manager, tokenizer, "<｜Assistant｜><think>\n")
    assert opened.gate.phase is Phase.REASONING and (manager.bitmask([opened]) == -1).all()
    # Markers of earlier turns (few-shot) followed by more text decide nothing.
    shots = _new(manager, tokenizer, "A: <think>hm</think>{}\nQ: next?\nA:")
    # (qwen3 with this tokenizer: its multi-token <think> cannot open at the first token)
    assert shots.gate.phase is (Phase.REASONING if name == "deepseek_r1" else Phase.ENDED)


def test_qwen3_first_token_opens_the_reasoning_or_starts_the_answer(tokenizer, managers):
    """A one-token start marker (Qwen3's <think>; here the tokenizer's <|im_start|> stands in)
    may open the reasoning at the first token; a marker of several tokens may not (its "<"
    is ordinary text too), so there the grammar applies from the first token."""
    plain, by_name = managers
    assert _new(by_name["qwen3"], tokenizer, "Q?").gate.ended
    (start,) = tokenizer.encode("<|im_start|>")
    manager = StructuredOutputManager(tokenizer, V, {tokenizer.eos_token_id},
                                      reasoning_parser=ReasoningMarkers("<|im_start|>", "</think>"))
    req = _new(manager, tokenizer, "Q?")
    row, grammar = manager.bitmask([req])[0], _fresh_row(plain)
    assert _allowed(row, start) and not _allowed(grammar, start)
    grammar.view(np.uint32)[start >> 5] |= np.uint32(1 << (start & 31))
    assert np.array_equal(row, grammar)                 # the grammar's tokens and the marker
    assert req.validate_tokens([start, 5]) == 0         # no drafts before the first token
    assert req.accept(start) and req.gate.phase is Phase.REASONING and req.num_accepted == 0
    assert (manager.bitmask([req]) == -1).all()
    # Another first token: the answer starts at once and the grammar took the token.
    req = _new(manager, tokenizer, "Q?")
    assert req.accept(tokenizer.encode("{")[0]) and req.gate.ended and req.num_accepted == 1


def test_draft_masks_across_the_end_marker_equal_stepping(tokenizer, managers):
    """Masks for drafts that cross the marker (reasoning rows all ones, then the grammar's)
    equal those of stepping token by token; validation stops at the first refused draft."""
    plain, by_name = managers
    manager = by_name["deepseek_r1"]
    drafts = tokenizer.encode('so.</think>{"name": "A')
    req = _new(manager, tokenizer, "Q?")
    assert req.validate_tokens(drafts) == len(drafts)
    bad = tokenizer.encode("so.</think>") + tokenizer.encode("nope")
    assert req.validate_tokens(bad) == len(tokenizer.encode("so.</think>"))
    other = _new(manager, tokenizer, "<think>\n\n</think>\n\n")        # constrained already
    other_drafts = tokenizer.encode('{"name": "B')
    got = manager.bitmask([req, other], [drafts, other_drafts])
    want = []
    for r, d in ((req, drafts), (other, other_drafts)):
        step = _new(manager, tokenizer, "Q?" if r is req else "<think>\n\n</think>\n\n")
        want.append(manager.bitmask([step])[0])
        for t in d:
            assert step.accept(t)
            want.append(manager.bitmask([step])[0])
    assert np.array_equal(got, np.stack(want))
    n_reasoning = len(tokenizer.encode("so.</think>"))
    assert (got[:n_reasoning] == -1).all() and not (got[n_reasoning] == -1).all()
    assert req.gate.phase is Phase.REASONING and req.num_accepted == 0     # nothing moved


# -- the engine on the default model ----------------------------------------------------------

# Few-shot turns make the model open a <think> block, reason and close it by itself.
SHOTS = [("Is the sky blue?", '<think>The sky is blue.</think>{"answer": "yes"}'),
         ("Is grass red?", '<think>Grass is green, not red.</think>{"answer": "no"}'),
         ("Is fire hot?", '<think>Fire is hot.</think>{"answer": "yes"}')]
CONVERSATION = [m for q, a in SHOTS for m in ({"role": "user", "content": q},
                                               {"role": "assistant", "content": a})]
CONVERSATION.append({"role": "user", "content": "Is snow white?"})
# Not the examples' shape: only the grammar can make the answer fit it.
VERDICT = {"type": "object", "additionalProperties": False, "required": ["white"],
           "properties": {"white": {"type": "boolean"}}}


@contextlib.contextmanager
def reasoning_parser(llm, name):
    """The shared engine with a structured-output manager that gates on `name`'s markers."""
    engine = llm.llm_engine
    original = engine.structured
    engine.structured = StructuredOutputManager(engine.tokenizer, original.vocab_size,
                                                original.eos_token_ids, reasoning_parser=name)
    try:
        yield engine
    finally:
        engine.structured = original


def test_engine_applies_the_schema_after_the_models_reasoning(llm):
    greedy = dict(temperature=0, max_tokens=40)
    free = llm.chat([CONVERSATION], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert free.text.startswith("<think>") and '</think>{"answer"' in free.text
    with reasoning_parser(llm, "deepseek_r1"):
        out = llm.chat([CONVERSATION], SamplingParams(**greedy, structured_outputs=SO(
            json=VERDICT)), use_tqdm=False)[0].outputs[0]
    head, _, answer = out.text.partition("</think>")
    assert head == free.text.partition("</think>")[0]      # the reasoning was not constrained
    assert json.loads(answer) in ({"white": True}, {"white": False})
    assert out.finish_reason == "stop"


def test_max_tokens_inside_the_reasoning_ends_it_there(llm):
    with reasoning_parser(llm, "deepseek_r1"):
        outs = llm.generate(["Tell me about snow.", "Count to three."], SamplingParams(
            temperature=0, max_tokens=6, structured_outputs=SO(json=VERDICT)), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 6
        assert not o.outputs[0].text.lstrip().startswith("{")    # unconstrained reasoning
    assert not llm.llm_engine.has_unfinished_requests()


# -- the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def r1_server():
    from server_fixtures import ServerProcess
    srv = ServerProcess("--reasoning-parser", "deepseek_r1").start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_server_response_format_applies_after_the_reasoning_streamed_and_not(r1_server):
    """`--reasoning-parser deepseek_r1`: the few-shot turns make the model reason and close
    </think>; the message's `reasoning` is that text and its `content` validates against the
    schema (not the examples' shape), streamed and not."""
    import jsonschema
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState
    client = openai.OpenAI(base_url=r1_server.base_url + "/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    kw = dict(model="SmolLM2-135M-Instruct", messages=CONVERSATION, max_tokens=40,
              temperature=0, response_format=fmt)
    message = client.chat.completions.create(**kw).choices[0].message
    reasoning = message.model_extra.get("reasoning")
    assert reasoning and "snow" in reasoning.lower() and "</think>" not in reasoning
    jsonschema.validate(json.loads(message.content), VERDICT)
    state, streamed_reasoning = ChatCompletionStreamState(), ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        if chunk.choices:
            streamed_reasoning += chunk.choices[0].delta.model_extra.get("reasoning") or ""
    assert streamed_reasoning == reasoning
    assert state.current_completion_snapshot.choices[0].message.content == message.content


def test_engine_and_server_know_the_same_reasoning_parsers():
    from jaxserve.config import REASONING_PARSERS
    from jaxserve.server.openai.reasoning import REASONING_PARSERS as SERVER_PARSERS
    from jaxserve.structured_output.reasoning import REASONING_MARKERS
    assert set(REASONING_PARSERS) == set(SERVER_PARSERS) == set(REASONING_MARKERS)
    for name, markers in REASONING_MARKERS.items():
        parser = SERVER_PARSERS[name]
        assert (parser.start, parser.end, parser.implicit_start) == (
            markers.start, markers.end, markers.implicit_start)
    with pytest.raises(ValueError, match="reasoning_parser"):
        from jaxserve.config import EngineArgs
        EngineArgs(reasoning_parser="r2")
