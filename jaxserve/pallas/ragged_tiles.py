"""Query tiling for ragged attention kernels: tokens of one sequence grouped into row tiles.

A tile holds up to `bq` consecutive new tokens of ONE sequence times the `gp` query heads that
share a kv head (G padded to gp), `R = bq * gp` rows, row = token_in_tile * gp + head_in_group.
A decode row is one tile; a prefill chunk of 100 tokens is ceil(100 / bq) tiles. The number of
tiles is bounded statically by `NT = min(T, ceil(T / bq) + S)` (each sequence wastes at most one
partial tile); tiles past the real ones have nq = 0 and the kernels idle on them.

Pure jnp, shared by the Mosaic GPU kernel's wrapper; no kernel code here.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.pallas.common import searchsorted, token_layout


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Per tile [NT]: sequence, first query index inside the sequence, real query count; per
    sequence [S]: first tile and q_len. `bq` tokens x `gp` heads per tile."""
    tile_seq: jax.Array
    tile_qstart: jax.Array
    tile_nq: jax.Array
    seq_first_tile: jax.Array
    q_lens: jax.Array
    num_tiles: int
    bq: int
    gp: int


def plan_tiles(meta, num_tokens: int, bq: int, gp: int) -> TilePlan:
    """Split every real sequence's new tokens into tiles of <= bq tokens (cumsum, no host sync)."""
    S = meta.kv_lens.shape[0]
    cu = meta.cu_q_lens.astype(jnp.int32)
    real = jnp.arange(S) < meta.num_seqs.reshape(-1)[0]
    q_lens = jnp.where(real, cu[1:] - cu[:-1], 0)                        # [S]
    tiles = (q_lens + bq - 1) // bq                                     # [S]
    tile_end = jnp.cumsum(tiles)
    tile_base = tile_end - tiles
    nt = max(1, min(num_tokens, -(-num_tokens // bq) + S))
    it = jnp.arange(nt, dtype=jnp.int32)
    tile_seq = jnp.minimum(searchsorted(tile_end, it, side="right"), S - 1).astype(jnp.int32)
    qstart = (it - tile_base[tile_seq]) * bq
    nq = jnp.clip(q_lens[tile_seq] - qstart, 0, bq).astype(jnp.int32)
    return TilePlan(tile_seq, qstart.astype(jnp.int32), nq, tile_base.astype(jnp.int32),
                    q_lens.astype(jnp.int32), nt, bq, gp)


def gather_q_tiles(q, meta, plan: TilePlan, num_kv_heads: int) -> jax.Array:
    """q [T, H, D] -> [K, NT, R, D]; rows of padded heads and of tokens past nq are zero."""
    T, H, D = q.shape
    K = num_kv_heads
    G = H // K
    cu = meta.cu_q_lens.astype(jnp.int32)
    qg = q.reshape(T, K, G, D)
    if plan.gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, plan.gp - G), (0, 0)))
    tq = jnp.arange(plan.bq, dtype=jnp.int32)
    tok = cu[plan.tile_seq][:, None] + plan.tile_qstart[:, None] + tq[None, :]   # [NT, bq]
    ok = tq[None, :] < plan.tile_nq[:, None]
    tiles = jnp.where(ok[:, :, None, None, None], qg[jnp.clip(tok, 0, T - 1)], 0)  # [NT,bq,K,Gp,D]
    return tiles.transpose(2, 0, 1, 3, 4).reshape(K, plan.num_tiles, plan.bq * plan.gp, D)


def scatter_tiles(out_tiles, meta, plan: TilePlan, num_tokens: int, num_heads: int, dtype):
    """[K, NT, R, D] tile outputs -> [T, H, D] in token order; padding tokens get zeros."""
    K, nt, _, D = out_tiles.shape
    G = num_heads // K
    cu = meta.cu_q_lens.astype(jnp.int32)
    T = num_tokens
    seq, _, valid = token_layout(meta, T)
    local = jnp.arange(T, dtype=jnp.int32) - cu[seq]
    tile = jnp.clip(plan.seq_first_tile[seq] + local // plan.bq, 0, nt - 1)
    out = out_tiles.reshape(K, nt, plan.bq, plan.gp, D)[:, tile, local % plan.bq]   # [K,T,Gp,D]
    out = out[:, :, :G].transpose(1, 0, 2, 3).reshape(T, num_heads, D)
    return jnp.where(valid[:, None, None], out, 0).astype(dtype)
