"""Pallas paged attention (interpret mode on CPU) vs its jnp reference, and the reference vs a
naive per-sequence numpy loop; KV quantisation round trips; input validation.

Tolerances (max abs error; outputs are softmax averages of N(0, 1) values, so |out| <~ 3):
  f32 q, f32 or fp8/int8 cache (dequantised exactly to f32)  kernel vs ref: 2e-5
  bf16 q / bf16 cache (P cast to bf16 before P@V)            kernel vs ref: 5e-2
  ref vs naive numpy (f64)                                                  1e-5
  quantised cache vs the unquantised f32 result (quantisation error itself):
      fp8 e4m3 0.25, fp8 e5m2 0.5, int8 0.05
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import kv_quant
from jaxserve.pallas.paged_attention import BlockSizes, ragged_paged_attention, ref_ragged_paged_attention
from jaxserve.pallas.paged_attention_decode import combine_splits, ragged_paged_attention_decode

try:
    from jaxserve.attention import AttentionMetadata
except ImportError:  # the kernel only reads attributes
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class AttentionMetadata:
        slot_mapping: jax.Array
        block_tables: jax.Array
        kv_lens: jax.Array
        cu_q_lens: jax.Array
        num_seqs: jax.Array

TOL = {"float32": 2e-5, "bfloat16": 5e-2}
QUANT_ERR = {"fp8_e4m3": 0.25, "fp8_e5m2": 0.5, "int8": 0.05}


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple          # new tokens per real sequence
    ctx: tuple             # cached tokens before this step per real sequence
    T: int                 # padded tokens
    S: int                 # padded sequences
    B: int = 16
    K: int = 2
    G: int = 4
    D: int = 64
    N: int = 48
    M: int = 8
    window: int | None = None
    soft_cap: float | None = None
    dtype: str = "float32"
    kv: str = "auto"
    blocks: BlockSizes | None = None


def make_batch(case: Case, seed: int = 0):
    """Random q/cache and metadata laid out exactly as docs/internals.md describes."""
    rng = np.random.default_rng(seed)
    ns = len(case.q_lens)
    kv_lens = [c + q for c, q in zip(case.ctx, case.q_lens)]
    assert sum(case.q_lens) <= case.T and ns <= case.S
    assert max(kv_lens, default=0) <= case.M * case.B
    perm = rng.permutation(case.N)
    bt = np.zeros((case.S, case.M), np.int32)
    used = 0
    for s, kl in enumerate(kv_lens):
        nb = -(-kl // case.B)
        bt[s, :nb] = perm[used:used + nb]
        used += nb
    assert used <= case.N
    cu = np.zeros(case.S + 1, np.int32)
    cu[1:ns + 1] = np.cumsum(case.q_lens)
    cu[ns + 1:] = cu[ns]
    kvl = np.zeros(case.S, np.int32)
    kvl[:ns] = kv_lens
    slots = np.full(case.T, case.N * case.B, np.int32)
    meta = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(bt),
                             kv_lens=jnp.asarray(kvl), cu_q_lens=jnp.asarray(cu),
                             num_seqs=jnp.asarray([ns], jnp.int32))
    H = case.K * case.G
    dt = jnp.dtype(case.dtype)
    q = jnp.asarray(rng.standard_normal((case.T, H, case.D)), dt)
    shape = (case.N, case.B, case.K, case.D)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    ks = vs = None
    if case.kv != "auto":
        sd = kv_quant.kv_storage_dtype(case.kv, dt)
        k, ks = kv_quant.quantize_kv(k.reshape(-1, case.K, case.D), sd)
        v, vs = kv_quant.quantize_kv(v.reshape(-1, case.K, case.D), sd)
        k, v = k.reshape(shape), v.reshape(shape)
        if ks is not None:         # an unquantised storage dtype (bfloat16) has no scales
            ks, vs = ks.reshape(shape[:-1]), vs.reshape(shape[:-1])
    else:
        k, v = k.astype(dt), v.astype(dt)
    return q, k, v, meta, ks, vs


def naive_attention(q, k, v, meta, *, sm_scale, window=None, soft_cap=None, ks=None, vs=None, sinks=None):
    """Per-sequence, per-token dense softmax in float64 numpy (`sinks` [H]: one more logit per
    head in the denominator, gpt-oss)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k.astype(jnp.float32), np.float64)
    v = np.asarray(v.astype(jnp.float32), np.float64)
    if ks is not None:
        k = k * np.asarray(ks, np.float64)[..., None]
        v = v * np.asarray(vs, np.float64)[..., None]
    T, H, D = q.shape
    _, B, K, _ = k.shape
    G = H // K
    bt, kv_lens = np.asarray(meta.block_tables), np.asarray(meta.kv_lens)
    cu, ns = np.asarray(meta.cu_q_lens), int(np.asarray(meta.num_seqs)[0])
    out = np.zeros((T, H, D))
    for s in range(ns):
        kl, ql = kv_lens[s], cu[s + 1] - cu[s]
        ctx_k = np.stack([k[bt[s, j // B], j % B] for j in range(kl)]) if kl else None
        ctx_v = np.stack([v[bt[s, j // B], j % B] for j in range(kl)]) if kl else None
        for i in range(ql):
            t, pos = cu[s] + i, kl - ql + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(H):
                sc = ctx_k[lo:pos + 1, h // G] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                sink = -np.inf if sinks is None else float(sinks[h])
                m = max(sc.max(), sink)
                p = np.exp(sc - m)
                out[t, h] = (p / (p.sum() + np.exp(sink - m))) @ ctx_v[lo:pos + 1, h // G]
    return out


def run_kernel(case: Case, seed=0, entry=ragged_paged_attention, **kw):
    q, k, v, meta, ks, vs = make_batch(case, seed)
    sm = 1.0 / np.sqrt(case.D)
    args = dict(sm_scale=sm, sliding_window=case.window, soft_cap=case.soft_cap,
                k_scale=ks, v_scale=vs)
    if entry is ragged_paged_attention:
        kw.setdefault("block_sizes", case.blocks)
    out = entry(q, k, v, meta, interpret=True, **args, **kw)
    ref = ref_ragged_paged_attention(q, k, v, meta, **args)
    return out, ref, (q, k, v, meta, ks, vs, sm)


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


SMALL = BlockSizes(q_rows=16, kv_tokens=16)   # many tiles and chunks even on tiny shapes
CASES = {
    "decode_only": Case(q_lens=(1, 1, 1, 1), ctx=(5, 40, 16, 99), T=8, S=6),
    "lone_decode_token_bucket_1": Case(q_lens=(1,), ctx=(37,), T=1, S=1),    # batch-1 decode's step
    "prefill_only_mha_b32": Case(q_lens=(17, 33), ctx=(0, 0), T=64, S=2, B=32, K=2, G=1,
                                 D=128, M=4),
    "prefill_chunk_on_prefix": Case(q_lens=(24,), ctx=(45,), T=32, S=2, blocks=SMALL),
    "mixed_empty_rows_padding_gqa8": Case(q_lens=(1, 0, 9, 1, 21), ctx=(40, 5, 3, 70, 0),
                                          T=40, S=7, K=1, G=8, blocks=SMALL),
    "mqa_partial_last_block": Case(q_lens=(3, 1, 12), ctx=(14, 30, 19), T=20, S=3, K=1, G=4),
    "gqa_ratio_3_padded_heads": Case(q_lens=(1, 6), ctx=(20, 11), T=8, S=2, K=2, G=3),
    "head_dim_256": Case(q_lens=(1, 5), ctx=(9, 3), T=8, S=2, K=1, G=2, D=256, M=2, N=8),
    "sliding_window": Case(q_lens=(1, 30, 1), ctx=(100, 10, 3), T=32, S=4, window=24,
                           blocks=SMALL),
    "soft_cap": Case(q_lens=(1, 12), ctx=(50, 20), T=16, S=2, soft_cap=2.0),
    "window_and_cap_b32": Case(q_lens=(7, 1), ctx=(60, 90), T=8, S=2, B=32, M=4, window=33,
                               soft_cap=5.0),
    "all_padding": Case(q_lens=(), ctx=(), T=8, S=4),
    "bf16": Case(q_lens=(1, 13, 1), ctx=(33, 4, 0), T=16, S=3, dtype="bfloat16"),
    "fp8_e4m3": Case(q_lens=(1, 9, 1), ctx=(33, 4, 60), T=16, S=3, kv="fp8_e4m3"),
    "fp8_e5m2": Case(q_lens=(1, 9), ctx=(33, 4), T=16, S=3, kv="fp8_e5m2", window=20),
    "int8": Case(q_lens=(5, 1), ctx=(12, 77), T=8, S=2, kv="int8", K=1, G=8),
    "fp8_bf16_q": Case(q_lens=(1, 6), ctx=(70, 2), T=8, S=2, kv="fp8", dtype="bfloat16"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ragged_kernel_matches_reference(name):
    case = CASES[name]
    out, ref, _ = run_kernel(case, seed=sum(map(ord, name)))
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert max_err(out, ref) <= TOL[case.dtype], name


@pytest.mark.parametrize("name", ["mixed_empty_rows_padding_gqa8", "sliding_window",
                                  "window_and_cap_b32", "int8", "head_dim_256",
                                  "gqa_ratio_3_padded_heads", "all_padding"])
def test_reference_matches_naive_numpy_loop(name):
    case = CASES[name]
    q, k, v, meta, ks, vs = make_batch(case, seed=7)
    sm = 1.0 / np.sqrt(case.D)
    ref = ref_ragged_paged_attention(q, k, v, meta, sm_scale=sm, sliding_window=case.window,
                                     soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    naive = naive_attention(q, k, v, meta, sm_scale=sm, window=case.window,
                            soft_cap=case.soft_cap, ks=ks, vs=vs)
    assert max_err(ref, naive) <= 1e-5


def test_padding_tokens_get_zeros():
    out, _, (_, _, _, meta, *_rest) = run_kernel(CASES["mixed_empty_rows_padding_gqa8"])
    real = int(meta.cu_q_lens[-1])
    assert real < out.shape[0] and not np.any(np.asarray(out[real:]))


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_quantised_cache_stays_close_to_full_precision(kv):
    case = Case(q_lens=(1, 7), ctx=(40, 9), T=8, S=2, kv=kv)
    out, _, _ = run_kernel(case, seed=3)
    full, _, _ = run_kernel(dataclasses.replace(case, kv="auto"), seed=3)
    assert max_err(out, full) <= QUANT_ERR[kv]


DECODE_CASES = {
    "splits_1": (Case(q_lens=(1, 1, 0, 1), ctx=(100, 7, 3, 64), T=8, S=5), 1),
    "splits_3_uneven": (Case(q_lens=(1, 1, 0, 1), ctx=(100, 7, 3, 64), T=8, S=5), 3),
    "splits_auto_gqa8_window_cap": (Case(q_lens=(1, 1), ctx=(120, 30), T=2, S=2, K=1, G=8,
                                         window=40, soft_cap=3.0), None),
    "int8_splits_4": (Case(q_lens=(1, 1), ctx=(90, 15), T=4, S=3, kv="int8"), 4),
    "fp8_mqa_d128": (Case(q_lens=(1,), ctx=(50,), T=2, S=2, K=1, G=4, D=128, kv="fp8"), 2),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_split_k_decode_matches_reference(name):
    case, splits = DECODE_CASES[name]
    out, ref, _ = run_kernel(case, entry=ragged_paged_attention_decode, num_splits=splits,
                             kv_tokens=16)
    assert max_err(out, ref) <= TOL[case.dtype]


def test_split_combine_ignores_empty_splits():
    acc = jnp.array([[[2.0, 4.0]], [[0.0, 0.0]]])          # [P=2, R=1, D=2]
    m = jnp.array([[1.0], [-0.7 * np.finfo(np.float32).max]])
    l = jnp.array([[2.0], [0.0]])
    np.testing.assert_allclose(combine_splits(acc, m, l), [[1.0, 2.0]])


def test_decode_entry_rejects_prefill_rows():
    q, k, v, meta, _, _ = make_batch(Case(q_lens=(1, 3), ctx=(4, 0), T=4, S=2))
    with pytest.raises(ValueError, match="q_len <= 1"):
        ragged_paged_attention_decode(q, k, v, meta, sm_scale=0.1, interpret=True)


@pytest.mark.parametrize("window", [24, None], ids=["sliding_layer", "global_layer"])
@pytest.mark.parametrize("entry", ["ref", "engine_ref", "ragged", "decode"])
def test_layer_window_in_metadata_equals_the_static_window(entry, window):
    """A model whose layers differ (Gemma 2/3) sets each layer's window in the metadata, traced
    inside its layer scan; every path gives what the static window gives (NO_WINDOW: none)."""
    from jaxserve.attention import ragged_paged_attention_ref
    from jaxserve.pallas.common import NO_WINDOW
    decode = entry == "decode"
    case = Case(q_lens=(1, 1, 1) if decode else (1, 30, 1), ctx=(100, 10, 3), T=32, S=4,
                soft_cap=3.0, blocks=SMALL)
    q, k, v, meta, _, _ = make_batch(case, seed=5)
    fn = {"ref": ref_ragged_paged_attention, "engine_ref": ragged_paged_attention_ref,
          "ragged": lambda *a, **kw: ragged_paged_attention(*a, **kw, interpret=True, block_sizes=SMALL),
          "decode": lambda *a, **kw: ragged_paged_attention_decode(*a, **kw, interpret=True,
                                                                   kv_tokens=16)}[entry]
    opts = dict(sm_scale=0.125, soft_cap=case.soft_cap)
    want = fn(q, k, v, meta, sliding_window=window, **opts)

    @jax.jit
    def per_layer(q, k, v, meta, w):      # the window is traced, as in a layer scan
        return fn(q, k, v, dataclasses.replace(meta, sliding_window=w), **opts)

    got = per_layer(q, k, v, meta, jnp.asarray([window or NO_WINDOW], jnp.int32))
    assert max_err(got, want) <= 2e-5
    if window is not None:      # the window matters on these contexts
        assert max_err(got, fn(q, k, v, meta, **opts)) > 1e-2
    with pytest.raises(ValueError, match="not both"):
        fn(q, k, v, dataclasses.replace(meta, sliding_window=jnp.asarray([8], jnp.int32)),
           sliding_window=8, **opts)


# --- validation --------------------------------------------------------------------------------
def _valid():
    return make_batch(Case(q_lens=(1, 3), ctx=(4, 0), T=4, S=2))


def test_rejects_heads_not_multiple_of_kv_heads():
    q, k, v, meta, _, _ = _valid()
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ragged_paged_attention(q[:, :7], k, v, meta, sm_scale=0.1)


def test_rejects_unsupported_head_dim():
    q, k, v, meta, _, _ = _valid()
    with pytest.raises(ValueError, match="head_dim must be one of"):
        ragged_paged_attention(q[..., :32], k[..., :32], v[..., :32], meta, sm_scale=0.1)


def test_rejects_mismatched_caches_and_missing_scales():
    q, k, v, meta, _, _ = _valid()
    with pytest.raises(ValueError, match="v_cache"):
        ragged_paged_attention(q, k, v[:4], meta, sm_scale=0.1)
    k8, v8 = k.astype(jnp.int8), v.astype(jnp.int8)
    with pytest.raises(ValueError, match="k_scale is required"):
        ragged_paged_attention(q, k8, v8, meta, sm_scale=0.1)
    with pytest.raises(ValueError, match="unquantised"):
        ragged_paged_attention(q, k, v, meta, sm_scale=0.1, k_scale=k[..., 0], v_scale=v[..., 0])


def test_rejects_bad_metadata_dtype_and_shape():
    q, k, v, meta, _, _ = _valid()
    bad = dataclasses.replace(meta, block_tables=np.asarray(meta.block_tables, np.int64))
    with pytest.raises(ValueError, match="block_tables must be int32"):
        ragged_paged_attention(q, k, v, bad, sm_scale=0.1)
    bad = dataclasses.replace(meta, cu_q_lens=meta.cu_q_lens[:-1])
    with pytest.raises(ValueError, match="cu_q_lens must be"):
        ragged_paged_attention(q, k, v, bad, sm_scale=0.1)


def test_rejects_bad_metadata_values():
    q, k, v, meta, _, _ = _valid()
    bad = dataclasses.replace(meta, kv_lens=jnp.asarray([4, 2], jnp.int32))   # q_len 3 > kv 2
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        ragged_paged_attention(q, k, v, bad, sm_scale=0.1)
    bad = dataclasses.replace(meta, cu_q_lens=jnp.asarray([0, 3, 1], jnp.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        ragged_paged_attention(q, k, v, bad, sm_scale=0.1)
    bad = dataclasses.replace(meta, block_tables=meta.block_tables.at[0, 0].set(10_000))
    with pytest.raises(ValueError, match="block_tables entries"):
        ragged_paged_attention(q, k, v, bad, sm_scale=0.1)


def test_rejects_bad_options():
    q, k, v, meta, _, _ = _valid()
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention(q, k, v, meta, sm_scale=0.1, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        ragged_paged_attention(q, k, v, meta, sm_scale=0.1, soft_cap=-1.0)


# --- KV quantisation ---------------------------------------------------------------------------
# worst-case |x - dequant(quant(x))| as a fraction of the token-head's absmax
ROUND_TRIP = {"fp8": 2.0 ** -4, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3, "int8": 0.5 / 127}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_kv_quant_round_trip_error_bound(name):
    x = jax.random.normal(jax.random.key(1), (64, 4, 128)) * jnp.logspace(-3, 3, 64)[:, None, None]
    sd = kv_quant.kv_storage_dtype(name, jnp.bfloat16)
    q, scale = jax.jit(kv_quant.quantize_kv, static_argnums=1)(x, sd)
    assert q.dtype == sd and q.shape == x.shape and scale.shape == (64, 4)
    assert scale.dtype == jnp.float32
    y = kv_quant.dequantize_kv(q, scale, jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    rel = float(jnp.max(jnp.abs(y - x) / absmax))
    assert rel <= ROUND_TRIP[name] * 1.001, rel
    # the absmax element itself maps onto the code's end point
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == kv_quant.qmax(sd)


def test_kv_quant_scale_never_zero():
    x = jnp.zeros((3, 2, 64)).at[1].set(1e-44).at[2, 0, 5].set(-3.0)
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        q, scale = kv_quant.quantize_kv(x, kv_quant.kv_storage_dtype(name, jnp.float32))
        assert bool(jnp.all(scale > 0)) and bool(jnp.all(jnp.isfinite(scale)))
        y = kv_quant.dequantize_kv(q, scale, jnp.float32)
        assert bool(jnp.all(jnp.isfinite(y))) and float(jnp.max(jnp.abs(y - x))) <= 0.2


def test_kv_storage_dtype_names():
    assert kv_quant.kv_storage_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_quant.kv_storage_dtype("fp8", jnp.bfloat16) == jnp.float8_e4m3fn
    assert kv_quant.kv_storage_dtype("fp8_e5m2", jnp.float32) == jnp.float8_e5m2
    assert kv_quant.kv_storage_dtype("int8", jnp.float32) == jnp.int8
    q, scale = kv_quant.quantize_kv(jnp.ones((2, 1, 64)), jnp.bfloat16)
    assert scale is None and q.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.kv_storage_dtype("fp4", jnp.float32)


# --- GPU lowering without a GPU ------------------------------------------------------------------
@pytest.mark.parametrize("layer_window", [False, True], ids=["static_window", "layer_window"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_kernels_lower_to_triton_for_cuda(kv, layer_window):
    """Cross-lower both kernels for CUDA: catches Triton-lowering gaps (non-power-of-two tensors,
    unsupported primitives) on a CPU-only machine, on jax 0.10 and 0.11 (helpers_lowering).
    Triton->PTX compilation is not covered."""
    from helpers_lowering import lower_for_cuda

    from jaxserve.pallas.paged_attention import _ragged_jit
    from jaxserve.pallas.paged_attention_decode import _decode_jit
    case = Case(q_lens=(1, 13, 1), ctx=(33, 4, 0), T=16, S=3, D=128, G=4, dtype="bfloat16", kv=kv)
    q, k, v, meta, ks, vs = make_batch(case)
    opts = dict(sm_scale=0.1, sliding_window=8, soft_cap=5.0, interpret=False)
    if layer_window:         # Gemma 2/3: the window is an operand, read in the kernel
        meta = dataclasses.replace(meta, sliding_window=jnp.asarray([8], jnp.int32))
        opts["sliding_window"] = None
    for fn, kw in ((_ragged_jit, dict(rows=64, kv_tokens=64)),
                   (_decode_jit, dict(kv_tokens=64, num_splits=4))):
        try:
            text = lower_for_cuda(fn, q, k, v, meta, ks, vs, **opts, **kw)
        except (ImportError, NotImplementedError) as e:
            if "triton" in str(e).lower() or "cuda" in str(e).lower():
                pytest.skip(f"no CUDA/Triton lowering in this jaxlib: {e}")
            raise
        assert "triton" in text.lower()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_dots_are_full_f32_for_f32_inputs_only(dtype):
    """On GPU an f32 dot at default precision runs as TF32 (6e-4 off the oracle on an H100):
    both kernels ask for HIGHEST on f32 operands and leave bf16 dots at the default."""
    import re

    from jaxserve.pallas.paged_attention import _ragged_jit
    from jaxserve.pallas.paged_attention_decode import _decode_jit
    case = Case(q_lens=(1, 1), ctx=(33, 4), T=8, S=2, D=128, dtype=dtype)
    q, k, v, meta, ks, vs = make_batch(case)
    opts = dict(sm_scale=0.1, sliding_window=None, soft_cap=None, interpret=False, kv_tokens=64)
    for fn, kw in ((_ragged_jit, dict(rows=64)), (_decode_jit, dict(num_splits=2))):
        text = str(jax.make_jaxpr(lambda *a, fn=fn, kw=kw: fn(*a, **opts, **kw))(q, k, v, meta, ks, vs))
        precisions = re.findall(r"precision=(\([^)]*\)|None)", text)
        assert len(re.findall(r"dot_general\[", text)) == 2            # q.k and p@v
        if dtype == "float32":
            assert precisions == ["(Precision.HIGHEST, Precision.HIGHEST)"] * 2
        else:
            assert all(p == "None" for p in precisions)
