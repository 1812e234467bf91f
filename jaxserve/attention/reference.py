"""Paged attention over a ragged batch in plain jnp.

`ragged_paged_attention_ref` is the plain-jnp path: the CPU default and the oracle the Pallas
kernels are checked against. A batch mixes decode rows (one new token) and prefill chunks (many
new tokens, causal inside the chunk, attending to the cached prefix); the new tokens' K/V are
already in the cache when attention runs (see docs/internals.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.attention.cpu_kernel import paged_attention as cpu_paged_attention
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.pallas.common import layer_window, searchsorted, target_platform, token_layout

_MASKED = -1e30
# CPU tuning of the reference path (measured on the default model, 2 cores; benchmarks/RESULTS.md):
_SHORT = 16          # chunks shorter than this are attended token by token (decodes)
_TOKEN_ROWS = 16     # single-token rows attended together in one loop step
_TILE = 64           # query tokens per row for longer chunks (prefill)
_TILE_ROWS = 2       # such rows attended together
_KV_CHUNK = 64       # KV positions per inner loop step (64 sequences at contexts 17-81: 0.87 vs 1.32 ms
                     # a layer with 128; at contexts 400-1000 within 1%)
# The static form (GPU targets): every loop has a trip count known at compile time, so XLA:GPU never
# copies a loop predicate to the host mid-step. All rows go through one online-softmax loop over
# the block table's whole width, its KV chunk as large as keeps one gathered chunk within this:
_STATIC_GATHER_BYTES = 256 << 20
_STATIC_TILE = 16    # query tokens per row in buckets with more tokens than sequences (prefill)


def static_form(platform: str | None = None) -> bool:
    """Whether the reference path takes its static form (`ragged_paged_attention_ref`'s `static`)
    on `platform` (default: the compile target's): on a GPU. A model runner then compiles its
    steps for several block-table widths (`worker.buckets.kv_widths`) and runs each step at the
    narrowest that holds its sequences, which bounds what the static loops read."""
    return (platform or target_platform()) == "gpu"


def _static_dot_dtype(k_pages, k_scale, page_codes):
    """The static form's dot dtype: 16-bit float pages as they are (no scales, no fp8 codes), else f32."""
    half = page_codes is None and k_scale is None and k_pages.dtype in (jnp.bfloat16, jnp.float16)
    return k_pages.dtype if half else jnp.float32


@dataclasses.dataclass
class _Rows:
    """Query rows: `tile` consecutive tokens of one sequence each, real rows first.
    tok [R, tile] (T marks an empty slot), pos [R, tile], seq [R], ctx [R] (KV positions the row
    reads: its last position + 1), num [] (real rows)."""
    tok: jax.Array
    pos: jax.Array
    seq: jax.Array
    ctx: jax.Array
    num: jax.Array

    def padded(self, multiple: int, num_tokens: int) -> _Rows:
        pad = (-self.seq.shape[0]) % multiple
        if not pad:
            return self
        def p(x, fill):
            return jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)])
        return _Rows(p(self.tok, num_tokens), p(self.pos, 0), p(self.seq, 0), p(self.ctx, 0),
                     self.num)


def _token_rows(meta: AttentionMetadata, num_tokens: int) -> _Rows:
    """One row per token of the sequences whose chunk is shorter than `_SHORT`, longest context
    first, so each batch of rows loops over about as many KV chunks as it needs."""
    seq, pos, valid = token_layout(meta, num_tokens)
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    mine = valid & (q_lens[seq] < _SHORT)
    order = jnp.argsort(jnp.where(mine, -pos, jnp.iinfo(jnp.int32).max)).astype(jnp.int32)
    mine, pos = mine[order], pos[order]
    return _Rows(jnp.where(mine, order, num_tokens)[:, None], pos[:, None], seq[order],
                 jnp.where(mine, pos + 1, 0), jnp.sum(mine).astype(jnp.int32))


def _tile_rows(meta: AttentionMetadata, num_tokens: int, tile: int, min_len: int | None = None) -> _Rows:
    """Rows of `tile` consecutive tokens over the sequences whose chunk has >= `min_len` tokens
    (default `_SHORT`)."""
    min_len = _SHORT if min_len is None else min_len
    cu, kv_lens = meta.cu_q_lens, meta.kv_lens
    S = kv_lens.shape[0]
    q_lens = cu[1:] - cu[:-1]
    per_seq = jnp.where(q_lens >= max(min_len, 1), (q_lens + tile - 1) // tile, 0)
    row_cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per_seq).astype(jnp.int32)])
    # sum(ceil(q / tile)) <= T / tile + (number of such sequences) <= T / tile + min(S, T / min_len)
    num_rows = min(num_tokens, num_tokens // tile + max(1, min(S, num_tokens // max(min_len, 1))))
    r = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.clip(searchsorted(row_cu[1:], r, side="right"), 0, S - 1).astype(jnp.int32)
    tok = (cu[seq] + (r - row_cu[seq]) * tile)[:, None] + jnp.arange(tile, dtype=jnp.int32)
    real = (tok < cu[seq + 1][:, None]) & (r < row_cu[-1])[:, None]
    pos = (kv_lens[seq] - q_lens[seq] - cu[seq])[:, None] + tok
    return _Rows(jnp.where(real, tok, num_tokens), pos, seq,
                 jnp.where(real, pos + 1, 0).max(-1), row_cu[-1])


def _attend_rows(qf, out, pages, tables, rows: _Rows, *, rows_per_step: int, chunk: int,
                 sliding_window, soft_cap, page_codes=None, sinks=None, static: bool = False):
    """Attention of `rows` of queries qf [T, K, G, D] (scaled, f32), written into out [T, K, G,
    D]. `sinks` [K, G] f32 or None: each head's sink logit, a key with value zero that every
    query sees (the online softmax starts from it). A loop over batches of `rows_per_step` rows
    (as many as there are real rows), each an online-softmax loop over `chunk` KV positions at
    a time (as many as its longest row needs): both trip counts are dynamic, so the work
    follows the batch, not the padded shapes.
    `static`: every row in one batch (`rows_per_step` ignored) and the KV loop over the tables'
    whole width, masked: trip counts known at compile time (the GPU form). Its dots take 16-bit
    float pages as they are (q and the probabilities rounded to the pages' dtype, f32
    accumulation, as the GPU kernels do): the gathered KV is not written out again in f32.
    Returns (out, pages): the pages are threaded through both loops (see `return_pages`)."""
    T, K, G, D = qf.shape
    B = pages[0].shape[1]
    W = rows.seq.shape[0] if static else rows_per_step
    rows = rows.padded(W, T)
    tile = rows.tok.shape[1]
    blocks = chunk // B
    heads = jnp.arange(K, dtype=jnp.int32)[:, None, None]

    k_pages, k_scale = pages[0], pages[2]
    dot = _static_dot_dtype(k_pages, k_scale, page_codes) if static else jnp.float32

    def gather(x, scale, ids):
        # [K, W, C, D]: the kv head leads, so neither dot below transposes the gathered K/V
        g = x[ids[None], :, heads]                               # [K, W, C/B, B, D]
        if page_codes is not None:    # uint8 bit patterns of an fp8 dtype: bitcast what was gathered
            g = jax.lax.bitcast_convert_type(g, jnp.dtype(page_codes))
        g = g.astype(dot)
        if scale is not None:
            g = g * scale[ids[None], :, heads][..., None]
        return g.reshape(K, W, chunk, D)

    def row_batch(b, carry):
        out, pages = carry
        tok, pos, seq, ctx = (jax.lax.dynamic_slice_in_dim(x, b * W, W, 0)
                              for x in (rows.tok, rows.pos, rows.seq, rows.ctx))
        table = tables[seq]                                       # [W, M]
        real = tok < T
        q = qf[jnp.minimum(tok, T - 1)].transpose(2, 0, 1, 3, 4)  # [K, W, tile, G, D]

        def kv_chunk(j, carry):
            (m, l, acc), (kp, vp, ks, vs) = carry
            ids = jax.lax.dynamic_slice_in_dim(table, j * blocks, blocks, 1)
            keys = gather(kp, ks, ids)
            s = jnp.einsum("kwqgd,kwcd->kwqgc", q.astype(dot), keys, preferred_element_type=jnp.float32)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kpos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
            mask = (kpos <= pos[..., None]) & real[..., None]     # [W, tile, C]
            if sliding_window is not None:
                mask &= kpos > pos[..., None] - sliding_window
            mask = mask[None, :, :, None, :]
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + p.sum(-1)
            values = keys if vp is None else gather(vp, vs, ids)     # None: latent pages, keys and values
            acc = acc * alpha[..., None] + jnp.einsum("kwqgc,kwcd->kwqgd", p.astype(dot), values,
                                                      preferred_element_type=jnp.float32)
            return (m_new, l, acc), (kp, vp, ks, vs)

        if sinks is None:
            init = (jnp.full((K, W, tile, G), _MASKED, jnp.float32), jnp.zeros((K, W, tile, G), jnp.float32))
        else:       # the sink as the first key seen: running max its logit, denominator exp(0)
            init = (jnp.broadcast_to(sinks[:, None, None, :], (K, W, tile, G)), jnp.ones((K, W, tile, G), jnp.float32))
        init += (jnp.zeros((K, W, tile, G, D), jnp.float32),)
        if static:
            first, last = 0, table.shape[1] // blocks
        else:
            first = 0
            if sliding_window is not None:   # chunks wholly before every row's window are skipped
                first = jnp.maximum(jnp.min(jnp.where(real, pos, ctx.max())) - sliding_window + 1,
                                    0) // chunk
            last = (jnp.max(ctx) + chunk - 1) // chunk
        (_, l, acc), pages = jax.lax.fori_loop(first, last, kv_chunk, (init, pages))
        o = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
        return out.at[tok].set(o.transpose(1, 2, 0, 3, 4), mode="drop"), pages

    if static:
        return row_batch(0, (out, pages))
    return jax.lax.fori_loop(0, (rows.num + W - 1) // W, row_batch, (out, pages))


def ragged_paged_attention_ref(q, k_pages, v_pages, meta: AttentionMetadata, *, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               k_scale=None, v_scale=None, return_pages: bool = False,
                               page_codes: str | None = None, sinks=None, cpu_kernel: bool = False,
                               static: bool | None = None):
    """q [T, H, D]; k_pages, v_pages [R, B, K, D]; scales [R, B, K] or None -> [T, H, D].
    `sinks` [H] or None: attention sinks (gpt-oss), a learned logit per head added to every
    softmax denominator (softmax over [scores, sink], the sink's column dropped).
    `v_pages` None (a latent cache, multi-head latent attention): the key pages are the values too.

    `return_pages=True` also returns (k_pages, v_pages, k_scale, v_scale) as threaded through the
    loops. Inside the model's layer loop the caller must continue with those: if a loop only
    closed over the pages, the pages would stay live after it and XLA would copy the whole cache
    into the loop's state on every layer (measured: most of a CPU decode step).
    `page_codes`: the pages are uint8 (uint16) holding this fp8 (bfloat16) dtype's bit patterns
    (`KVCache.codes`).

    Two groups of query rows, each an online-softmax loop over chunks of KV gathered from the
    pages: tokens of short chunks (decodes) one per row, sorted by context length; longer chunks
    (prefill) in rows of `_TILE` tokens, so a context is gathered once per tile, not per token.
    `cpu_kernel` (attention backend "cpu"): every token goes to the CPU kernel instead
    (attention/cpu_kernel.py; f32, bf16 or int8 pages with K and V, else this path as usual).

    `static` (default: on a GPU target, chosen at trace time): the form without a loop whose trip
    count is data-dependent, which XLA:GPU runs by copying the predicate to the host every
    iteration. One group of rows (a token each in buckets of no more tokens than sequences, else
    `_STATIC_TILE` tokens), all attended at once over the block tables' whole width in chunks,
    masked: no host sync, at the price of every row reading as far as the tables reach (a model
    runner narrows them to each step's longest sequence: `static_form`).
    """
    T, H, D = q.shape
    B, K = k_pages.shape[1], k_pages.shape[2]
    sliding_window = layer_window(meta, sliding_window)
    if static is None:
        static = not cpu_kernel and static_form()
    if static:
        S = meta.kv_lens.shape[0]
        tile = 1 if T <= S else min(_STATIC_TILE, T)
        rows = _tile_rows(meta, T, tile, min_len=1)
        R = rows.seq.shape[0]
        item = jnp.dtype(_static_dot_dtype(k_pages, k_scale, page_codes)).itemsize
        fits = _STATIC_GATHER_BYTES // max(1, item * K * R * D * (1 if v_pages is None else 2))
        chunk = B * max(1, min(fits // B, 512 // B, meta.block_tables.shape[1]))
    else:
        chunk = B * max(1, _KV_CHUNK // B)
    tables = meta.block_tables
    tables = jnp.pad(tables, ((0, 0), (0, (-tables.shape[1]) % (chunk // B))))
    qf = (q.astype(jnp.float32) * sm_scale).reshape(T, K, H // K, D)
    out = jnp.zeros_like(qf)
    pages = (k_pages, v_pages, k_scale, v_scale)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(K, H // K)
    opts = dict(chunk=chunk, sliding_window=sliding_window, soft_cap=soft_cap, page_codes=page_codes,
                sinks=sinks)
    bf16_bits = page_codes == "bfloat16" and k_pages.dtype == jnp.uint16     # the kernel reads them as bf16
    if (cpu_kernel and (page_codes is None or bf16_bits) and v_pages is not None
            and (k_pages.dtype == v_pages.dtype and k_pages.dtype in (jnp.float32, jnp.bfloat16, jnp.uint16)
                 and k_scale is None
                 or k_pages.dtype == v_pages.dtype == jnp.int8 and k_scale is not None and v_scale is not None)):
        out = cpu_paged_attention(qf, k_pages, v_pages, tables, meta, window=sliding_window, soft_cap=soft_cap,
                                  sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    elif static:
        out, pages = _attend_rows(qf, out, pages, tables, rows, rows_per_step=R, static=True, **opts)
    else:
        out, pages = _attend_rows(qf, out, pages, tables, _token_rows(meta, T),
                                  rows_per_step=min(_TOKEN_ROWS, T), **opts)
        if T >= _SHORT:      # else no chunk is long enough for a tile (the 1- and 2-token buckets)
            out, pages = _attend_rows(qf, out, pages, tables, _tile_rows(meta, T, min(_TILE, T)),
                                      rows_per_step=_TILE_ROWS, **opts)
    out = out.reshape(T, H, D).astype(q.dtype)
    return (out, pages) if return_pages else out
