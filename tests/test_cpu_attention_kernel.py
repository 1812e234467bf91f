"""The CPU paged attention kernel (attention backend "cpu": attention/cpu_kernel.py,
layers/csrc/paged_attention.cc) inside the reference path: the same results as the dense oracle on
every case of the kernel tests (quantised or bf16 caches by the reference path as before), sliding
windows static and per layer, soft cap, attention sinks; a prompt's numbers the same whether it is
attended in one chunk or several; and where "auto" picks it."""

from __future__ import annotations

import ctypes
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention_kernel import CASES, TOL, Case, make_batch, max_err, naive_attention
from test_reference_attention import MANY_ROWS, SMALL_ROWS

from jaxserve.attention import reference
from jaxserve.layers import int4_cpu
from jaxserve.pallas.paged_attention import ref_ragged_paged_attention


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert int4_cpu.load() is None, int4_cpu.load()


def _run(case, seed=0, **kw):
    q, k, v, meta, ks, vs = make_batch(case, seed)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window, soft_cap=case.soft_cap,
                k_scale=ks, v_scale=vs)
    fn = jax.jit(lambda q, k, v, meta, ks, vs: reference.ragged_paged_attention_ref(
        q, k, v, meta, **{**args, "k_scale": ks, "v_scale": vs}, cpu_kernel=True, **kw))
    text = fn.lower(q, k, v, meta, ks, vs).as_text()
    return fn(q, k, v, meta, ks, vs), ref_ragged_paged_attention(q, k, v, meta, **args), text, meta


@pytest.mark.parametrize("name", list(CASES))
def test_every_kernel_case_matches_the_oracle(name):
    case = CASES[name]
    got, want, text, meta = _run(case, seed=sum(map(ord, name)))
    assert max_err(got, want) <= TOL[case.dtype], name
    assert not np.asarray(got[int(meta.cu_q_lens[-1]):]).any()       # padding tokens stay zero
    takes = case.kv == "int8" or (case.kv == "auto" and case.dtype in ("float32", "bfloat16"))
    assert (int4_cpu.ATTENTION_TARGET in text) == takes, "the kernel takes f32, bf16 or int8 K/V pages only"


INT8_CASES = {
    "decode": Case(q_lens=(1, 1, 1, 1), ctx=(5, 40, 16, 99), T=8, S=6, kv="int8"),
    "prefill_chunk_on_prefix": Case(q_lens=(24,), ctx=(45,), T=32, S=2, kv="int8"),
    "window_and_cap_gqa3": Case(q_lens=(1, 6, 1), ctx=(60, 11, 90), T=16, S=3, K=2, G=3, window=33,
                                soft_cap=5.0, kv="int8"),
    "mqa_d128_b32": Case(q_lens=(3, 1), ctx=(50, 70), T=8, S=2, K=1, G=4, D=128, B=32, M=4, kv="int8"),
    "head_dim_40": Case(q_lens=(1, 5), ctx=(9, 30), T=8, S=2, K=1, G=2, D=40, kv="int8"),    # no whole vector
}


@pytest.mark.parametrize("name", list(INT8_CASES))
def test_int8_pages_match_the_oracle(name):
    """An int8 KV cache (`--kv-cache-dtype int8`: codes and a scale per token and kv head) read by
    the kernel: the oracle's numbers (which dequantise the pages first) to f32 rounding."""
    got, want, text, meta = _run(INT8_CASES[name], seed=sum(map(ord, name)))
    assert int4_cpu.ATTENTION_TARGET in text
    assert max_err(got, want) <= TOL["float32"], name


@pytest.mark.parametrize("name", ["decode", "prefill_chunk_on_prefix", "window_and_cap_gqa3", "head_dim_40"])
def test_bf16_pages_with_f32_queries_match_the_oracle(name):
    """`--kv-cache-dtype bfloat16` on the CPU (f32 activations, bf16 pages: half the pool's memory,
    llama.cpp's default KV size): the kernel reads the pages widened exactly, so the oracle's
    numbers (on the same bf16 pages) to f32 rounding."""
    case = dataclasses.replace(INT8_CASES[name], kv="bfloat16")
    got, want, text, meta = _run(case, seed=sum(map(ord, name)))
    assert int4_cpu.ATTENTION_TARGET in text
    assert max_err(got, want) <= TOL["float32"], name


@pytest.fixture(scope="module")
def avx2_target():
    """The kernel compiled without AVX-512 (8-lane vectors), registered under its own name: the
    AVX2 path is checked whatever this CPU's best build is."""
    try:
        with open("/proc/cpuinfo") as f:
            if " avx2" not in f.read():
                pytest.skip("needs a CPU with AVX2")
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    lib = ctypes.CDLL(str(int4_cpu.build(int4_cpu._compiler(), ("-mno-avx512f",))))
    jax.ffi.register_ffi_target("jaxserve_paged_attention_avx2", jax.ffi.pycapsule(lib.JaxservePagedAttention),
                                platform="cpu")
    return "jaxserve_paged_attention_avx2"


@pytest.mark.parametrize("name", ["decode_only", "prefill_chunk_on_prefix", "mixed_empty_rows_padding_gqa8",
                                  "gqa_ratio_3_padded_heads", "head_dim_256", "window_and_cap_b32"])
def test_the_avx2_build_matches_the_oracle(name, avx2_target, monkeypatch):
    monkeypatch.setattr(int4_cpu, "ATTENTION_TARGET", avx2_target)
    case = dataclasses.replace(CASES[name], kv="auto", dtype="float32")
    got, want, text, _ = _run(case, seed=sum(map(ord, name)))
    assert avx2_target in text
    assert max_err(got, want) <= TOL[case.dtype], name


@pytest.mark.parametrize("name", list(MANY_ROWS))
def test_decodes_and_tiles_side_by_side(name, monkeypatch):
    """Decodes, chunks and tiles in one step (the reference's small tuning constants, which the
    kernel ignores: every token alike)."""
    for key, value in SMALL_ROWS.items():
        monkeypatch.setattr(reference, key, value)
    case = MANY_ROWS[name]
    got, want, _, _ = _run(case)
    assert max_err(got, want) <= TOL[case.dtype]


def test_sinks_and_a_per_layer_window():
    case = dataclasses.replace(CASES["sliding_window"], window=None)
    q, k, v, meta, _, _ = make_batch(case, 3)
    H = q.shape[1]
    sinks = jnp.asarray(np.random.default_rng(0).standard_normal(H), jnp.float32)
    sm = 1.0 / np.sqrt(case.D)
    for window in (None, 24):
        m = meta if window is None else dataclasses.replace(meta, sliding_window=jnp.asarray([window], jnp.int32))
        got = reference.ragged_paged_attention_ref(q, k, v, m, sm_scale=sm, sinks=sinks, cpu_kernel=True)
        want = naive_attention(q, k, v, meta, sm_scale=sm, window=window, sinks=np.asarray(sinks))
        assert max_err(got, want) <= 1e-5


def test_auto_picks_the_kernel_on_cpu_with_f32_bf16_or_int8_pages_only():
    from jaxserve.attention import cpu_kernel
    assert cpu_kernel.problem(jnp.float32, False, "cpu") is None
    assert cpu_kernel.problem(jnp.int8, False, "cpu") is None
    assert cpu_kernel.problem(jnp.bfloat16, False, "cpu") is None      # --kv-cache-dtype bfloat16
    assert "latent" in cpu_kernel.problem(jnp.float32, True, "cpu")
    assert "f32, bf16 or int8 KV pages" in cpu_kernel.problem(jnp.float16, False, "cpu")
    assert "f32, bf16 or int8 KV pages" in cpu_kernel.problem(jnp.float8_e4m3fn, False, "cpu")
    assert "CPU only" in cpu_kernel.problem(jnp.float32, False, "gpu")


def test_selection_by_name_and_by_the_engine():
    from jaxserve.attention.backend import FALLBACK, AttentionCase, Platform, cpu_backend, select_backend
    case = AttentionCase(jnp.float32, jnp.float32, 9, 3, 64, 16)
    cpu = Platform("cpu")
    assert select_backend("cpu", case, cpu) == "cpu" and FALLBACK["cpu"] == ("reference",)
    with pytest.raises(ValueError, match="f32, bf16 or int8 KV pages"):
        select_backend("cpu", dataclasses.replace(case, kv_dtype=jnp.uint8), cpu)
    with pytest.raises(ValueError, match="CPU only"):
        select_backend("cpu", case, Platform("gpu", "9.0"))
    assert select_backend("auto", case, cpu) == "reference"          # the engine decides (below)
    # `--dtype auto` on one CPU device: the kernel; float32, several devices, a named backend or
    # attention sinks keep the reference path
    assert cpu_backend("reference", "auto", "auto", 1, case) == "cpu"
    assert cpu_backend("reference", "auto", "float32", 1, case) == "reference"
    assert cpu_backend("reference", "auto", "auto", 2, case) == "reference"
    assert cpu_backend("reference", "reference", "auto", 1, case) == "reference"
    assert cpu_backend("reference", "auto", "auto", 1, dataclasses.replace(case, sinks=True)) == "reference"
    assert cpu_backend("reference", "auto", "auto", 1, dataclasses.replace(case, kv_dtype=jnp.uint8)) == "reference"
    assert cpu_backend("cpu", "cpu", "float32", 1, case) == "cpu"                  # asked by name
    with pytest.raises(ValueError, match="one device"):
        cpu_backend("cpu", "cpu", "auto", 2, case)


def test_a_token_gets_the_same_numbers_in_any_chunk():
    """The last 10 tokens of a 40-token prompt attended with the whole prompt, and alone after a
    prefix-cache hit on the first 30: bit for bit the same (what keeps greedy outputs identical
    with speculation and with the prefix cache), though the reference path's would differ."""
    case = Case(q_lens=(40,), ctx=(0,), T=48, S=2, K=3, G=3, D=64, N=16, M=4)
    q, k, v, meta, _, _ = make_batch(case, 5)
    tail = dataclasses.replace(meta, cu_q_lens=jnp.asarray([0, 10, 10], jnp.int32),
                               slot_mapping=meta.slot_mapping)
    q_tail = jnp.zeros_like(q).at[:10].set(q[30:40])
    run = jax.jit(lambda q, m: reference.ragged_paged_attention_ref(q, k, v, m, sm_scale=0.125, cpu_kernel=True))
    whole, part = np.asarray(run(q, meta)), np.asarray(run(q_tail, tail))
    np.testing.assert_array_equal(part[:10], whole[30:40])
    assert not part[10:].any()


def test_a_block_id_outside_the_pages_is_an_error_not_a_read_out_of_bounds():
    case = CASES["decode_only"]
    q, k, v, meta, _, _ = make_batch(case, 0)
    bad = dataclasses.replace(meta, block_tables=meta.block_tables.at[0, 0].set(k.shape[0] + 5))
    with pytest.raises(Exception, match="block id out of range"):
        jax.block_until_ready(reference.ragged_paged_attention_ref(q, k, v, bad, sm_scale=0.125, cpu_kernel=True))
