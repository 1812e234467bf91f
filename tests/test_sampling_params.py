"""SamplingParams: vLLM's defaults, normalisation and validation messages."""

import pytest

from jaxserve.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert p.logprobs is None and p.prompt_logprobs is None and p.logit_bias is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature must be non-negative, got -1."),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan."),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number, got inf."),
    (dict(top_p=float("nan")), "top_p must be a finite number, got nan."),
    (dict(seed=2**64), "seed must fit in 64 bits ([-2**63, 2**64)), got 18446744073709551616."),
    (dict(logit_bias={5: float("nan")}), "logit_bias must map non-negative token ids to finite "
                                         "numbers, got 5: nan."),
    (dict(logit_bias={-3: 1.0}), "logit_bias must map non-negative token ids to finite numbers, "
                                 "got -3: 1.0."),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(min_tokens=5, max_tokens=2), "min_tokens must be less than or equal to max_tokens=2, got 5."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(logprobs=-1), "logprobs must be non-negative, got -1."),
    (dict(prompt_logprobs=-2), "prompt_logprobs must be non-negative, got -2."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3."),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (dict(stop=["ok", ""]), "stop cannot contain an empty string."),
    (dict(n=2, best_of=1), "best_of must be greater than or equal to n, got n=2 and best_of=1."),
    (dict(n=2, temperature=0.0), "n must be 1 when using greedy sampling, got 2."),
])
def test_validation_messages_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message


def test_non_int_fields_rejected_with_field_name():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=1.5)
    with pytest.raises(ValueError, match="^n must be an int"):
        SamplingParams(n="2")


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=None, seed=-1,
                       logit_bias={"5": 1.5, 7: -300}, output_kind=1, max_tokens=None)
    assert p.top_k == 0 and p.stop == ["###"] and p.stop_token_ids == [] and p.seed is None
    assert p.logit_bias == {5: 1.5, 7: -100.0}
    assert p.output_kind is RequestOutputKind.DELTA and p.max_tokens is None
    assert p.output_text_buffer_length == 2
    assert SamplingParams(stop="###", include_stop_str_in_output=True).output_text_buffer_length == 0


def test_greedy_resets_filters():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_stop_token_ids_and_eos():
    p = SamplingParams(stop_token_ids=[7, 9])
    assert p.all_stop_token_ids == {7, 9}
    p.update_from_tokenizer(2)
    assert p.eos_token_ids == {2} and p.all_stop_token_ids == {2, 7, 9}
    q = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    q.update_from_tokenizer([2, 3])
    assert q.all_stop_token_ids == {7}
    r = SamplingParams()
    r.update_from_generation_config({"eos_token_id": [4, 5]}, model_eos_token_id=2)
    assert r.eos_token_ids == {2, 4, 5}


def test_clone_is_deep_and_from_optional_uses_defaults():
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    p.update_from_tokenizer(2)
    c = p.clone()
    c.stop.append("b")
    c.logit_bias[2] = 2.0
    assert p.stop == ["a"] and p.logit_bias == {1: 1.0} and c.eos_token_ids == {2}
    q = SamplingParams.from_optional(temperature=None, top_p=None, max_tokens=None, n=2)
    assert q.temperature == 1.0 and q.top_p == 1.0 and q.max_tokens is None and q.n == 2
    assert p.replace(n=3).n == 3
    with pytest.raises(ValueError, match="temperature"):
        p.replace(temperature=-0.5)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
