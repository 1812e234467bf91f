"""After warm-up, serving compiles nothing: every program a step can need (each token bucket,
with and without prompt logprobs, every sampler stage, penalties of any length) was built at
start-up. Counted with jax.monitoring: every jit trace and every backend compile (a persistent
cache load included) records an event."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams

# jax._src.dispatch: JAXPR_TRACE_EVENT, BACKEND_COMPILE_EVENT (also fired on cache loads).
_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def count_compilations():
    seen: list[str] = []

    def listener(event, duration, **kwargs):
        if event in _EVENTS:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="module")
def warm_llm():
    # float32: results that do not depend on the batch, so alone and together compare (conftest.py)
    llm = LLM(max_model_len=512, max_num_batched_tokens=128, max_num_seqs=16,
              num_gpu_blocks_override=256, seed=0, dtype="float32")
    yield llm
    llm.shutdown()


def test_the_counter_sees_a_new_shape():
    f = jax.jit(lambda x: x * 2 + 1)
    with count_compilations() as seen:
        f(jnp.zeros(3)).block_until_ready()
        f(jnp.zeros(3)).block_until_ready()      # cached: no new event
        n = len(seen)
        f(jnp.zeros(5)).block_until_ready()      # a new shape: traced and compiled again
    assert n >= 2 and len(seen) > n


def _prompt(llm, n, offset):
    vocab = llm.llm_engine.model_config.vocab_size
    return {"prompt_token_ids": [int(t) for t in (np.arange(n) * 7919 + offset) % (vocab - 200)
                                 + 100]}


def _mix():
    """Every sampler stage and variant, outputs crossing power-of-two lengths (40 tokens)."""
    base = dict(max_tokens=40, ignore_eos=True)
    return [
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=0.9, top_k=20, seed=1, **base),
        SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=2, **base),
        SamplingParams(temperature=0.0, presence_penalty=1.2, frequency_penalty=0.5, **base),
        SamplingParams(temperature=0.8, repetition_penalty=1.4, seed=3, **base),
        SamplingParams(temperature=0.0, logit_bias={1000: 100.0, 2000: -100.0}, **base),
        SamplingParams(temperature=0.0, min_tokens=30, max_tokens=40),
        SamplingParams(temperature=0.0, logprobs=0, **base),
        SamplingParams(temperature=1.0, seed=4, logprobs=5, **base),
        SamplingParams(temperature=0.0, prompt_logprobs=3, **base),
        SamplingParams(temperature=0.5, top_k=3, seed=5, logprobs=5, prompt_logprobs=0,
                       repetition_penalty=1.1, **base),
        # structured output: the bitmask rides in the same programs
        SamplingParams(temperature=0.8, seed=6, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,200}")),
    ]


def test_serving_after_warmup_compiles_nothing(warm_llm):
    llm = warm_llm
    mix = _mix()
    prompts = [_prompt(llm, n, i) for i, n in enumerate([5, 17, 40, 70] * 3)][:len(mix)]
    with count_compilations() as seen:
        together = llm.generate(prompts, mix, use_tqdm=False)       # one mixed batch
        alone = [llm.generate([p], [sp], use_tqdm=False)[0]         # and one at a time
                 for p, sp in zip(prompts[:4], mix[:4])]
    assert seen == [], f"{len(seen)} compilation events while serving"
    for p, sp, out in zip(prompts, mix, together):
        c = out.outputs[0]
        assert len(c.token_ids) == 40 if sp.ignore_eos else len(c.token_ids) >= sp.min_tokens
        if sp.logprobs is not None:
            assert len(c.logprobs) == len(c.token_ids)
            assert all(len(e) in (sp.logprobs, sp.logprobs + 1) and tok in e
                       for e, tok in zip(c.logprobs, c.token_ids))
        if sp.prompt_logprobs is not None:
            n = len(p["prompt_token_ids"])
            assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
            assert all(len(e) >= max(1, sp.prompt_logprobs) for e in out.prompt_logprobs[1:])
    # Greedy and seeded rows do not depend on what shares the batch.
    for a, b in zip(alone, together):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert set(together[5].outputs[0].token_ids) == {1000}       # logit_bias +100 forces it
