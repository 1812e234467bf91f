"""The one switch between attention backends, and one layer's attention against the stacked cache."""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.attention import kv_cache as kvc
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.attention.reference import ragged_paged_attention_ref


def resolve_backend(name: str) -> str:
    """"auto" -> the Pallas kernel on GPU, the jnp reference elsewhere."""
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if name not in ("reference", "pallas"):
        raise ValueError(f"attention_backend must be 'auto', 'reference' or 'pallas', got {name!r}")
    return name


def _kernel(backend: str):
    if backend == "reference":
        return ragged_paged_attention_ref
    from jaxserve.pallas import paged_attention
    return paged_attention.ragged_paged_attention


def paged_attention(q, cache: kvc.KVCache, layer, meta: AttentionMetadata, *, backend: str,
                    sm_scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> tuple[jax.Array, kvc.KVCache]:
    """One layer's attention: q [T, H, D] against layer `layer` of the stacked cache.
    Returns the output and the cache to carry on with (see `return_pages`)."""
    n = cache.num_blocks
    meta = dataclasses.replace(meta, block_tables=meta.block_tables + layer * n)
    scales = {}
    if cache.quantized:
        scales = dict(k_scale=kvc.layer_view(cache.k_scale), v_scale=kvc.layer_view(cache.v_scale))
    args = (q, kvc.layer_view(cache.k), kvc.layer_view(cache.v), meta)
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, **scales)
    if backend != "reference":
        return _kernel(backend)(*args, **opts), cache
    out, (k, v, ks, vs) = ragged_paged_attention_ref(*args, **opts, return_pages=True)
    shape, scale_shape = cache.k.shape, cache.k.shape[:-1]
    return out, kvc.KVCache(k.reshape(shape), v.reshape(shape),
                            None if ks is None else ks.reshape(scale_shape),
                            None if vs is None else vs.reshape(scale_shape))
