"""gpt-oss (`GptOssForCausalLM`): Llama's decoder with

- attention: q/k/v/o projections with biases, attention sinks (a learned logit per head in every
  softmax denominator; the reference attention path applies them), layers alternating between a
  sliding window and global attention (`layer_types`, per layer in the attention metadata as
  Gemma's), YaRN rope;
- a mixture of experts in every layer: a router with a bias (top-k, then softmax over the k),
  experts with biases and the clamped SwiGLU (`layers/moe.py: clamped_swiglu`).

The checkpoint keeps all of a layer's experts in one tensor, `[X, in, out]` (not transposed),
with gate and up interleaved in `gate_up_proj`'s output columns (gate even, up odd): declared as
the stride-2 `rows` of that tensor, so the loader splits them and the export joins them again.
MXFP4 checkpoints (`*_blocks` / `*_scales`) are dequantized as read (`loader/mxfp4.py`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxserve import attention
from jaxserve.attention import kv_cache as kvc
from jaxserve.config import ModelConfig
from jaxserve.layers.norm import rms_norm
from jaxserve.models import llama
from jaxserve.models.llama import build, compute_logits  # noqa: F401  (the family API)
from jaxserve.models.params import Param
from jaxserve.pallas.common import NO_WINDOW
from jaxserve.sharding.plan import ShardingPlan, embed_lookup

ROUTER = "mlp.router.weight"
EXPERTS = "model.layers.{layer}.mlp.experts."


def declare(cfg: ModelConfig) -> list[Param]:
    """llama.py's declaration (attention with q/k/v biases, the router) with gpt-oss's extra
    arrays: o_proj's bias, the sinks, the router's bias, and the experts read from the per-layer
    tensors gate_up_proj / down_proj and their biases."""
    L, E, H = cfg.num_layers, cfg.hidden_size, cfg.num_heads
    X, F = cfg.moe.num_experts, cfg.moe.moe_intermediate_size
    layer = "model.layers.{layer}."

    def per_layer(path, shape, axes, name, **kw):
        return Param(path, (L, *shape), ("layers", *axes), name, stacked=True, **kw)

    def experts(path, shape, axes, name, **kw):
        return per_layer(path, (X, *shape), ("experts", *axes), EXPERTS + name, **kw)

    up_axes, down_axes = ("embed", "moe_mlp"), ("moe_mlp", "embed")
    params = [p for p in llama.declare(cfg, (ROUTER, "", "", "")) if not p.path.startswith("layers.we_")]
    return params + [
        per_layer("layers.bo", (E,), ("embed",), layer + "self_attn.o_proj.bias", init="zeros"),
        per_layer("layers.sinks", (H,), ("q_heads",), layer + "self_attn.sinks", init="zeros"),
        per_layer("layers.router_bias", (X,), ("router",), layer + "mlp.router.bias", init="zeros"),
        experts("layers.we_gate", (E, F), up_axes, "gate_up_proj", rows=(0, 2 * F, 2), dense=True),
        experts("layers.we_up", (E, F), up_axes, "gate_up_proj", rows=(1, 2 * F, 2), dense=True),
        experts("layers.we_down", (F, E), down_axes, "down_proj", dense=True),
        experts("layers.be_gate", (F,), ("moe_mlp",), "gate_up_proj_bias", rows=(0, 2 * F, 2), init="zeros"),
        experts("layers.be_up", (F,), ("moe_mlp",), "gate_up_proj_bias", rows=(1, 2 * F, 2), init="zeros"),
        experts("layers.be_down", (E,), ("embed",), "down_proj_bias", init="zeros"),
    ]


def _layer(cfg: ModelConfig, backend: str, kv_quantize, plan: ShardingPlan | None, carry, xs):
    x, cache, meta, cos, sin = carry
    w, layer, window = xs
    layer_meta = dataclasses.replace(meta, sliding_window=window[None])
    h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
    o, cache = llama.self_attention(cfg, backend, kv_quantize, plan, w, h, cache, layer, layer_meta, cos, sin)
    x = x + o
    x = x + llama.mlp(cfg, plan, w, rms_norm(x, w.mlp_norm, cfg.rms_norm_eps))
    return (x, cache, meta, cos, sin), None


def forward(weights: llama.Weights, cache: kvc.KVCache, tokens: jax.Array, positions: jax.Array,
            meta: attention.AttentionMetadata, *, cfg: ModelConfig, backend: str = "reference",
            kv_quantize=None, plan: ShardingPlan | None = None, each_layer=None):
    """tokens, positions [T] -> final hidden states [T, E] and the updated cache (llama.forward's
    contract), each layer with its own window."""
    x = embed_lookup(plan, weights.embed, tokens).astype(weights.final_norm.dtype)
    cos, sin = llama.rope_tables(cfg, positions)
    xs = (weights.layers, jnp.arange(cfg.num_layers, dtype=jnp.int32),
          jnp.asarray([NO_WINDOW if w is None else w for w in cfg.layer_windows], jnp.int32))
    body = partial(_layer, cfg, backend, kv_quantize, plan)
    x, cache, *_ = llama.run_layers(body, (x, cache, meta, cos, sin), xs, cfg.num_layers, each_layer)
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), cache
