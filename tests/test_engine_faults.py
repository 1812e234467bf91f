"""Engine reliability on the shared default-model engine: a model step that raises fails only its
own requests (and leaves no prefix-cache entry for K/V it never wrote), prompt logprobs survive a
preemption mid-prompt, and refused requests leave nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import SamplingParams
from jaxserve.core.request import RequestStatus

LONG = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from "
        "wine making. Within fifty years presses were running in more than two hundred cities "
        "across Europe, and the price of books fell so far that ordinary merchants could own "
        "them.")
TINY_LLAMA = Path(__file__).parent / "data" / "tiny-llama"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _drain(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


class StepFault(RuntimeError):
    pass


def _fail_steps_with(engine, request_id: str):
    """Make the model step raise whenever it computes `request_id`."""
    def hook(sched):
        if any(row.request_id == request_id for row in sched.scheduled):
            raise StepFault(f"injected fault in the step of {request_id}")
    engine.fault_hook = hook


def test_prompt_logprobs_after_preemption_mid_prompt_land_at_their_positions(llm, variant):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    ref = llm.generate(LONG, params, use_tqdm=False)[0].prompt_logprobs
    with variant(llm, max_num_batched_tokens=16) as sched:
        engine.add_request("pre", LONG, params)
        engine.step()
        engine.step()                               # two 16-token chunks of the prompt
        request = sched.get_request("pre")
        assert request.num_computed_tokens == 32 < request.num_prompt_tokens
        sched._preempt(request)                     # as when the pool runs dry: back to 0
        assert request.num_computed_tokens == 0 and request.status == RequestStatus.PREEMPTED
        got = _drain(engine)["pre"].prompt_logprobs
    assert len(got) == len(ref) and got[0] is None
    ids = engine.tokenizer.encode(LONG)
    for pos in range(1, len(ref)):          # each entry scores the prompt token at its position
        assert got[pos][ids[pos]].logprob == pytest.approx(ref[pos][ids[pos]].logprob,
                                                           abs=1e-4), pos


def test_failed_step_fails_only_its_requests_and_the_engine_keeps_serving(llm):
    engine = llm.llm_engine
    alone = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    failed_before = engine.num_failed_steps     # the engine is shared: other files fail steps too
    engine.add_request("ok", "The capital of France is", GREEDY)
    engine.step()                                   # "ok" is prefilled before the fault
    _fail_steps_with(engine, "bad")
    try:
        engine.add_request("bad", LONG, GREEDY)
        failed = engine.step()                      # "ok" shares this step: it fails too
        engine.fault_hook = None
        engine.add_request("later", "The capital of France is", GREEDY)
        finals = _drain(engine)
    finally:
        engine.fault_hook = None
    reasons = {o.request_id: o.outputs[0].finish_reason for o in failed}
    assert reasons == {"bad": "error", "ok": "error"}
    assert all(o.finished for o in failed)
    assert engine.num_failed_steps == failed_before + 1 and isinstance(engine.last_step_error, StepFault)
    assert finals["later"].outputs[0].token_ids == alone.token_ids
    assert engine.scheduler.kv_cache_usage == 0.0 and not engine.processor.has("bad")


def test_failed_step_uncaches_the_prefix_blocks_it_would_have_written(llm):
    engine = llm.llm_engine
    pool = engine.scheduler.kv_cache_manager.block_pool
    prompt = LONG + " Printing changed everything."    # not cached by an earlier test
    ref = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert pool.reset_prefix_cache()
    hashes_before = len(pool.cached_block_hash_to_block)
    _fail_steps_with(engine, "f1")
    try:
        engine.add_request("f1", prompt, GREEDY)
        engine.add_request("f2", prompt, GREEDY)    # same step: hits f1's fresh blocks
        failed = engine.step()
    finally:
        engine.fault_hook = None
    assert {o.request_id for o in failed} == {"f1", "f2"}
    assert len(pool.cached_block_hash_to_block) == hashes_before   # no hash on unwritten K/V
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids


def test_n_with_a_colliding_child_id_adds_nothing(llm):
    engine = llm.llm_engine
    engine.add_request("1_dup", "Hi", GREEDY)
    with pytest.raises(ValueError, match="'1_dup'"):
        engine.add_request("dup", "Hello there", SamplingParams(n=2, max_tokens=2))
    assert engine.scheduler.get_num_unfinished_requests() == 1
    assert engine.scheduler.get_request("0_dup") is None and not engine.processor.has("dup")
    finals = _drain(engine)
    assert set(finals) == {"1_dup"} and engine.scheduler.kv_cache_usage == 0.0


@pytest.mark.parametrize("params, field", [
    (SamplingParams(best_of=3, temperature=1.0, max_tokens=2), "best_of"),
])
def test_not_supported_yet_is_refused_not_ignored(llm, params, field):
    """A field the engine cannot honour is a ValueError naming it, never silently dropped."""
    with pytest.raises(ValueError, match=field) as info:
        llm.generate("Hi", params, use_tqdm=False)
    assert info.value.param == field and not llm.llm_engine.has_unfinished_requests()


def test_prompt_longer_than_the_whole_kv_pool_is_a_value_error(llm, variant):
    engine = llm.llm_engine
    with variant(llm, num_blocks=4):               # 4 x 16 = 64 tokens in the whole pool
        with pytest.raises(ValueError, match=r"prompt \(\d+ tokens\) is longer than the whole "
                                             r"KV cache") as info:
            llm.generate(LONG * 2, GREEDY, use_tqdm=False)
        assert info.value.param == "prompt"
        assert not engine.has_unfinished_requests()
        out = llm.generate("Hi", GREEDY, use_tqdm=False)[0]   # a prompt that fits still runs
        assert out.outputs[0].finish_reason == "length"


_JAX_CACHE_CONFIG = """
import json, sys
import jax
from jaxserve import LLM
names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes")
before = [getattr(jax.config, n) for n in names]
kwargs = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], load_format="dummy", warmup=False, max_model_len=64,
          num_gpu_blocks_override=8, max_num_batched_tokens=16, max_num_seqs=2, **kwargs)
llm.generate("t1 t2", use_tqdm=False)
llm.shutdown()
print(json.dumps({"before": before, "after": [getattr(jax.config, n) for n in names]}))
"""


def _jax_cache_config_around_llm(**kwargs) -> dict:
    """jax.config's persistent-cache settings before and after LLM() in a fresh process (this
    one has the cache on: conftest)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    res = subprocess.run([sys.executable, "-c", _JAX_CACHE_CONFIG, str(TINY_LLAMA),
                          json.dumps(kwargs)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_llm_leaves_process_wide_jax_config_alone_without_compilation_cache_dir():
    """A notebook's own jitted functions must not start landing in jaxserve's cache directory."""
    got = _jax_cache_config_around_llm()
    assert got["before"] == [None, 1.0, 0]
    assert got["after"] == got["before"]


def test_llm_with_compilation_cache_dir_turns_the_cache_on(tmp_path):
    got = _jax_cache_config_around_llm(compilation_cache_dir=str(tmp_path / "xla"))
    assert got["after"] == [str(tmp_path / "xla"), 0.0, -1]


def test_constructing_an_engine_leaves_jax_compilation_cache_config_alone(tmp_path):
    import jax

    from jaxserve import LLM
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    try:
        llm = LLM(str(TINY_LLAMA), load_format="dummy", warmup=False, max_model_len=64,
                  num_gpu_blocks_override=8, max_num_batched_tokens=16, max_num_seqs=2)
        llm.shutdown()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == before[1]
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
