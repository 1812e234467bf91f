"""GPU-only checks (`pytest -m gpu`): the Pallas kernels compiled for the device (not interpreted)
against the dense oracle, and the whole engine on the Pallas backend. Skipped without a GPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_paged_attention_kernel import CASES, DECODE_CASES, TOL, make_batch, max_err

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def reference(*args, **kwargs):
    """The dense oracle with every XLA dot in full f32: on a GPU the default f32 matmul is TF32
    (the f32 kernels run HIGHEST and must be compared with an oracle that does too)."""
    import jax

    from jaxserve.pallas.paged_attention import ref_ragged_paged_attention
    with jax.default_matmul_precision("highest"):
        return ref_ragged_paged_attention(*args, **kwargs)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].q_lens])
def test_ragged_kernel_compiled_matches_oracle(name):
    from jaxserve.pallas.paged_attention import ragged_paged_attention
    case = CASES[name]
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window,
                soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    out = ragged_paged_attention(q, k, v, meta, interpret=False, block_sizes=case.blocks, **args)
    assert max_err(out, reference(q, k, v, meta, **args)) <= TOL[case.dtype]


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_split_k_decode_compiled_matches_oracle(name):
    from jaxserve.pallas.paged_attention_decode import ragged_paged_attention_decode
    case = DECODE_CASES[name]
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window,
                soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    out = ragged_paged_attention_decode(q, k, v, meta, interpret=False, **args)
    assert max_err(out, reference(q, k, v, meta, **args)) <= TOL[case.dtype]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_engine_on_gpu_matches_cpu_tokens_and_reference_backend():
    """The seeded dummy tiny Llama (f32, highest matmul precision) on the GPU, with the XLA
    reference attention and with the Pallas kernel, against greedy tokens computed on CPU
    (`benchmarks/make_cpu_tokens.py`, carried as tests/data/tiny-llama/cpu_greedy.json).
    Random weights have near-tied logits, so a rare flip is reported, not hidden: agreement
    is printed and must stay >= 0.9 (1.0 expected)."""
    import jax
    import make_cpu_tokens as m

    from jaxserve import LLM
    want = json.loads(Path(m.TINY, "cpu_greedy.json").read_text())
    got = {}
    with jax.default_matmul_precision("highest"):
        for backend in ("reference", "pallas"):
            with LLM(model=m.TINY, attention_backend=backend, **want["settings"]) as llm:
                got[backend] = m.greedy(llm)
    for backend, tokens in got.items():
        print(f"{backend}: agreement with CPU tokens {_agreement(tokens, want['tokens']):.3f}")
    print(f"pallas vs reference on GPU: {_agreement(got['pallas'], got['reference']):.3f}")
    assert _agreement(got["reference"], want["tokens"]) >= 0.9
    assert _agreement(got["pallas"], got["reference"]) >= 0.9


def test_engine_on_mosaic_backend_matches_reference_backend_on_gpu():
    """The Mosaic GPU kernel inside the engine against the XLA reference attention on the same
    GPU, on the seeded dummy tiny Llama: f32 model with an int8 KV cache (the kernel splits f32 q
    into bf16 parts: near-f32, tokens expected equal) and a bf16 model (bf16 rounding differs
    between the paths and random weights have near-ties: agreement reported, loosely bounded).
    On a Hopper GPU with jax >= 0.11, `auto` picks the Mosaic kernel for the bf16 model exactly when
    jaxserve/pallas/measured.py records a measurement of it."""
    import jax
    import make_cpu_tokens as m

    from jaxserve import LLM
    from jaxserve.attention.backend import current_platform
    want = json.loads(Path(m.TINY, "cpu_greedy.json").read_text())
    variants = {"f32 + int8 KV": dict(want["settings"], kv_cache_dtype="int8"),
                "bf16": dict(want["settings"], dtype="bfloat16")}
    platform = current_platform()
    if not platform.hopper or platform.jax_version < (0, 11):
        pytest.skip(f"Mosaic GPU needs Hopper and jax >= 0.11: {platform}")
    agreement = {}
    with jax.default_matmul_precision("highest"):
        for label, settings in variants.items():
            got = {}
            for backend in ("reference", "mosaic", "auto"):
                if backend == "auto" and label != "bf16":
                    continue
                with LLM(model=m.TINY, attention_backend=backend, **settings) as llm:
                    if backend == "auto":   # Mosaic only once a GPU measurement is recorded
                        from jaxserve.pallas import measured
                        mosaic_measured = measured.find("attention/mosaic", platform.compute_capability,
                                                        "bfloat16") is not None
                        assert (llm.llm_engine.attention_backend == "mosaic") == mosaic_measured
                        continue
                    got[backend] = m.greedy(llm)
            agreement[label] = _agreement(got["mosaic"], got["reference"])
            print(f"mosaic vs reference on GPU, {label}: agreement {agreement[label]:.3f}")
    assert agreement["f32 + int8 KV"] >= 0.9
    assert agreement["bf16"] >= 0.5


def test_kv_pool_sized_by_profile_run_fills_the_utilization_target():
    """No kv_cache_memory_bytes: the pool is gpu_memory_utilization of the device limit minus the
    profiled peak (jaxserve/worker/kv_sizing.py), so after start-up the device holds about that
    fraction (prints the figures)."""
    import make_cpu_tokens as m

    from jaxserve import LLM
    from jaxserve.worker.kv_sizing import device_memory_stats
    settings = dict(m.SETTINGS, kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)
    with LLM(model=m.TINY, warmup=False, **settings) as llm:
        stats = device_memory_stats()
        if not stats or "bytes_limit" not in stats:
            pytest.skip("this device reports no memory statistics")
        used = stats["bytes_in_use"] / stats["bytes_limit"]
        print(f"profile-sized pool: {llm.llm_engine.cache_config.num_blocks} blocks; device "
              f"{stats['bytes_in_use'] / 2**30:.2f} of {stats['bytes_limit'] / 2**30:.2f} GiB in use "
              f"({used:.1%}), peak {stats.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB")
        assert 0.35 <= used <= 0.52
        assert len(m.greedy(llm)) == len(m.prompts())
