"""The fused CPU kernel for quantized matmuls of a few rows (layers/int4_cpu.py, csrc/int4_matvec.cc):
it builds here, matches the dequantised reference for every weight variant, takes a stacked layer
in place under the layer scan, has gradients, is chosen only where it should be, and falls back
to XLA's tiles with the reason when it cannot build."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers import int4 as int4_layer
from jaxserve.layers import int4_cpu
from jaxserve.layers.int4 import Int4Weight, pack, ref_int4_matmul, with_fused_kernel
from jaxserve.layers.linear import linear
from jaxserve.layers.scan import scan_layers


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """The kernel must build on the CI machines (they have a C++ compiler): a skip would hide it."""
    assert int4_cpu.load() is None, int4_cpu.load()


def _weight(rng, k, n, g, kind, layers=None, act_order=False):
    """kind: "offset" (GGUF Q4_1), "zero" (GPTQ/AWQ uint8 zero points), "symmetric" (zero 8), "int8"
    (GGUF Q8_0). `layers`: stacked [layers, ...] arrays."""
    lead = () if layers is None else (layers,)
    if kind == "int8":
        q = jnp.asarray(rng.integers(-127, 128, (*lead, k, n)), jnp.int8)
    else:
        q = pack(jnp.asarray(rng.integers(0, 16, (*lead, k, n)), jnp.uint8))
    groups = (*lead, k // g, n)
    scale = jnp.asarray(rng.random(groups) * 0.02, jnp.float32)
    return Int4Weight(q, scale,
                      zero=jnp.asarray(rng.integers(0, 16, groups), jnp.uint8) if kind == "zero" else None,
                      perm=jnp.asarray(rng.permutation(k), jnp.int32) if act_order else None, group_size=g,
                      offset=jnp.asarray(rng.random(groups) * 0.01, jnp.float32) if kind == "offset" else None,
                      bits=8 if kind == "int8" else 4)


def _close(y, ref, tol=1e-5):
    np.testing.assert_allclose(y, ref, rtol=tol, atol=0.2 * tol * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("kind", ["offset", "zero", "symmetric", "int8"])
@pytest.mark.parametrize("k,n,g", [(576, 1536, 32), (1536, 576, 32), (256, 48, 128), (64, 208, 64)])
def test_kernel_matches_the_dequantised_reference(kind, k, n, g):
    """Every row count up to the kernel's limit; column counts that are whole 64-column blocks, a
    3-vector block (48) and a block plus a remainder vector (208); one group and many."""
    rng = np.random.default_rng(k + n)
    w = _weight(rng, k, n, g, kind)
    call = jax.jit(lambda x, w: int4_cpu.matmul(x, w.q, w.scale, w.zero, w.offset, None, w.group_size, w.bits))
    for rows in range(1, int4_cpu.MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        _close(call(x, w), ref_int4_matmul(x, w))


@pytest.mark.parametrize("kind", ["offset", "int8"])
def test_many_rows_pass_over_spans_of_columns_the_cache_holds(kind):
    """More rows than the kernel's accumulators (a prompt): every chunk of rows over one span of
    columns before the next (a wide matrix: several spans a thread), each row its own result,
    f32 and int8 activations alike."""
    rng = np.random.default_rng(5)
    k, n = 4096, 1536                              # ~2-4 KB of codes a column: spans of 256-448
    w = _weight(rng, k, n, 32, kind)
    x = jnp.asarray(rng.standard_normal((2 * int4_cpu.MAX_ROWS + 3, k)), jnp.float32)
    call = jax.jit(lambda x, w: int4_cpu.matmul(x, w.q, w.scale, w.zero, w.offset, None, w.group_size, w.bits))
    y = call(x, w)
    _close(y, ref_int4_matmul(x, w))
    np.testing.assert_array_equal(np.asarray(call(x[5:6], w))[0], np.asarray(y)[5])     # one row alone: the same
    if kind == "offset" and int4_cpu.int8_dot() is not None:
        q8 = jax.jit(lambda x, w: int4_cpu.matmul(x, w.q, w.scale, w.zero, w.offset, None, w.group_size, w.bits,
                                                  int8_x=True, int8_hi_only=True))
        y8 = np.asarray(q8(x, w))
        np.testing.assert_array_equal(np.asarray(q8(x[7:8], w))[0], y8[7])
        assert np.abs(y8 - np.asarray(y)).max() <= 0.02 * np.abs(np.asarray(y)).max()


def _int8_parts(x, g):
    """x as the kernel's int8_x takes it: per block of 32 (16, 8) inputs a scale d = max|x| / 127,
    codes round(x / d) and the rest's codes round(254 (x / d - code)), both clipped to +-127."""
    x = np.asarray(x, np.float32)
    qb = 32 if g % 32 == 0 else 16 if g % 16 == 0 else 8
    xb = x.reshape(x.shape[0], -1, qb)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = amax / np.float32(127)
    t = (xb * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)).astype(np.float32)
    hi = np.clip(np.rint(t), -127, 127)
    lo = np.clip(np.rint((t - hi) * np.float32(254)), -127, 127)
    return jnp.asarray((hi * d + lo * (d / np.float32(254))).reshape(x.shape), jnp.float32)


def _avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def builds():
    """target -> the integer dot product it has: the machine's own build, and where the CPU has
    AVX2 one compiled without AVX-512 (the AVX2 path, whatever this CPU's best is)."""
    out = {int4_cpu.TARGET: int4_cpu.int8_dot()}
    if _avx2():
        path = int4_cpu.build(int4_cpu._compiler(), ("-mno-avx512f",))
        out["jaxserve_int4_matvec_avx2"] = int4_cpu.register(path, "jaxserve_int4_matvec_avx2")
        assert out["jaxserve_int4_matvec_avx2"] == "AVX2"
    return {t: dot for t, dot in out.items() if dot is not None}


@pytest.mark.parametrize("kind", ["offset", "zero", "symmetric"])
@pytest.mark.parametrize("k,n,g", [(576, 1536, 32), (1536, 576, 32), (256, 48, 128), (96, 208, 48), (64, 32, 8)])
def test_int8_x_is_the_product_of_its_int8_parts(builds, kind, k, n, g):
    """int8_x: the result is the f32 product of x as its two int8 parts (the integer dot products
    are exact), and that x is within 1/(127 * 508) of each block's max|x| of x."""
    if not builds:
        pytest.skip("needs a CPU with an integer dot product (AVX512-VNNI or AVX2) in its kernel build")
    rng = np.random.default_rng(k + n + g)
    w = _weight(rng, k, n, g, kind)
    for target in builds:
        call = jax.jit(lambda x, w, target=target: int4_cpu.matmul(x, w.q, w.scale, w.zero, w.offset, None,
                                                                   w.group_size, w.bits, int8_x=True, target=target))
        for rows in range(1, int4_cpu.MAX_ROWS + 1):
            x = jnp.asarray(rng.standard_normal((rows, k)) * np.exp(rng.standard_normal((rows, k))), jnp.float32)
            parts = _int8_parts(x, g)
            _close(call(x, w), ref_int4_matmul(parts, w))
            qb = 32 if g % 32 == 0 else 16 if g % 16 == 0 else 8
            block_max = np.repeat(np.abs(np.asarray(x)).reshape(rows, -1, qb).max(-1), qb, axis=1)
            assert np.all(np.abs(np.asarray(parts) - np.asarray(x)) <= block_max / (127 * 508) * 1.02)   # f32 rounding


def test_int8_x_sums_extreme_blocks_exactly(builds):
    """The largest sums a block can make: every code 15 and every x code +-127 (x constant over
    each block of 32: high parts 127, or alternating sign), where AVX2 keeps a block's sums in
    int16 lanes (16 products of 15 x 127 = 30480 a lane)."""
    if not builds:
        pytest.skip("needs a CPU with an integer dot product (AVX512-VNNI or AVX2) in its kernel build")
    k, n, g = 256, 64, 32
    w = _weight(np.random.default_rng(0), k, n, g, "symmetric")
    w = dataclasses.replace(w, q=jnp.full_like(w.q, -1), scale=jnp.full_like(w.scale, 0.01))   # codes 15
    sign = np.where(np.arange(k) % 64 < 32, 1.0, -1.0)          # whole blocks of +1 / -1
    x = jnp.asarray(np.stack([sign, -sign, sign * np.linspace(1, 2, k)]), jnp.float32)
    for target in builds:
        y = int4_cpu.matmul(x, w.q, w.scale, w.zero, w.offset, None, g, 4, int8_x=True, target=target)
        _close(y, ref_int4_matmul(_int8_parts(x, g), w))


def test_int8_x_takes_int4_codes_only_and_the_engine_asks_for_it_where_built(builds):
    rng = np.random.default_rng(6)
    w8 = _weight(rng, 64, 32, 32, "int8")
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="int8_x needs int4 codes"):
        int4_cpu.matmul(x, w8.q, w8.scale, None, None, None, 32, 8, int8_x=True)
    if int4_cpu.int8_dot() is None:
        with pytest.raises(ValueError, match="no integer dot product"):
            with_fused_kernel(w8, int8_x=True)
        return
    # a Q8_0 weight under int8_x keeps f32 activations (the flag is for int4 codes)
    fused = with_fused_kernel({"w8": w8, "w4": _weight(rng, 64, 32, 32, "offset")}, int8_x=True)
    assert fused["w8"].fused_int8_x and fused["w4"].fused_int8_x
    _close(jax.jit(linear)(x, fused["w8"]), ref_int4_matmul(x, w8))
    _close(jax.jit(linear)(x, fused["w4"]), ref_int4_matmul(_int8_parts(x, 32), fused["w4"]))
    from jaxserve.loader.loader import cpu_matmuls_for
    assert cpu_matmuls_for({"w": w8}, "auto", 1, platform="cpu")["w"].fused_int8_x


@pytest.mark.parametrize("act_order", [False, True])
def test_linear_takes_the_kernel_up_to_its_rows_and_the_tiles_above(act_order):
    rng = np.random.default_rng(1)
    w = with_fused_kernel(_weight(rng, 256, 96, 32, "zero", act_order=act_order), max_rows=4)
    for lead in [(1,), (2,), (2, 2), (5,), (3, 4), (0,)]:
        x = jnp.asarray(rng.standard_normal((*lead, 256)), jnp.float32)
        fn = jax.jit(linear)
        fused = int4_cpu.TARGET in fn.lower(x, w).as_text()
        assert fused == (1 <= int(np.prod(lead)) <= 4)
        y = fn(x, w)
        assert y.shape == (*lead, 96) and y.dtype == jnp.float32
        if y.size:
            _close(y, ref_int4_matmul(x, w))
    # under vmap the call runs once per batch entry
    x = jnp.asarray(rng.standard_normal((3, 2, 256)), jnp.float32)
    _close(jax.jit(jax.vmap(linear, in_axes=(0, None)))(x, w), ref_int4_matmul(x, w))
    # the head's f32 logits from bf16 rows, and a weight split over devices: the tiles
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    assert linear(x, w, out_dtype=jnp.float32).dtype == jnp.float32
    split = dataclasses.replace(w, in_shards=2)
    assert int4_cpu.TARGET not in jax.jit(linear).lower(x, split).as_text()


@pytest.mark.parametrize("kind", ["offset", "int8"])
def test_the_layer_scan_hands_the_kernel_the_whole_stack(kind):
    """`scan_layers` (models' run_layers) passes a stacked fused weight whole with its layer index:
    the custom call's operand is the [layers, ...] stack (no per-layer copy), and the result is
    the per-layer reference's."""
    rng = np.random.default_rng(2)
    L, k, g = 3, 128, 32
    w = with_fused_kernel(_weight(rng, k, k, g, kind, layers=L))
    bias = jnp.asarray(rng.standard_normal((L, k)), jnp.float32)

    def body(h, xs):
        lw, layer, b = xs
        return jnp.tanh(linear(h, lw["w"]) + b), None

    def run(x, w):
        return scan_layers(body, x, ({"w": w}, jnp.arange(L, dtype=jnp.int32), bias))

    x = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)
    text = jax.jit(run).lower(x, w).as_text()
    assert int4_cpu.TARGET in text
    q_type = f"tensor<{L}x{k // 8 if kind != 'int8' else k}x{k}x{'i32' if kind != 'int8' else 'i8'}>"
    assert any(int4_cpu.TARGET in line and q_type in line for line in text.splitlines()), "stack not passed whole"
    ref = x
    for i in range(L):
        one = Int4Weight(w.q[i], w.scale[i], offset=None if w.offset is None else w.offset[i],
                         group_size=g, bits=w.bits)
        ref = jnp.tanh(ref_int4_matmul(ref, one) + bias[i])
    _close(jax.jit(run)(x, w), ref, 1e-4)      # three layers of summation-order rounding
    # without the kernel the scan slices as before, with the same numbers
    plain = dataclasses.replace(w, fused_max_rows=None)
    assert int4_cpu.TARGET not in jax.jit(run).lower(x, plain).as_text()
    _close(jax.jit(run)(x, plain), ref, 1e-4)


def test_gradients_through_the_kernel_are_the_tiles_gradients():
    rng = np.random.default_rng(3)
    w = _weight(rng, 128, 64, 32, "offset")
    fused = with_fused_kernel(w)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)

    def loss(x, w):
        return jnp.sum(jnp.sin(linear(x, w)))

    gx, gw = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, fused)
    rx, rw = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, w)
    _close(gx, rx)
    _close(gw.scale, rw.scale)
    _close(gw.offset, rw.offset)


def test_the_cpu_default_dtype_turns_the_kernel_on_for_one_device_only(monkeypatch):
    from jaxserve.loader.loader import cpu_matmuls_for
    monkeypatch.setenv("JAXSERVE_CPU_BF16_TILES", "1")      # bf16 tiles whatever this CPU
    w = {"w": _weight(np.random.default_rng(4), 64, 16, 32, "offset"), "dense": jnp.ones(3)}
    on = cpu_matmuls_for(w, "auto", 1, platform="cpu")["w"]
    assert on.fused_max_rows == int4_cpu.FUSED_MAX_ROWS and on.bf16_min_rows == int4_layer.BF16_MIN_ROWS
    assert cpu_matmuls_for(w, "auto", 2, platform="cpu")["w"].fused_max_rows is None       # tensor parallel
    assert cpu_matmuls_for(w, "float32", 1, platform="cpu")["w"].fused_max_rows is None    # batch-invariant
    assert cpu_matmuls_for(w, "auto", 1, platform="gpu")["w"].fused_max_rows is None


def test_no_compiler_or_a_failed_build_falls_back_to_the_tiles_with_the_reason(monkeypatch, tmp_path, caplog):
    from jaxserve.loader import loader
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    build = int4_cpu.load.__wrapped__           # uncached: the process's registered kernel stays
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "0")
    assert build() == "JAXSERVE_CPU_KERNELS=0"
    monkeypatch.delenv("JAXSERVE_CPU_KERNELS")
    monkeypatch.setenv("CXX", "false")          # a compiler that fails
    assert build().startswith("the kernel did not build")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert build().startswith("the kernel did not build")
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("tmp*"))
    monkeypatch.setattr(int4_cpu, "load", lambda: "no C++ compiler found (set CXX)")
    monkeypatch.setenv("JAXSERVE_CPU_BF16_TILES", "1")
    w = {"w": _weight(np.random.default_rng(5), 64, 16, 32, "offset")}
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        out = loader.cpu_matmuls_for(w, "auto", 1, platform="cpu")
    assert out["w"].fused_max_rows is None and out["w"].bf16_min_rows is not None
    assert "no C++ compiler found" in caplog.text


def test_the_default_model_on_the_kernel_generates_what_the_float32_tiles_do(llm):
    """End to end at batch 1 (the 2-token bucket, the head's 2 sampler rows): `--dtype auto` runs
    the kept Q4_1/Q8_0 GGUF's decode steps through the kernel (the Q4_1 layers with int8 parts of
    x where the build has an integer dot product) and its decode attention through the CPU
    attention kernel; the shared engine (float32) through
    the f32 tiles. The same greedy tokens; the logprobs differ at bf16's level because "auto"
    also prefills the prompt (a 16-row step) through bf16 tiles."""
    from conftest import SHARED_LLM_KWARGS

    from jaxserve import LLM, SamplingParams
    fast = LLM(warmup=False, **{**SHARED_LLM_KWARGS, "dtype": "auto", "max_num_seqs": 4})
    try:
        weights = fast.llm_engine.runner.weights
        fused = [w for w in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, Int4Weight))
                 if isinstance(w, Int4Weight)]
        assert fused and all(w.fused_max_rows == int4_cpu.FUSED_MAX_ROWS and w.q8_min_rows is None for w in fused)
        assert all(w.fused_int8_x == (int4_cpu.int8_dot() is not None) for w in fused)
        assert fast.llm_engine.runner.backend == "cpu" and llm.llm_engine.runner.backend == "reference"
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
        for prompt in ["The capital of France is", "def fibonacci(n):"]:
            a = fast.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            b = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert a.token_ids == b.token_ids
            la = [next(iter(d.values())).logprob for d in a.logprobs]
            lb = [next(iter(d.values())).logprob for d in b.logprobs]
            np.testing.assert_allclose(la, lb, atol=0.1)
        # Steps of 3-8 rows run at 4 or 8 tokens on the kernel (not 16 through the tiles): three
        # prompts decode together in the 4-token program, with the same greedy tokens.
        runner, seen = fast.llm_engine.runner, []
        assert runner.buckets[:5] == [1, 2, 4, 8, 16]
        dispatch = runner.dispatch
        runner.dispatch = lambda sched: seen.append(sched.num_scheduled_tokens) or dispatch(sched)
        prompts = ["The capital of France is", "def fibonacci(n):", "Bees make"]
        try:
            a = fast.generate(prompts, params, use_tqdm=False)
        finally:
            del runner.dispatch
        b = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        assert seen.count(3) >= 20 and runner.bucket_for(3) == 4 and runner.bucket_for(5) == 8
    finally:
        fast.shutdown()
