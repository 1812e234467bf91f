"""attention_backend selection (the platform and jax version injected) and the engine end to end on
the Mosaic GPU backend in interpret mode (jax >= 0.11) against the reference backend's tokens."""
from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxserve.attention.backend import AttentionCase, Platform, select_backend
from jaxserve.pallas.measured import Measurement

H100 = Platform("gpu", "9.0", (0, 11))
H100_OLD_JAX = Platform("gpu", "9.0", (0, 10))
A100 = Platform("gpu", "8.0", (0, 11))
CPU = Platform("cpu", None, (0, 11))
CPU_OLD_JAX = Platform("cpu", None, (0, 10))
BF16 = AttentionCase(jnp.bfloat16, jnp.bfloat16, 32, 8, 128, 16)      # Llama-3.1-8B in bf16
# What `auto` would pick once every kernel is measured everywhere (the shipped table, which holds
# only what a GPU has measured, is tested in tests/test_kernel_fallback.py).
ALL_MEASURED = tuple(Measurement(k, d, None, None, "test") for k in ("attention/mosaic", "attention/pallas")
                     for d in ("sm80", "sm90"))


def case(**kw) -> AttentionCase:
    return AttentionCase(**{**BF16.__dict__, **kw})


@pytest.mark.parametrize("platform, want", [(H100, "mosaic"), (H100_OLD_JAX, "pallas"), (A100, "pallas"),
                                            (CPU, "reference"), (CPU_OLD_JAX, "reference")])
def test_auto_picks_mosaic_only_on_hopper_with_new_jax(platform, want):
    assert select_backend("auto", BF16, platform, measured=ALL_MEASURED) == want


@pytest.mark.parametrize("unsupported", [
    dict(kv_dtype=jnp.float32),                       # f32 cache: no wgmma path yet
    dict(q_dtype=jnp.float16, kv_dtype=jnp.float16),
    dict(head_dim=96),
    dict(q_dtype=jnp.float32, kv_dtype=jnp.bfloat16, head_dim=256),   # over shared memory
    dict(block_size=12),
    dict(block_size=48),                              # does not divide a 64..256-token chunk
    dict(num_q_heads=128, num_kv_heads=1),            # GQA ratio over one wgmma tile
    dict(head_dim=256),                               # spills registers on an H100 (compile report)
])
def test_auto_falls_back_to_triton_on_hopper_for_unsupported_cases(unsupported):
    assert select_backend("auto", case(**unsupported), H100, measured=ALL_MEASURED) == "pallas"


@pytest.mark.parametrize("supported", [dict(kv_dtype=jnp.float8_e4m3fn), dict(kv_dtype=jnp.int8),
                                       dict(q_dtype=jnp.float32, kv_dtype=jnp.int8, head_dim=64),
                                       dict(head_dim=64), dict(block_size=32), dict(block_size=64)])
def test_auto_picks_mosaic_on_hopper_for_supported_cases(supported):
    assert select_backend("auto", case(**supported), H100, measured=ALL_MEASURED) == "mosaic"


@pytest.mark.parametrize("platform, unsupported, words", [
    (H100_OLD_JAX, {}, "jax >= 0.11"),
    (CPU_OLD_JAX, {}, "jax >= 0.11"),
    (A100, {}, "Hopper"),
    (H100, dict(kv_dtype=jnp.float32), "KV cache dtype float32"),
    (H100, dict(head_dim=96), "head_dim 96"),
    (H100, dict(block_size=48), "block_size 48"),
    (Platform("tpu", None, (0, 11)), {}, "tpu"),
])
def test_mosaic_where_it_cannot_run_is_a_value_error_naming_why(platform, unsupported, words):
    with pytest.raises(ValueError, match=f"attention_backend='mosaic'.*{words}"):
        select_backend("mosaic", case(**unsupported), platform)


def test_explicit_backends_and_aliases():
    assert select_backend("mosaic", BF16, H100) == "mosaic"
    assert select_backend("mosaic", BF16, CPU) == "mosaic"          # interpreted off GPU
    assert select_backend("pallas", BF16, CPU) == "pallas"
    assert select_backend("triton", BF16, H100) == "pallas"
    assert select_backend("reference", BF16, H100) == "reference"
    with pytest.raises(ValueError, match="attention_backend must be"):
        select_backend("flash", BF16, H100)


def test_engine_args_accept_the_new_names():
    from jaxserve.config import EngineArgs
    for name in ("mosaic", "triton"):
        assert EngineArgs(attention_backend=name).attention_backend == name


def test_engine_refuses_mosaic_it_cannot_run():
    """An f32 model with an f32 cache is outside the kernel (or jax is too old): the engine says
    so at start-up instead of failing inside the first step."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import make_cpu_tokens as m

    from jaxserve import LLM
    with pytest.raises(ValueError, match="attention_backend='mosaic'"):
        LLM(model=m.TINY, attention_backend="mosaic", **m.SETTINGS)


def _mgpu_available() -> bool:
    from jaxserve.pallas.paged_attention_mgpu import MGPU_AVAILABLE
    return MGPU_AVAILABLE


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU interpret mode needs jax >= 0.11")
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_engine_on_mosaic_backend_interpreted_matches_reference_tokens(kv):
    """The seeded dummy tiny Llama (f32 q, int8 or fp8 KV: cases the kernel supports; the CPU fp8
    pool is uint8 bit patterns, bitcast for the kernel) through the whole engine with the Mosaic
    GPU kernel in interpret mode: greedy tokens equal the reference backend's. Small on purpose
    (the interpreter costs seconds per call)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import make_cpu_tokens as m

    from jaxserve import LLM, SamplingParams
    settings = dict(m.SETTINGS, kv_cache_dtype=kv, max_model_len=128, max_num_seqs=2,
                    max_num_batched_tokens=32)
    prompts = [{"prompt_token_ids": p} for p in m.prompts()[1:3]]       # 17 and 40 tokens
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    got = {}
    for backend in ("reference", "mosaic"):
        with LLM(model=m.TINY, attention_backend=backend, warmup=False, **settings) as llm:
            assert llm.llm_engine.attention_backend == backend
            got[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got["mosaic"] == got["reference"]
