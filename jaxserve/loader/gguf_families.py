"""GGUF files of the Gemma 2, Gemma 3 (text), Phi-3 and gpt-oss families, as llama.cpp's converter
(convert_hf_to_gguf.py) writes them: their metadata keys -> a config.json-like dict that
`ModelConfig.from_hf` reads with the family's own field reader, and their tensor names.

llama.cpp's conventions for these architectures (its gguf package's constants and tensor map):
  - q/k rows are NOT permuted (they rotate "neox"-style, as transformers does);
  - Gemma: every RMSNorm weight (`*norm.weight`, q/k norms included) is stored as w + 1, since
    llama.cpp's norm scales by the weight alone; `NORM_SHIFT` undoes it. The attention scale is not
    stored: llama.cpp uses 1/sqrt(hidden / heads) for the 27B models (Gemma 2: 46 layers, Gemma 3:
    62) and 1/sqrt(head_dim) otherwise; an `attention.scale` key, when present, wins. Sliding layers
    alternate from the first (Gemma 2) or every 6th layer is global (Gemma 3) unless
    `attention.sliding_window_pattern` lists them; Gemma 3's sliding layers rotate on
    `rope.freq_base_swa` (llama.cpp: 10000). Gemma 2's soft caps default to llama.cpp's 50 and 30.
  - Phi-3: fused `attn_qkv` (q, k, v rows) and `ffn_up` holding gate_up (gate rows, then up);
    rope turns `rope.dimension_count` dims of each head; LongRoPE shows as the tensors
    `rope_factors_long/short.weight` beside `rope.scaling.original_context_length`; a
    `attention.sliding_window` of 0 means none.
  - gpt-oss: the experts split into ffn_gate_exps / ffn_up_exps / ffn_down_exps (transposed,
    MXFP4 in released files; `joined` rebuilds transformers' tensors), the pre-MLP norm named
    post_attention_norm, sinks attn_sinks; YaRN from rope.scaling.* (untruncated, as gpt-oss's
    config.json says), the SwiGLU clamp from swiglu_clamp_exp (llama.cpp's 7.0 when absent).
"""

from __future__ import annotations

from typing import Any

import numpy as np

ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
         "gpt-oss": "GptOssForCausalLM"}

_PROJ = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}
_GEMMA2 = {**_PROJ, "input_layernorm.weight": "attn_norm.weight",
           "post_attention_layernorm.weight": "post_attention_norm.weight",
           "pre_feedforward_layernorm.weight": "ffn_norm.weight",
           "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
# HF layer tensor suffix -> GGUF `blk.N.` suffix, per HF architecture
NAMES = {
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": {**_GEMMA2, "self_attn.q_norm.weight": "attn_q_norm.weight",
                          "self_attn.k_norm.weight": "attn_k_norm.weight"},
    "Phi3ForCausalLM": {"input_layernorm.weight": "attn_norm.weight",
                        "self_attn.qkv_proj.weight": "attn_qkv.weight",
                        "self_attn.o_proj.weight": "attn_output.weight",
                        "post_attention_layernorm.weight": "ffn_norm.weight",
                        "mlp.gate_up_proj.weight": "ffn_up.weight",
                        "mlp.down_proj.weight": "ffn_down.weight"},
    "GptOssForCausalLM": {**{k: v for k, v in _PROJ.items() if k.startswith("self_attn.")},
                          **{f"self_attn.{p}_proj.bias": f"attn_{n}.bias"
                             for p, n in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))},
                          "input_layernorm.weight": "attn_norm.weight", "self_attn.sinks": "attn_sinks.weight",
                          "post_attention_layernorm.weight": "post_attention_norm.weight",
                          "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"},
}
# what llama.cpp's converter added to each norm weight (Gemma: 1, undone at load)
NORM_SHIFT = {"Gemma2ForCausalLM": 1.0, "Gemma3ForCausalLM": 1.0}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def hf_config(arch: str, field, tensors: dict, dequantize) -> dict[str, Any]:
    """The family fields of `arch` as config.json names them. `field(key, default)` reads
    `{arch}.{key}`; `tensors` maps GGUF tensor names to tensors, `dequantize` reads one."""
    out: dict[str, Any] = {}
    hidden, heads, layers = (int(field(k)) for k in ("embedding_length", "attention.head_count", "block_count"))
    head_dim = int(field("attention.key_length", hidden // heads))
    window = int(field("attention.sliding_window", 0) or 0)
    if arch.startswith("gemma"):
        scale = field("attention.scale")
        # the key holds an f32 1/sqrt(s): s is an integer in every released model, rounding is safe
        out["query_pre_attn_scalar"] = (round(1.0 / float(scale) ** 2, 3) if scale else
                                        hidden // heads if layers == _LAYERS_27B[arch] else head_dim)
        caps = (50.0, 30.0) if arch == "gemma2" else (None, None)
        for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), caps):
            out[key] = field(key, default)
        out["sliding_window"] = window or None
        pattern = field("attention.sliding_window_pattern")
        if not window:
            out["layer_types"] = ["full_attention"] * layers
        elif isinstance(pattern, list):       # per layer: true slides
            out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern:
            out["sliding_window_pattern"] = int(pattern)
        if arch == "gemma3":
            out["rope_local_base_freq"] = float(field("rope.freq_base_swa", 10000.0))
            out["rope_theta"] = float(field("rope.freq_base", 1000000.0))
            if field("rope.scaling.type") == "linear":     # gguf.py refuses the other types
                out["rope_scaling"] = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    elif arch == "gpt-oss":
        out.update(num_local_experts=int(field("expert_count")), num_experts_per_tok=int(field("expert_used_count")),
                   intermediate_size=int(field("expert_feed_forward_length")), sliding_window=window or None,
                   rope_theta=float(field("rope.freq_base", 150000.0)))
        clamp = field("swiglu_clamp_exp")       # llama.cpp: 7.0, gpt-oss's own value
        if clamp is not None:
            out["swiglu_limit"] = float(clamp[0] if isinstance(clamp, list) else clamp)
        if field("rope.scaling.type") == "yarn":
            # gpt-oss was trained with YaRN's untruncated ramp (its config.json: truncate false)
            original = int(field("rope.scaling.original_context_length", 4096))    # the converter's default
            out["rope_scaling"] = {"rope_type": "yarn", "factor": float(field("rope.scaling.factor")),
                                   "original_max_position_embeddings": original,
                                   "beta_fast": float(field("rope.scaling.yarn_beta_fast", 32.0)),
                                   "beta_slow": float(field("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    else:   # phi3
        out["sliding_window"] = window or None
        rope_dims = field("rope.dimension_count")
        if rope_dims is not None:
            out["partial_rotary_factor"] = int(rope_dims) / head_dim
        factors = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in tensors]
        if len(factors) == 1:
            raise ValueError(f"GGUF file has the LongRoPE tensor {factors[0]} but not its long/short partner")
        if factors:
            original = field("rope.scaling.original_context_length")
            if original is None:
                raise ValueError("GGUF file has LongRoPE factor tensors but no "
                                 "phi3.rope.scaling.original_context_length")
            out["rope_scaling"] = {
                "rope_type": "longrope", "original_max_position_embeddings": int(original),
                **{f"{kind}_factor": [float(x) for x in np.asarray(dequantize(tensors[f"rope_factors_{kind}.weight"]))
                                      .reshape(-1)] for kind in ("long", "short")}}
            attn_factor = field("rope.scaling.attn_factor")
            if attn_factor is not None:
                out["rope_scaling"]["attention_factor"] = float(attn_factor)
    out["head_dim"] = head_dim
    return out


# gpt-oss: transformers keeps a layer's experts as gate_up_proj [X, in, 2F] (gate columns even, up
# odd) and down_proj [X, F, out]; llama.cpp's converter splits and transposes them into
# ffn_gate_exps / ffn_up_exps [X, F, in] and ffn_down_exps [X, out, F] (biases likewise split)
_JOINED = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
           "mlp.experts.down_proj_bias")


def is_joined(architecture: str, hf_name: str) -> bool:
    return architecture == "GptOssForCausalLM" and hf_name.split(".", 3)[-1] in _JOINED


def joined(hf_name: str, read) -> np.ndarray:
    """gpt-oss expert tensor `hf_name` in transformers' layout, from llama.cpp's tensors
    (`read(gguf_name)` -> f32 array)."""
    _, _, layer, suffix = hf_name.split(".", 3)
    blk = f"blk.{layer}."
    if suffix == "mlp.experts.down_proj":
        return np.ascontiguousarray(read(blk + "ffn_down_exps.weight").swapaxes(1, 2))
    if suffix == "mlp.experts.down_proj_bias":
        return read(blk + "ffn_down_exps.bias")
    bias = suffix.endswith("_bias")
    gate, up = (read(f"{blk}ffn_{k}_exps.{'bias' if bias else 'weight'}") for k in ("gate", "up"))
    if not bias:
        gate, up = gate.swapaxes(1, 2), up.swapaxes(1, 2)
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), np.float32)
    out[..., 0::2], out[..., 1::2] = gate, up
    return out
