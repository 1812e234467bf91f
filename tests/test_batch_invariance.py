"""Batch invariance: a prompt's tokens and logprobs do not depend on what shares its steps.

`--batch-invariant` (EngineArgs.batch_invariant) sends every quantized matmul of the CPU path
through one kernel at every row count; RMSNorm sums each row in one fixed order on CPU
(`layers.norm.row_sum`; XLA:CPU's reduce changes its order from 8 rows). The default path keeps
the faster kernels by row count (bf16 tiles from 16 rows where the CPU multiplies bf16, the fused
kernel up to 4): there a row's logits move with its batch (benchmarks/RESULTS.md: the cost)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.norm import rms_norm, row_sum


@pytest.mark.parametrize("n", [576, 64, 7, 1])
def test_row_sum_is_the_sum_and_one_rows_value_never_moves_with_the_row_count(n):
    rng = np.random.default_rng(n)
    first = rng.standard_normal((1, n)).astype(np.float32) * 3
    alone = np.asarray(jax.jit(row_sum)(first))
    np.testing.assert_allclose(alone, first.sum(-1, keepdims=True), rtol=1e-5, atol=1e-5)
    w = jnp.asarray(rng.standard_normal(n), jnp.float32)
    norm_alone = np.asarray(jax.jit(rms_norm, static_argnums=2)(first, w, 1e-5))
    for rows in (2, 8, 9, 64, 300):
        x = np.concatenate([first, rng.standard_normal((rows - 1, n)).astype(np.float32)])
        assert np.array_equal(np.asarray(jax.jit(row_sum)(x))[:1], alone)
        assert np.array_equal(np.asarray(jax.jit(rms_norm, static_argnums=2)(x, w, 1e-5))[:1], norm_alone)


def _alone_and_in_a_batch(llm):
    from jaxserve import SamplingParams
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=0)
    others = [f"Tell me about topic number {i}: the history of" for i in range(19)]
    alone = llm.generate(["Bees make"], sp, use_tqdm=False)[0].outputs[0]
    batch = llm.generate(["Bees make", *others], sp, use_tqdm=False)[0].outputs[0]
    lps = lambda o: [next(iter(d.values())).logprob for d in o.logprobs]   # noqa: E731
    return (alone.token_ids, lps(alone)), (batch.token_ids, lps(batch))


@pytest.mark.slow
def test_default_model_gives_one_answer_alone_and_in_a_batch_of_20():
    """The default model (GGUF weights kept quantized, `--dtype auto`): bit for bit the same
    greedy tokens and logprobs alone as in a batch of 20 prompts (decode and prefill steps of
    1 to ~240 rows)."""
    from conftest import engine_variant

    from jaxserve import LLM, SamplingParams
    with LLM(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256, batch_invariant=True,
             warmup=False) as llm:
        w = llm.llm_engine.runner.weights
        assert w.layers.wq.fused_max_rows is None or w.layers.wq.bf16_min_rows is None
        alone, batch = _alone_and_in_a_batch(llm)
        # Async scheduling on and off: bit for bit the same tokens, logprobs and stops (a stopped
        # request's one extra step in async mode changes its batch, not anyone's numbers here).
        sp = SamplingParams(max_tokens=16, temperature=0.9, seed=4, logprobs=2, stop=[" the"])
        prompts = ["Bees make", "The river", "def f(x):", "Once upon"]
        runs = []
        for asynchronous in (False, True):
            with engine_variant(llm, async_scheduling=asynchronous):
                runs.append([(c.token_ids, c.text, c.finish_reason,
                              [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
                             for o in llm.generate(prompts, sp, use_tqdm=False) for c in o.outputs])
    assert alone == batch
    assert runs[0] == runs[1]


def test_batch_invariant_is_refused_where_it_is_not_built():
    from jaxserve.aot.compiler import compile_engine
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match="batch_invariant is implemented on the CPU only"):
        compile_engine(EngineArgs(batch_invariant=True), "h100", "/nonexistent")


TINY = dict(model=str(__import__("pathlib").Path(__file__).resolve().parent / "data" / "tiny-llama"),
            load_format="dummy", max_model_len=128, num_gpu_blocks_override=16, warmup=False)


@pytest.mark.parametrize("why, kwargs", [
    ("quantized linear layers", TINY),                                  # dense weights: XLA's dot
    ("f32 activations", dict(TINY, dtype="bfloat16")),
])
def test_batch_invariant_is_refused_where_it_cannot_hold(why, kwargs):
    from jaxserve import LLM
    with pytest.raises(ValueError, match=f"batch_invariant needs {why}"):
        LLM(batch_invariant=True, **kwargs)


def test_batch_invariant_needs_one_device_and_the_cpu_attention_kernel():
    from jaxserve import LLM
    from jaxserve.loader.loader import _batch_invariant
    with pytest.raises(ValueError, match="batch_invariant needs one device"):
        _batch_invariant({}, "auto", 2, "cpu", quantized=True)
    with pytest.raises(ValueError, match="batch_invariant needs the CPU"):
        _batch_invariant({}, "float32", 1, "gpu", quantized=True)
    with pytest.raises(ValueError, match="batch_invariant needs the CPU attention kernel"):
        LLM(batch_invariant=True, kv_cache_dtype="fp8", max_model_len=128, num_gpu_blocks_override=16,
            warmup=False)
