"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) as pure
functions over registered pytrees.

Per-layer weights are stacked along a leading layer axis and the forward pass scans over them, so
one layer body is compiled however deep the model is. Every weight carries logical axis names
(`LAYER_AXES`, `WEIGHT_AXES`) that the sharding rules map to mesh axes; this file never names a
mesh axis. Matrices are stored `[in, out]`.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxserve import attention
from jaxserve.attention import kv_cache as kvc
from jaxserve.config import ModelConfig
from jaxserve.layers.linear import linear
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: jax.Array          # [L, E]
    wq: jax.Array                 # [L, E, H*D]
    wk: jax.Array                 # [L, E, K*D]
    wv: jax.Array                 # [L, E, K*D]
    wo: jax.Array                 # [L, H*D, E]
    mlp_norm: jax.Array           # [L, E]
    w_gate: jax.Array             # [L, E, F]
    w_up: jax.Array               # [L, E, F]
    w_down: jax.Array             # [L, F, E]
    bq: jax.Array | None = None   # [L, H*D]  (Qwen2)
    bk: jax.Array | None = None   # [L, K*D]
    bv: jax.Array | None = None   # [L, K*D]
    q_norm: jax.Array | None = None  # [L, D]  (Qwen3)
    k_norm: jax.Array | None = None  # [L, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array              # [V, E]
    layers: LayerWeights
    final_norm: jax.Array         # [E]
    lm_head: jax.Array | None     # [E, V]; None when tied to the embedding


LAYER_AXES = {
    "attn_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "q_heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "wo": ("layers", "q_heads", "embed"),
    "mlp_norm": ("layers", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "bq": ("layers", "q_heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
}
WEIGHT_AXES = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("embed", "vocab")}


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every per-layer weight this config needs (absent optional ones left out)."""
    E, F, L, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    HD, KD = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes = dict(attn_norm=(L, E), wq=(L, E, HD), wk=(L, E, KD), wv=(L, E, KD), wo=(L, HD, E),
                  mlp_norm=(L, E), w_gate=(L, E, F), w_up=(L, E, F), w_down=(L, F, E))
    if cfg.attention_bias:
        shapes.update(bq=(L, HD), bk=(L, KD), bv=(L, KD))
    if cfg.qk_norm:
        shapes.update(q_norm=(L, D), k_norm=(L, D))
    return shapes


def _layer(cfg: ModelConfig, backend: str, kv_quantize, carry, xs):
    x, cache, cos, sin, meta = carry
    w, layer = xs
    T = x.shape[0]
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
    q = linear(h, w.wq, w.bq).reshape(T, H, D)
    k = linear(h, w.wk, w.bk).reshape(T, K, D)
    v = linear(h, w.wv, w.bv).reshape(T, K, D)
    if cfg.qk_norm:
        q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    cache = kvc.write(cache, layer, k, v, meta.slot_mapping, kv_quantize)
    o, cache = attention.paged_attention(q, cache, layer, meta, backend=backend, sm_scale=D ** -0.5,
                                  sliding_window=cfg.sliding_window)
    x = x + linear(o.reshape(T, H * D), w.wo)

    h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
    x = x + linear(jax.nn.silu(linear(h, w.w_gate)) * linear(h, w.w_up), w.w_down)
    return (x, cache, cos, sin, meta), None


def forward(weights: Weights, cache: kvc.KVCache, tokens: jax.Array, positions: jax.Array,
            meta: attention.AttentionMetadata, *, cfg: ModelConfig, backend: str = "reference",
            kv_quantize=None):
    """tokens, positions [T] -> final hidden states [T, E] and the updated cache."""
    x = weights.embed[tokens]
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict))
    cos, sin = rope_cos_sin(positions, inv_freq)
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    body = partial(_layer, cfg, backend, kv_quantize)
    (x, cache, *_), _ = jax.lax.scan(body, (x, cache, cos, sin, meta), (weights.layers, layer_ids))
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), cache


def compute_logits(weights: Weights, hidden: jax.Array) -> jax.Array:
    """hidden [R, E] -> logits [R, V] in f32."""
    head = weights.embed.T if weights.lm_head is None else weights.lm_head
    return jnp.einsum("re,ev->rv", hidden, head, preferred_element_type=jnp.float32)
