"""DeepSeek V2 / V2-Lite / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head
latent attention (MLA) over a latent KV cache, and DeepSeek's mixture of experts.

MLA (`cfg.mla`, model_config.MlaConfig): per token one latent c = norm(h @ kv_a)[:r]
(kv_lora_rank r) and one rope key k_pe (qk_rope_head_dim dr) shared by all heads; head i's key
is [c @ W_uk_i, k_pe] and its value c @ W_uv_i (W_uk, W_uv: kv_b's two parts). The paged cache
holds only [c, k_pe] per token (the latent layout of attention/kv_cache.py: one "head" of
r + dr dims, no V), and attention runs in latent space with the projections absorbed:

    q_i . k_i = (q_nope_i @ W_uk_i^T) . c + q_pe_i . k_pe     (q_i's latent query: [q_nope_i W_uk_i^T, q_pe_i])
    o_i = sum_j p_ij (c_j @ W_uv_i) = (sum_j p_ij c_j) @ W_uv_i

so every layer is multi-query attention of H latent queries against one latent head, on the
ragged reference path (values: the first r dims of the cached latent), for prefill chunks and
decodes alike, and W_uv is applied once to each head's output. The scale is 1/sqrt(qk_nope +
qk_rope dims), times YaRN's mscale(factor, mscale_all_dim)^2. DeepSeek rotates its rope dims in
adjacent pairs; they are de-interleaved (q and k alike: q.k is unchanged) and rotated as halves.

MoE (`cfg.moe`, model_config.DeepseekMoeConfig): the first `first_k_dense_replace` layers (and
those off `moe_layer_freq`) have a dense SwiGLU MLP; the others route each token to top-k
experts (`layers/moe.py: route_grouped`: V2 softmax greedy / group-limited, V3 sigmoid with a
correction bias and noaux_tc groups) run by the grouped matmuls (expert parallelism as every MoE
family), plus shared experts every token passes through. The scan over layers picks the layer's
MLP kind with a `lax.cond`, as llama.py does.

Tensor parallelism: heads split (q, kv_b, o); the latent projections (q_a, kv_a) and the cache's
latent are replicated (the plan repeats the one latent head per device).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import attention
from jaxserve.attention import kv_cache as kvc
from jaxserve.config import ModelConfig
from jaxserve.layers import moe
from jaxserve.layers.experts import ExpertWeight
from jaxserve.layers.linear import DenseWeight, linear
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import mla_softmax_scale_factor
from jaxserve.models import llama
from jaxserve.models.llama import Weights, compute_logits  # noqa: F401  (the family API)
from jaxserve.models.params import Param, is_plain_array, layer_param_makers
from jaxserve.sharding.plan import ShardingPlan, embed_lookup, shard_attention, shard_experts

MOE_NAMES = ("mlp.gate.weight", "mlp.experts.{expert}.gate_proj.weight",
             "mlp.experts.{expert}.up_proj.weight", "mlp.experts.{expert}.down_proj.weight")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: jax.Array                  # [L, E]
    wkv_a: DenseWeight                    # [L, E, r + dr]  (kv_a_proj_with_mqa)
    kv_a_norm: jax.Array                  # [L, r]
    wkv_b: jax.Array                      # [L, r, H * (dn + dv)]  plain: absorbed into q and o
    wo: DenseWeight                       # [L, H * dv, E]
    mlp_norm: jax.Array                   # [L, E]
    wq: DenseWeight | None = None         # [L, E, H * (dn + dr)]  (no q_lora_rank: V2-Lite)
    wq_a: DenseWeight | None = None       # [L, E, qr]
    q_a_norm: jax.Array | None = None     # [L, qr]
    wq_b: DenseWeight | None = None       # [L, qr, H * (dn + dr)]
    # dense layers (Ld of them) and MoE layers (Ls), stacked apart
    w_gate: DenseWeight | None = None     # [Ld, E, F]
    w_up: DenseWeight | None = None       # [Ld, E, F]
    w_down: DenseWeight | None = None     # [Ld, F, E]
    router: DenseWeight | None = None     # [Ls, E, X]
    e_bias: jax.Array | None = None       # [Ls, X]  (V3: e_score_correction_bias)
    we_gate: ExpertWeight | None = None   # [Ls, X, E, Fe]
    we_up: ExpertWeight | None = None     # [Ls, X, E, Fe]
    we_down: ExpertWeight | None = None   # [Ls, X, Fe, E]
    ws_gate: DenseWeight | None = None    # [Ls, E, Fs]  shared experts (Fs = n_shared * Fe)
    ws_up: DenseWeight | None = None      # [Ls, E, Fs]
    ws_down: DenseWeight | None = None    # [Ls, Fs, E]


DENSE_MLP = ("w_gate", "w_up", "w_down")
SPARSE_MLP = ("router", "e_bias", "we_gate", "we_up", "we_down", "ws_gate", "ws_up", "ws_down")
MATRICES = {"wkv_a", "wo", "wq", "wq_a", "wq_b", "w_gate", "w_up", "w_down", "router", "ws_gate", "ws_up",
            "ws_down"}
EXPERTS = {"we_gate", "we_up", "we_down"}


def declare(cfg: ModelConfig) -> list[Param]:
    """Every array of this DeepSeek config (checkpoint names as transformers saves them)."""
    m = cfg.mla
    E, F, L, V, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size, cfg.num_heads
    r, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    layer = "model.layers.{layer}."
    sparse = cfg.moe.sparse_layers(L) if cfg.moe is not None else ()
    dense = tuple(i for i in range(L) if i not in sparse)

    per_layer, matrix = layer_param_makers(L, layer)

    def norm(name, dim, axis, suffix):
        return per_layer(name, (dim,), (axis,), suffix, init="ones")

    q = H * (dn + dr)
    params = [
        Param("embed", (V, E), ("vocab", "embed"), "model.embed_tokens.weight"),
        norm("attn_norm", E, "embed", "input_layernorm.weight"),
        matrix("wkv_a", (E, r + dr), ("embed", "latent"), "self_attn.kv_a_proj_with_mqa.weight"),
        norm("kv_a_norm", r, "latent", "self_attn.kv_a_layernorm.weight"),
        per_layer("wkv_b", (r, H * (dn + dv)), ("latent", "q_heads"), "self_attn.kv_b_proj.weight", transpose=True),
        matrix("wo", (H * dv, E), ("q_heads", "embed"), "self_attn.o_proj.weight"),
        norm("mlp_norm", E, "embed", "post_attention_layernorm.weight"),
        Param("final_norm", (E,), ("embed",), "model.norm.weight", init="ones"),
    ]
    if m.q_lora_rank is None:
        params.append(matrix("wq", (E, q), ("embed", "q_heads"), "self_attn.q_proj.weight"))
    else:
        qr = m.q_lora_rank
        params += [matrix("wq_a", (E, qr), ("embed", "latent"), "self_attn.q_a_proj.weight"),
                   norm("q_a_norm", qr, "latent", "self_attn.q_a_layernorm.weight"),
                   matrix("wq_b", (qr, q), ("latent", "q_heads"), "self_attn.q_b_proj.weight")]
    if dense:
        params += [matrix("w_gate", (E, F), ("embed", "mlp"), "mlp.gate_proj.weight", dense),
                   matrix("w_up", (E, F), ("embed", "mlp"), "mlp.up_proj.weight", dense),
                   matrix("w_down", (F, E), ("mlp", "embed"), "mlp.down_proj.weight", dense)]
    if sparse:
        params += llama._moe_params(cfg, MOE_NAMES, per_layer, sparse)
        if cfg.moe.topk_method == "noaux_tc":
            params.append(per_layer("e_bias", (cfg.moe.num_experts,), ("router",),
                                    "mlp.gate.e_score_correction_bias", sparse, init="zeros", dtype="float32"))
        if cfg.moe.n_shared_experts:
            Fs = cfg.moe.n_shared_experts * cfg.moe.moe_intermediate_size
            params += [matrix("ws_gate", (E, Fs), ("embed", "mlp"), "mlp.shared_experts.gate_proj.weight", sparse),
                       matrix("ws_up", (E, Fs), ("embed", "mlp"), "mlp.shared_experts.up_proj.weight", sparse),
                       matrix("ws_down", (Fs, E), ("mlp", "embed"), "mlp.shared_experts.down_proj.weight", sparse)]
    if not cfg.tie_word_embeddings:
        params.append(Param("lm_head", (E, V), ("embed", "vocab"), "lm_head.weight", transpose=True, dense=True))
    return params


def build(cfg: ModelConfig, arrays: dict[str, jax.Array]) -> Weights:
    """The model pytree from `path -> array`: matmul operands wrapped (`DenseWeight` around a
    plain array; a weight type the loader made as it is), experts in an `ExpertWeight`."""
    def get(name):
        a = arrays.get(f"layers.{name}")
        if a is None or name not in MATRICES | EXPERTS:
            return a
        a = DenseWeight(a) if is_plain_array(a) else a
        return ExpertWeight(a) if name in EXPERTS else a

    layers = LayerWeights(**{f.name: get(f.name) for f in dataclasses.fields(LayerWeights)})
    head = arrays.get("lm_head")
    return Weights(embed=arrays["embed"], layers=layers, final_norm=arrays["final_norm"],
                   lm_head=DenseWeight(head) if is_plain_array(head) else head)


def _deinterleave(x: jax.Array) -> jax.Array:
    """[..., dr] rope dims in adjacent pairs -> evens then odds (rotate-half's layout)."""
    d = x.shape[-1]
    return x[..., np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])]


def mla_attention(cfg: ModelConfig, backend: str, kv_quantize, plan: ShardingPlan | None, w: LayerWeights,
                  h: jax.Array, cache, layer, meta, cos: jax.Array, sin: jax.Array):
    """One layer's MLA: normed h [T, E] -> (output after o_proj [T, E], cache), the latents of
    this step's tokens written to the cache and attention run in latent space (module doc)."""
    m, eps = cfg.mla, cfg.rms_norm_eps
    T, H = h.shape[0], cfg.num_heads
    r, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if w.wq is not None:
        q = linear(h, w.wq)
    else:
        q = linear(rms_norm(linear(h, w.wq_a), w.q_a_norm, eps), w.wq_b)
    q = q.reshape(T, H, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv = linear(h, w.wkv_a)                                        # [T, r + dr]
    c, k_pe = rms_norm(kv[:, :r], w.kv_a_norm, eps), kv[:, None, r:]
    if m.rope_interleave:
        q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
    q_pe, k_pe = llama._rope(q_pe, cos, sin), llama._rope(k_pe, cos, sin)
    kv_b = w.wkv_b.reshape(r, H, dn + dv)
    w_uk, w_uv = kv_b[..., :dn], kv_b[..., dn:]
    q_lat = jnp.einsum("thn,rhn->thr", q_nope, w_uk.astype(q.dtype))
    q_full = jnp.concatenate([q_lat, q_pe], axis=-1)              # [T, H, r + dr]
    latent = jnp.concatenate([c[:, None, :], k_pe.astype(c.dtype)], axis=-1)   # [T, 1, r + dr]
    scale = (dn + dr) ** -0.5 * mla_softmax_scale_factor(cfg.rope_scaling_dict)

    def attend(q, k, v, cache, layer, meta):     # one device's heads when tensor-parallel
        cache = kvc.write(cache, layer, k, None, meta.slot_mapping, kv_quantize)
        return attention.paged_attention(q, cache, layer, meta, backend=backend, sm_scale=scale)

    o, cache = shard_attention(plan, attend, q_full, latent, None, cache, layer, meta)
    o = jnp.einsum("thr,rhv->thv", o[..., :r], w_uv.astype(o.dtype))   # values: the latent's first r dims
    return linear(o.reshape(T, H * dv), w.wo), cache


def _swiglu(h, gate, up, down):
    return linear(jax.nn.silu(linear(h, gate)) * linear(h, up), down)


def mlp(cfg: ModelConfig, plan: ShardingPlan | None, w: LayerWeights, h: jax.Array) -> jax.Array:
    """The layer's MLP: dense SwiGLU, or (weights with a router) routed plus shared experts."""
    if w.router is None:
        return _swiglu(h, w.w_gate, w.w_up, w.w_down)
    c = cfg.moe
    logits = linear(h, w.router, out_dtype=jnp.float32)
    weights, ids = moe.route_grouped(logits, c.num_experts_per_tok, scoring=c.scoring_func, method=c.topk_method,
                                     n_group=c.n_group, topk_group=c.topk_group, renormalize=c.norm_topk_prob,
                                     scale=c.routed_scaling_factor, bias=w.e_bias)
    out = shard_experts(plan, moe.expert_mlp, h, weights, ids, w.we_gate, w.we_up, w.we_down)
    if w.ws_gate is not None:
        out = out + _swiglu(h, w.ws_gate, w.ws_up, w.ws_down)
    return out


def decoder_layer(cfg: ModelConfig, backend: str, kv_quantize, plan: ShardingPlan | None, mlp_stacks, carry, xs):
    """One decoder layer as a scan body: MLA, then the dense or MoE MLP (the multi-token
    prediction layer of `models/mtp.py` runs it too)."""
    x, cache, cos, sin, meta = carry
    w, layer, *kind = xs
    h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
    o, cache = mla_attention(cfg, backend, kv_quantize, plan, w, h, cache, layer, meta, cos, sin)
    x = x + o
    h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
    if not kind:
        x = x + mlp(cfg, plan, w, h)
    else:     # this layer's MLP from its kind's stack: (is_sparse, index in that stack)
        (dense, sparse), (is_sparse, index) = mlp_stacks, kind

        def run(stack, h):
            one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), stack)
            return mlp(cfg, plan, dataclasses.replace(w, **one), h)

        x = x + jax.lax.cond(is_sparse, partial(run, sparse), partial(run, dense), h)
    return (x, cache, cos, sin, meta), None


def rope_tables(cfg: ModelConfig, positions: jax.Array):
    """(cos, sin) of `positions` over MLA's rope dims (qk_rope_head_dim), YaRN included."""
    return llama.rope_tables(dataclasses.replace(cfg, head_dim=cfg.mla.qk_rope_head_dim), positions)


def forward(weights: Weights, cache: kvc.KVCache, tokens: jax.Array, positions: jax.Array,
            meta: attention.AttentionMetadata, *, cfg: ModelConfig, backend: str = "reference",
            kv_quantize=None, plan: ShardingPlan | None = None, each_layer=None):
    """tokens, positions [T] -> final hidden states [T, E] and the updated (latent) cache
    (llama.forward's contract)."""
    if not cache.latent:
        raise ValueError(f"{cfg.architecture} needs the latent KV cache layout (kv_cache.allocate(latent=True))")
    x = embed_lookup(plan, weights.embed, tokens).astype(weights.final_norm.dtype)
    cos, sin = rope_tables(cfg, positions)
    layers, stacks, xs = weights.layers, None, ()
    if layers.router is not None and layers.w_gate is not None:    # dense and MoE layers mixed
        if each_layer is not None:
            raise ValueError("each_layer: models that mix dense and MoE layers are not supported")
        sparse = cfg.moe.sparse_layers(cfg.num_layers)
        is_sparse = [i in sparse for i in range(cfg.num_layers)]
        index = [sum(k == s for k in is_sparse[:i]) for i, s in enumerate(is_sparse)]
        stacks = ({n: getattr(layers, n) for n in DENSE_MLP},
                  {n: getattr(layers, n) for n in SPARSE_MLP if getattr(layers, n) is not None})
        layers = dataclasses.replace(layers, **{n: None for n in DENSE_MLP + SPARSE_MLP})
        xs = (jnp.asarray(is_sparse), jnp.asarray(index, jnp.int32))
    body = partial(decoder_layer, cfg, backend, kv_quantize, plan, stacks)
    carry = llama.run_layers(body, (x, cache, cos, sin, meta),
                             (layers, jnp.arange(cfg.num_layers, dtype=jnp.int32), *xs), cfg.num_layers, each_layer)
    x, cache = carry[:2]
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), cache
