"""`ModelConfig`: the network as the engine sees it, read from a Hugging Face `config.json`
(`ModelConfig.from_hf`, one field reader per family) or GGUF metadata, with its rope scaling
checked; `MoeConfig` for mixture-of-experts layers. Host side: never imports jax.
(`jaxserve.config` re-exports these beside the engine's other configuration.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.models.registry import check_architecture

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): the router scores `num_experts`
    experts per token with a softmax, keeps the top `num_experts_per_tok`, and (when
    `norm_topk_prob`) renormalises the kept weights to sum to 1. Mixtral's "top-k, then softmax
    over the k logits" is exactly softmax -> top-k -> renormalise, so it is `norm_topk_prob=True`.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # gpt-oss's experts: a router with a bias, experts with biases and the clamped SwiGLU
    # (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit); None: SwiGLU
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    def __post_init__(self):
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "decoder_sparse_step"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, "
                                 f"got {getattr(self, name)!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        if (self.swiglu_alpha is None) != (self.swiglu_limit is None) or not all(
                v is None or v > 0 for v in (self.swiglu_alpha, self.swiglu_limit)):
            raise ValueError(f"model config fields swiglu_alpha and swiglu_limit must both be positive numbers, "
                             f"got {self.swiglu_alpha!r} and {self.swiglu_limit!r}")
        if not all(isinstance(i, int) and i >= 0 for i in self.mlp_only_layers):
            raise ValueError(f"model config field mlp_only_layers must list layer indices >= 0, "
                             f"got {list(self.mlp_only_layers)}")

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts; the others have a dense MLP of the
        model's intermediate_size. Transformers' rule (Qwen3-MoE, Qwen2-MoE): layer i is sparse
        unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer is
        ((i + 1) % step == 0). Indices past the last layer are ignored, as transformers does."""
        return tuple(i for i in range(num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder of one of the registered families, independent of where its
    weights come from. Family-specific fields (q/k norm, qkv bias, sliding window, `moe`) are
    read from config.json by that family's parser (`_FAMILY_FIELDS`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Normalised rope scaling: None or {"rope_type": ..., "factor": ..., ...}.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False          # per-head RMSNorm on q and k before rope (Qwen3)
    sliding_window: int | None = None
    moe: MoeConfig | None = None   # sparse MLP (Qwen3-MoE, Mixtral); None: dense MLP
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2/3: the gated MLP's activation, per-layer attention kinds ("sliding_attention" uses
    # sliding_window, "full_attention" none; None: every layer as sliding_window says), the
    # attention scale 1/sqrt(query_pre_attn_scalar) (None: 1/sqrt(head_dim)), tanh soft caps of
    # the attention scores and of the final logits, and (Gemma 3) the sliding layers' own rope
    # base, unscaled (rope_theta and rope_scaling are the global layers').
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0   # rope turns the first head_dim * this dims (Phi-4-mini)
    attention_sinks: bool = False  # a learned logit per head in every softmax denominator (gpt-oss)
    # The longest context served (the engine's max_model_len; None: derived_max_model_len).
    # LongRoPE picks its short or long factors by it, once (vLLM's rule; layers/rotary.py).
    max_model_len: int | None = None
    # DeepSeek V2/V3: multi-head latent attention. The KV cache then holds one latent "head" per
    # token (num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim), no separate values.
    mla: MlaConfig | None = None

    def __post_init__(self):
        check_architecture(self.architecture)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, "
                                 f"got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            _check_rope_scaling(dict(self.rope_scaling))
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                                 f"{self.num_layers} layers, got {list(self.layer_types)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"model config field {name} must be a positive number or null, got {v!r}")
        scaling = self.rope_scaling_dict or {}
        if scaling.get("rope_type") == "longrope":
            half = int(self.head_dim * self.partial_rotary_factor) // 2
            for name in ("short_factor", "long_factor"):
                if len(scaling[name]) != half:
                    raise ValueError(f"rope_scaling.{name} must have one factor per rotary dim pair ({half}), "
                                     f"got {len(scaling[name])}")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"partial_rotary_factor must be in (0, 1] and turn an even number of the "
                             f"{self.head_dim} head dims, got {self.partial_rotary_factor}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the model takes (vLLM's `_get_and_verify_max_len`):
        max_position_embeddings, times the factor for linear and dynamic NTK rope scaling (the
        dynamic fixed base is made for that length); for YaRN original_max_position_embeddings
        times the factor (Qwen3: 32768 x 4)."""
        scaling = self.rope_scaling_dict or {}
        if scaling.get("rope_type") in ("linear", "dynamic"):
            return int(self.max_position_embeddings * float(scaling["factor"]))
        if scaling.get("rope_type") == "yarn":
            return int(scaling["original_max_position_embeddings"] * float(scaling["factor"]))
        return self.max_position_embeddings

    def resolve_max_model_len(self, requested: int | None) -> int:
        """--max-model-len (None: the model's own) checked against derived_max_model_len."""
        limit = self.derived_max_model_len
        if requested is None:
            return limit
        if requested > limit:
            yarn = (self.rope_scaling_dict or {}).get("rope_type") == "yarn"
            raise ValueError(f"max_model_len ({requested}) is larger than the model's "
                             + (f"rope_scaling.original_max_position_embeddings x rope_scaling.factor ({limit})"
                                if yarn else f"max_position_embeddings ({self.max_position_embeddings})"
                                + (f" x rope_scaling.factor ({limit})" if limit != self.max_position_embeddings
                                   else "")))
        return requested

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field; cannot tell which model "
                             "this is")
        arch = archs[0]
        check_architecture(arch)
        text = hf.get("text_config") or hf
        text = {**_FAMILY_DEFAULTS.get(arch, {}), **text}
        try:
            hidden = int(text["hidden_size"])
            num_heads = int(text["num_attention_heads"])
            cfg = dict(
                vocab_size=int(text["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(text["intermediate_size"]),
                num_layers=int(text["num_hidden_layers"]),
                num_heads=num_heads,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing the required field {e.args[0]!r}") from None
        num_kv = text.get("num_key_value_heads") or num_heads
        head_dim = text.get("head_dim") or hidden // num_heads
        theta, scaling = _rope_from_hf(text, int(text.get("max_position_embeddings", 2048)))
        eos = text.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        try:
            family = _FAMILY_FIELDS.get(arch, _llama_fields)(text)
        except KeyError as e:
            raise ValueError(f"config.json is missing the required field {e.args[0]!r}") from None
        # a family's parser may replace a common field (DeepSeek's MLA: one latent "head")
        return cls(**{**dict(
            architecture=arch,
            num_kv_heads=int(num_kv),
            head_dim=int(head_dim),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                            text.get("tie_word_embeddings", False))),
            bos_token_id=text.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **cfg), **family})


# --- per-family config.json fields ---------------------------------------------------------------
# Each parser reads the fields its family adds to the common decoder shape; a family not listed
# reads Llama's (optional qkv bias, sliding window only when use_sliding_window says so).

def _window(text: dict[str, Any], default_on: bool) -> int | None:
    window = text.get("sliding_window") if text.get("use_sliding_window", default_on) else None
    return int(window) if window else None


def _llama_fields(text: dict[str, Any]) -> dict[str, Any]:
    return dict(attention_bias=bool(text.get("attention_bias", False)),
                sliding_window=_window(text, False))


def _mistral_fields(text: dict[str, Any]) -> dict[str, Any]:
    return dict(_llama_fields(text), sliding_window=_window(text, True))


def _qwen2_fields(text: dict[str, Any]) -> dict[str, Any]:
    return dict(_llama_fields(text), attention_bias=bool(text.get("attention_bias", True)))


def _qwen3_fields(text: dict[str, Any]) -> dict[str, Any]:
    return dict(_llama_fields(text), qk_norm=True)


def _qwen3_moe_fields(text: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes num_local_experts beside (or instead of) num_experts
    experts = text.get("num_experts", text.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    moe = MoeConfig(num_experts=int(experts),
                    num_experts_per_tok=int(text["num_experts_per_tok"]),
                    moe_intermediate_size=int(text["moe_intermediate_size"]),
                    norm_topk_prob=bool(text.get("norm_topk_prob", False)),
                    decoder_sparse_step=int(text.get("decoder_sparse_step", 1)),
                    mlp_only_layers=tuple(int(i) for i in text.get("mlp_only_layers") or ()))
    return dict(_qwen3_fields(text), moe=moe)


def _mixtral_fields(text: dict[str, Any]) -> dict[str, Any]:
    # Mixtral's experts are intermediate_size wide; its router is top-k then softmax over the k
    moe = MoeConfig(num_experts=int(text["num_local_experts"]),
                    num_experts_per_tok=int(text["num_experts_per_tok"]),
                    moe_intermediate_size=int(text["intermediate_size"]),
                    norm_topk_prob=True)
    return dict(_mistral_fields(text), moe=moe)


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: q from the hidden state directly (q_lora_rank None,
    V2-Lite) or through a q_lora_rank-wide normed bottleneck; K and V of every head up-projected
    (kv_b) from one kv_lora_rank-wide normed latent per token, beside a qk_rope_head_dim-wide rope
    key shared by all heads. q.k covers qk_nope_head_dim + qk_rope_head_dim dims per head, values
    v_head_dim. `rope_interleave`: the rope dims are rotated in adjacent pairs (DeepSeek's layout)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"model config field q_lora_rank must be a positive integer or null, "
                             f"got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")

    @property
    def latent_dim(self) -> int:
        """What the KV cache holds per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


DEEPSEEK_ROUTING = {("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc")}


@dataclass(frozen=True)
class DeepseekMoeConfig(MoeConfig):
    """DeepSeek's MoE (V2: softmax scores, top-k greedy or within the best `topk_group` of
    `n_group` expert groups by their best score; V3: sigmoid scores plus a per-expert
    correction bias for the choice, groups ranked by the sum of their two best, "noaux_tc"),
    the kept weights (renormalised when `norm_topk_prob`) times `routed_scaling_factor`, plus
    `n_shared_experts` experts every token uses (one SwiGLU of that many times the experts'
    width). Layers before `first_k_dense_replace`, and those off every `moe_layer_freq`-th, are
    dense (vLLM's rule)."""

    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self):
        super().__post_init__()
        if (self.scoring_func, self.topk_method) not in DEEPSEEK_ROUTING:
            raise ValueError(f"scoring_func {self.scoring_func!r} with topk_method {self.topk_method!r} is not "
                             f"supported; supported: {sorted(DEEPSEEK_ROUTING)}")
        for name in ("n_group", "topk_group", "moe_layer_freq"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.topk_method != "greedy":
            if self.num_experts % self.n_group or self.topk_group > self.n_group:
                raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts}) "
                                 f"and topk_group ({self.topk_group}) be at most n_group")
            if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
                raise ValueError(f"topk_group ({self.topk_group}) groups of {self.num_experts // self.n_group} "
                                 f"experts hold fewer than num_experts_per_tok ({self.num_experts_per_tok})")

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(i for i in range(num_layers)
                     if i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0)


def _deepseek_fields(text: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek V2 / V2-Lite / V3: MLA (the cache's one latent head) and DeepSeek's MoE. V3's
    transformers class always routes by sigmoid + noaux_tc; V2's by softmax and topk_method."""
    v3 = "DeepseekV3ForCausalLM" in (text.get("architectures") or ())
    mla = MlaConfig(q_lora_rank=None if text.get("q_lora_rank") is None else int(text["q_lora_rank"]),
                    kv_lora_rank=int(text["kv_lora_rank"]), qk_nope_head_dim=int(text["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(text["qk_rope_head_dim"]), v_head_dim=int(text["v_head_dim"]),
                    rope_interleave=bool(text.get("rope_interleave", True)) if v3 else True)   # V2: always pairs
    moe = None
    if text.get("n_routed_experts"):
        moe = DeepseekMoeConfig(
            num_experts=int(text["n_routed_experts"]), num_experts_per_tok=int(text["num_experts_per_tok"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            norm_topk_prob=bool(text.get("norm_topk_prob", v3)),
            scoring_func=text.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            topk_method=text.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            n_group=int(text.get("n_group") or 1), topk_group=int(text.get("topk_group") or 1),
            routed_scaling_factor=float(text.get("routed_scaling_factor") or 1.0),
            n_shared_experts=int(text.get("n_shared_experts") or 0),
            first_k_dense_replace=int(text.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(text.get("moe_layer_freq") or 1))
    if text.get("attention_bias"):
        raise ValueError("attention_bias is not supported for DeepSeek (its checkpoints have none)")
    return dict(num_kv_heads=1, head_dim=mla.latent_dim, mla=mla, moe=moe)


def _optional_float(text: dict[str, Any], name: str) -> float | None:
    v = text.get(name)
    return None if v is None else float(v)


def _gemma_fields(text: dict[str, Any], pattern: int) -> dict[str, Any]:
    """Gemma 2 (every other layer slides, from the first) and Gemma 3 (every `pattern`-th layer is
    global): layer_types as config.json lists them, else transformers' default pattern."""
    if text.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: jaxserve serves causal decoders "
                         "(this is an embedding model's config)")
    n = int(text["num_hidden_layers"])
    pattern = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or pattern)
    types = text.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                        for i in range(n)]
    head_dim = text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"])
    return dict(attention_bias=bool(text.get("attention_bias", False)),
                sliding_window=_window(text, True),
                hidden_act=text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh",
                layer_types=tuple(types),
                query_pre_attn_scalar=float(text.get("query_pre_attn_scalar") or head_dim),
                attn_logit_softcapping=_optional_float(text, "attn_logit_softcapping"),
                final_logit_softcapping=_optional_float(text, "final_logit_softcapping"))


def _gemma2_fields(text: dict[str, Any]) -> dict[str, Any]:
    return _gemma_fields(text, 2)


def _gemma3_fields(text: dict[str, Any]) -> dict[str, Any]:
    local = text.get("rope_local_base_freq")
    params = text.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        sliding = params["sliding_attention"]          # transformers 5: rope per layer type
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention.rope_type {sliding['rope_type']!r} is not "
                             "supported; Gemma 3's sliding layers use the default rope")
        local = sliding.get("rope_theta", local)
    return dict(_gemma_fields(text, 6), qk_norm=True, rope_local_theta=float(local or 10000.0))


# transformers' Gemma3TextConfig defaults: Gemma 3's multimodal checkpoints (4B and up) write
# only what differs from them in text_config
_GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                             rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                             sliding_window=4096, max_position_embeddings=131072, query_pre_attn_scalar=256,
                             hidden_activation="gelu_pytorch_tanh", sliding_window_pattern=6)
_FAMILY_DEFAULTS = {"Gemma3ForCausalLM": _GEMMA3_TEXT_DEFAULTS,
                    "Gemma3ForConditionalGeneration": _GEMMA3_TEXT_DEFAULTS}


def _phi3_fields(text: dict[str, Any]) -> dict[str, Any]:
    params = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    factor = text.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    return dict(_llama_fields(text), sliding_window=_window(text, True), partial_rotary_factor=float(factor))


def _gpt_oss_fields(text: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: experts intermediate_size wide, routed top-k then softmax over the k (with the
    router's bias), clamped SwiGLU; q/k/v/o biases; attention sinks; every other layer sliding
    from the first, unless layer_types says otherwise."""
    n = int(text["num_hidden_layers"])
    types = text.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    moe = MoeConfig(num_experts=int(text["num_local_experts"]),
                    num_experts_per_tok=int(text["num_experts_per_tok"]),
                    moe_intermediate_size=int(text["intermediate_size"]), norm_topk_prob=True,
                    swiglu_alpha=float(text.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(text.get("swiglu_limit", 7.0)))
    return dict(attention_bias=bool(text.get("attention_bias", True)), sliding_window=_window(text, True),
                layer_types=tuple(types), moe=moe, attention_sinks=True)


_FAMILY_FIELDS = {
    "GptOssForCausalLM": _gpt_oss_fields,
    "DeepseekV2ForCausalLM": _deepseek_fields,
    "DeepseekV3ForCausalLM": _deepseek_fields,
    "Phi3ForCausalLM": _phi3_fields,
    "Gemma2ForCausalLM": _gemma2_fields,
    "Gemma3ForCausalLM": _gemma3_fields,
    "Gemma3ForConditionalGeneration": _gemma3_fields,
    "MistralForCausalLM": _mistral_fields,
    "Qwen2ForCausalLM": _qwen2_fields,
    "Qwen3ForCausalLM": _qwen3_fields,
    "Qwen3MoeForCausalLM": _qwen3_moe_fields,
    "MixtralForCausalLM": _mixtral_fields,
}


def _rope_from_hf(text: dict[str, Any], max_position_embeddings: int = 2048
                  ) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """Read rope settings from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (older files). YaRN's original_max_position_embeddings defaults
    to max_position_embeddings and its factor to their ratio, as transformers fills them."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]     # Gemma 3 in transformers 5: the global layers' rope
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(text.get("rope_theta", 10000.0))
        scaling = dict(text.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    scaling.pop("partial_rotary_factor", None)      # a ModelConfig field of its own
    if scaling.get("rope_type") == "su":             # LongRoPE's first name (Phi-3 configs)
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type") == "longrope":       # older files keep L0 beside the scaling
        scaling.setdefault("original_max_position_embeddings", text.get("original_max_position_embeddings"))
    if scaling.get("rope_type") == "yarn":
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        if scaling.get("factor") is None and isinstance(scaling["original_max_position_embeddings"], int):
            scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    _check_rope_scaling(scaling)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    # lists (LongRoPE's factors) as tuples: the config stays hashable
    return theta, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    """A ValueError naming the field when jaxserve cannot apply these rope settings."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            f = scaling.get(name)
            if not isinstance(f, (list, tuple)) or not f or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f):
                raise ValueError(f"rope_scaling.{name} must be a list of positive numbers for rope_type "
                                 f"'longrope', got {f!r}")
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings (or the config's "
                             f"original_max_position_embeddings) must be a positive int, got {original!r}")
    if rope_type in ("linear", "llama3", "dynamic", "yarn"):
        factor = scaling.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"rope_scaling.factor must be a positive number for rope_type "
                             f"{rope_type!r}, got {factor!r}")
    if rope_type == "yarn":
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings must be a positive integer "
                             f"for rope_type 'yarn', got {original!r}")
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            value = scaling.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"rope_scaling.{key} must be a number, got {value!r}")
