"""Gemma 2 and Gemma 3 text models (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`, and the text model
of `Gemma3ForConditionalGeneration`, whose `language_model.` weights are read and whose vision
tower and projector are ignored: the loader says so).

The pieces are llama.py's (stacked weights, `self_attention`, the gated MLP, the layer scan);
what Gemma changes:
  - every RMSNorm scales by 1 + w (stored w; computed in f32), and each layer norms the outputs
    of attention and of the MLP too before adding them (post_attention / post_feedforward norms);
  - the embedding is multiplied by sqrt(hidden_size) rounded to the activation dtype, as
    transformers does;
  - GeGLU (tanh-approximated gelu) MLP; scores scaled by 1/sqrt(query_pre_attn_scalar);
  - Gemma 2 soft-caps the attention scores (attn_logit_softcapping) and both may cap the final
    logits (final_logit_softcapping: cap * tanh(logits / cap));
  - layers alternate sliding-window and global attention (`cfg.layer_types`): each layer's
    window travels in the attention metadata (`meta.sliding_window`, traced in the scan, so
    one layer body serves both kinds);
  - Gemma 3: q/k norms, and sliding layers rotate with their own unscaled rope base
    (`rope_local_theta`) while global layers use rope_theta with rope_scaling (linear).
Every layer keeps its whole context in the paged KV cache (a sliding layer reads only its window;
its cache is not trimmed).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxserve import attention
from jaxserve.attention import kv_cache as kvc
from jaxserve.config import ModelConfig
from jaxserve.layers.linear import DenseWeight
from jaxserve.layers.norm import rms_norm
from jaxserve.models import llama
from jaxserve.models.llama import LayerWeights
from jaxserve.models.params import Param
from jaxserve.pallas.common import NO_WINDOW
from jaxserve.sharding.plan import ShardingPlan, embed_lookup

NORM_OFFSET = 1.0       # Gemma's RMSNorm scales by 1 + w
# Gemma 3 checkpoints with a vision tower keep the text model under this prefix
MULTIMODAL_PREFIX = "language_model."


@partial(jax.tree_util.register_dataclass, data_fields=["embed", "layers", "final_norm", "lm_head"],
         meta_fields=["logit_soft_cap"])
@dataclasses.dataclass
class Weights:
    embed: jax.Array              # [V, E]
    layers: LayerWeights
    final_norm: jax.Array         # [E]
    lm_head: DenseWeight | None   # [E, V]; None when tied to the embedding (Gemma's default)
    logit_soft_cap: float | None = None   # final_logit_softcapping, applied by compute_logits


def declare(cfg: ModelConfig) -> list[Param]:
    """llama.py's declaration with Gemma's norm names (the MLP's input norm is
    pre_feedforward_layernorm; post_attention_layernorm is the norm after attention), its two
    extra norms, norms that dummy weights fill with 0 (scale 1 + 0), and the multimodal prefix."""
    L, E = cfg.num_layers, cfg.hidden_size
    layer = "model.layers.{layer}."

    def norm(path, suffix):
        return Param(path, (L, E), ("layers", "embed"), layer + suffix, stacked=True, init="zeros")

    params = []
    for p in llama.declare(cfg):
        if p.path == "layers.mlp_norm":
            p = norm("layers.mlp_norm", "pre_feedforward_layernorm.weight")
        elif p.init == "ones":
            p = dataclasses.replace(p, init="zeros")
        params.append(p)
    params += [norm("layers.post_attn_norm", "post_attention_layernorm.weight"),
               norm("layers.post_mlp_norm", "post_feedforward_layernorm.weight")]
    if cfg.architecture == "Gemma3ForConditionalGeneration":
        params = [dataclasses.replace(p, checkpoint=MULTIMODAL_PREFIX + p.checkpoint) for p in params]
    return params


def build(cfg: ModelConfig, arrays: dict[str, jax.Array]) -> Weights:
    w = llama.build(cfg, arrays)
    # transformers' Gemma3ForConditionalGeneration does not cap its logits (its text_config may
    # name a cap; the released checkpoints have none), so neither does jaxserve for it
    cap = None if cfg.architecture == "Gemma3ForConditionalGeneration" else cfg.final_logit_softcapping
    return Weights(w.embed, w.layers, w.final_norm, w.lm_head, cap)


def _layer(cfg: ModelConfig, backend: str, kv_quantize, plan: ShardingPlan | None, carry, xs):
    x, cache, meta, (cos_g, sin_g, cos_l, sin_l) = carry
    w, layer, window, sliding = xs
    eps = cfg.rms_norm_eps
    cos, sin = jnp.where(sliding, cos_l, cos_g), jnp.where(sliding, sin_l, sin_g)
    h = rms_norm(x, w.attn_norm, eps, NORM_OFFSET)
    layer_meta = dataclasses.replace(meta, sliding_window=window[None])
    o, cache = llama.self_attention(cfg, backend, kv_quantize, plan, w, h, cache, layer, layer_meta,
                                    cos, sin, norm_offset=NORM_OFFSET)
    x = x + rms_norm(o, w.post_attn_norm, eps, NORM_OFFSET)
    h = rms_norm(x, w.mlp_norm, eps, NORM_OFFSET)
    x = x + rms_norm(llama.mlp(cfg, plan, w, h), w.post_mlp_norm, eps, NORM_OFFSET)
    return (x, cache, meta, (cos_g, sin_g, cos_l, sin_l)), None


def forward(weights: Weights, cache: kvc.KVCache, tokens: jax.Array, positions: jax.Array,
            meta: attention.AttentionMetadata, *, cfg: ModelConfig, backend: str = "reference",
            kv_quantize=None, plan: ShardingPlan | None = None, each_layer=None):
    """tokens, positions [T] -> final hidden states [T, E] and the updated cache (llama.forward's
    contract)."""
    x = embed_lookup(plan, weights.embed, tokens)
    x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)     # the normalizer in the activation dtype
    ropes = llama.rope_tables(cfg, positions)
    if cfg.rope_local_theta is not None:       # Gemma 3: sliding layers' own base, unscaled
        ropes += llama.rope_tables(cfg, positions, cfg.rope_local_theta, None)
    else:
        ropes += ropes
    windows = cfg.layer_windows
    xs = (weights.layers, jnp.arange(cfg.num_layers, dtype=jnp.int32),
          jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32),
          jnp.asarray([w is not None for w in windows]))
    body = partial(_layer, cfg, backend, kv_quantize, plan)
    x, cache, *_ = llama.run_layers(body, (x, cache, meta, ropes), xs, cfg.num_layers, each_layer)
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps, NORM_OFFSET), cache


def compute_logits(weights: Weights, hidden: jax.Array) -> jax.Array:
    """hidden [R, E] -> logits [R, V] in f32, soft-capped when the model says so."""
    logits = llama.compute_logits(weights, hidden)
    cap = weights.logit_soft_cap
    return logits if cap is None else cap * jnp.tanh(logits / cap)
