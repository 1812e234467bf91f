"""The model registry: the checkpoint's `architectures` name -> the module of its family. The one
list of supported architectures; importing it imports no jax (configs are checked host-side),
`get_model` imports the family's module on first use.

A family module provides `declare(cfg) -> list[Param]`, `build(cfg, arrays) -> weights`,
`forward(weights, cache, tokens, positions, meta, *, cfg, backend, kv_quantize, plan, each_layer)` and
`compute_logits(weights, hidden)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# architectures name -> family module
MODELS: dict[str, str] = {
    "LlamaForCausalLM": "jaxserve.models.llama",
    "MistralForCausalLM": "jaxserve.models.llama",
    "Qwen2ForCausalLM": "jaxserve.models.llama",
    "Qwen3ForCausalLM": "jaxserve.models.llama",
    "Qwen3MoeForCausalLM": "jaxserve.models.qwen3_moe",
    "MixtralForCausalLM": "jaxserve.models.mixtral",
    "Gemma2ForCausalLM": "jaxserve.models.gemma",
    "Gemma3ForCausalLM": "jaxserve.models.gemma",
    "Gemma3ForConditionalGeneration": "jaxserve.models.gemma",     # its text model
    "Phi3ForCausalLM": "jaxserve.models.phi3",                      # Phi-3, Phi-3.5, Phi-4-mini
    "GptOssForCausalLM": "jaxserve.models.gpt_oss",
    "DeepseekV2ForCausalLM": "jaxserve.models.deepseek",            # V2, V2-Lite (MLA, DeepSeek MoE)
    "DeepseekV3ForCausalLM": "jaxserve.models.deepseek",            # V3, R1
}
SUPPORTED_ARCHITECTURES = tuple(MODELS)


def check_architecture(architecture: str) -> None:
    if architecture not in MODELS:
        raise ValueError(f"Unsupported architecture {architecture!r}; jaxserve supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def get_model(architecture: str) -> ModuleType:
    """The module holding this architecture's declaration and forward pass."""
    check_architecture(architecture)
    return importlib.import_module(MODELS[architecture])
