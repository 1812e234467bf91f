"""Write a loaded model as a Hugging Face directory, so other tools (transformers, load
generators, evaluation harnesses) can use exactly the model jaxserve serves — the embedded GGUF
model in particular:

    config.json  generation_config.json  tokenizer.json  tokenizer_config.json
    model.safetensors   (weights=True; the checkpoint names and layouts of the declaration)

FP8 linear layers (`Fp8Weight`: `--quantization fp8`, `jaxserve quantize`) are written as a
compressed-tensors "float-quantized" checkpoint: e4m3 `weight` [out, in] beside its f32
`weight_scale`, and `quantization_config` in config.json, which `loader/fp8.py` reads back.

Weights are written in the layout `loader.py` reads back, one tensor per layer, `[out, in]`
matrices, so `jaxserve serve DIR` and transformers load the same numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers.experts import ExpertWeight
from jaxserve.layers.fp8 import Fp8Weight
from jaxserve.models.registry import get_model

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
                "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                "Phi3ForCausalLM": "phi3", "GptOssForCausalLM": "gpt_oss",
                "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
# what an architecture is exported as: the text model jaxserve serves (its vision tower was not loaded)
_EXPORTED_AS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def hf_config(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """ModelConfig -> the Hugging Face `config.json` dict `ModelConfig.from_hf` reads back."""
    eos = list(cfg.eos_token_ids)
    out = {
        "architectures": [cfg.architecture], "model_type": _MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling_dict,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": dtype,
    }
    if cfg.sliding_window:
        out.update(sliding_window=cfg.sliding_window, use_sliding_window=True)
    if cfg.partial_rotary_factor != 1.0:
        out.update(partial_rotary_factor=cfg.partial_rotary_factor)
    if cfg.architecture == "Phi3ForCausalLM":    # Phi3Config's default pad id (32000) may lie past the vocabulary
        out.update(pad_token_id=None)
    if (cfg.rope_scaling_dict or {}).get("rope_type") == "longrope":    # transformers reads L0 at the top level
        out.update(original_max_position_embeddings=cfg.rope_scaling_dict["original_max_position_embeddings"])
    if cfg.architecture.startswith("Gemma"):
        out.update(hidden_activation=cfg.hidden_act, layer_types=list(cfg.layer_types),
                   query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar),   # transformers wants an int
                   attn_logit_softcapping=cfg.attn_logit_softcapping,
                   final_logit_softcapping=cfg.final_logit_softcapping)
        if cfg.rope_local_theta is not None:
            out.update(rope_local_base_freq=cfg.rope_local_theta)
    if cfg.architecture == "GptOssForCausalLM":    # without rope_parameters GptOssConfig assumes YaRN x32
        out.pop("rope_scaling")
        out.update(layer_types=list(cfg.layer_types), swiglu_alpha=cfg.moe.swiglu_alpha,
                   swiglu_limit=cfg.moe.swiglu_limit, rope_parameters={
                       "rope_theta": cfg.rope_theta, **(cfg.rope_scaling_dict or {"rope_type": "default"})})
    if cfg.moe is not None:
        m = cfg.moe
        out.update(num_experts_per_tok=m.num_experts_per_tok, num_local_experts=m.num_experts)
        if cfg.architecture == "Qwen3MoeForCausalLM":
            out.update(num_experts=m.num_experts, moe_intermediate_size=m.moe_intermediate_size,
                       norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=m.decoder_sparse_step,
                       mlp_only_layers=list(m.mlp_only_layers))
    if cfg.mla is not None:
        out.update(_deepseek_fields(cfg))
    return out


def _deepseek_fields(cfg: ModelConfig) -> dict[str, Any]:
    """MLA and DeepSeek MoE fields (head counts as transformers' config classes hold them)."""
    m = cfg.mla
    out = dict(num_key_value_heads=cfg.num_heads, head_dim=m.qk_rope_head_dim, q_lora_rank=m.q_lora_rank,
               kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
               qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave)
    if cfg.moe is not None:
        e = cfg.moe
        out.update(n_routed_experts=e.num_experts, moe_intermediate_size=e.moe_intermediate_size,
                   norm_topk_prob=e.norm_topk_prob, scoring_func=e.scoring_func, topk_method=e.topk_method,
                   n_group=e.n_group, topk_group=e.topk_group, routed_scaling_factor=e.routed_scaling_factor,
                   n_shared_experts=e.n_shared_experts, first_k_dense_replace=e.first_k_dense_replace,
                   moe_layer_freq=e.moe_layer_freq)
    return out


def _int_if_whole(x: float | None):
    return int(x) if x is not None and float(x).is_integer() else x


def _host_arrays(cfg: ModelConfig, weights, dtype) -> dict[str, np.ndarray]:
    """Checkpoint name -> host array, walking the declaration in reverse."""
    model = get_model(cfg.architecture)
    nodes = {}
    for p in model.declare(cfg):
        node = weights
        for part in p.path.split("."):
            node = getattr(node, part)
        nodes[p] = node
    tensors, parts = {}, {}
    for p, node in nodes.items():
        node = node.w if isinstance(node, ExpertWeight) else node     # experts [L, X, in, out]
        if isinstance(node, Fp8Weight):     # e4m3 codes [L, in, out] and their scales, as stored
            codes = np.asarray(jax.device_get(node.w))
            codes = np.swapaxes(codes, -1, -2) if node.k_major else codes
            scales = np.asarray(jax.device_get(node.scale), np.float32)
            for pos, name in p.checkpoint_names():
                tensors[name] = np.ascontiguousarray(codes[pos].T)
                scale = scales[pos].T                     # [out or out/b, 1 or in/b]
                tensors[name.removesuffix("weight") + "weight_scale"] = np.ascontiguousarray(
                    scale.reshape(1) if scale.size == 1 else scale)
            continue
        x = np.asarray(jax.device_get(node.w if hasattr(node, "w") else node)).astype(dtype)
        for pos, name in p.checkpoint_names():
            t = np.ascontiguousarray(x[pos].T if p.transpose else x[pos])
            if p.rows is not None:       # a part of a fused tensor: joined below, in its rows
                parts.setdefault(name, []).append((p, t))
            else:
                tensors[name] = t
    for name, pieces in parts.items():
        axis = pieces[0][0].out_axis % pieces[0][1].ndim
        shape = list(pieces[0][1].shape)
        shape[axis] = max(p.rows[1] for p, _ in pieces)
        fused = np.empty(shape, pieces[0][1].dtype)
        for p, t in pieces:
            fused[(slice(None),) * axis + (p.row_slice(),)] = t
        tensors[name] = fused
    return tensors


def fp8_quantization_config(weights) -> dict[str, Any] | None:
    """compressed-tensors `quantization_config` (FP8 "float-quantized") for a model whose linear
    layers are `Fp8Weight`s (one granularity and activation scheme for all), None without any:
    what llm-compressor writes and `loader/fp8.py` reads back."""
    fp8 = [w for w in jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, Fp8Weight))
           if isinstance(w, Fp8Weight)]
    if not fp8:
        return None
    kinds = {(w.granularity, w.activations, w.block_size) for w in fp8}
    if len(kinds) != 1:
        raise ValueError(f"exporting FP8 weights needs one scale granularity and activation scheme for all "
                         f"layers, got {sorted(kinds)}")
    granularity, activations, block = kinds.pop()
    if activations == "static":
        raise ValueError("exporting static activation scales is not supported")
    weights_scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                      "strategy": granularity}
    if granularity == "block":
        weights_scheme["block_structure"] = [block, block]
    group = {"targets": ["Linear"], "weights": weights_scheme, "input_activations": None}
    if activations == "dynamic":
        group["input_activations"] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                      "strategy": "group" if granularity == "block" else "token",
                                      **({"group_size": block} if granularity == "block" else {})}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


def export_model(directory: str | os.PathLike, cfg: ModelConfig, tokenizer, weights=None, *,
                 dtype: str = "float32") -> list[str]:
    """Write the Hugging Face files (and `model.safetensors` when `weights` is given) into
    `directory` (created if missing). Returns the file names written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if cfg.architecture in _EXPORTED_AS:
        import dataclasses
        cfg = dataclasses.replace(cfg, architecture=_EXPORTED_AS[cfg.architecture])

    def dump(name, obj):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        written.append(name)

    config = hf_config(cfg, dtype)
    quantization = None if weights is None else fp8_quantization_config(weights)
    if quantization is not None:
        config["quantization_config"] = quantization
    dump("config.json", config)
    dump("generation_config.json", {"bos_token_id": cfg.bos_token_id,
                                    "eos_token_id": list(cfg.eos_token_ids) or None})
    tokenizer.backend.save(str(out / "tokenizer.json"))
    written.append("tokenizer.json")
    dump("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token, "unk_token": tokenizer.unk_token,
        "pad_token": tokenizer.pad_token, "add_bos_token": tokenizer.add_bos_token,
        "chat_template": tokenizer.chat_template,
        "model_max_length": cfg.max_position_embeddings})
    if weights is not None:
        from safetensors.numpy import save_file
        save_file(_host_arrays(cfg, weights, jnp.dtype(dtype)), str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        # safetensors creates its file 0600; give it the mode open() gave the files above
        # (0666 less the umask), so whoever may read the config may read the weights.
        os.chmod(out / "model.safetensors", (out / "config.json").stat().st_mode & 0o777)
        written.append("model.safetensors")
    return written


def truncate_layers(cfg: ModelConfig, weights, num_layers: int):
    """The model's first `num_layers` decoder layers with its final norm and head (LayerSkip-
    style early exit): a self-speculative draft model sharing the tokenizer. -> (cfg, weights)."""
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
    import dataclasses
    layers = jax.tree.map(lambda x: x[:num_layers], weights.layers)
    return (dataclasses.replace(cfg, num_layers=num_layers),
            dataclasses.replace(weights, layers=layers))
