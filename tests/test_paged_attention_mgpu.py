"""Mosaic GPU ragged paged attention (jaxserve/pallas/paged_attention_mgpu.py).

Three gates, as docs/DESIGN.md's "Kernels" asks:
  * GPU interpret mode (jax >= 0.11, CPU) against `ref_ragged_paged_attention` on every case of
    the Triton kernels' CASES and split-K DECODE_CASES (as "decode_<name>") the kernel supports:
    every case with bf16 q (bf16 cache, or the case's fp8/int8 cache), and every case with
    head_dim <= 128 with f32 q (the case's fp8/int8 cache, else the f32 cache rounded to bf16:
    f32 caches are not supported).
    Each case runs with small blocks (64-token chunks, 3 KV splits: many chunks, both SMEM slots,
    empty splits) and with the shipped defaults; each decode case also runs with its own split
    count (64-token chunks: the Triton test's 16-token chunks are below this kernel's minimum).
  * lowering for CUDA on CPU (Mosaic GPU checks layouts and the 227 KiB shared-memory limit at
    lowering) for every shipped block configuration, under an H100 AbstractDevice.
  * `gpu`-marked: the compiled kernel against the reference on a GPU.
On jax < 0.11 (the Python 3.11 venv) everything but the import check skips, with the reason.

Tolerances (max abs error; the reference sees the same bf16/fp8/int8 cache values):
  bf16 q: P rounded to bf16 before P @ V                         5e-2 (the Triton kernel's)
  f32 q: q and P as bf16 high + low parts (~16 mantissa bits)     5e-5 (Triton f32: 2e-5;
         observed 6e-6 to 1.2e-5 here)
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention_kernel import CASES, DECODE_CASES, Case, make_batch, max_err

from jaxserve.pallas import paged_attention_mgpu as mgpu
from jaxserve.pallas.paged_attention import ref_ragged_paged_attention
from jaxserve.pallas.paged_attention_mgpu import MgpuBlockSizes, ragged_paged_attention_mgpu

needs_mgpu = pytest.mark.skipif(
    not mgpu.MGPU_AVAILABLE,
    reason=f"Mosaic GPU plgpu.kernel + GPU interpret mode need jax >= 0.11 "
           f"(this is {jax.__version__}); run with the Python 3.12 venv")

TOL = {"bfloat16": 5e-2, "float32": 5e-5}
SMALL = MgpuBlockSizes(kv_tokens=64, num_splits=3)
# the split-K decode kernel's cases (q_len <= 1, f32 q, head_dim <= 128) with their split counts
DECODE_SPLITS = {f"decode_{name}": splits for name, (_, splits) in DECODE_CASES.items()}
ALL_CASES = {**CASES, **{f"decode_{name}": case for name, (case, _) in DECODE_CASES.items()}}
assert len(ALL_CASES) == len(CASES) + len(DECODE_CASES)
SUPPORTED = {name: dataclasses.replace(case, dtype="bfloat16", blocks=None)
             for name, case in ALL_CASES.items()}
F32_Q = {name: dataclasses.replace(case, dtype="float32", blocks=None)
         for name, case in ALL_CASES.items() if case.D <= 128}
# beyond CASES: contexts of many chunks and pages, 8-token pages, splits over a long prefix
SUPPORTED.update({
    "long_ctx_b8_pages": Case(q_lens=(1, 1, 20, 1), ctx=(300, 129, 200, 0), T=32, S=5, B=8,
                              N=160, M=64, K=2, G=4, D=128, dtype="bfloat16"),
    "long_window_gqa5": Case(q_lens=(1, 37), ctx=(400, 150), T=40, S=2, N=64, M=32, K=1, G=5,
                             window=90, soft_cap=10.0, dtype="bfloat16"),
})


def batch(case: Case, seed: int = 0):
    """make_batch, with an f32 case's unquantised cache rounded to bf16 (no f32 caches here)."""
    q, k, v, meta, ks, vs = make_batch(case, seed)
    if case.kv == "auto" and k.dtype == jnp.float32:
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    return q, k, v, meta, ks, vs


def run(case: Case, block_sizes, *, seed: int, interpret: bool):
    q, k, v, meta, ks, vs = batch(case, seed)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window,
                soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    # Wait for the kernel before the reference: GPU interpret mode runs the kernel as host
    # callbacks that dispatch jax ops themselves (jax 0.11.2), and eager ops dispatched from this
    # thread meanwhile can deadlock both (seen on a loaded 2-core machine: all threads in futex
    # waits, the callback in `wait_smem_to_gmem`, this thread in the reference's first slice).
    out = jax.block_until_ready(ragged_paged_attention_mgpu(
        q, k, v, meta, interpret=interpret, block_sizes=block_sizes, **args))
    with jax.default_matmul_precision("highest"):
        ref = ref_ragged_paged_attention(q, k, v, meta, **args)
    return out, ref, meta


@needs_mgpu
@pytest.mark.parametrize("blocks", ["small", "default"])
@pytest.mark.parametrize("name", list(SUPPORTED))
def test_interpret_matches_reference(name, blocks):
    case = SUPPORTED[name]
    sizes = SMALL if blocks == "small" else None
    if sizes is None and case.D not in mgpu.DEFAULT_BLOCK_SIZES:    # head_dim 256: not shipped (spills on an
        sizes = MgpuBlockSizes(kv_tokens=64)                       # H100), still correct given its sizes
    out, ref, meta = run(case, sizes, seed=sum(map(ord, name)), interpret=True)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert max_err(out, ref) <= TOL[case.dtype], name
    assert not np.asarray(out[int(meta.cu_q_lens[-1]):]).any()     # padding tokens are zeros


@needs_mgpu
@pytest.mark.parametrize("name", list(F32_Q))
def test_interpret_f32_q_matches_reference(name):
    case = F32_Q[name]
    out, ref, meta = run(case, None, seed=sum(map(ord, name)), interpret=True)
    assert out.dtype == jnp.float32
    assert max_err(out, ref) <= TOL["float32"], name
    assert not np.asarray(out[int(meta.cu_q_lens[-1]):]).any()


@needs_mgpu
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", list(DECODE_SPLITS))
def test_interpret_decode_splits_match_reference(name, q_dtype):
    """The decode cases with the split count the Triton decode test gives them (None: the
    default); contexts of at most two 64-token chunks, so 3 and 4 splits leave splits empty."""
    case = SUPPORTED[name] if q_dtype == "bfloat16" else F32_Q[name]
    bs = MgpuBlockSizes(kv_tokens=64, num_splits=DECODE_SPLITS[name])
    out, ref, meta = run(case, bs, seed=sum(map(ord, name)), interpret=True)
    assert out.dtype == jnp.dtype(q_dtype)
    assert max_err(out, ref) <= TOL[q_dtype], name
    assert not np.asarray(out[int(meta.cu_q_lens[-1]):]).any()


@needs_mgpu
@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("window", [90, None], ids=["sliding_layer", "global_layer"])
def test_interpret_layer_window_in_metadata_equals_the_static_window(window, kv):
    """Gemma 2/3: each layer's window comes in the metadata (traced), NO_WINDOW on global layers."""
    from jaxserve.pallas.common import NO_WINDOW
    case = dataclasses.replace(SUPPORTED["long_window_gqa5"], window=None, kv=kv)
    q, k, v, meta, ks, vs = batch(case, seed=11)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    layer = dataclasses.replace(meta, sliding_window=jnp.asarray([window or NO_WINDOW], jnp.int32))
    got = jax.block_until_ready(ragged_paged_attention_mgpu(q, k, v, layer, interpret=True, **args))
    with jax.default_matmul_precision("highest"):
        want = ref_ragged_paged_attention(q, k, v, meta, sliding_window=window, **args)
    assert max_err(got, want) <= TOL["bfloat16"]


@needs_mgpu
@pytest.mark.gpu        # run by the GPU suite (`pytest -m gpu`, 16 cores): CI's 2 cores deadlock it
@pytest.mark.skipif((os.cpu_count() or 1) < 8, reason="the interpreter runs each warpgroup as an XLA CPU "
                    "computation whose barrier waits hold pool threads: deadlocks with few cores")
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_interpret_warp_specialized_matches_reference(kv):
    """The compiled kernel's form (a memory warpgroup and a compute warpgroup talking through
    full/free barriers, 2 slots, several chunks per split, page-id windows) interpreted."""
    case = Case(q_lens=(1, 9), ctx=(300, 120), T=16, S=2, N=64, M=32, B=8, dtype="bfloat16", kv=kv)
    q, k, v, meta, ks, vs = make_batch(case)
    bs = MgpuBlockSizes(kv_tokens=64, num_splits=2)
    kv_chunk, bq, gp, splits = mgpu._plan(q, k, meta, bs)
    out = jax.block_until_ready(mgpu._mgpu_jit(
        q, k, v, meta, ks, vs, sm_scale=0.125, sliding_window=None, soft_cap=None,
        kv_chunk=kv_chunk, bq=bq, gp=gp, num_splits=splits, interpret=True, ws_interpret=True))
    ref = ref_ragged_paged_attention(q, k, v, meta, sm_scale=0.125, k_scale=ks, v_scale=vs)
    assert max_err(out, ref) <= TOL["bfloat16"]


# --- what the kernel does not do yet, and its own limits -----------------------------------------
def _batch(**kw):
    return make_batch(Case(q_lens=(1, 3), ctx=(4, 0), T=4, S=2, dtype="bfloat16", **kw))


@needs_mgpu
def test_rejects_unsupported_dtypes_and_blocks():
    q, k, v, meta, _, _ = _batch()
    with pytest.raises(ValueError, match="q dtype float16 not supported"):
        ragged_paged_attention_mgpu(q.astype(jnp.float16), k.astype(jnp.float16),
                                    v.astype(jnp.float16), meta, sm_scale=0.1)
    with pytest.raises(ValueError, match="head_dim 256 not supported"):    # spills on Hopper: not shipped
        q2, k2, v2, meta2, _, _ = make_batch(Case(q_lens=(1,), ctx=(4,), T=4, S=1, D=256, M=2,
                                                  N=8, dtype="bfloat16"))
        ragged_paged_attention_mgpu(q2.astype(jnp.float32), k2, v2, meta2, sm_scale=0.1)
    with pytest.raises(ValueError, match="KV cache dtype float32 not supported"):
        ragged_paged_attention_mgpu(q, k.astype(jnp.float32), v.astype(jnp.float32), meta,
                                    sm_scale=0.1)
    with pytest.raises(ValueError, match="kv_tokens=32"):
        ragged_paged_attention_mgpu(q, k, v, meta, sm_scale=0.1,
                                    block_sizes=MgpuBlockSizes(kv_tokens=32))
    with pytest.raises(ValueError, match="num_splits"):
        ragged_paged_attention_mgpu(q, k, v, meta, sm_scale=0.1,
                                    block_sizes=MgpuBlockSizes(kv_tokens=64, num_splits=-2))
    with pytest.raises(ValueError, match="multiple of kv heads"):      # the shared checks run too
        ragged_paged_attention_mgpu(q[:, :7], k, v, meta, sm_scale=0.1)


@pytest.mark.skipif(mgpu.MGPU_AVAILABLE, reason="needs jax < 0.11: checks the message old jax gives")
def test_old_jax_gets_a_clear_error():
    q, k, v, meta, _, _ = _batch()
    with pytest.raises(ValueError, match="needs jax >= 0.11"):
        ragged_paged_attention_mgpu(q, k, v, meta, sm_scale=0.1)


def test_default_splits_fill_the_gpu_and_stay_bounded():
    assert mgpu.default_num_splits(8, 64, 64) == 1          # 512 programs already
    assert mgpu.default_num_splits(8, 32, 64) == 2          # 256: just under two per SM
    assert mgpu.default_num_splits(8, 4, 64) == 16          # batch 4 decode: split the context
    assert mgpu.default_num_splits(1, 1, 3) == 3            # never more than the chunks
    assert mgpu.default_num_splits(1, 1, 1000) == mgpu.MAX_SPLITS


def test_shipped_blocks_fit_shared_memory():
    for head_dim, bs in mgpu.DEFAULT_BLOCK_SIZES.items():
        for quantized in (False, True):                     # bf16 cache, fp8/int8 cache
            for block_size in (8, 16, 64):
                need = mgpu.smem_bytes(mgpu.ROWS, head_dim, bs.kv_tokens, quantized=quantized,
                                       slots=bs.slots, block_size=block_size)
                assert need <= mgpu.SMEM_BYTES, (head_dim, quantized)
                if head_dim <= 128:                         # f32 q: two parts, smaller chunks
                    c = min(bs.kv_tokens, mgpu.F32_Q_KV_TOKENS)
                    need = mgpu.smem_bytes(mgpu.ROWS, head_dim, c, quantized=quantized, q_parts=2,
                                           slots=bs.slots, block_size=block_size)
                    assert need <= mgpu.SMEM_BYTES, (head_dim, quantized, "f32 q")


def test_block_table_fits_two_programs_per_sm():
    """Issue 25: at head_dim 128 (and 64) a program leaves room for a second on its SM (bf16 q,
    bf16 or 8-bit cache); head_dim 256 cannot (sizes module docstring says why). The previous
    kernel took 193 KiB at head_dim 128: one program per SM."""
    for head_dim, want in ((64, 2), (128, 2)):
        bs = mgpu.DEFAULT_BLOCK_SIZES[head_dim]
        for quantized in (False, True):
            need = mgpu.smem_bytes(mgpu.ROWS, head_dim, bs.kv_tokens, quantized=quantized,
                                   slots=bs.slots, block_size=16)
            assert mgpu.ctas_per_sm(need) >= want, (head_dim, quantized, need)
    assert mgpu.smem_bytes(mgpu.ROWS, 128, 64) < 100 * 1024
    assert mgpu.ctas_per_sm(193 * 1024) == 1 and mgpu.ctas_per_sm(114 * 1024) == 1


def test_bytes_model_decode_is_the_kv_pages():
    """Decode at batch 256 x 8k, Llama-3-8B's attention shape: the model's KV bytes are exactly
    the pages read (8192 is whole chunks), and everything else is under 1% of them."""
    sizes = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    bf16 = mgpu.bytes_moved([1] * 256, [8192] * 256, **sizes)
    assert bf16.kv == 256 * 8192 * 8 * 128 * 2 * 2
    assert bf16.kv_fraction > 0.99 and bf16.kv_scales == 0
    fp8 = mgpu.bytes_moved([1] * 256, [8192] * 256, kv_dtype_bytes=1, **sizes)
    assert fp8.kv == bf16.kv // 2
    assert fp8.kv_scales >= 256 * 8192 * 8 * 2 * 4               # f32 scales: 1/16 of fp8 K/V
    # only the useful rows leave the kernel: 4 of 64 rows per decode tile, bf16
    assert bf16.out < 256 * 8 * 64 * 128 * 4


def test_bytes_model_follows_the_kernels_tile_plan():
    """The model's chunk count equals the kernel's: a prefill chunk's tiles each read their own
    causal prefix (whole chunks), a window skips the chunks left of it."""
    from jaxserve.pallas.ragged_tiles import plan_tiles
    case = Case(q_lens=(1, 40, 1, 7), ctx=(300, 100, 0, 60), T=64, S=4, N=128, M=32, K=2, G=4,
                window=90, dtype="bfloat16")
    q, k, _, meta, _, _ = make_batch(case)
    bs = MgpuBlockSizes(kv_tokens=64, num_splits=2)
    kv_chunk, bq, gp, _ = mgpu._plan(q, k, meta, bs)
    tile_meta = np.asarray(mgpu.tile_metadata(plan_tiles(meta, q.shape[0], bq, gp), meta,
                                              kv_chunk, case.window))
    chunks = int((tile_meta[:, 4] - tile_meta[:, 3]).sum())
    q_lens = [int(x) for x in np.diff(np.asarray(meta.cu_q_lens))[: int(meta.num_seqs[0])]]
    kv_lens = [int(x) for x in np.asarray(meta.kv_lens)[: len(q_lens)]]
    model = mgpu.bytes_moved(q_lens, kv_lens, num_q_heads=case.K * case.G, num_kv_heads=case.K,
                             head_dim=case.D, block_size=case.B, block_sizes=bs,
                             sliding_window=case.window, max_pages_per_seq=case.M)
    assert model.kv == chunks * kv_chunk * case.D * case.K * 2 * 2
    no_window = mgpu.bytes_moved(q_lens, kv_lens, num_q_heads=case.K * case.G, num_kv_heads=case.K,
                                 head_dim=case.D, block_size=case.B, block_sizes=bs, max_pages_per_seq=case.M)
    assert no_window.kv > model.kv                                  # the window skips chunks


def test_merge_splits_weights_by_lse_and_ignores_empty_splits():
    o = np.zeros((3, 2, 1, 2), np.float32)                # [P, Qs, R, D]: f32 as high + low
    o[0, 0] = [[1.0, 2.0]]
    o[0, 1] = [[2.0 ** -10, 0.0]]
    o[1, 0] = [[3.0, 4.0]]
    lse = np.array([[np.log(1.0)], [np.log(3.0)], [mgpu.MASK_VALUE]], np.float32)   # split 2 empty
    got = np.asarray(mgpu.merge_splits(jnp.asarray(o), jnp.asarray(lse)))
    want = (np.array([1.0 + 2.0 ** -10, 2.0]) * 1 + np.array([3.0, 4.0]) * 3) / 4
    np.testing.assert_allclose(got[0], want, rtol=1e-6)


# --- lowering for CUDA without a GPU --------------------------------------------------------------
H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                   platform="gpu")


def lower_for_h100(case: Case, block_sizes: MgpuBlockSizes, **opts) -> str:
    """Trace the jitted entry with `interpret=False` and lower it for CUDA under an abstract
    H100 mesh; Mosaic GPU runs layout inference and the shared-memory check while lowering."""
    q, k, v, meta, ks, vs = batch(case)
    kv_chunk, bq, gp, splits = mgpu._plan(q, k, meta, block_sizes)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = mgpu._mgpu_jit.trace(q, k, v, meta, ks, vs, sm_scale=0.1, kv_chunk=kv_chunk, bq=bq,
                                      gp=gp, num_splits=splits, interpret=False, **opts)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


@needs_mgpu
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("head_dim", sorted(mgpu.DEFAULT_BLOCK_SIZES))
def test_shipped_blocks_lower_for_cuda(head_dim, kv, q_dtype):
    if q_dtype == "float32" and head_dim > 128:
        # Not shipped: f32 q with head_dim 256 does not fit shared memory (module docs), and the
        # backend selection says so before any array exists, instead of failing inside Mosaic.
        kv_dtype = {"auto": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(kv, kv)
        reason = mgpu.unsupported_reason(q_dtype, kv_dtype, num_q_heads=8, num_kv_heads=2,
                                         head_dim=head_dim, block_size=16)
        assert reason and "shared memory" in reason
        return
    case = Case(q_lens=(1, 13, 1), ctx=(33, 4, 0), T=16, S=3, D=head_dim, dtype=q_dtype, kv=kv)
    bs = mgpu.DEFAULT_BLOCK_SIZES[head_dim]
    if q_dtype == "float32":
        bs = dataclasses.replace(bs, kv_tokens=min(bs.kv_tokens, mgpu.F32_Q_KV_TOKENS))
    bs = dataclasses.replace(bs, num_splits=2)
    text = lower_for_h100(case, bs, sliding_window=8, soft_cap=5.0)
    assert "mosaic_gpu" in text


@needs_mgpu
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_layer_window_lowers_for_cuda(kv):
    """Gemma 2/3's per-layer window (an int32 operand read in the kernel) lowers for Hopper."""
    case = Case(q_lens=(1, 13, 1), ctx=(33, 4, 0), T=16, S=3, D=128, dtype="bfloat16", kv=kv)
    q, k, v, meta, ks, vs = batch(case)
    meta = dataclasses.replace(meta, sliding_window=jnp.asarray([8], jnp.int32))
    bs = dataclasses.replace(mgpu.DEFAULT_BLOCK_SIZES[128], num_splits=2)
    kv_chunk, bq, gp, splits = mgpu._plan(q, k, meta, bs)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = mgpu._mgpu_jit.trace(q, k, v, meta, ks, vs, sm_scale=0.1, kv_chunk=kv_chunk, bq=bq, gp=gp,
                                      num_splits=splits, interpret=False, sliding_window=None, soft_cap=5.0)
        assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@needs_mgpu
def test_lowering_rejects_blocks_over_shared_memory():
    """The lowering gate has teeth: D=256 with 128-token chunks needs ~265 KiB."""
    case = Case(q_lens=(1,), ctx=(33,), T=4, S=1, D=256, dtype="bfloat16")
    with pytest.raises(ValueError, match="shared memory"):
        lower_for_h100(case, MgpuBlockSizes(kv_tokens=128, num_splits=1), sliding_window=None,
                       soft_cap=None)


# --- compiled, on a GPU ---------------------------------------------------------------------------
@pytest.mark.gpu
@needs_mgpu
@pytest.mark.parametrize("blocks", ["small", "default"])
@pytest.mark.parametrize("name", list(SUPPORTED))
def test_compiled_matches_reference(name, blocks):
    case = SUPPORTED[name]
    out, ref, meta = run(case, SMALL if blocks == "small" else None,
                         seed=sum(map(ord, name)), interpret=False)
    assert max_err(out, ref) <= TOL[case.dtype], name
    assert not np.asarray(out[int(meta.cu_q_lens[-1]):]).any()


@pytest.mark.gpu
@needs_mgpu
@pytest.mark.parametrize("name", list(F32_Q))
def test_compiled_f32_q_matches_reference(name):
    out, ref, meta = run(F32_Q[name], None, seed=sum(map(ord, name)), interpret=False)
    assert max_err(out, ref) <= TOL["float32"], name


@needs_mgpu
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_interpret_finds_no_races(kv):
    """The interpreter's happens-before race detector over several chunks per split. It tracks
    TMA copies and ordinary SMEM loads/stores, not wgmma operand reads (jax 0.11.2), so it
    checks the int8 path's widening reads against the page copies (dropping the K barrier wait
    makes this test fail), the P and output stores; bf16 K/V slots are read only by wgmma."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
    case = Case(q_lens=(1, 9), ctx=(200, 120), T=16, S=2, N=64, M=16, dtype="bfloat16", kv=kv)
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=0.125, k_scale=ks, v_scale=vs)
    gpu_interpret.reset_gpu_interpret_mode_state()
    out = jax.block_until_ready(ragged_paged_attention_mgpu(      # see `run`
        q, k, v, meta, interpret=mgpu.plgpu.InterpretGPUParams(detect_races=True),
        block_sizes=MgpuBlockSizes(kv_tokens=64, num_splits=2), **args))
    assert max_err(out, ref_ragged_paged_attention(q, k, v, meta, **args)) <= TOL["bfloat16"]
    assert not gpu_interpret.get_races().races_found
