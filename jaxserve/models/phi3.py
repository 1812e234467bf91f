"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): Llama's decoder with fused checkpoint
tensors, split at load: `self_attn.qkv_proj` holds q, k and v's rows (in that order) and
`mlp.gate_up_proj` the gate's rows then the up projection's. Rope may turn only the first
head_dim * partial_rotary_factor dims (Phi-4-mini: 0.75) and use LongRoPE scaling (rope_type
"longrope" / "su": short or long factors, chosen once by max_model_len as vLLM does;
layers/rotary.py). The forward pass is llama.py's.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.llama import build, compute_logits, forward  # noqa: F401  (the family API)
from jaxserve.models.params import Param

QKV = "self_attn.qkv_proj.weight"
GATE_UP = "mlp.gate_up_proj.weight"


def declare(cfg: ModelConfig) -> list[Param]:
    """llama.py's declaration with wq/wk/wv as row ranges of qkv_proj and w_gate/w_up of
    gate_up_proj (each a matrix [out, in] in the checkpoint, so the ranges are output rows)."""
    HD, KD, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    fused = {"layers.wq": (QKV, (0, HD)), "layers.wk": (QKV, (HD, HD + KD)),
             "layers.wv": (QKV, (HD + KD, HD + 2 * KD)),
             "layers.w_gate": (GATE_UP, (0, F)), "layers.w_up": (GATE_UP, (F, 2 * F))}
    if cfg.attention_bias:
        raise ValueError("Phi3ForCausalLM: attention_bias is not supported (Phi-3 checkpoints have no qkv bias)")
    params = []
    for p in llama.declare(cfg):
        if p.path in fused:
            name, rows = fused[p.path]
            p = dataclasses.replace(p, checkpoint="model.layers.{layer}." + name, rows=rows)
        params.append(p)
    return params
