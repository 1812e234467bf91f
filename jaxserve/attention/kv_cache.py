"""The paged KV cache: one pytree holding every layer's pages, passed in, returned and donated.

Layout `[L, N, B, K, D]` (layers, blocks, block_size, kv heads, head_dim) so the model can scan
over layers; a layer's pages are addressed as rows `layer * N + block_id` of the flat
`[L * N, B, K, D]` view (a free reshape), which keeps every read and write in place.

The latent layout (multi-head latent attention, DeepSeek V2/V3) has no `v`: `k` holds each
token's compressed latent and rope key `[L, N, B, 1, kv_lora_rank + qk_rope_head_dim]`, which
attention reads as keys and (its first kv_lora_rank dims) as values, so a token costs one
latent, not a K and a V per head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Logical axis names, for the sharding rules (kv heads are split across tensor-parallel ranks; the
# cache's own axis name, because with fewer KV heads than ranks the cache repeats them and the
# K/V projections do not split).
KV_AXES = ("layers", "kv_blocks", "kv_block_tokens", "kv_cache_heads", "head_dim")
SCALE_AXES = ("layers", "kv_blocks", "kv_block_tokens", "kv_cache_heads")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array                    # [L, N, B, K, D]
    v: jax.Array | None             # [L, N, B, K, D]; None: the latent layout (k is read as values too)
    k_scale: jax.Array | None = None  # [L, N, B, K] f32, only for fp8/int8 caches
    v_scale: jax.Array | None = None  # [L, N, B, K] f32
    # An fp8 (or bfloat16) dtype name when k/v are uint8 (uint16) arrays holding that dtype's bit
    # patterns (CPU pools: XLA:CPU has no fp8 or bf16 scatter and converts the whole pool to a wider
    # float and back on every write, so such a pool is written and read as integers and only the
    # gathered pages are bitcast).
    codes: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def latent(self) -> bool:
        return self.v is None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def dtype(self) -> jnp.dtype:
        """What the pages hold (the fp8 dtype of a uint8 `codes` pool)."""
        return jnp.dtype(self.codes) if self.codes else self.k.dtype


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype, quantized: bool, latent: bool = False) -> int:
    """Bytes one block costs across all layers, K and V (and their scales); `latent`: the latent
    layout's one array (no V)."""
    per_token_head = head_dim * jnp.dtype(dtype).itemsize + (4 if quantized else 0)
    return (1 if latent else 2) * num_layers * block_size * num_kv_heads * per_token_head


def allocate(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
             head_dim: int, dtype, quantized: bool = False, fp8_as_bytes: bool = False,
             latent: bool = False) -> KVCache:
    """The zeroed pool. `fp8_as_bytes` (CPU pools): an fp8 or bfloat16 `dtype` is held as uint8 /
    uint16 bit patterns (see `KVCache.codes`; zero bits are zeros). `latent`: no V pages (the
    latent layout)."""
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    scales = (jnp.ones(shape[:-1], jnp.float32), None if latent else jnp.ones(shape[:-1], jnp.float32)) \
        if quantized else (None, None)
    codes = None
    if fp8_as_bytes and jnp.issubdtype(dtype, jnp.floating) and (jnp.dtype(dtype).itemsize == 1
                                                                 or jnp.dtype(dtype) == jnp.bfloat16):
        codes, dtype = jnp.dtype(dtype).name, _bits_of(dtype)
    return KVCache(jnp.zeros(shape, dtype), None if latent else jnp.zeros(shape, dtype), *scales, codes=codes)


def _bits_of(dtype) -> jnp.dtype:
    """The unsigned integer type of `dtype`'s width (a `codes` pool's element type)."""
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def as_stored(x: jax.Array, codes: str | None) -> jax.Array:
    """New K/V in the pool's element type (the bit patterns for a `codes` pool)."""
    if codes is None:
        return x
    return jax.lax.bitcast_convert_type(x.astype(codes), _bits_of(codes))


def as_values(pages: jax.Array, codes: str | None) -> jax.Array:
    """Pages (or pages gathered from them) as the dtype they hold; bitcast only what is given."""
    return pages if codes is None else jax.lax.bitcast_convert_type(pages, jnp.dtype(codes))


def layer_view(x: jax.Array) -> jax.Array:
    """[L, N, ...] -> [L * N, ...]: the flat page view attention reads through."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def write(cache: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array | None,
          slot_mapping: jax.Array, quantize=None) -> KVCache:
    """Scatter the step's new k, v [T, K, D] of one layer into their slots [T] (v None: a latent
    cache, k the latents).

    Padding tokens carry slot N * B, which is out of range for the layer and dropped.
    `quantize(x) -> (q, scale)` is given for fp8/int8 caches.
    """
    L, N, B = cache.k.shape[:3]
    in_layer = slot_mapping < N * B
    rows = jnp.where(in_layer, layer * N + slot_mapping // B, L * N)   # L * N: dropped
    offs = slot_mapping % B

    one = slot_mapping.shape[0] == 1
    if one:
        # One token (the batch-1 decode bucket): XLA:CPU turns a one-element scatter (or an
        # update slice) into a copy of the whole pool every step; a second, dropped index keeps
        # it the in-place scatter of the 2-token steps.
        rows, offs = jnp.append(rows, L * N), jnp.append(offs, 0)

    def put(pages, new):
        flat = layer_view(pages)
        if one:
            new = jnp.concatenate([new, new], axis=0)       # the second row is dropped
        flat = flat.at[rows, offs].set(new.astype(flat.dtype), mode="drop")
        return flat.reshape(pages.shape)

    if cache.latent != (v is None):
        raise ValueError("a latent KV cache takes k only (v None); a K/V cache takes both")
    if quantize is None:      # unquantised (a bfloat16 `codes` pool: its bit patterns)
        return KVCache(put(cache.k, as_stored(k, cache.codes)),
                       None if v is None else put(cache.v, as_stored(v, cache.codes)), cache.k_scale,
                       cache.v_scale, cache.codes)
    kq, ks = quantize(k)
    kq = as_stored(kq, cache.codes)
    if v is None:
        return KVCache(put(cache.k, kq), None, put(cache.k_scale, ks), None, cache.codes)
    vq, vs = quantize(v)
    vq = as_stored(vq, cache.codes)
    return KVCache(put(cache.k, kq), put(cache.v, vq), put(cache.k_scale, ks),
                   put(cache.v_scale, vs), cache.codes)
