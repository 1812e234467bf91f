"""Model implementations, keyed by the Hugging Face `architectures` name."""

from jaxserve.models import llama

MODEL_REGISTRY = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "Qwen3ForCausalLM": llama,
}


def get_model(architecture: str):
    """The module holding `forward` and `compute_logits` for this architecture."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"Unsupported architecture {architecture!r}; jaxserve supports "
                         f"{', '.join(MODEL_REGISTRY)}") from None
