"""The CPU paged attention kernel (layers/csrc/paged_attention.cc, built and registered with the
fused int4 kernel by `layers.int4_cpu.load()`): attention backend "cpu".

Each token's G query heads of a kv head read the K and V rows of its context from the pages in
place (scores, softmax, values) on XLA's intra-op threads. XLA:CPU runs the reference path's decode
loops as many small gathers, dots and fusions: ~40 us a layer at batch 1 on the default model,
most of it per-op overhead (benchmarks/RESULTS.md). Every token is attended alike whatever its
chunk, so a prompt gets the same numbers prefilled whole, in chunks or after a prefix-cache hit
(the engine's greedy outputs with and without speculation or the prefix cache stay identical).

f32 pages, bf16 ones (`--kv-cache-dtype bfloat16`: half the memory, llama.cpp's default KV size),
or an int8 KV cache (`--kv-cache-dtype int8`: codes with a scale per token and kv head, a quarter
of the bytes decode attention reads); fp8 KV caches and the latent cache (no V pages) stay on the
reference path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.layers import int4_cpu


def problem(kv_dtype, latent: bool, platform: str) -> str | None:
    """Why the kernel cannot serve this case (None: it can)."""
    if platform != "cpu":
        return f"it runs on CPU only (this is {platform})"
    if latent:
        return "it has no latent-cache (multi-head latent attention) layout"
    if kv_dtype is not None and jnp.dtype(kv_dtype) not in (jnp.float32, jnp.bfloat16, jnp.int8):
        return f"it reads f32, bf16 or int8 KV pages (the cache is {jnp.dtype(kv_dtype).name})"
    return int4_cpu.load()


def paged_attention(qf: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                    meta: AttentionMetadata, *, window, soft_cap: float | None,
                    sinks: jax.Array | None, k_scale: jax.Array | None = None,
                    v_scale: jax.Array | None = None) -> jax.Array:
    """qf [T, K, G, D] f32 (scaled), pages [R, B, K, D] f32 or bf16 (or uint16 holding bf16 bits: a
    CPU pool's `codes` form; or int8 with `k_scale`, `v_scale`
    [R, B, K] f32), tables [S, M] (offset to the layer's rows) -> [T, K, G, D]: every real token
    attended, padding tokens zeros. `window`: a static int, a [1] int32 array (this layer's), or
    None; `sinks` [K, G] f32 or None."""
    why = int4_cpu.load()
    if why is not None:
        raise RuntimeError(f"attention backend 'cpu': the CPU kernel library is not available: {why}")
    win = jnp.zeros((1,), jnp.int32) if window is None else jnp.asarray(window, jnp.int32).reshape(1)
    call = jax.ffi.ffi_call(int4_cpu.ATTENTION_TARGET, jax.ShapeDtypeStruct(qf.shape, jnp.float32),
                            vmap_method="sequential")
    return call(qf, k_pages, v_pages, tables.astype(jnp.int32), meta.kv_lens.astype(jnp.int32),
                meta.cu_q_lens.astype(jnp.int32), meta.num_seqs.astype(jnp.int32).reshape(-1)[:1], win,
                jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
                *(jnp.zeros((0,), jnp.float32) if x is None else x.astype(jnp.float32) for x in (k_scale, v_scale)),
                soft_cap=np.float32(soft_cap or 0.0))
