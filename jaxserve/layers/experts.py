"""Expert weights and the grouped matmul: `ExpertWeight` stacks X experts' matrices `[..., X, in,
out]` in any weight type (`DenseWeight`, `Fp8Weight`, later int4), and `grouped_linear` multiplies
each row of activations by its own expert's matrix, computing only the experts rows are routed to.

Two layouts of the rows (`Groups`, built by `group_rows` from the routing):

- "tiles" (every backend): the (token, expert) assignments sorted by expert and cut into tiles of
  `tile` rows that each belong to one expert (a group's last tile padded). Each tile is
  `linear(x_tile [tile, in], w[e])`, the weight type's own kernel, batched over tiles (the tiles'
  expert matrices are gathered a chunk at a time, `MAX_GATHER_BYTES`); on a GPU, dense experts
  take the grouped matmul kernel instead, which reads each tile's expert where it lies. The tile
  count is static: at most `(P + min(X, P) * (tile - 1)) / tile` for P assignments and X experts,
  so the padding costs at most `min(X, P) * (tile - 1) / P` of the useful FLOPs; `tile_rows` picks
  the tile from the shapes at trace time to keep that under `PADDING_BUDGET`. Decode shapes (P <=
  X) get tile 1: each assignment multiplies its own expert's matrix, no sort, exactly the useful
  FLOPs.
- "ragged" (backends in `RAGGED_DOT_BACKENDS`, weight types with a `register_ragged` kernel):
  the assignments sorted by expert and `jax.lax.ragged_dot` over the group sizes. XLA's CPU and
  GPU lowerings of ragged_dot are a masked dense dot over every expert (X times the useful FLOPs:
  benchmarks/bench_moe.py, and the compile report), so neither takes it by default.

A weight type that has a `linear` kernel runs as experts with no further code (tiles vmap that
kernel over the gathered expert slices); `register_ragged` adds a ragged_dot backend for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.layers.linear import DenseWeight, linear
from jaxserve.pallas.common import searchsorted, target_platform
from jaxserve.pallas.grouped_matmul import grouped_matmul, whole_blocks

# Backends whose ragged_dot is a grouped matmul. None: XLA lowers it to a dense dot over every
# expert on the CPU, and on a GPU too (64x the useful FLOPs for Qwen3-30B-A3B at EP 2, in the
# compile report); a GPU takes the tiles with the grouped matmul kernel (`pallas/grouped_matmul`).
RAGGED_DOT_BACKENDS: tuple[str, ...] = ()
PADDING_BUDGET = 0.4           # tiles' padding rows as a fraction of the assignments, at most
MAX_GATHER_BYTES = 256 << 20   # expert matrices gathered at once by the tiles layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertWeight:
    """X experts' matrices stacked `[..., X, in, out]` (layers may lead; `lax.scan` slices them
    off) in the weight type `w`; `grouped_linear` is its matmul (`linear` refuses it). `layer`:
    set when the layer scan keeps the stack whole (`experts_read_in_place`): w is then [L, X, in,
    out] and the matmul reads layer `layer` where it lies; None: w is one layer's."""

    w: Any
    layer: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def num_experts(self) -> int:
        return self.shape[-3]


def experts_read_in_place(experts: ExpertWeight) -> bool:
    """Whether the layer scan should keep this [L, X, in, out] stack whole: dense experts on a
    GPU, whose grouped matmul kernel reads a layer's experts where they lie (a scan's slice is a
    copy of every expert of the layer, every step)."""
    return experts.layer is None and _grouped_kernel_takes(experts.w) and experts.w.w.ndim == 4


def _grouped_kernel_takes(w) -> bool:
    """Whether the grouped matmul kernel serves these dense experts: on a GPU, bf16/f16 only (an
    f32 dot in a Triton kernel runs as TF32; the XLA path keeps f32), matrices of whole kernel
    blocks only (`whole_blocks`: gpt-oss's 2880 would pad, i.e. copy, the whole stack)."""
    return (type(w) is DenseWeight and jnp.dtype(w.w.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and whole_blocks(*w.w.shape[-2:]) and target_platform() == "gpu")


_RAGGED: dict[type, Callable] = {}


def register_ragged(weight_type: type) -> Callable:
    """Decorator: `fn(x [M, in], w [X, in, out] of weight_type, group_sizes [X]) -> [M, out]` (rows
    sorted by expert, x.dtype) is the ragged_dot backend of `weight_type`'s experts."""
    def register(fn: Callable) -> Callable:
        _RAGGED[weight_type] = fn
        return fn
    return register


@register_ragged(DenseWeight)
def _ragged_dense(x: jax.Array, w: DenseWeight, group_sizes: jax.Array) -> jax.Array:
    pref = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    return jax.lax.ragged_dot(x, w.w, group_sizes, preferred_element_type=pref).astype(x.dtype)


class Groups(NamedTuple):
    """Where the routed rows are. rows [M]: the assignment (index into the T*k flattened
    routing) each row holds, P = T*k for padding rows. "tiles": tile_expert [M / tile] is each
    tile's local expert. "ragged": group_sizes [X], rows sorted by expert (those of experts
    outside this device's slice last)."""

    layout: str
    rows: jax.Array
    tile: int = 0
    tile_expert: jax.Array | None = None
    group_sizes: jax.Array | None = None
    assignments: int = 0        # P = T * k: the row id of padding


def tile_rows(assignments: int, experts: int) -> int:
    """Rows per tile for P assignments over X experts: the largest whose worst-case padding
    (min(X, P) * (tile - 1) rows) stays within PADDING_BUDGET of P; 1 at decode shapes. On a GPU
    a power of two (the grouped matmul kernel's blocks), rounded down."""
    tile = 1 + int(PADDING_BUDGET * assignments / min(experts, assignments))
    if target_platform() != "gpu":
        return tile
    tile = 1 << (tile.bit_length() - 1)
    # 8-row tiles would multiply on CUDA cores (the kernel's dot needs 16 rows): 16, padding up
    # to 15 rows an expert (the FLOPs stay within 1.5x of the useful ones from P = 32 X up)
    return 16 if tile == 8 and assignments >= 32 * min(experts, assignments) else tile


def num_tiles(assignments: int, experts: int, tile: int) -> int:
    """The most tiles P assignments can need: sum over experts of ceil(g_e / tile)."""
    return (assignments + min(experts, assignments) * (tile - 1)) // tile


def default_layout(*weights) -> str:
    """"ragged" where ragged_dot is a grouped matmul (the backend, checked at trace time) and
    every weight's type has a ragged kernel, else "tiles"."""
    ragged = target_platform() in RAGGED_DOT_BACKENDS and all(type(w.w) in _RAGGED for w in weights)
    return "ragged" if ragged else "tiles"


def group_rows(ids: jax.Array, num_experts: int, first_expert=0, layout: str = "tiles") -> Groups:
    """ids [T, k] global expert ids -> the rows of the assignments to experts first_expert ..
    first_expert + num_experts - 1 (this device's slice) in `layout`."""
    T, k = ids.shape
    P, X = T * k, num_experts
    local = ids.reshape(-1) - first_expert                          # [P]
    mine = (local >= 0) & (local < X)
    if layout == "ragged":
        key = jnp.where(mine, local, X)                             # other devices' experts last
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        sizes = jnp.bincount(key, length=X + 1)[:X].astype(jnp.int32)
        return Groups("ragged", jnp.where(mine[order], order, P), group_sizes=sizes, assignments=P)
    if layout != "tiles":
        raise ValueError(f"layout must be 'tiles' or 'ragged', got {layout!r}")
    tile = tile_rows(P, X)
    if tile == 1:           # one assignment per tile: no sort, P tiles in routing order
        rows = jnp.where(mine, jnp.arange(P, dtype=jnp.int32), P)
        return Groups("tiles", rows, 1, jnp.where(mine, local, 0).astype(jnp.int32), assignments=P)
    N = num_tiles(P, X, tile)
    key = jnp.where(mine, local, X)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)        # [P] grouped by expert
    sizes = jnp.bincount(key, length=X + 1)[:X]                     # [X]
    starts = jnp.cumsum(sizes) - sizes                              # first sorted slot per expert
    tiles = (sizes + tile - 1) // tile
    first_tile = jnp.cumsum(tiles) - tiles
    e_sorted = key[order]
    rank = jnp.arange(P) - starts[jnp.minimum(e_sorted, X - 1)]     # place inside its group
    dest = jnp.where(e_sorted < X, first_tile[jnp.minimum(e_sorted, X - 1)] * tile + rank, N * tile)
    rows = jnp.full((N * tile,), P, jnp.int32).at[dest].set(order, mode="drop")
    tile_expert = searchsorted(jnp.cumsum(tiles), jnp.arange(N), side="right")
    return Groups("tiles", rows, tile, jnp.minimum(tile_expert, X - 1).astype(jnp.int32), assignments=P)


def grouped_linear(x: jax.Array, experts: ExpertWeight, groups: Groups) -> jax.Array:
    """x [M, in] (rows as `groups` lays them out) @ each row's expert matrix -> [M, out]."""
    w = experts.w
    kernel = _grouped_kernel_takes(w)
    if experts.layer is not None:
        if kernel and groups.layout == "tiles":
            return grouped_matmul(x, w.w, _live_experts(groups), groups.tile, layer=experts.layer)
        w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, experts.layer, keepdims=False), w)
    if groups.layout == "ragged":
        try:
            fn = _RAGGED[type(w)]
        except KeyError:
            raise TypeError(f"no ragged expert kernel registered for weight type {type(w).__name__}; "
                            "use the tiles layout") from None
        return fn(x, w, groups.group_sizes)
    tile, (M, K) = groups.tile, x.shape
    if kernel:                      # each tile's expert read in place
        return grouped_matmul(x, w.w, _live_experts(groups), tile)
    xt = x.reshape(M // tile, tile, K)

    def one(args):                 # one tile: its rows through its expert's matrix
        xs, e = args
        return linear(xs, jax.tree.map(lambda a: a[e], w))

    per_expert = sum(a.nbytes for a in jax.tree.leaves(w)) // experts.num_experts
    batch = max(1, MAX_GATHER_BYTES // max(per_expert, 1))
    if batch >= M // tile:         # one gather of every tile's matrix, one batched matmul
        y = jax.vmap(one)((xt, groups.tile_expert))
    else:
        y = jax.lax.map(one, (xt, groups.tile_expert), batch_size=batch)
    return y.reshape(M, -1)


def _live_experts(groups: Groups) -> jax.Array:
    """Each tile's expert, -1 for a tile of padding rows only (its first row is padding: tiles
    fill from their first row; a one-row tile of another device's assignment): the grouped matmul
    skips those (with expert parallelism most of the static tile count)."""
    first = groups.rows.reshape(-1, groups.tile)[:, 0]
    return jnp.where(first < groups.assignments, groups.tile_expert, -1)


def useful_flops(tokens: int, k: int, hidden: int, inner: int) -> int:
    """The matmul FLOPs of T tokens through k SwiGLU experts each (gate, up, down)."""
    return 2 * tokens * k * 3 * hidden * inner

