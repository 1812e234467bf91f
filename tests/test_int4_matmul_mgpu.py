"""The Mosaic GPU W4A16 matmul (jaxserve/pallas/int4_matmul.py, `int4_matmul_mgpu`) and its selection.

Gates, as for the FP8 kernel: GPU interpret mode (jax >= 0.11, on CPU) against `ref_int4_matmul`
(layers/int4.py's oracle on the loader's `Int4Weight`, so the re-layout is checked too) over
shapes with M, N off the tiles, group sizes 32/64/128, symmetric and asymmetric, act order;
the interpreter's race detector; lowering for CUDA under an H100 AbstractDevice (layouts, shared
memory) for every shipped tile configuration; `gpu`-marked: compiled on a GPU. On jax < 0.11
these skip with a reason starting "needs jax".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_lowering import lower_for_cuda

from jaxserve.layers.int4 import Int4Weight, pack, ref_int4_matmul
from jaxserve.layers.int4_kernel import resolve_int4_kernel, to_kernel
from jaxserve.pallas import int4_matmul as im

needs_mgpu = pytest.mark.skipif(
    not im.MGPU_AVAILABLE,
    reason=f"needs jax >= 0.11 for Mosaic GPU plgpu.kernel + GPU interpret mode (this is {jax.__version__}); "
           "run with the Python 3.12 venv")


def _weight(k, n, g, asym, act_order=False, seed=0) -> Int4Weight:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (k, n))
    scale = rng.uniform(0.005, 0.02, (k // g, n)).astype(np.float32)
    zero = jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8) if asym else None
    perm = jnp.asarray(rng.permutation(k), jnp.int32) if act_order else None
    return Int4Weight(pack(jnp.asarray(codes)), jnp.asarray(scale), zero, perm, group_size=g)


# (M, K, N, group, asymmetric, act order, x dtype)
CASES = [
    (1, 256, 128, 128, False, False, "bfloat16"),
    (5, 128, 64, 32, True, False, "bfloat16"),
    (16, 512, 192, 64, True, False, "float32"),
    (17, 256, 200, 32, False, True, "bfloat16"),      # N off the 64-row tile, act-order permutation
    (70, 384, 128, 128, True, False, "float16"),      # the mid tiles, three K steps
    (130, 256, 64, 64, False, False, "bfloat16"),     # two prefill M tiles
    (8, 1024, 64, 128, True, True, "bfloat16"),       # more K steps than the decode tiles' slots
    (3, 512, 64, 256, True, False, "bfloat16"),       # a 256-row group: two K steps share its scales
]


def _close(y, ref):
    ref = np.asarray(ref)
    # bf16 dequantised weights and activations against an f32 oracle
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2e-2, atol=2e-2 * float(np.abs(ref).max()))


@needs_mgpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_interpret_matches_reference(case):
    m, k, n, g, asym, act_order, dtype = case
    w = _weight(k, n, g, asym, act_order, seed=m + k + n)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(dtype)
    kw = to_kernel(w, jnp.float16 if dtype == "float16" else jnp.bfloat16)
    assert kw.codes.dtype == jnp.int4 and kw.codes.shape == (n, k) and (kw.bias is None) == (not asym)
    y = im.int4_matmul_mgpu(x, kw, interpret=True)
    assert y.shape == (m, n) and y.dtype == x.dtype
    _close(y, ref_int4_matmul(x, w))


def test_kernel_layout_dequantises_to_the_same_matrix():
    """The re-layout at load (signed codes, scale and bias) is the same matrix on every jax."""
    for asym in (False, True):
        w = _weight(128, 64, 32, asym, seed=3)
        kw = to_kernel(w, jnp.float16)
        x = jnp.eye(128, dtype=jnp.float32)
        # f16 scales and biases (8 - zero) * scale: 2^-11 of |bias| <= 0.3 each
        np.testing.assert_allclose(im.ref_int4_matmul(x, kw), ref_int4_matmul(x, w), rtol=0, atol=3e-4)


@needs_mgpu
def test_interpret_finds_no_races():
    """More K steps than slots: every slot refilled by TMA right after its step's loads and wgmma."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
    w = _weight(512, 64, 64, True, seed=4)
    x = jax.random.normal(jax.random.key(0), (8, 512), jnp.bfloat16)
    gpu_interpret.reset_gpu_interpret_mode_state()
    y = im.int4_matmul_mgpu(x, to_kernel(w), tiles=im.Int4Tiles(16, stages=2),
                            interpret=im.plgpu.InterpretGPUParams(detect_races=True))
    assert not gpu_interpret.get_races().races_found
    _close(y, ref_int4_matmul(x, w))


@needs_mgpu
@pytest.mark.parametrize("tiles", im.SHIPPED_TILES, ids=str)
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
def test_shipped_tiles_lower_for_cuda(tiles, g, asym):
    assert im.smem_bytes(tiles, g, asym=asym) <= 227 * 1024
    k, n = 1024, 512
    w = im.Int4KernelWeight(jax.ShapeDtypeStruct((n, k), jnp.int4), jax.ShapeDtypeStruct((k // g, n), jnp.bfloat16),
                            jax.ShapeDtypeStruct((k // g, n), jnp.bfloat16) if asym else None, None, g)
    f = jax.jit(functools.partial(im.int4_matmul_mgpu, tiles=tiles))
    text = lower_for_cuda(f, jax.ShapeDtypeStruct((tiles.tile_m, k), jnp.bfloat16), w)
    assert "mosaic_gpu" in text


@needs_mgpu
def test_stacked_pallas_weight_lowers_inside_scan():
    """What the model does: `linear` on an Int4KernelWeight sliced by lax.scan over layers, f16."""
    from jaxserve.layers.linear import linear

    def model(x, w):
        return jax.lax.scan(lambda h, wl: (linear(h, wl), None), x, w)[0]
    w = im.Int4KernelWeight(jax.ShapeDtypeStruct((2, 512, 512), jnp.int4),
                            jax.ShapeDtypeStruct((2, 4, 512), jnp.float16), None,
                            jax.ShapeDtypeStruct((2, 512), jnp.int32), 128)
    text = lower_for_cuda(jax.jit(model), jax.ShapeDtypeStruct((3, 512), jnp.float16), w)
    assert "mosaic_gpu" in text


def test_kernel_is_chosen_only_when_asked():
    """Never the default (no GPU has compiled it); explicit "pallas" on one device, jax >= 0.11."""
    assert resolve_int4_kernel() == resolve_int4_kernel("auto") == resolve_int4_kernel("xla") == "xla"
    with pytest.raises(ValueError, match="int4 kernel must be one of"):
        resolve_int4_kernel("marlin")
    with pytest.raises(ValueError, match="'pallas' runs on one device"):
        resolve_int4_kernel("pallas", num_devices=2)
    if im.MGPU_AVAILABLE:
        assert resolve_int4_kernel("pallas") == "pallas"
    else:
        with pytest.raises(ValueError, match="needs jax >= 0.11"):
            resolve_int4_kernel("pallas")


def test_bad_shapes_are_errors_naming_them():
    if not im.MGPU_AVAILABLE:
        pytest.skip(f"needs jax >= 0.11 (this is {jax.__version__})")
    kw = to_kernel(_weight(96, 64, 32, False))            # K = 96: not a whole number of 64-row steps
    with pytest.raises(ValueError, match="group_size"):
        im.int4_matmul_mgpu(jnp.ones((1, 96), jnp.bfloat16), kw)
    with pytest.raises(ValueError, match="disagree on K"):
        im.int4_matmul_mgpu(jnp.ones((1, 64), jnp.bfloat16), to_kernel(_weight(128, 64, 32, False)))


def test_old_jax_gets_a_clear_error():
    if im.MGPU_AVAILABLE:
        pytest.skip("needs jax < 0.11 (this jax has Mosaic GPU's plgpu.kernel)")
    with pytest.raises(ValueError, match="needs jax >= 0.11"):
        im.int4_matmul_mgpu(jnp.ones((1, 128)), to_kernel(_weight(128, 64, 64, False)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_compiled_matches_reference(case):
    m, k, n, g, asym, act_order, dtype = case
    w = _weight(k, n, g, asym, act_order, seed=m + k + n)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(dtype)
    kw = to_kernel(w, jnp.float16 if dtype == "float16" else jnp.bfloat16)
    _close(jax.jit(im.int4_matmul_mgpu)(x, kw), ref_int4_matmul(x, w))


def _gptq_layers(L, k, n, g, seed=0):
    """GPTQ v1 tensors (zeros stored minus 1) of L layers as the loader reads them, and the
    Int4Weights they are."""
    from jaxserve.loader.int4 import pack_np
    rng = np.random.default_rng(seed)
    tensors, names = {}, []
    for i in range(L):
        codes, zero = rng.integers(0, 16, (k, n)), rng.integers(0, 16, (k // g, n))
        p = f"model.layers.{i}.mlp.down_proj."
        tensors |= {p + "qweight": pack_np(codes, 0), p + "qzeros": pack_np((zero - 1) & 15, 1),
                    p + "scales": rng.uniform(0.005, 0.02, (k // g, n)).astype(np.float16)}
        names.append(p + "weight")
    return tensors, names


def test_loader_re_lays_out_for_the_kernel_only_when_asked():
    """`stack_int4(kernel="pallas")` is the one re-layout at load: the same matrix as the XLA
    path's Int4Weight; "auto" keeps the Int4Weight. `use_kernel` converts a model's dense int4
    matrices and leaves experts (grouped_linear's business) alone."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxserve.layers.experts import ExpertWeight
    from jaxserve.layers.int4_kernel import use_kernel
    from jaxserve.loader.int4 import Int4Scheme, stack_int4
    tensors, names = _gptq_layers(2, 128, 64, 64)
    scheme = Int4Scheme("gptq", 64, False, zero_offset=1)
    one = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)), PartitionSpec())
    xla = stack_int4(scheme, tensors.__getitem__, set(tensors), names, 128, 64, one)
    assert isinstance(xla, Int4Weight)
    if not im.MGPU_AVAILABLE:
        with pytest.raises(ValueError, match="needs jax >= 0.11"):
            stack_int4(scheme, tensors.__getitem__, set(tensors), names, 128, 64, one, kernel="pallas")
        return
    kw = stack_int4(scheme, tensors.__getitem__, set(tensors), names, 128, 64, one, kernel="pallas")
    assert isinstance(kw, im.Int4KernelWeight) and kw.codes.shape == (2, 64, 128) and kw.shape == (2, 128, 64)
    eye = jnp.eye(128, dtype=jnp.float32)
    for layer in range(2):
        sl = jax.tree.map(lambda a, i=layer: a[i], (xla, kw))
        np.testing.assert_allclose(im.ref_int4_matmul(eye, sl[1]), ref_int4_matmul(eye, sl[0]), atol=1e-3)
    tree = {"wq": xla, "experts": ExpertWeight(xla)}
    out = use_kernel(tree, "pallas")
    assert isinstance(out["wq"], im.Int4KernelWeight) and out["experts"].w is xla
    assert use_kernel(tree) is tree


def test_a_weight_the_kernel_cannot_represent_is_refused():
    """A later Int4Weight variant (a float offset, another bit width) is refused by name rather
    than re-laid out without the field; a weight split over devices too."""
    import dataclasses

    @dataclasses.dataclass
    class Variant(Int4Weight):
        offset: jax.Array | None = None
        bits: int = 4
    w = _weight(64, 64, 32, False)
    assert isinstance(to_kernel(Variant(w.q, w.scale, group_size=32)), im.Int4KernelWeight)
    for extra, name in ((dict(offset=jnp.ones((2, 64))), "offset"), (dict(bits=8), "bits"), (dict(in_shards=2), "")):
        with pytest.raises(ValueError, match=f"int4 kernel 'pallas' .*{name}"):
            to_kernel(Variant(w.q, w.scale, group_size=32, **extra))
