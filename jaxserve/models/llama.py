"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm, and
with a mixture-of-experts MLP Qwen3-MoE and Mixtral: `qwen3_moe.py`, `mixtral.py` name their
checkpoint tensors) as pure functions over registered pytrees.

Per-layer weights are stacked along a leading layer axis and the forward pass scans over them, so
one layer body is compiled however deep the model is. A model that mixes dense and MoE MLPs
(Qwen3-MoE's `mlp_only_layers`, `decoder_sparse_step`) stacks each kind of MLP over its own layers
and the scanned body picks the layer's kind with a `lax.cond` (one branch runs). `declare(cfg)` is the one list of the
model's arrays (shape, logical axes, checkpoint name, dummy init) that the loaders and the
sharding rules read; this file never names a mesh axis. Matrices are stored `[in, out]` as
`DenseWeight`s (the router and lm_head included, through `linear`), experts as `ExpertWeight`s
`[X, in, out]` (through `grouped_linear`), so other weight types (FP8, LoRA) change no code here.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxserve import attention
from jaxserve.attention import kv_cache as kvc
from jaxserve.config import ModelConfig
from jaxserve.layers import moe
from jaxserve.layers.embedding import tied_logits
from jaxserve.layers.experts import ExpertWeight
from jaxserve.layers.linear import DenseWeight, linear
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import (
    apply_rope,
    longrope_attention_factor,
    longrope_inv_freq,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)
from jaxserve.layers.scan import scan_layers
from jaxserve.models.params import Param, is_plain_array, layer_param_makers
from jaxserve.sharding.plan import ShardingPlan, embed_lookup, shard_attention, shard_experts


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: jax.Array          # [L, E]
    wq: DenseWeight               # [L, E, H*D]
    wk: DenseWeight               # [L, E, K*D]
    wv: DenseWeight               # [L, E, K*D]
    wo: DenseWeight               # [L, H*D, E]
    mlp_norm: jax.Array           # [L, E]
    # The MLP: dense, or a mixture of experts. When a model mixes both, the dense arrays stack
    # only the dense layers (Ld) and the expert arrays only the sparse ones (Ls).
    w_gate: DenseWeight | None = None   # [L or Ld, E, F]  (dense MLP)
    w_up: DenseWeight | None = None     # [L or Ld, E, F]
    w_down: DenseWeight | None = None   # [L or Ld, F, E]
    router: DenseWeight | None = None      # [L or Ls, E, X]  (mixture of experts: X experts)
    we_gate: ExpertWeight | None = None    # [L or Ls, X, E, Fe]
    we_up: ExpertWeight | None = None      # [L or Ls, X, E, Fe]
    we_down: ExpertWeight | None = None    # [L or Ls, X, Fe, E]
    bq: jax.Array | None = None   # [L, H*D]  (Qwen2)
    bk: jax.Array | None = None   # [L, K*D]
    bv: jax.Array | None = None   # [L, K*D]
    q_norm: jax.Array | None = None  # [L, D]  (Qwen3)
    k_norm: jax.Array | None = None  # [L, D]
    post_attn_norm: jax.Array | None = None  # [L, E]  (Gemma: norms after attention and MLP too)
    post_mlp_norm: jax.Array | None = None   # [L, E]
    bo: jax.Array | None = None              # [L, E]  (gpt-oss: o_proj has a bias too)
    sinks: jax.Array | None = None           # [L, H]  (gpt-oss: attention sinks, one logit per head)
    router_bias: jax.Array | None = None     # [L or Ls, X]  (gpt-oss: router and experts with biases)
    be_gate: jax.Array | None = None         # [L or Ls, X, Fe]
    be_up: jax.Array | None = None           # [L or Ls, X, Fe]
    be_down: jax.Array | None = None         # [L or Ls, X, E]


DENSE_MLP = ("w_gate", "w_up", "w_down")
SPARSE_MLP = ("router", "we_gate", "we_up", "we_down", "router_bias", "be_gate", "be_up", "be_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array              # [V, E]; or a GGUF table kept quantized, Int4Weight [E, V]
    layers: LayerWeights
    final_norm: jax.Array         # [E]
    lm_head: DenseWeight | None   # [E, V]; None when tied to the embedding


def declare(cfg: ModelConfig, moe_names: tuple[str, str, str, str] | None = None) -> list[Param]:
    """Every array of this config's model: shape, logical axes, checkpoint name, init.

    `moe_names` (families with `cfg.moe`): the checkpoint names, inside a layer, of the router
    and of each expert's gate, up and down projections ("{expert}" marks the expert index)."""
    E, F, L, D, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim,
                     cfg.vocab_size)
    HD, KD = cfg.num_heads * D, cfg.num_kv_heads * D
    layer = "model.layers.{layer}."

    sparse = cfg.moe.sparse_layers(L) if cfg.moe is not None else ()
    dense = tuple(i for i in range(L) if i not in sparse)

    per_layer, matrix = layer_param_makers(L, layer)

    params = [
        Param("embed", (V, E), ("vocab", "embed"), "model.embed_tokens.weight"),
        per_layer("attn_norm", (E,), ("embed",), "input_layernorm.weight", init="ones"),
        matrix("wq", (E, HD), ("embed", "q_heads"), "self_attn.q_proj.weight"),
        matrix("wk", (E, KD), ("embed", "kv_heads"), "self_attn.k_proj.weight"),
        matrix("wv", (E, KD), ("embed", "kv_heads"), "self_attn.v_proj.weight"),
        matrix("wo", (HD, E), ("q_heads", "embed"), "self_attn.o_proj.weight"),
        per_layer("mlp_norm", (E,), ("embed",), "post_attention_layernorm.weight", init="ones"),
        *(_moe_params(cfg, moe_names, per_layer, sparse) if sparse else []),
        *([matrix("w_gate", (E, F), ("embed", "mlp"), "mlp.gate_proj.weight", dense),
           matrix("w_up", (E, F), ("embed", "mlp"), "mlp.up_proj.weight", dense),
           matrix("w_down", (F, E), ("mlp", "embed"), "mlp.down_proj.weight", dense)]
          if dense else []),
        Param("final_norm", (E,), ("embed",), "model.norm.weight", init="ones"),
    ]
    if cfg.attention_bias:
        params += [per_layer("bq", (HD,), ("q_heads",), "self_attn.q_proj.bias", init="zeros"),
                   per_layer("bk", (KD,), ("kv_heads",), "self_attn.k_proj.bias", init="zeros"),
                   per_layer("bv", (KD,), ("kv_heads",), "self_attn.v_proj.bias", init="zeros")]
    if cfg.qk_norm:
        params += [per_layer("q_norm", (D,), ("head_dim",), "self_attn.q_norm.weight",
                             init="ones"),
                   per_layer("k_norm", (D,), ("head_dim",), "self_attn.k_norm.weight",
                             init="ones")]
    if not cfg.tie_word_embeddings:
        params.append(Param("lm_head", (E, V), ("embed", "vocab"), "lm_head.weight",
                            transpose=True, dense=True))
    return params


def _moe_params(cfg: ModelConfig, names, per_layer, ids) -> list[Param]:
    """The router [Ls, E, X] and the experts stacked [Ls, X, ...] over the sparse layers `ids`
    (one checkpoint tensor per layer and expert), split on the `experts` and `moe_mlp` logical
    axes."""
    if names is None:
        raise ValueError(f"{cfg.architecture}: a mixture-of-experts config needs the family's "
                         "checkpoint names (declare(cfg, moe_names=...))")
    E, X, Fe = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.moe_intermediate_size
    router, gate, up, down = names

    def expert(name, shape, axes, suffix):
        return per_layer(name, (X, *shape), ("experts", *axes), suffix, ids, per_expert=True,
                         transpose=True, dense=True)

    return [per_layer("router", (E, X), ("embed", "router"), router, ids, transpose=True, dense=True),
            expert("we_gate", (E, Fe), ("embed", "moe_mlp"), gate),
            expert("we_up", (E, Fe), ("embed", "moe_mlp"), up),
            expert("we_down", (Fe, E), ("moe_mlp", "embed"), down)]


def build(cfg: ModelConfig, arrays: dict[str, jax.Array]) -> Weights:
    """The model pytree from `path -> array` (as declared), matmul operands wrapped: a plain
    array in a `DenseWeight`, a weight type (an `Fp8Weight` the loader made) as it is; experts
    in an `ExpertWeight` around either."""
    dense = {"layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate", "layers.w_up",
             "layers.w_down", "layers.router", "lm_head"}      # the arrays declared dense=True
    experts = {"layers.we_gate", "layers.we_up", "layers.we_down"}   # dense and per_expert

    def get(path):
        if path not in arrays:
            return None
        a = arrays[path]
        if path in dense or path in experts:
            a = DenseWeight(a) if is_plain_array(a) else a
        return ExpertWeight(a) if path in experts else a

    names = [f.name for f in dataclasses.fields(LayerWeights)]
    layers = LayerWeights(**{n: get(f"layers.{n}") for n in names})
    return Weights(embed=arrays["embed"], layers=layers, final_norm=arrays["final_norm"],
                   lm_head=get("lm_head"))


def self_attention(cfg: ModelConfig, backend: str, kv_quantize, plan: ShardingPlan | None, w,
                   h: jax.Array, cache, layer, meta, cos: jax.Array, sin: jax.Array, *,
                   norm_offset: float = 0.0):
    """One layer's attention: normed input h [T, E] -> (output after wo [T, E], cache).

    Projections (with Qwen2's bias), Qwen3/Gemma 3's per-head q/k norm (scale `norm_offset` + w),
    rope (the first 2 * cos.shape[-1] dims of each head: partial rotary), the cache write and
    paged attention with the config's scale (query_pre_attn_scalar), soft cap, sinks (gpt-oss)
    and window: the static cfg.sliding_window, unless the caller set this layer's own in
    `meta.sliding_window`."""
    T = h.shape[0]
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(h, w.wq, w.bq).reshape(T, H, D)
    k = linear(h, w.wk, w.bk).reshape(T, K, D)
    v = linear(h, w.wv, w.bv).reshape(T, K, D)
    if cfg.qk_norm:
        q = rms_norm(q, w.q_norm, cfg.rms_norm_eps, norm_offset)
        k = rms_norm(k, w.k_norm, cfg.rms_norm_eps, norm_offset)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    scale = (cfg.query_pre_attn_scalar or D) ** -0.5
    window = cfg.sliding_window if getattr(meta, "sliding_window", None) is None else None

    def attend(q, k, v, cache, layer, meta, sinks=None):     # one device's heads when tensor-parallel
        cache = kvc.write(cache, layer, k, v, meta.slot_mapping, kv_quantize)
        return attention.paged_attention(q, cache, layer, meta, backend=backend, sm_scale=scale,
                                         sliding_window=window, soft_cap=cfg.attn_logit_softcapping,
                                         sinks=sinks)

    o, cache = shard_attention(plan, attend, q, k, v, cache, layer, meta, sinks=w.sinks)
    return linear(o.reshape(T, H * D), w.wo, w.bo), cache


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first 2 * cos.shape[-1] dims of each head, pass the rest (partial rotary)."""
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)


def rope_tables(cfg: ModelConfig, positions: jax.Array, theta: float | None = None,
                scaling: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, rotary dims / 2] of the config's rope (or of `theta` and `scaling`: Gemma 3's
    sliding layers)."""
    rot = int(cfg.head_dim * cfg.partial_rotary_factor)
    if theta is None:
        theta, scaling = cfg.rope_theta, cfg.rope_scaling_dict
    if (scaling or {}).get("rope_type") == "longrope":      # Phi-3: factors chosen by max_model_len
        long = (cfg.max_model_len or cfg.derived_max_model_len) > scaling["original_max_position_embeddings"]
        cos, sin = rope_cos_sin(positions, jnp.asarray(longrope_inv_freq(rot, theta, scaling, long)))
        mscale = longrope_attention_factor(scaling, cfg.max_position_embeddings)
        return cos * mscale, sin * mscale
    cos, sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(rot, theta, scaling)))
    attention_factor = rope_attention_factor(scaling)
    if attention_factor != 1.0:         # YaRN: q.k scaled by its square, as transformers does
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def run_layers(body, carry, xs, num_layers: int, each_layer=None):
    """Scan `body(carry, xs) -> (carry, None)` over the stacked layers `xs` (layer weights
    first), or with `each_layer` (calibration, eager) run them one at a time in a Python loop,
    each on what `each_layer(index, layer_weights)` returns. Returns the final carry. `xs` is
    (layer weights, layer indices, ...): the scan hands int4 weights on the fused CPU kernel to the
    body whole, indexed by the layer (`layers.scan.scan_layers`)."""
    if each_layer is None:
        return scan_layers(body, carry, xs)
    for i in range(num_layers):
        w, *rest = jax.tree.map(lambda a, i=i: a[i], xs)
        carry, _ = body(carry, (each_layer(i, w), *rest))
    return carry


def _layer(cfg: ModelConfig, backend: str, kv_quantize, plan: ShardingPlan | None, mlp_stacks,
           carry, xs):
    x, cache, cos, sin, meta = carry
    w, layer, *kind = xs
    mixed = (mlp_stacks, kind) if kind else None

    h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
    o, cache = self_attention(cfg, backend, kv_quantize, plan, w, h, cache, layer, meta, cos, sin)
    x = x + o

    h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
    if mixed is None:
        x = x + mlp(cfg, plan, w, h)
    else:     # this layer's MLP from its kind's stack: (is_sparse, index in that stack)
        (dense, sparse), (is_sparse, index) = mixed

        def run(stack, h):
            one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False),
                               stack)
            return mlp(cfg, plan, dataclasses.replace(w, **one), h)

        x = x + jax.lax.cond(is_sparse, partial(run, sparse), partial(run, dense), h)
    return (x, cache, cos, sin, meta), None


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True)}


def mlp(cfg: ModelConfig, plan: ShardingPlan | None, w: LayerWeights, h: jax.Array):
    if w.router is None:     # gated: SwiGLU, or GeGLU (Gemma's tanh-approximated gelu)
        act = ACTIVATIONS[cfg.hidden_act]
        return linear(act(linear(h, w.w_gate)) * linear(h, w.w_up), w.w_down)
    # the weights say which MLP this layer has; cfg.moe holds the router's settings
    logits = linear(h, w.router, w.router_bias, out_dtype=jnp.float32)
    weights, ids = moe.route(logits, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob)
    fn = moe.expert_mlp
    if cfg.moe.swiglu_limit is not None:
        fn = partial(moe.expert_mlp, act=partial(moe.clamped_swiglu, alpha=cfg.moe.swiglu_alpha,
                                                 limit=cfg.moe.swiglu_limit))
    biases = None if w.be_gate is None else (w.be_gate, w.be_up, w.be_down)
    return shard_experts(plan, fn, h, weights, ids, w.we_gate, w.we_up, w.we_down, biases=biases)


def forward(weights: Weights, cache: kvc.KVCache, tokens: jax.Array, positions: jax.Array,
            meta: attention.AttentionMetadata, *, cfg: ModelConfig, backend: str = "reference",
            kv_quantize=None, plan: ShardingPlan | None = None, each_layer=None,
            aux_layers: tuple[int, ...] = ()):
    """tokens, positions [T] -> final hidden states [T, E] and the updated cache. `plan` (None:
    one device) says how heads and vocabulary split over the tensor-parallel devices.

    `aux_layers` (EAGLE-3's features, `models/eagle3.py`): also return the residual stream at
    the input of each of these layers, concatenated -> (hidden, cache, aux [T, n * E]).

    `each_layer(index, layer_weights) -> layer_weights` (calibration, eager only): the layers run
    one at a time in a Python loop instead of the scan, each on what `each_layer` returns for its
    slice of the stacked weights (FP8 GPTQ swaps in weight types that quantise themselves as
    their inputs arrive, `loader/fp8_calibrate.py`)."""
    x = embed_lookup(plan, weights.embed, tokens).astype(weights.final_norm.dtype)   # a quantized table gives f32
    cos, sin = rope_tables(cfg, positions)
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    layers, stacks, xs = weights.layers, None, ()
    if layers.router is not None and layers.w_gate is not None:    # dense and MoE layers mixed
        sparse = cfg.moe.sparse_layers(cfg.num_layers)
        is_sparse = [i in sparse for i in range(cfg.num_layers)]
        index = [sum(k == s for k in is_sparse[:i]) for i, s in enumerate(is_sparse)]
        stacks = ({n: getattr(layers, n) for n in DENSE_MLP},
                  {n: getattr(layers, n) for n in SPARSE_MLP})
        layers = dataclasses.replace(layers, **{n: None for n in DENSE_MLP + SPARSE_MLP})
        xs = (jnp.asarray(is_sparse), jnp.asarray(index, jnp.int32))
    body = partial(_layer, cfg, backend, kv_quantize, plan, stacks)
    if each_layer is not None and stacks is not None:
        raise ValueError("each_layer: models that mix dense and MoE layers are not supported")
    carry = (x, cache, cos, sin, meta)
    if aux_layers:
        body = partial(_keeping_aux, body, tuple(aux_layers))
        carry = (*carry, jnp.zeros((len(aux_layers), *x.shape), x.dtype))
    carry = run_layers(body, carry, (layers, layer_ids, *xs), cfg.num_layers, each_layer)
    x, cache = carry[:2]
    out = rms_norm(x, weights.final_norm, cfg.rms_norm_eps), cache
    if aux_layers:
        aux = carry[-1]
        return *out, jnp.concatenate(list(aux), axis=-1)
    return out


def _keeping_aux(body, ids: tuple[int, ...], carry, xs):
    """`body` that first keeps its input x where its layer is one of `ids` (a select per id: no
    branch, no [L, T, E] stack)."""
    *inner, aux = carry
    x, layer = inner[0], xs[1]
    aux = jnp.stack([jnp.where(layer == i, x, aux[k]) for k, i in enumerate(ids)])
    inner, _ = body(tuple(inner), xs)
    return (*inner, aux), None


def compute_logits(weights: Weights, hidden: jax.Array) -> jax.Array:
    """hidden [R, E] -> logits [R, V] in f32."""
    # f32 logits whatever the weights' dtype (the head stays unquantised, as in vLLM)
    if weights.lm_head is None:     # tied: the embedding [V, E] is the head
        return tied_logits(hidden, weights.embed)
    return linear(hidden, weights.lm_head, out_dtype=jnp.float32)
