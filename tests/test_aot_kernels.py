"""jaxserve.aot.kernels: every shipped GPU kernel configuration compiled for an H100 from this
machine, with registers, spills, shared memory and CTAs per SM.

The parser and occupancy tests run everywhere. The compile tests need the compile-only H100 target
(jax >= 0.11.2 with the CUDA plugin wheels, `jaxserve.aot.targets`) and skip where it is missing
(the Python 3.11 venv, jax 0.10)."""

from __future__ import annotations

import os

import pytest

from jaxserve.aot import ptxas as px

PTXAS = """ptxas info    : (C7519) warpgroup.arrive is injected in around line 354 by compiler
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fused_a' for 'sm_90a'
ptxas info    : Function properties for fused_a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
ptxas info    : Compiling entry function 'kern' for 'sm_90a'
ptxas info    : Function properties for kern
    24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compile time = 19.917 ms
"""

THUNKS = """001: kCustomKernel [source       | next=002 (1)] input_reduce_fusion grid: [4, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
007: kWhile        [prev=006 (1) | next=013 (1)]
    008: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
015: kCustomKernel [prev=014 (1) | next=016 (1)] ragged_paged_attention grid: [8, 8, 1] threads: [128, 1, 1]  shared_memory: 66048 bytes
005: kCustomCall   [prev=004 (1) | next=006 (1)] kCustomCall
"""  # noqa: E501 - XLA's lines as written

RESOURCES = ("Resources(smem_scratch_bytes=110592, tmem_scratch_cols=0, tmem_collective_scratch_cols=0, "
             "barrier_counts=Counter({Barrier(arrival_count=2, num_barriers=6, orders_tensor_core=False): 1, "
             "Barrier(arrival_count=2, num_barriers=1, orders_tensor_core=False): 1}), scoped_gmem_semaphores={})")

PTX = """.version 8.7
.target sm_90a
.visible .entry anonymous_mosaic_gpu_kernel(
\t.param .u64 p0
)
.maxntid 256, 1, 1
{
}
.visible .entry loop_add_fusion(
\t.param .u64 p0
)
.reqntid 64, 2, 1
{
}
"""


def test_parse_ptxas():
    funcs = px.parse_ptxas(PTXAS)
    assert funcs["fused_a"] == {"registers": 8, "spill_stores": 0, "spill_loads": 0, "spill_bytes": 0,
                                "stack_frame": 0, "barriers": 0, "smem_static": 0}
    k = funcs["kern"]
    assert (k["registers"], k["spill_bytes"], k["stack_frame"], k["barriers"], k["smem_static"]) == (255, 36, 24, 2, 1)


def test_parse_thunks_resources_and_ptx():
    launches = px.parse_thunk_sequence(THUNKS)
    assert [t["name"] for t in launches] == ["input_reduce_fusion", "loop_compare_fusion", "ragged_paged_attention"]
    assert launches[2] == {"name": "ragged_paged_attention", "grid": (8, 8, 1), "threads": 128,
                           "shared_memory": 66048}
    assert px.parse_mosaic_resources(RESOURCES) == 110592 + 8 * 7      # launch size seen in Mosaic's own IR
    assert px.parse_ptx_threads(PTX) == {"anonymous_mosaic_gpu_kernel": 256, "loop_add_fusion": 128}
    with pytest.raises(ValueError):
        px.parse_mosaic_resources("Resources()")


def test_ctas_per_sm():
    # registers: 168 regs -> 5376 per warp (multiple of 256), x4 warps = 21504 -> 3 CTAs
    assert px.ctas_per_sm(168, 128, 66048) == 3
    assert px.ctas_per_sm(168, 128, 0) == 3
    # shared memory: 228 KiB // (110649 + 1 KiB) = 2
    assert px.ctas_per_sm(58, 128, 110649) == 2
    # registers are allocated per warp in units of 256: 64 regs -> 65536 // (4 * 2048) = 8
    assert px.ctas_per_sm(64, 128, None) == 8
    assert px.ctas_per_sm(65, 128, None) == 7                     # 65 -> 72 per thread: 65536 // 9216
    assert px.ctas_per_sm(16, 32, 0) == 32                         # the 32-CTA limit
    assert px.ctas_per_sm(16, 1024, 0) == 2                        # the 2048-thread limit
    assert px.ctas_per_sm(None, 128, 0) is None and px.ctas_per_sm(32, None, 0) is None


def test_cases_cover_the_tables():
    kernels = pytest.importorskip("jaxserve.aot.kernels")
    from jaxserve.pallas import fp8_matmul, int4_matmul, paged_attention, paged_attention_mgpu_sizes
    cases = kernels.kernel_cases()
    by = {}
    for c in cases:
        by.setdefault(c.name, []).append(c)
        assert c.kind in ("triton", "mosaic") and callable(c.build)
    assert {c.config["head_dim"] for c in by["attention/pallas"]} == set(paged_attention.DEFAULT_BLOCK_SIZES)
    assert {c.config["head_dim"] for c in by["attention/mosaic"]} == set(paged_attention_mgpu_sizes.DEFAULT_BLOCK_SIZES)
    assert {(c.config["tile_m"], c.config["tile_n"]) for c in by["fp8/pallas"]} == {
        (t.tile_m, t.tile_n) for t in fp8_matmul.SHIPPED_TILES}
    assert {c.config["tile_m"] for c in by["int4/pallas"]} == {t.tile_m for t in int4_matmul.SHIPPED_TILES}
    assert {c.config["kv_dtype"] for c in by["attention/pallas"]} >= {"bfloat16", "float8_e4m3fn", "int8"}
    # the experts' grouped matmul at every power-of-two tile `tile_rows` gives on a GPU up to 64
    assert {c.config["tile"] for c in by["experts/grouped-matmul"]} == {1, 2, 4, 8, 16, 32, 64}


@pytest.fixture(scope="module")
def h100():
    from jaxserve.aot.targets import get_target
    try:
        return get_target("h100", 1)
    except ValueError as e:
        pytest.skip(f"needs jax 0.11.2 with the CUDA plugin wheels for a compile-only H100 target: {e}")


def _pick(cases, name, **config):
    return next(c for c in cases if c.name == name and all(c.config[k] == v for k, v in config.items()))


def _check(row):
    assert row["compiled"], row["error"]
    assert row["error"] is None, row["error"]
    assert row["registers"] > 0 and row["spill_bytes"] is not None
    assert row["threads"] > 0 and row["smem_bytes"] > 0 and row["ctas_per_sm"] >= 1
    assert row["custom_call"] and not row["interpreted"]


def test_compile_one_of_each_kind(h100):
    from jaxserve.aot import kernels
    cases = kernels.kernel_cases()
    env = {k: os.environ.get(k) for k in kernels._MOSAIC_ENV}
    picks = [_pick(cases, "attention/pallas", head_dim=128, q_dtype="bfloat16", kv_dtype="float8_e4m3fn"),
             _pick(cases, "attention/mosaic", head_dim=128, kv_dtype="bfloat16"),
             _pick(cases, "fp8/pallas", tile_m=128, scales="block")]
    rows = kernels.kernel_report(h100, picks)
    for row in rows:
        _check(row)
    triton, mosaic, fp8 = rows
    assert triton["custom_call"] == "__gpu$xla.gpu.triton" and triton["kernel"] == "ragged_paged_attention"
    assert triton["threads"] == 128                                # num_warps=4 (triton_params)
    assert "mosaic_gpu" in mosaic["custom_call"] and mosaic["threads"] == 256     # two warpgroups
    assert fp8["threads"] == 128
    # Mosaic's launch asks for the modeled scratch plus barriers and alignment: never less
    from jaxserve.pallas import fp8_matmul
    assert fp8["smem_dynamic"] >= fp8_matmul.smem_bytes(fp8_matmul.BLOCK_PREFILL_TILES, "bfloat16")
    assert fp8["spill_bytes"] == 0      # block scales at larger M take tiles that do not spill
    assert env == {k: os.environ.get(k) for k in kernels._MOSAIC_ENV}            # the dump settings restored


@pytest.mark.slow
def test_compile_every_shipped_case(h100):
    from jaxserve.aot import kernels
    rows = kernels.kernel_report(h100)
    print("\n" + kernels.format_report(rows))
    for row in rows:
        _check(row)
