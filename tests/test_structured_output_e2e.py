"""Structured output on the default model through `LLM.generate`: seeded samples under a JSON
schema all validate, regex / choice / grammar outputs always match, unconstrained requests are
unchanged by constrained neighbours, preemption does not corrupt a grammar, and invalid specs
are ValueErrors that leave the engine clean."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import engine_variant

from jaxserve import SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as SO

# Nested object, array of enums, bounded integer and number, a pattern, required fields; short
# keys keep each sample ~30 tokens.
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "lv", "tags", "own"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "lv": {"enum": ["low", "high"]},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 1,
                 "maxItems": 2},
        "own": {"type": "object", "additionalProperties": False, "required": ["p", "zip"],
                "properties": {"p": {"type": "number", "minimum": 0, "maximum": 10,
                                     "multipleOf": 0.5},
                               "zip": {"type": "string", "pattern": "^[0-9]{3}$"}}},
    },
}


def _generate(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


@pytest.mark.slow
def test_200_seeded_samples_under_a_json_schema_all_stop_and_validate(llm):
    """The default JSON whitespace rule (a space, or a line break and bounded indentation):
    every sample finishes with "stop". With llguidance's unbounded whitespace, 20 of these 200
    samples emitted line breaks until max_tokens."""
    spec = SO(json=SCHEMA)
    prompts = [f"Record {i} as JSON:" for i in range(50)]
    outs = llm.generate(prompts, [SamplingParams(n=4, temperature=1.0, seed=4 * i, max_tokens=160,
                                                 structured_outputs=spec) for i in range(50)],
                        use_tqdm=False)
    samples = [c for o in outs for c in o.outputs]
    assert len(samples) == 200
    for c in samples:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert max(map(len, re.findall(r"\s+", c.text)), default=0) <= 33, c.text
    assert len({c.text for c in samples}) > 100        # sampled, not one answer repeated


def test_regex_choice_and_grammar_outputs_always_match(llm):
    regex = r"[A-Z][a-z]{1,6}-[0-9]{2,3}"
    grammar = 'start: "(" NUM (" + " NUM)* ")"\nNUM: /[1-9][0-9]?/'
    choices = ["red", "green", "blue", "light yellow"]
    prompts = [f"Answer {i}:" for i in range(8)]
    for spec, check in ((SO(regex=regex), lambda t: re.fullmatch(regex, t)),
                        (SO(choice=choices), lambda t: t in choices),
                        (SO(grammar=grammar),
                         lambda t: re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", t))):
        outs = _generate(llm, prompts, n=2, temperature=1.0, seed=3, max_tokens=48,
                         structured_outputs=spec)
        for c in (c for o in outs for c in o.outputs):
            assert check(c.text), (spec.kind, c.text)
            assert c.finish_reason == "stop"


def test_unconstrained_greedy_is_unchanged_next_to_constrained_rows(llm):
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    alone = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=12,
                                 structured_outputs=SO(choice=["Paris", "Lyon"]))
    mixed = llm.generate([prompt, prompt, "Pick a city:"],
                         [greedy, constrained, constrained], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.token_ids
    assert mixed[0].outputs[0].text == alone.text
    for a, b in zip(mixed[0].outputs[0].logprobs, alone.logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert {o.outputs[0].text for o in mixed[1:]} <= {"Paris", "Lyon"}


def test_constrained_logprobs_are_of_the_constrained_distribution(llm):
    out = _generate(llm, ["Yes or no?"], temperature=0.0, max_tokens=4, logprobs=3,
                    structured_outputs=SO(choice=["yes", "no"]))[0].outputs[0]
    assert out.text in ("yes", "no")
    first = out.logprobs[0]
    allowed = {t for t in first if first[t].logprob > -1e20}
    assert out.token_ids[0] in allowed and first[out.token_ids[0]].rank == 1


def test_preemption_keeps_each_grammar_state(llm):
    """Seeded sampling repeats its tokens whatever shares the batch, so outputs produced
    under preemption (recompute) must equal the ones produced without it: a recomputed token
    fed twice to a matcher would change or reject the output."""
    spec = SO(json=SCHEMA, disable_any_whitespace=True)
    prompts = [f"Record {i} as JSON, after a preamble that takes KV blocks: " + "x " * 24
               for i in range(6)]
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=48, structured_outputs=spec)
    free = llm.generate(prompts, params, use_tqdm=False)
    with engine_variant(llm, num_blocks=10) as sched:
        tight = llm.generate(prompts, params, use_tqdm=False)
        assert sched.num_preemptions_total > 0
    for a, b in zip(free, tight):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        jsonschema.validate(json.loads(b.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("spec,needle", [
    (SO(json={"type": "object", "properties": {"a": {"type": "strnig"}}}), "Invalid type"),
    (SO(json={"type": "object", "if": {}}), "Unimplemented keys"),
    (SO(regex="(unclosed"), "unclosed group"),
])
def test_an_invalid_spec_is_a_value_error_and_leaves_the_engine_clean(llm, spec, needle):
    with pytest.raises(ValueError, match="structured_outputs") as e:
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2),
                                  SamplingParams(max_tokens=2, structured_outputs=spec)],
                     use_tqdm=False)
    assert needle in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()
