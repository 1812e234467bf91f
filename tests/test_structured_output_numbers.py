"""JSON numbers are bounded by default: a schema's unbounded integer stops at int64 and its
unbounded number at |x| <= 1e18 with 10 decimals, so a sampled number cannot run to max_tokens
(issue 45: `"founded": 12320131282726214885...`); a schema's own bounds are kept and
`unbounded_json_numbers` lifts the rule."""

from __future__ import annotations

import json

import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as SO
from jaxserve.structured_output import StructuredOutputManager
from jaxserve.structured_output.json_numbers import INT_MAX, INT_MIN

# `class City(BaseModel): name: str; country: str; founded: int`, as the OpenAI client's
# `chat.completions.parse` sends it (strict: additionalProperties false)
CITY = {"properties": {"name": {"title": "Name", "type": "string"},
                       "country": {"title": "Country", "type": "string"},
                       "founded": {"title": "Founded", "type": "integer"}},
        "required": ["name", "country", "founded"], "title": "City", "type": "object",
        "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.default_model import default_model_path
    from jaxserve.tokenizer.tokenizer import Tokenizer
    return Tokenizer.from_gguf(str(default_model_path()))


@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, 49152, {tokenizer.eos_token_id})


def accepts(manager, tokenizer, spec: SO, text: str) -> bool:
    """The grammar takes every token of `text` and may end there."""
    req = manager.new_request(SamplingParams(structured_outputs=spec))
    return all(req.accept(t) for t in tokenizer.encode(text)) and req.matcher.is_accepting()


def refuses(manager, tokenizer, spec: SO, text: str) -> bool:
    """The grammar refuses a token of `text` (not merely an unfinished text)."""
    req = manager.new_request(SamplingParams(structured_outputs=spec))
    return not all(req.accept(t) for t in tokenizer.encode(text))


def city(founded: str) -> str:
    return f'{{"name": "Rome", "country": "Italy", "founded": {founded}}}'


def test_an_unbounded_integer_stops_at_int64(manager, tokenizer):
    spec = SO(json=CITY)
    for ok in (str(INT_MAX), str(INT_MIN), "0", "-753", "9" * 18):
        assert accepts(manager, tokenizer, spec, city(ok)), ok
    for bad in (str(INT_MAX + 1), "9" * 19, "1" * 20, str(INT_MIN - 1), "12320131282726214885"):
        assert refuses(manager, tokenizer, spec, city(bad)), bad
    assert INT_MAX == 2**63 - 1 and INT_MIN == -(2**63) + 1024


def test_unbounded_json_numbers_lifts_the_bound(manager, tokenizer):
    spec = SO(json=CITY, unbounded_json_numbers=True)
    for text in (city("1" * 40), city("-" + "9" * 30)):
        assert accepts(manager, tokenizer, spec, text)
    assert accepts(manager, tokenizer, SO(json_object=True, unbounded_json_numbers=True),
                   '{"x": 1.5e400, "y": [123456789012345678901234567890]}')


def test_an_unbounded_number_stays_within_1e18_with_10_decimals(manager, tokenizer):
    spec = SO(json={"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
                    "additionalProperties": False})
    for ok in ("3.14", "-0.5", "7", "1" + "0" * 18, "-" + "9" * 18 + "." + "9" * 10, "0.0000000001"):
        assert accepts(manager, tokenizer, spec, f'{{"x": {ok}}}'), ok
    for bad in ("2" + "0" * 18, "1." + "1" * 11, "3.14159265358979323846", "1e5", "1.5E-3"):
        assert refuses(manager, tokenizer, spec, f'{{"x": {bad}}}'), bad


def test_a_schemas_own_bounds_are_kept(manager, tokenizer):
    def x(schema):
        return SO(json={"type": "object", "properties": {"x": schema}, "required": ["x"],
                        "additionalProperties": False})
    own = x({"type": "integer", "minimum": -5, "maximum": 1000})
    assert accepts(manager, tokenizer, own, '{"x": -5}')
    assert refuses(manager, tokenizer, own, '{"x": 1001}')
    wide = x({"type": "number", "maximum": 5e18})                    # past 1e18: as written
    assert accepts(manager, tokenizer, wide, '{"x": 4' + "0" * 18 + "}")
    assert refuses(manager, tokenizer, wide, '{"x": -2' + "0" * 18 + "}")
    low = x({"type": "integer", "minimum": 5})                       # only the missing side
    assert accepts(manager, tokenizer, low, f'{{"x": {INT_MAX}}}')
    assert refuses(manager, tokenizer, low, f'{{"x": {INT_MAX + 1}}}')
    assert refuses(manager, tokenizer, low, '{"x": 4}')
    step = x({"type": "number", "multipleOf": 0.25})                 # its own decimals
    assert accepts(manager, tokenizer, step, '{"x": 1.75}')
    assert refuses(manager, tokenizer, step, '{"x": 1.7}')
    enum = x({"type": "number", "enum": [0.123456789012345]})        # literals as written
    assert accepts(manager, tokenizer, enum, '{"x": 0.123456789012345}')


def test_free_values_and_every_schema_position_are_bounded(manager, tokenizer):
    nested = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": ["integer", "null"]}},
        "b": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/n"}]},
        "c": {}, "f": {"title": "F", "description": "pydantic's Any"}},
        "$defs": {"n": {"type": "number"}}}
    good = '{"a": [1, null, -2], "b": 2.5, "c": {"d": [1.5, true]}, "f": 3, "e": 7}'
    assert accepts(manager, tokenizer, SO(json=nested), good)
    for bad in ('{"a": [1' + "0" * 19, '{"b": 1e9', '{"c": ' + "1" * 20, '{"e": [1.' + "5" * 11,
                '{"f": {"g": 1e9',
                '{"a": [], "zz": ' + "9" * 19):
        assert refuses(manager, tokenizer, SO(json=nested), bad), bad
    for spec in (SO(json_object=True), SO(json={}), SO(json={"type": "object"})):
        assert accepts(manager, tokenizer, spec, '{"x": [1, 2.5, {"y": -3}], "z": null}')
        assert refuses(manager, tokenizer, spec, '{"x": ' + "1" * 20)
        assert refuses(manager, tokenizer, spec, '{"x": 1e5')


def test_structural_tag_and_tool_call_schemas_are_bounded(manager, tokenizer):
    tag = json.dumps({"type": "structural_tag", "triggers": ["<fn="], "structures": [
        {"begin": "<fn=get>", "schema": CITY, "end": "</fn>"}]})
    assert accepts(manager, tokenizer, SO(structural_tag=tag), f"<fn=get>{city('753')}</fn>")
    assert refuses(manager, tokenizer, SO(structural_tag=tag), f"<fn=get>{city('9' * 19)}")
    free = json.dumps({"type": "structural_tag", "triggers": ["<fn="], "structures": [
        {"begin": "<fn=get>", "schema": {"type": "object"}, "end": "</fn>"}]})
    assert accepts(manager, tokenizer, SO(structural_tag=free), '<fn=get>{"a": [1.5]}</fn>')
    assert refuses(manager, tokenizer, SO(structural_tag=free), '<fn=get>{"a": 1e5')
    # tool_choice "required" or named: the server's ChatCompletionRequest -> structured_outputs;
    # get_weather's parameters are open, so an argument the schema does not name is a free value
    from jaxserve.server.openai.protocol import ChatCompletionRequest
    add_city = {"type": "function", "function": {"name": "add_city", "parameters": CITY}}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

    def spec(tool_choice):
        return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                     tools=[add_city, weather], tool_choice=tool_choice
                                     ).to_sampling_params(64).structured_outputs

    def required(name, args):
        return f'[{{"name":"{name}","parameters":{args}}}]'
    founded = '{"name":"Rome","country":"Italy","founded":%s}'
    assert accepts(manager, tokenizer, spec("required"), required("add_city", founded % 753))
    assert refuses(manager, tokenizer, spec("required"), required("add_city", founded % INT_MAX)
                   .replace(str(INT_MAX), str(INT_MAX + 1)))
    days = '{"city":"Paris","days":%s}'
    assert accepts(manager, tokenizer, spec("required"), required("get_weather", days % 3.5))
    assert refuses(manager, tokenizer, spec("required"), required("get_weather", days % ("9" * 19)))
    named = spec({"type": "function", "function": {"name": "get_weather"}})
    assert accepts(manager, tokenizer, named, days % 3.5)
    assert refuses(manager, tokenizer, named, days % ("9" * 19))


def test_free_values_that_llguidance_would_intersect_keep_their_numbers(manager, tokenizer):
    """Two references to one open object in an allOf would intersect the bounded any-value with
    itself without end; the grammar then bounds only the schema's own integers and numbers."""
    schema = {"$defs": {"o": {"type": "object", "properties": {"n": {"type": "integer"}}}},
              "allOf": [{"$ref": "#/$defs/o"}, {"$ref": "#/$defs/o"}]}
    assert accepts(manager, tokenizer, SO(json=schema), '{"n": 7, "x": 1e400}')
    assert refuses(manager, tokenizer, SO(json=schema), f'{{"n": {INT_MAX + 1}}}')


def test_unbounded_json_numbers_is_part_of_the_cache_key_and_validated(tokenizer):
    m = StructuredOutputManager(tokenizer, 49152, {tokenizer.eos_token_id})
    m.compile(SO(json=CITY))
    m.compile(SO(json=CITY, unbounded_json_numbers=True))
    assert m.stats.compiles == 2
    with pytest.raises(ValueError, match="structured_outputs.unbounded_json_numbers must be a bool"):
        SO(json=CITY, unbounded_json_numbers="yes")


@pytest.mark.slow
def test_200_seeded_city_samples_all_stop_with_an_int64_founded(llm):
    """Issue 45. With unbounded numbers 4 of these 200 samples ran to max_tokens writing the
    year's digits (`"founded": 75322000300027242148854722248725010134991892`) and 4 more ended
    past int64 (`"founded": 3064818182216128800000000`)."""
    spec = SO(json=CITY, disable_additional_properties=True)      # response_format strict
    chat = [{"role": "user",
             "content": "Extract the city: Rome is in Italy and was founded in 753 BC."}]
    outs = llm.chat([chat] * 200, [SamplingParams(temperature=0.7, seed=s, max_tokens=64,
                                                  structured_outputs=spec) for s in range(200)],
                    use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        founded = json.loads(c.text)["founded"]
        assert isinstance(founded, int) and INT_MIN <= founded <= INT_MAX, c.text
    digits = max(len(str(abs(json.loads(o.outputs[0].text)["founded"]))) for o in outs)
    assert digits == 19, "no sample reached the bound: this test no longer exercises it"
