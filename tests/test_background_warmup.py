"""The background warm-up (`LLMEngine(warmup="background")`, what `jaxserve serve` uses): the
engine is ready once the decode and 16-token programs are built; the rest compile on one
compiler thread, smallest first. While they do, steps stay within the built buckets or wait for
the program they need (a prompt-logprobs request): every program is compiled exactly once, on
the compiler thread, never on the step's. Once it is done, serving compiles nothing. And the
persistent compilation cache answers a second start whose flags change no shapes."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.worker.compile_queue import BackgroundCompiler

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


def test_a_waited_program_jumps_the_queue_and_is_compiled_once_on_the_compiler_thread():
    first_started, release = threading.Event(), threading.Event()
    calls = []

    def compile_fn(key):
        calls.append((key, threading.current_thread().name))
        if key == "a":
            first_started.set()
            release.wait(30)
        if key == "bad":
            raise RuntimeError("no such program")
        return f"exe-{key}"

    c = BackgroundCompiler(compile_fn, ["a", "b", "c", "d", "bad"])
    assert first_started.wait(30)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(c=c.get("c")))
    waiter.start()
    while c.queued[:1] != ["c"]:        # the waiter moved "c" ahead of "b"
        pass
    assert c.queued == ["c", "b", "d", "bad"] and c.pending == 5
    release.set()
    waiter.join(30)
    assert got == {"c": "exe-c"}
    c.wait(30)
    assert [k for k, _ in calls] == ["a", "c", "b", "d", "bad"]
    assert {name for _, name in calls} == {"jaxserve-compile"}
    assert c.get("a") == "exe-a" and c.get("c") == "exe-c" and len(calls) == 5   # no second compile
    assert c.ready("d") and not c.ready("bad")
    with pytest.raises(RuntimeError, match="no such program"):
        c.get("bad")
    c.close()


@pytest.fixture(scope="module")
def background_llm():
    events = collections.Counter()

    def listener(event, duration, **kwargs):
        if event in _EVENTS:
            events[(threading.current_thread().name, event)] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    llm = LLM(max_model_len=512, max_num_batched_tokens=128, max_num_seqs=16,
              num_gpu_blocks_override=256, seed=0, warmup="background")
    yield llm, events
    jax.monitoring.unregister_event_duration_listener(listener)
    llm.shutdown()


def _prompt(llm, n, offset):
    vocab = llm.llm_engine.model_config.vocab_size
    return {"prompt_token_ids": [(i * 7919 + offset) % (vocab - 200) + 100 for i in range(n)]}


def test_serves_while_compiling_then_compiles_nothing(background_llm):
    llm, events = background_llm
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    # the plain programs up to 16 tokens: 1, 2, 16, and on the default model's fused int4
    # kernel 4 and 8 too (`token_buckets(few_rows=True)`)
    up_front = [(T, False) for T in (1, 2, 4, 8, 16)]
    later = [k for k in runner.warmup_keys() if k not in up_front]
    assert len(later) == 9 and set(up_front) <= set(runner.compiled_programs)
    before = {k: v for k, v in events.items() if k[0] != "jaxserve-compile"}
    steps = []      # (tokens, the step's token cap) of each step
    engine.fault_hook = lambda s: steps.append((sum(len(x.token_ids) for x in s.scheduled),
                                                runner.ready_token_budget()))
    prompts = [_prompt(llm, n, i) for i, n in enumerate([70, 40, 100])]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # a prompt-logprobs step needs a variant the compiler has not reached: it waits for it
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate(prompts + [_prompt(llm, 30, 9)], [greedy] * 3 + [scored], use_tqdm=False)
    assert any(cap is not None for _, cap in steps), "nothing ran while compiling"
    assert all(cap is None or n <= cap for n, cap in steps), steps
    assert len(first[3].prompt_logprobs) == 30
    # nothing traced or compiled on the step's thread while serving
    assert {k: v for k, v in events.items() if k[0] != "jaxserve-compile"} == before
    engine.wait_for_programs(timeout=1200)
    assert runner.compiled_programs == sorted(runner.warmup_keys())
    compiles = events[("jaxserve-compile", "/jax/core/compile/backend_compile_duration")]
    assert compiles == len(later), "each background program compiled exactly once"
    steps.clear()
    seen = sum(events.values())
    again = llm.generate(prompts, [greedy] * 3, use_tqdm=False)
    assert sum(events.values()) == seen, "compiled while serving after the warm-up"
    assert any(n > 16 for n, _ in steps) and all(cap is None for _, cap in steps)
    # 16-token chunks while compiling, whole prompts after: the same greedy tokens
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first[:3]]


CHILD = """
import json, sys
from jaxserve import LLM
llm = LLM(max_model_len=256, max_num_batched_tokens=16, num_gpu_blocks_override=64,
          compilation_cache_dir=sys.argv[1], program_cache_dir="", **json.loads(sys.argv[2]))
print("PROGRAMS", llm.llm_engine.runner.programs_obtained())
"""


def test_flags_that_change_no_shape_hit_the_persistent_cache(tmp_path):
    def start(**flags) -> str:
        out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "xla"), json.dumps(flags)],
                             capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert out.returncode == 0, out.stderr[-3000:]
        return [line for line in out.stdout.splitlines() if line.startswith("PROGRAMS")][0]

    # the step programs of buckets 1, 2, 4, 8, 16 (4 and 8: the fused int4 kernel) and their
    # prompt-logprobs variants that differ (from 4 tokens on), and the penalty-row write
    assert start() == "PROGRAMS 0 loaded from the compilation cache, 8 compiled"
    assert start(seed=7, enable_prefix_caching=False, served_model_name="other",
                 generation_config="vllm", gpu_memory_utilization=0.5) == \
        "PROGRAMS 8 loaded from the compilation cache, 0 compiled"
