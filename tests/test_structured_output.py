"""Structured output without the model: grammars from every request form compile against the
default model's tokenizer (or fail naming the field), matchers advance and roll back, the device
bitmask equals llguidance's own reference, and the scheduler finishes a request when its
grammar is complete."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import llguidance
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.sample.penalties import zeros
from jaxserve.sample.sampler import SamplingTensors, sample
from jaxserve.sample.structured import allowed_tokens, apply_bitmask
from jaxserve.sampling_params import SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as SO
from jaxserve.structured_output import StructuredOutputManager

V = 49152


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.default_model import default_model_path
    from jaxserve.tokenizer.tokenizer import Tokenizer
    return Tokenizer.from_gguf(str(default_model_path()))


@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, V, {tokenizer.eos_token_id})


def drive(manager, tokenizer, spec: SO, text: str):
    """Feed the tokens of `text` to a fresh matcher; returns the StructuredRequest."""
    req = manager.new_request(SamplingParams(structured_outputs=spec))
    for t in tokenizer.encode(text):
        assert req.accept(t), (text, req.error)
    return req


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}}


@pytest.mark.parametrize("spec,good,bad", [
    (SO(json=PERSON), '{"name": "Ann", "age": 7}', '{"name": 7'),
    (SO(json=json.dumps(PERSON)), '{"name":"Ann","age":0}', '{"name": "Ann", "age": -1'),
    (SO(json_object=True), '{"x": [1, 2]}', "[1"),
    (SO(regex=r"[0-9]{3}-[a-z]+"), "123-abc", "12a"),
    (SO(choice=["yes", "no"]), "no", "nope"),
    (SO(grammar='start: "x" NUM "y"\nNUM: /[0-9]+/'), "x42y", "xy"),
    (SO(grammar='root ::= "a" [0-9]+'), "a123", "b"),                     # GBNF
])
def test_each_form_accepts_its_language_and_rejects_the_rest(manager, tokenizer, spec, good, bad):
    req = drive(manager, tokenizer, spec, good)
    assert req.matcher.is_accepting()
    fresh = manager.new_request(SamplingParams(structured_outputs=spec))
    assert not all(fresh.accept(t) for t in tokenizer.encode(bad))


def test_choice_and_closed_object_finish_without_eos(manager, tokenizer):
    assert drive(manager, tokenizer, SO(choice=["yes", "no"]), "yes").is_finished
    assert drive(manager, tokenizer, SO(json=PERSON, disable_any_whitespace=True),
                 '{"name":"A","age":1}').is_finished
    regex = drive(manager, tokenizer, SO(regex="[a-z]+"), "abc")
    assert not regex.is_finished and regex.matcher.is_accepting()   # more letters may follow


def test_eos_is_allowed_only_where_the_grammar_is_complete(manager, tokenizer):
    eos = tokenizer.eos_token_id
    req = manager.new_request(SamplingParams(structured_outputs=SO(regex="[a-z]+")))
    bit = lambda m: bool((m[0, eos // 32] >> (eos % 32)) & 1)
    assert not bit(manager.bitmask([req]))
    for t in tokenizer.encode("abc"):
        req.accept(t)
    assert bit(manager.bitmask([req]))
    assert req.accept(eos) and req.is_finished


def test_rollback_restores_the_state(manager, tokenizer):
    req = drive(manager, tokenizer, SO(json=PERSON), '{"name": "Ann"')
    before = manager.bitmask([req])
    assert req.accept(tokenizer.encode(",")[0])
    req.rollback(1)
    assert np.array_equal(manager.bitmask([req]), before)
    assert req.validate_tokens(tokenizer.encode(', "age": 3}')) == len(tokenizer.encode(', "age": 3}'))
    with pytest.raises(ValueError, match="roll back"):
        req.rollback(req.num_accepted + 1)


def test_draft_token_masks_equal_stepping_and_rolling_back(manager, tokenizer):
    reqs = [drive(manager, tokenizer, SO(json=PERSON), '{"name": "A'),
            drive(manager, tokenizer, SO(choice=["yes please", "no"]), "")]
    drafts = [tokenizer.encode('nn", "age'), tokenizer.encode("yes please")]
    got = manager.bitmask(reqs, drafts)
    want = []
    for req, draft in zip(reqs, drafts):
        want.append(manager.bitmask([req])[0])
        for t in draft:
            assert req.accept(t)
            want.append(manager.bitmask([req])[0])
        req.rollback(len(draft))
    assert np.array_equal(got, np.stack(want))


def test_the_cache_compiles_a_spec_once(tokenizer):
    m = StructuredOutputManager(tokenizer, V, {tokenizer.eos_token_id})
    for schema in (PERSON, json.dumps(PERSON), dict(reversed(list(PERSON.items())))):
        m.new_request(SamplingParams(structured_outputs=SO(json=schema)))
    assert (m.stats.compiles, m.stats.cache_hits) == (1, 2)


@pytest.mark.parametrize("spec,needle", [
    (SO(json={"type": "strnig"}), "Invalid type: strnig"),
    (SO(json={"type": "object", "if": {"required": ["a"]}}), 'Unimplemented keys: ["if"]'),
    (SO(json="{not json"), "structured_outputs.json is not valid JSON"),
    (SO(regex="a(b"), "unclosed group"),
    (SO(grammar="start: foo"), 'unknown name: "foo"'),
    (SO(structural_tag='{"type": "structural_tag", "format": {}}'), "only vLLM's form"),
    (SO(structural_tag=json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                                   "triggers": ["<g"]})), "starts with none of the triggers"),
])
def test_invalid_specs_are_value_errors_naming_the_field(manager, spec, needle):
    with pytest.raises(ValueError, match="structured_outputs") as e:
        manager.compile(spec)
    assert needle in str(e.value)


def test_structural_tag_constrains_only_inside_the_tag(manager, tokenizer):
    tag = json.dumps({"type": "structural_tag", "triggers": ["<fn="], "structures": [
        {"begin": "<fn=get>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                         "required": ["x"]}, "end": "</fn>"}]})
    req = drive(manager, tokenizer, SO(structural_tag=tag), 'Sure. <fn=get>{"x": 3}</fn> done')
    assert req.matcher.is_accepting()
    bad = manager.new_request(SamplingParams(structured_outputs=SO(structural_tag=tag)))
    assert not all(bad.accept(t) for t in tokenizer.encode('<fn=get>{"x": "three"}'))


def _accepts(manager, tokenizer, spec: SO, text: str) -> bool:
    req = manager.new_request(SamplingParams(structured_outputs=spec))
    return all(req.accept(t) for t in tokenizer.encode(text)) and req.matcher.is_accepting()


PRETTY = '{\n  "name": "Ann",\n  "age": 7\n}'
RUNAWAY = '{"name": "Ann",\n\n\n\n\n\n  "age": 7}'     # the line breaks a sampled model loops on


def test_json_whitespace_is_bounded_by_default_and_configurable(manager, tokenizer):
    """Default: one space, or a line break and bounded indentation, between JSON tokens (so
    pretty-printed JSON passes but no gap can grow until max_tokens); a request's
    whitespace_pattern or disable_any_whitespace, or the engine's structured_outputs_config,
    changes it."""
    from jaxserve.config import StructuredOutputsConfig
    from jaxserve.structured_output.grammar import FLEXIBLE_JSON_WHITESPACE
    spec = SO(json=PERSON)
    for text in ('{"name":"Ann","age":7}', '{"name": "Ann", "age": 7}', PRETTY,
                 '{ "name" : "Ann" , "age" : 7 }'):
        assert _accepts(manager, tokenizer, spec, text), text
    assert not _accepts(manager, tokenizer, spec, RUNAWAY)
    assert not _accepts(manager, tokenizer, spec, '{"name": "Ann",' + " " * 40 + '"age": 7}')
    flexible = SO(json=PERSON, whitespace_pattern=FLEXIBLE_JSON_WHITESPACE)
    assert _accepts(manager, tokenizer, flexible, RUNAWAY)
    assert not _accepts(manager, tokenizer, SO(json=PERSON, disable_any_whitespace=True), PRETTY)
    # engine level (--structured-outputs-config), for requests that set nothing
    for config, runaway, pretty in (({"whitespace_pattern": FLEXIBLE_JSON_WHITESPACE}, True, True),
                                    ({"disable_any_whitespace": True}, False, False)):
        so = StructuredOutputsConfig.from_dict(config)
        engine = StructuredOutputManager(tokenizer, V, {tokenizer.eos_token_id},
                                         whitespace_pattern=so.whitespace_pattern,
                                         disable_any_whitespace=so.disable_any_whitespace)
        assert _accepts(engine, tokenizer, spec, RUNAWAY) is runaway
        assert _accepts(engine, tokenizer, spec, PRETTY) is pretty
        assert _accepts(engine, tokenizer, SO(json=PERSON, whitespace_pattern=" ?"),
                        '{"name": "Ann", "age": 7}')          # the request's own rule wins


def test_structural_tag_json_follows_the_whitespace_rule(manager, tokenizer):
    tag = json.dumps({"type": "structural_tag", "triggers": ["<fn="], "structures": [
        {"begin": "<fn=get>", "schema": PERSON, "end": "</fn>"}]})
    assert _accepts(manager, tokenizer, SO(structural_tag=tag), f"<fn=get>{PRETTY}</fn>")
    assert not _accepts(manager, tokenizer, SO(structural_tag=tag), f"<fn=get>{RUNAWAY}</fn>")


@pytest.mark.parametrize("config,needle", [
    ({"disable_any_whitespace": "yes"}, "disable_any_whitespace must be a bool"),
    ({"whitespace_pattern": ""}, "whitespace_pattern must be a non-empty regex"),
    ({"backend": "xgrammar"}, "backend must be 'auto' or 'guidance'"),
    ({"any_whitespace": True}, r"unknown key\(s\) \['any_whitespace'\]"),
])
def test_structured_outputs_config_is_validated(config, needle):
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match=needle):
        EngineArgs(structured_outputs_config=config)


def test_strict_forbids_unnamed_properties(manager, tokenizer):
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = '{"a": 1, "b": 2}'
    assert drive(manager, tokenizer, SO(json=open_schema), text).matcher.is_accepting()
    strict = manager.new_request(SamplingParams(
        structured_outputs=SO(json=open_schema, disable_additional_properties=True)))
    assert not all(strict.accept(t) for t in tokenizer.encode(text))


def test_device_bitmask_matches_llguidance_reference(manager, tokenizer):
    reqs = [drive(manager, tokenizer, SO(json=PERSON), '{"name": "A'),
            drive(manager, tokenizer, SO(choice=["alpha", "beta"]), ""),
            drive(manager, tokenizer, SO(regex="[0-9]+"), "12")]
    mask = manager.bitmask(reqs)
    logits = np.random.default_rng(0).standard_normal((3, V)).astype(np.float32)
    want = logits.copy()
    apply_token_bitmask_inplace(want, mask)
    got = np.asarray(jax.jit(apply_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    assert np.array_equal(got > -1e29, np.isfinite(want))
    assert np.array_equal(got[np.isfinite(want)], want[np.isfinite(want)])
    assert np.asarray(allowed_tokens(jnp.asarray(mask), V)).sum(-1).min() >= 1


def _tensors(R, temperature):
    f = lambda v, dt: jnp.full(R, v, dt)
    return SamplingTensors(temperature=f(temperature, jnp.float32), top_k=f(0, jnp.int32),
                           top_p=f(1, jnp.float32), min_p=f(0, jnp.float32),
                           seeds=jnp.arange(R, dtype=jnp.uint32), positions=f(0, jnp.int32),
                           slots=f(R, jnp.int32), penalised=f(False, bool),
                           min_tokens_active=f(False, bool), presence=f(0, jnp.float32),
                           frequency=f(0, jnp.float32), repetition=f(1, jnp.float32),
                           logprobs=f(True, bool))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_all_ones_mask_changes_nothing_and_a_mask_is_obeyed(manager, tokenizer,
                                                                     temperature):
    R, W = 4, (V + 31) // 32
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((R, V)), jnp.float32)
    t, state = _tensors(R, temperature), zeros(R, V)
    plain = sample(logits, t, state, k=3)
    ones = sample(logits, t, state, k=3, bitmask=jnp.full((R, W), -1, jnp.int32))
    for a, b in zip(plain, ones):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    req = manager.new_request(SamplingParams(structured_outputs=SO(choice=["yes", "no"])))
    mask = np.full((R, W), -1, np.int32)
    mask[1] = manager.bitmask([req])[0]
    out = sample(logits, t, state, k=3, bitmask=jnp.asarray(mask))
    assert req.accept(int(out.token_ids[1]))
    assert np.array_equal(np.asarray(out.token_ids)[[0, 2, 3]],
                          np.asarray(plain.token_ids)[[0, 2, 3]])
    # logprobs are those of the constrained distribution (vLLM: the mask precedes its sampler)
    allowed = np.flatnonzero(np.asarray(allowed_tokens(jnp.asarray(mask[1:2]), V))[0])
    assert np.isclose(np.logaddexp.reduce(np.asarray(out.top_logprobs[1])), 0.0, atol=1e-4) \
        or len(allowed) > 3
    assert set(np.asarray(out.top_ids[1])[:min(3, len(allowed))]) <= set(allowed.tolist())


def test_scheduler_feeds_tokens_and_stops_when_the_grammar_is_complete(manager, tokenizer):
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=128), CacheConfig(block_size=16,
                                                                      num_blocks=16))
    params = SamplingParams(max_tokens=50, structured_outputs=SO(choice=["yes", "no"]))
    params.update_from_tokenizer(tokenizer.eos_token_id)
    req = Request("r", [1, 2, 3], params)
    req.structured = manager.new_request(params)
    sched.add_request(req)
    for token in tokenizer.encode("yes"):
        out = sched.schedule()
        sched.update_from_output(out, {"r": [token]})
    assert req.status == RequestStatus.FINISHED_STOPPED and req.get_finished_reason() == "stop"
    assert req.stop_reason is None and req.output_token_ids == tokenizer.encode("yes")


def test_a_token_the_grammar_forbids_finishes_the_request_with_an_error(manager, tokenizer):
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=128), CacheConfig(block_size=16,
                                                                      num_blocks=16))
    params = SamplingParams(max_tokens=50, structured_outputs=SO(regex="[0-9]+"))
    req = Request("r", [1, 2, 3], params)
    req.structured = manager.new_request(params)
    sched.add_request(req)
    sched.update_from_output(sched.schedule(), {"r": tokenizer.encode("x")})
    assert req.status == RequestStatus.FINISHED_ERROR


def test_a_tokenizer_llguidance_cannot_read_is_a_value_error():
    from jaxserve.tokenizer.tokenizer import Tokenizer
    m = StructuredOutputManager(Tokenizer.synthetic(100, 0), 100, {0})
    with pytest.raises(ValueError, match="llguidance cannot read"):
        m.compile(SO(regex="a"))


def test_llguidance_version_has_the_batched_fill():
    assert hasattr(llguidance.LLExecutor, "unsafe_compute_mask_ptr")


# -- request forms (the server's protocol models, also run-batch's) ----------------------------
def _chat(**kw):
    from jaxserve.server.openai.protocol import ChatCompletionRequest
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw) \
        .to_sampling_params(100).structured_outputs


def _completion(**kw):
    from jaxserve.server.openai.protocol import CompletionRequest
    return CompletionRequest(prompt="x", **kw).to_sampling_params(100).structured_outputs


def test_response_format_maps_to_structured_outputs():
    assert _chat(response_format={"type": "text"}) is None
    assert _chat(response_format={"type": "json_object"}).json_object is True
    so = _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON, "strict": True}})
    assert so.json == PERSON and so.disable_additional_properties
    assert not _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON}}).disable_additional_properties
    tag = {"type": "structural_tag", "triggers": ["<f"],
           "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}
    assert json.loads(_chat(response_format=tag).structural_tag) == tag
    with pytest.raises(ValueError, match="response_format type 'xml'"):
        _chat(response_format={"type": "xml"})
    with pytest.raises(ValueError, match="json_schema"):
        _chat(response_format={"type": "json_schema"})


def test_structured_outputs_field_and_guided_aliases():
    assert _completion(guided_choice=["a", "b"]).choice == ["a", "b"]
    assert _completion(guided_json=PERSON).json == PERSON
    assert _completion(guided_regex="[0-9]+", guided_whitespace_pattern=" ?").regex == "[0-9]+"
    assert _completion(guided_grammar='start: "a"').grammar == 'start: "a"'
    so = _completion(structured_outputs={"json": PERSON, "disable_any_whitespace": True})
    assert so.json == PERSON and so.disable_any_whitespace
    assert _chat(guided_choice=["y"]).choice == ["y"]
    with pytest.raises(ValueError, match="not several"):
        _chat(guided_regex="a", response_format={"type": "json_object"})
    with pytest.raises(ValueError, match="exactly one"):
        _completion(guided_regex="a", guided_choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs"):
        _completion(structured_outputs={"jsn": {}})


def test_async_llm_compiles_grammars_off_the_event_loop():
    """A slow compile runs in a worker thread while the loop keeps serving; its ValueError
    comes back from add_request (the server's 400)."""
    import asyncio
    import threading
    import time

    from test_server_async import FakeEngine

    from jaxserve.engine.async_llm import AsyncLLM

    class Engine(FakeEngine):
        threads: list[int] = []

        def compile_structured(self, params):
            self.threads.append(threading.get_ident())
            time.sleep(0.3)
            if params.structured_outputs.regex == "(":
                raise ValueError("structured_outputs.regex: unclosed group")

    async def main():
        engine = Engine()
        llm = AsyncLLM(engine=engine)
        await llm.start()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)
        task = asyncio.create_task(ticker())
        params = SamplingParams(max_tokens=2, structured_outputs=SO(regex="[a-z]"))
        stream = await llm.add_request("a", {"prompt_token_ids": [1]}, params)
        assert ticks >= 10 and engine.threads[0] != threading.get_ident()
        async for _ in stream:
            pass
        with pytest.raises(ValueError, match="unclosed group"):
            await llm.add_request("b", {"prompt_token_ids": [1]},
                                  SamplingParams(structured_outputs=SO(regex="(")))
        task.cancel()
        await llm.shutdown()
    asyncio.run(main())
