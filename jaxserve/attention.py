"""Paged attention over a ragged batch, and the one switch between its backends.

`ragged_paged_attention_ref` is the plain-jnp path: the CPU default and the oracle the Pallas
kernels are checked against. A batch mixes decode rows (one new token) and prefill chunks (many
new tokens, causal inside the chunk, attending to the cached prefix); the new tokens' K/V are
already in the cache when attention runs (see docs/internals.md).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxserve import kv_cache as kvc

_MASKED = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: jax.Array   # [T] int32, slot of each new token's K/V; N * B for padding
    block_tables: jax.Array   # [S, M] int32, block ids per sequence
    kv_lens: jax.Array        # [S] int32, tokens in the cache after this step; 0 for padding
    cu_q_lens: jax.Array      # [S + 1] int32, cumulative new-token counts
    num_seqs: jax.Array       # [1] int32, real sequences


def token_layout(meta: AttentionMetadata, num_tokens: int):
    """Per token: its sequence [T], its absolute position [T], whether it is real [T]."""
    cu = meta.cu_q_lens
    S = meta.kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, S - 1).astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    pos = meta.kv_lens[seq] - q_lens[seq] + (t - cu[seq])
    return seq, pos, t < cu[-1]


def _kv_chunk_tokens(num_tokens: int, block_size: int, kv_heads: int, head_dim: int) -> int:
    """KV positions per loop step. Small chunks keep one step's gathered K/V in cache (~4 MiB):
    on CPU that is 5x faster than big chunks for decode batches, and no slower for prefill."""
    budget = (4 << 20) // max(1, num_tokens * kv_heads * head_dim * 4)
    chunk = 512
    while chunk > max(block_size, 32) and chunk > budget:
        chunk //= 2
    return max(chunk, block_size)


def ragged_paged_attention_ref(q, k_pages, v_pages, meta: AttentionMetadata, *, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               k_scale=None, v_scale=None):
    """q [T, H, D]; k_pages, v_pages [R, B, K, D]; scales [R, B, K] or None -> [T, H, D].

    An online-softmax loop over chunks of each token's context, run for as many chunks as the
    longest sequence needs (a dynamic trip count, so no context-length bucket is compiled).
    """
    T, H, D = q.shape
    B, K = k_pages.shape[1], k_pages.shape[2]
    G = H // K
    seq, pos, valid = token_layout(meta, T)
    chunk = _kv_chunk_tokens(T, B, K, D)
    blocks_per_chunk = chunk // B
    tables = meta.block_tables
    pad = (-tables.shape[1]) % blocks_per_chunk
    tables = jnp.pad(tables, ((0, 0), (0, pad)))
    tok_tables = tables[seq]                                     # [T, Mp]
    qg = q.reshape(T, K, G, D).astype(jnp.float32) * sm_scale

    def gather(pages, scale, ids):
        x = pages[ids].astype(jnp.float32)                       # [T, C, B, K, D]
        if scale is not None:
            x = x * scale[ids][..., None]
        return x.reshape(T, chunk, K, D)

    def body(j, carry):
        m, l, acc = carry                                        # [T,K,G], [T,K,G], [T,K,G,D]
        ids = jax.lax.dynamic_slice_in_dim(tok_tables, j * blocks_per_chunk, blocks_per_chunk, 1)
        k = gather(k_pages, k_scale, ids)
        v = gather(v_pages, v_scale, ids)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = (kpos[None, :] <= pos[:, None]) & valid[:, None]  # [T, C]
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - sliding_window
        mask = mask[:, None, None, :]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgc,tckd->tkgd", p, v)
        return m_new, l, acc

    num_chunks = (jnp.max(meta.kv_lens) + chunk - 1) // chunk
    init = (jnp.full((T, K, G), _MASKED, jnp.float32), jnp.zeros((T, K, G), jnp.float32),
            jnp.zeros((T, K, G, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return out.reshape(T, H, D).astype(q.dtype)


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
                    soft_cap: float | None = None):
    """One layer's attention: q [T, H, D] against layer `layer` of the stacked cache."""
    n = cache.num_blocks
    meta = dataclasses.replace(meta, block_tables=meta.block_tables + layer * n)
    scales = {}
    if cache.quantized:
        scales = dict(k_scale=kvc.layer_view(cache.k_scale), v_scale=kvc.layer_view(cache.v_scale))
    fn = partial(_kernel(backend), sm_scale=sm_scale, sliding_window=sliding_window,
                 soft_cap=soft_cap, **scales)
    return fn(q, kvc.layer_view(cache.k), kvc.layer_view(cache.v), meta)
