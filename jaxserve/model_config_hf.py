"""Each registered family's own `config.json` fields, beyond the common decoder shape that
`ModelConfig.from_hf` reads: one reader per family (`_FAMILY_FIELDS`; a family not listed reads
Llama's), returning `ModelConfig` keyword arguments (q/k norm, qkv bias, sliding window, Gemma's
layer types and soft caps, Phi-3's partial rotary factor, the MoE / MLA block configs), and the
defaults a family's checkpoints leave out of `config.json` (`_FAMILY_DEFAULTS`: Gemma 3's text
config). GGUF metadata reaches these too, as the config.json-like dict `loader/gguf_families.py`
makes. Host side: never imports jax."""

from __future__ import annotations

from typing import Any

from jaxserve.model_config_blocks import DeepseekMoeConfig, MlaConfig, MoeConfig


def family_defaults(architecture: str) -> dict[str, Any]:
    """The fields `architecture`'s checkpoints may leave out of config.json (its text_config)."""
    return _FAMILY_DEFAULTS.get(architecture, {})


def family_fields(architecture: str, text: dict[str, Any]) -> dict[str, Any]:
    """`architecture`'s own ModelConfig fields read from config.json (its text_config); a
    KeyError names a missing required field."""
    return _FAMILY_FIELDS.get(architecture, _llama_fields)(text)


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
