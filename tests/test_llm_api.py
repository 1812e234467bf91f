"""The offline `LLM` API, shaped like vLLM's: prompt forms, input order, chat, output field names,
validation errors (ValueError naming the field) that leave the engine usable, and shutdown."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.outputs import CompletionOutput, RequestOutput

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _assert_engine_idle(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_usage == 0.0


def test_generate_accepts_str_list_and_token_id_dicts(llm):
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    single = llm.generate(prompts[0], SP, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == prompts[0]
    many = llm.generate(prompts, SP, use_tqdm=False)
    assert [o.prompt for o in many] == prompts
    assert many[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    ids = [tok.encode(p) for p in prompts]
    one_dict = llm.generate({"prompt_token_ids": ids[1]}, SP, use_tqdm=False)
    assert one_dict[0].prompt_token_ids == ids[1] and one_dict[0].prompt is None
    dicts = llm.generate([{"prompt_token_ids": i} for i in ids], SP, use_tqdm=False)
    assert [o.prompt_token_ids for o in dicts] == ids
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in many]


def test_outputs_come_back_in_input_order(llm):
    # A long prompt first and short ones after: the short ones finish first, yet order holds.
    prompts = ["word " * 150, "Hi", "A", "word " * 60]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 1, 2, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 1, 2, 3]
    ids = [int(o.request_id) for o in outs]
    assert ids == sorted(ids) and len(set(ids)) == 4


def test_chat_with_one_conversation_and_with_a_list(llm):
    conv = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "What is 2+2?"}]
    conv2 = [{"role": "user", "content": "Name a colour."}]
    one = llm.chat(conv, SP, use_tqdm=False)
    assert len(one) == 1
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    assert one[0].prompt_token_ids == expected
    both = llm.chat([conv, conv2], SP, use_tqdm=False)
    assert len(both) == 2
    assert both[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert both[1].prompt_token_ids == tok.apply_chat_template(conv2, add_generation_prompt=True,
                                                               tokenize=True)


def test_output_fields_are_named_as_vllm():
    assert list(inspect.signature(RequestOutput.__init__).parameters)[1:] == [
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
        "metrics", "num_cached_tokens"]
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
        "stop_reason"]


def test_output_values(llm):
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                     logprobs=1), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and out.finished
    assert isinstance(out.request_id, str) and out.prompt == "Hello there"
    assert out.prompt_logprobs is None and out.num_cached_tokens >= 0
    m = out.metrics
    assert m.first_token_time >= m.arrival_time
    assert len(m.inter_token_latencies) == 2 and min(m.inter_token_latencies) >= 0
    assert sum(m.inter_token_latencies) == pytest.approx(m.last_token_time - m.first_token_time)
    c = out.outputs[0]
    assert isinstance(c, CompletionOutput) and c.index == 0
    assert len(c.token_ids) == 3 and c.text == llm.get_tokenizer().decode(c.token_ids)
    assert c.finish_reason == "length" and c.stop_reason is None
    assert len(c.logprobs) == 3 and c.cumulative_logprob < 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(min_p=1.5), "min_p"), (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(temperature=0, n=2), "n"),
])
def test_sampling_params_errors_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_too_many_logprobs_is_a_value_error(llm):
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("Hi", SamplingParams(logprobs=llm.engine_args.max_logprobs + 1),
                     use_tqdm=False)
    _assert_engine_idle(llm)


@pytest.mark.parametrize("bad", [
    "", {"prompt_token_ids": []}, {"prompt_token_ids": [1, 10 ** 7]},
    {"prompt_token_ids": [-1]}, {"prompt_token_ids": [1] * 600}, 3.5, {"text": "hi"},
], ids=["empty-str", "empty-ids", "out-of-vocab", "negative-id", "too-long", "float", "bad-dict"])
def test_bad_prompt_raises_value_error_and_engine_stays_usable(llm, bad):
    with pytest.raises(ValueError):
        llm.generate(["Fine prompt", bad], SP, use_tqdm=False)
    _assert_engine_idle(llm)
    out = llm.generate("Fine prompt", SP, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_sampling_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="same"):
        llm.generate(["a", "b"], [SP], use_tqdm=False)
    _assert_engine_idle(llm)


def test_unknown_engine_argument_is_a_value_error():
    with pytest.raises(ValueError, match="max_num_sequences"):
        LLM(max_num_sequences=4)


def test_num_gpu_blocks_override_sets_the_pool_size():
    from jaxserve.config import EngineArgs
    from jaxserve.worker.kv_sizing import num_kv_blocks
    args = EngineArgs(num_gpu_blocks_override=40)
    assert args.cache_config().num_blocks == 40
    assert num_kv_blocks(args, bytes_per_block=1 << 20, weight_bytes=0) == 40


def test_shutdown_frees_and_generate_after_it_is_a_clear_error():
    with LLM(warmup=False, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2,
             num_gpu_blocks_override=8) as llm:
        assert "shut down" not in repr(llm)
        cache, weights = llm.llm_engine.runner.cache, llm.llm_engine.runner.weights
    assert repr(llm) == "LLM(shut down)"                  # the context manager shut it down
    assert cache.k.is_deleted() and all(a.is_deleted() for a in jax.tree.leaves(weights))
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("Hi", SP, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.chat([{"role": "user", "content": "Hi"}], SP, use_tqdm=False)
    llm.shutdown()                                        # idempotent


@pytest.mark.parametrize("messages, error, match", [
    ("hello", TypeError, r"messages must be a conversation .* got str"),
    ([{"content": "x"}], ValueError, r"messages\[0\] needs a 'role'"),
    ([[{"role": "user", "content": "hi"}], "x"], TypeError, r"messages\[1\] must be a list"),
    ([[{"role": "user", "content": "hi"}], [3]], TypeError, r"messages\[1\]\[0\] must be a dict"),
    ({"role": "user", "content": "hi"}, TypeError, r"messages must be a conversation .* got dict"),
], ids=["str", "no-role", "str-conversation", "int-message", "bare-dict"])
def test_chat_with_malformed_messages_names_the_argument(llm, messages, error, match):
    with pytest.raises(error, match=match):
        llm.chat(messages, SP, use_tqdm=False)
    _assert_engine_idle(llm)


def test_chat_template_errors_are_value_errors_naming_the_messages(llm):
    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"chat template to messages: .*boom"):
        llm.chat(conv, SP, use_tqdm=False, chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(ValueError, match=r"chat template to messages\[1\]: UndefinedError"):
        tagged = [dict(conv[0], meta={"tag": "!"})]
        llm.chat([tagged, conv], SP, use_tqdm=False,
                 chat_template="{% for m in messages %}{{ m.content ~ m.meta.tag }}{% endfor %}")
    _assert_engine_idle(llm)


def test_generate_with_wrong_argument_types_names_the_argument(llm):
    with pytest.raises(TypeError, match=r"prompts must be a str, .* got NoneType"):
        llm.generate(None, SP, use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams .* got dict: "
                                        r"use SamplingParams\(\*\*params\)"):
        llm.generate(["x"], {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got dict"):
        llm.generate(["x", "y"], [SP, {"max_tokens": 2}], use_tqdm=False)
    _assert_engine_idle(llm)


def test_max_tokens_beyond_the_context_is_a_value_error_like_the_servers_400(llm):
    limit = llm.llm_engine.max_model_len
    ids = (llm.get_tokenizer().encode("word " * 600))[:limit - 5]
    with pytest.raises(ValueError, match=rf"maximum context length is {limit} tokens .* "
                                         rf"you requested {limit + 3} tokens \({limit - 5} in "
                                         r"the prompt, 8 in max_tokens\)") as info:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8), use_tqdm=False)
    assert info.value.param == "max_tokens"
    _assert_engine_idle(llm)
    fits = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)   # up to the context
    out = llm.generate({"prompt_token_ids": ids}, fits, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_progress_bar_shows_token_speeds_while_requests_run(llm, monkeypatch):
    import re

    import tqdm.auto

    import jaxserve.llm
    seen = []       # (requests done, postfix) at each postfix change

    class Recording(tqdm.auto.tqdm):
        def set_postfix_str(self, s="", refresh=True):
            seen.append((self.n, s))
            super().set_postfix_str(s, refresh)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    monkeypatch.setattr(jaxserve.llm._Progress, "REFRESH_S", 0.0, raising=False)
    llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    speed = re.compile(r"est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s")
    running = [speed.fullmatch(s) for n, s in seen if n == 0]
    assert any(m and float(m[1]) > 0 and float(m[2]) > 0 for m in running), seen
    last = speed.fullmatch(seen[-1][1])
    assert last and float(last[1]) > 0 and float(last[2]) > 0
