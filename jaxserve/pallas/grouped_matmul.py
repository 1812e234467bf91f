"""The experts' grouped matmul on a GPU: rows laid out in tiles of one expert each (the "tiles" layout
of `jaxserve.layers.experts`), each tile multiplied by its own expert's matrix, read where it lies
in the [X, in, out] stack (no gather of per-tile copies, no dense dot over every expert).

    y [N * tile, out] = for each tile i: x[i * tile:(i + 1) * tile] @ w[tile_expert[i]]

Triton kernel, grid (N tiles, out / bn). A program loads its tile's expert id, then loops over the
input dimension in steps of `bk`, multiplying the tile's rows [tile, bk] by the expert's block [bk,
bn] into an f32 accumulator (no step at all for a tile of padding rows, expert -1): `dot` (tensor
cores) for tiles of 16 rows or more, a broadcast multiply and sum below (exact FLOPs for a decode's
one-row tiles, where a 16-row dot would do 16x the work). Tiles must hold a power of two rows
(`tile_rows` makes them so on a GPU).

The stack may be the layer scan's whole [L, X, in, out] one with the layer's index (`layer`): a
scan's slice of a layer would be a copy of all its experts, every step (`layers.scan.scan_layers`
keeps dense experts whole on a GPU).

FLOPs: 2 * tile * in * out per live tile (the routed rows and their tiles' padding; the static
tile count's padding tiles are skipped). HBM bytes: each live tile reads its expert's matrix once
(L2 absorbs the repeats of neighbouring tiles of one expert), x once per output block, y once.

Off GPU the kernel runs in Pallas' interpreter (tests); the engine's CPU path keeps XLA's batched
matmul over the gathered experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas.common import pad_to, target_platform

DOT_MIN_ROWS = 16        # tl.dot's smallest M


def _blocks(tile: int, k: int, n: int) -> tuple[int, int]:
    """(bk, bn), powers of two (Triton's blocks): smaller for the broadcast form, whose [tile, bk,
    bn] f32 product sits in registers (16 KB for a one-row tile)."""
    p2 = pl.next_power_of_2
    if tile >= DOT_MIN_ROWS:
        return min(64, p2(k)), min(128, p2(n))
    return min(32, p2(k)), min(128 // max(1, tile // 2), p2(n))


def whole_blocks(k: int, n: int) -> bool:
    """Whether a [k, n] expert matrix is whole blocks at every tile size: else each call would pad
    (copy) the whole stack it is given."""
    return all(k % bk == 0 and n % bn == 0 for bk, bn in (_blocks(t, k, n) for t in (1, 2, 4, DOT_MIN_ROWS)))


def _kernel(layer_ref, te_ref, x_ref, w_ref, o_ref, *, tile: int, bk: int, bn: int, steps: int):
    i, j = pl.program_id(0), pl.program_id(1)
    layer, e = layer_ref[0], te_ref[i]
    live = e >= 0                      # a tile of padding rows: zeros, no weights read
    e = jnp.maximum(e, 0)
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)

    def body(kk, acc):
        rows = pl.ds(pl.multiple_of(kk * bk, bk), bk)
        xa = x_ref[:, rows]                                    # [tile, bk]
        wb = w_ref[layer, e, rows, cols]                       # [bk, bn]
        if tile >= DOT_MIN_ROWS:
            return acc + jnp.dot(xa, wb, preferred_element_type=jnp.float32)
        prod = xa.astype(jnp.float32)[:, :, None] * wb.astype(jnp.float32)[None, :, :]
        return acc + jnp.sum(prod, axis=1)

    @pl.when(live)
    def _():
        acc = lax.fori_loop(0, steps, body, jnp.zeros((tile, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros((tile, bn), o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def _grouped_matmul(x, w, layer, tile_expert, *, tile: int, interpret: bool):
    from jaxserve.pallas.paged_attention import triton_params
    M, K = x.shape
    N, F = M // tile, w.shape[-1]
    bk, bn = _blocks(tile, K, F)
    if K % bk or F % bn:        # a copy of the weights: shipped shapes are whole blocks
        x, w = pad_to(x, 1, bk), pad_to(pad_to(w, 2, bk), 3, bn)
    Kp, Fp = w.shape[2], w.shape[3]
    whole = pl.BlockSpec()
    out = pl.pallas_call(
        functools.partial(_kernel, tile=tile, bk=bk, bn=bn, steps=Kp // bk),
        grid=(N, Fp // bn),
        in_specs=[whole, whole, pl.BlockSpec((tile, Kp), lambda i, j: (i, 0)), whole],
        out_specs=pl.BlockSpec((tile, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((M, Fp), x.dtype),
        interpret=interpret,
        name="grouped_matmul",
        compiler_params=triton_params(num_warps=4, num_stages=2),
    )(layer, tile_expert.astype(jnp.int32), x, w)
    return out[:, :F]


def grouped_matmul(x: jax.Array, w: jax.Array, tile_expert: jax.Array, tile: int, *, layer=None,
                   interpret: bool | None = None) -> jax.Array:
    """x [N * tile, in] (rows tile by tile) @ w[tile_expert[i]] per tile -> [N * tile, out] in
    x.dtype; a tile whose expert is -1 (padding) gives zeros and costs no FLOPs. w [X, in, out],
    or [L, X, in, out] with `layer` (a traced index: the layer scan's stack, read in place).
    `tile` a power of two. interpret None: compiled for a GPU target, else the Pallas interpreter."""
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"grouped_matmul: tile must be a power of two, got {tile}")
    if x.shape[0] % tile:
        raise ValueError(f"grouped_matmul: {x.shape[0]} rows are not whole tiles of {tile}")
    if w.ndim != (3 if layer is None else 4) or w.shape[-2] != x.shape[1]:
        raise ValueError(f"grouped_matmul: w {w.shape} is not [{'' if layer is None else 'L, '}X, {x.shape[1]}, out]")
    if layer is None:
        w, layer = w[None], 0
    if interpret is None:
        interpret = target_platform() != "gpu"
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return _grouped_matmul(x, w.astype(x.dtype), layer, tile_expert, tile=tile, interpret=bool(interpret))


def reference(x, w, tile_expert, tile: int):
    """The same in XLA: every tile's expert gathered, one batched matmul (f32 accumulation)."""
    xt = x.reshape(-1, tile, x.shape[1])
    y = jnp.einsum("ntk,nkf->ntf", xt, w[jnp.maximum(tile_expert, 0)], preferred_element_type=jnp.float32)
    y = jnp.where((tile_expert >= 0)[:, None, None], y, 0)
    return y.reshape(x.shape[0], -1).astype(x.dtype)
