"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a sparse mixture-of-experts MLP
(`block_sparse_moe`, experts w1 = gate, w3 = up, w2 = down) in every layer; the forward pass is
`llama.py`'s, only the checkpoint names are this family's."""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.llama import build, compute_logits, forward  # noqa: F401  (the family API)
from jaxserve.models.params import Param

MOE_NAMES = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}.w1.weight",
             "block_sparse_moe.experts.{expert}.w3.weight",
             "block_sparse_moe.experts.{expert}.w2.weight")


def declare(cfg: ModelConfig) -> list[Param]:
    return llama.declare(cfg, MOE_NAMES)
