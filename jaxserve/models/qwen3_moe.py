"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norm, explicit head_dim) with a
mixture-of-experts MLP in every layer, or (`decoder_sparse_step` > 1, `mlp_only_layers`) in some
layers and a dense MLP in the others; the forward pass is `llama.py`'s, only the checkpoint names
of the router and experts are this family's."""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.llama import build, compute_logits, forward  # noqa: F401  (the family API)
from jaxserve.models.params import Param

MOE_NAMES = ("mlp.gate.weight", "mlp.experts.{expert}.gate_proj.weight",
             "mlp.experts.{expert}.up_proj.weight", "mlp.experts.{expert}.down_proj.weight")


def declare(cfg: ModelConfig) -> list[Param]:
    return llama.declare(cfg, MOE_NAMES)
