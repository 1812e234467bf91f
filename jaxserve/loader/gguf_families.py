"""GGUF files of the Gemma 2, Gemma 3 (text), Phi-3, gpt-oss and DeepSeek V2/V3 families, as llama.cpp's converter
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
  - DeepSeek V2 / V2-Lite / V3 (`deepseek2`): MLA as multi-query attention over the latent, so
    newer converters write head_count_kv 1, key_length / value_length kv_lora_rank + rope dims /
    kv_lora_rank and the per-head sizes as key_length_mla (qk_nope + qk_rope) / value_length_mla
    (v_head_dim); in older files key_length / value_length hold those per-head sizes (and
    head_count_kv the head count; either way the model's cache is the one latent). The rope dims
    (rope.dimension_count) stay in DeepSeek's adjacent pairs (llama.cpp's "norm" rope: nothing is
    permuted). kv_b_proj [H * (dn + dv), r] is attn_kv_b in older files; newer ones split it per
    head into attn_k_b [H, r, dn] (transposed) and attn_v_b [H, dv, r], joined back here. Experts
    are stacked (ffn_{gate,up,down}_exps [X, out, in]; one expert is sliced before dequantizing),
    shared experts ffn_*_shexp, the router ffn_gate_inp, V3's e_score_correction_bias
    exp_probs_b.bias. MoE keys: expert_count (absent: all layers dense), expert_used_count,
    expert_feed_forward_length, leading_dense_block_count (first_k_dense_replace),
    expert_shared_count, expert_weights_scale (routed_scaling_factor, 1 when absent),
    expert_weights_norm (norm_topk_prob, false when absent), expert_gating_func (1 softmax,
    2 sigmoid; softmax when absent, as llama.cpp reads V2 files) and expert_group_count /
    expert_group_used_count (n_group / topk_group, 1 when absent: older files route ungrouped, as
    llama.cpp did). Sigmoid routes as V3 (noaux_tc, DeepseekV3ForCausalLM), softmax as V2 (greedy,
    group_limited_greedy with groups). YaRN: rope.scaling.factor / original_context_length /
    yarn_beta_* (32 / 1 when absent), and yarn_log_multiplier = 0.1 * mscale_all_dim; the
    converter drops mscale and llama.cpp leaves cos / sin unscaled, so mscale = mscale_all_dim (as
    DeepSeek's configs have it); without yarn_log_multiplier neither the scores nor cos / sin are
    scaled (attention_factor 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
         "gpt-oss": "GptOssForCausalLM", "deepseek2": "DeepseekV2ForCausalLM"}   # deepseek2: V3 by its routing

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
_DEEPSEEK = {**{k: v for k, v in _PROJ.items() if k not in ("self_attn.k_proj.weight", "self_attn.v_proj.weight")},
             "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
             "self_attn.q_b_proj.weight": "attn_q_b.weight",
             "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
             "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
             **{f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}}
NAMES["DeepseekV2ForCausalLM"] = NAMES["DeepseekV3ForCausalLM"] = _DEEPSEEK
# what llama.cpp's converter added to each norm weight (Gemma: 1, undone at load)
NORM_SHIFT = {"Gemma2ForCausalLM": 1.0, "Gemma3ForCausalLM": 1.0}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def hf_config(arch: str, field, tensors: dict, dequantize) -> dict[str, Any]:
    """The family fields of `arch` as config.json names them. `field(key, default)` reads
    `{arch}.{key}`; `tensors` maps GGUF tensor names to tensors, `dequantize` reads one."""
    if arch == "deepseek2":
        return _deepseek2_config(field)
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


def _deepseek2_config(field) -> dict[str, Any]:
    """DeepSeek's config.json fields from deepseek2 metadata (module doc)."""
    def need(key):
        value = field(key)
        if value is None:
            raise ValueError(f"GGUF file lacks the metadata field deepseek2.{key}")
        return value

    dr, r = int(need("rope.dimension_count")), int(need("attention.kv_lora_rank"))
    if field("attention.key_length_mla") is not None or field("attention.value_length_mla") is not None:
        qk, dv = int(need("attention.key_length_mla")), int(need("attention.value_length_mla"))
    else:       # older converters: the per-head sizes as key_length / value_length
        qk, dv = int(need("attention.key_length")), int(need("attention.value_length"))
    if qk <= dr:
        raise ValueError(f"the per-head key length ({qk}) must exceed rope.dimension_count ({dr})")
    q_lora = field("attention.q_lora_rank")
    out: dict[str, Any] = {"q_lora_rank": None if not q_lora else int(q_lora), "kv_lora_rank": r,
                           "qk_nope_head_dim": qk - dr, "qk_rope_head_dim": dr, "v_head_dim": dv,
                           "rope_interleave": True}
    sigmoid = False
    if field("expert_count"):
        gating = int(field("expert_gating_func", 1) or 1)       # llama.cpp: V2 files have none, softmax
        if gating not in (1, 2):
            raise ValueError(f"deepseek2.expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
        sigmoid = gating == 2
        groups, used = int(field("expert_group_count", 1) or 1), int(field("expert_group_used_count", 1) or 1)
        out.update(n_routed_experts=int(field("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")),
                   first_k_dense_replace=int(need("leading_dense_block_count")),
                   n_shared_experts=int(need("expert_shared_count")),
                   routed_scaling_factor=float(field("expert_weights_scale", 1.0) or 1.0),
                   norm_topk_prob=bool(field("expert_weights_norm", False)),
                   scoring_func="sigmoid" if sigmoid else "softmax",
                   topk_method="noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
                   n_group=groups, topk_group=used)
    out["architectures"] = ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"]
    if field("rope.scaling.type") == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(need("rope.scaling.factor")),
                   "original_max_position_embeddings": int(need("rope.scaling.original_context_length"))}
        for key in ("beta_fast", "beta_slow"):
            if field(f"rope.scaling.yarn_{key}") is not None:
                scaling[key] = float(field(f"rope.scaling.yarn_{key}"))
        log_mul = field("rope.scaling.yarn_log_multiplier")
        if log_mul:     # an f32 of 0.1 * mscale_all_dim (0.707 or 1 in released configs)
            scaling["mscale"] = scaling["mscale_all_dim"] = round(float(log_mul) / 0.1, 5)
        else:           # no attention scaling, and (llama.cpp) cos / sin not scaled either
            scaling["attention_factor"] = 1.0
        out["rope_scaling"] = scaling
    return out


# gpt-oss: transformers keeps a layer's experts as gate_up_proj [X, in, 2F] (gate columns even, up
# odd) and down_proj [X, F, out]; llama.cpp's converter splits and transposes them into
# ffn_gate_exps / ffn_up_exps [X, F, in] and ffn_down_exps [X, out, F] (biases likewise split)
_JOINED = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
           "mlp.experts.down_proj_bias")


def is_joined(architecture: str, hf_name: str) -> bool:
    suffix = hf_name.split(".", 3)[-1]
    if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return suffix == "self_attn.kv_b_proj.weight" or suffix.startswith("mlp.experts.")
    return architecture == "GptOssForCausalLM" and suffix in _JOINED


def joined(hf_name: str, read, has=None, read_expert=None) -> np.ndarray:
    """gpt-oss expert tensor, or DeepSeek kv_b_proj / one expert's matrix, `hf_name` in
    transformers' layout, from llama.cpp's tensors (`read(gguf_name)` -> f32 array; `has(gguf_name)`;
    `read_expert(gguf_name, expert)` -> that expert's f32 matrix of a stacked tensor)."""
    _, _, layer, suffix = hf_name.split(".", 3)
    blk = f"blk.{layer}."
    if suffix == "self_attn.kv_b_proj.weight":      # DeepSeek
        if has(blk + "attn_kv_b.weight") or not has(blk + "attn_k_b.weight"):
            return read(blk + "attn_kv_b.weight")
        k_b, v_b = read(blk + "attn_k_b.weight"), read(blk + "attn_v_b.weight")    # [H, r, dn], [H, dv, r]
        if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
            raise ValueError(f"{blk}attn_k_b / attn_v_b have shapes {k_b.shape} / {v_b.shape}, expected "
                             "[heads, kv_lora_rank, qk_nope] / [heads, v_head_dim, kv_lora_rank]")
        kv_b = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)      # [H, dn + dv, r]
        return kv_b.reshape(-1, kv_b.shape[-1])
    if suffix.startswith("mlp.experts.") and read_expert is not None and suffix.split(".")[2].isdigit():
        _, _, expert, proj, _ = suffix.split(".")                    # mlp.experts.E.gate_proj.weight
        return read_expert(f"{blk}ffn_{proj.removesuffix('_proj')}_exps.weight", int(expert))
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
