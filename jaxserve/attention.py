"""Paged attention over a ragged batch, and the one switch between its backends.

`ragged_paged_attention_ref` is the plain-jnp path: the CPU default and the oracle the Pallas
kernels are checked against. A batch mixes decode rows (one new token) and prefill chunks (many
new tokens, causal inside the chunk, attending to the cached prefix); the new tokens' K/V are
already in the cache when attention runs (see docs/internals.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve import kv_cache as kvc

_MASKED = -1e30
_TILE = 8   # query tokens per row in prefill-heavy steps (8 beat 16 and 4 on CPU)


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


def _row_layout(meta: AttentionMetadata, num_tokens: int, tile: int):
    """Groups the query tokens into rows of up to `tile` consecutive tokens of one sequence, so a
    sequence's context is gathered once per row instead of once per token.

    Returns per row: its sequence [R], its token indices [R, tile], their positions [R, tile],
    which are real [R, tile]; and per token its (row, column) to scatter results back.
    """
    seq_t, pos_t, valid_t = token_layout(meta, num_tokens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    if tile == 1:
        return seq_t, t[:, None], pos_t[:, None], valid_t[:, None], (t, jnp.zeros_like(t))
    cu, kv_lens = meta.cu_q_lens, meta.kv_lens
    S = kv_lens.shape[0]
    q_lens = cu[1:] - cu[:-1]
    row_cu = jnp.concatenate([jnp.zeros(1, jnp.int32),
                              jnp.cumsum((q_lens + tile - 1) // tile).astype(jnp.int32)])
    num_rows = num_tokens // tile + S                 # >= sum(ceil(q_len / tile)) always
    r = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(row_cu[1:], r, side="right"), 0, S - 1).astype(jnp.int32)
    tok = (cu[seq] + (r - row_cu[seq]) * tile)[:, None] + jnp.arange(tile, dtype=jnp.int32)
    valid = (tok < cu[seq + 1][:, None]) & (r < row_cu[-1])[:, None]
    pos = (kv_lens[seq] - q_lens[seq] - cu[seq])[:, None] + tok
    local = t - cu[seq_t]
    return seq, jnp.clip(tok, 0, num_tokens - 1), pos, valid, (row_cu[seq_t] + local // tile,
                                                                 local % tile)


def ragged_paged_attention_ref(q, k_pages, v_pages, meta: AttentionMetadata, *, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               k_scale=None, v_scale=None, return_pages: bool = False):
    """q [T, H, D]; k_pages, v_pages [R, B, K, D]; scales [R, B, K] or None -> [T, H, D].

    `return_pages=True` also returns (k_pages, v_pages, k_scale, v_scale) as threaded through the
    loop. Inside the model's layer loop the caller must continue with those: if the loop only
    closed over the pages, the pages would stay live after it and XLA would copy the whole cache
    into the loop's state on every layer (measured: most of a CPU decode step).

    An online-softmax loop over chunks of each row's context, run for as many chunks as the
    longest sequence needs (a dynamic trip count, so no context-length bucket is compiled).
    Decode-heavy steps use one row per token; prefill-heavy steps (many more tokens than
    sequences) use rows of 8 tokens of one sequence, gathering each context once per row.
    """
    T, H, D = q.shape
    B, K = k_pages.shape[1], k_pages.shape[2]
    G = H // K
    S = meta.kv_lens.shape[0]
    tile = _TILE if T >= 4 * S else 1
    seq, tok, pos, valid, (tok_row, tok_col) = _row_layout(meta, T, tile)
    R = seq.shape[0]
    chunk = _kv_chunk_tokens(R, B, K, D)
    blocks_per_chunk = chunk // B
    tables = meta.block_tables
    pad = (-tables.shape[1]) % blocks_per_chunk
    row_tables = jnp.pad(tables, ((0, 0), (0, pad)))[seq]       # [R, Mp]
    qr = (q.astype(jnp.float32) * sm_scale)[tok].reshape(R, tile, K, G, D)

    def gather(pages, scale, ids):
        x = pages[ids].astype(jnp.float32)                       # [R, C, B, K, D]
        if scale is not None:
            x = x * scale[ids][..., None]
        return x.reshape(R, chunk, K, D)

    def body(j, carry):
        (m, l, acc), (k_pages, v_pages, k_scale, v_scale) = carry   # [R,q,K,G] x2, [R,q,K,G,D]
        ids = jax.lax.dynamic_slice_in_dim(row_tables, j * blocks_per_chunk, blocks_per_chunk, 1)
        k = gather(k_pages, k_scale, ids)
        v = gather(v_pages, v_scale, ids)
        s = jnp.einsum("rqkgd,rckd->rqkgc", qr, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = (kpos <= pos[..., None]) & valid[..., None]      # [R, q, C]
        if sliding_window is not None:
            mask &= kpos > pos[..., None] - sliding_window
        mask = mask[:, :, None, None, :]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("rqkgc,rckd->rqkgd", p, v)
        return (m_new, l, acc), (k_pages, v_pages, k_scale, v_scale)

    num_chunks = (jnp.max(meta.kv_lens) + chunk - 1) // chunk
    init = (jnp.full((R, tile, K, G), _MASKED, jnp.float32),
            jnp.zeros((R, tile, K, G), jnp.float32), jnp.zeros((R, tile, K, G, D), jnp.float32))
    (_, l, acc), pages = jax.lax.fori_loop(0, num_chunks, body,
                                           (init, (k_pages, v_pages, k_scale, v_scale)))
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    out = out[tok_row, tok_col].reshape(T, H, D).astype(q.dtype)
    return (out, pages) if return_pages else out


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
