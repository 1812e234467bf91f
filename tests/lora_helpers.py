"""Tiny random checkpoints and PEFT adapters for the LoRA tests, and the transformers + peft
oracle (CPU torch, f32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_tiny(path: Path, family: str = "llama", seed: int = 0) -> Path:
    """A random tiny Llama or Qwen3 checkpoint (f32 safetensors) with a synthetic tokenizer."""
    import torch
    import transformers

    from jaxserve.tokenizer.tokenizer import Tokenizer
    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)
    else:
        cfg = transformers.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():       # O(1) logits: random init's 0.02 std gives near-flat ones
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(str(path), safe_serialization=True)
    Tokenizer.synthetic(SMALL["vocab_size"]).backend.save(str(path / "tokenizer.json"))
    return path


def write_adapter(model, path: Path, *, r: int = 8, alpha: float = 16, targets=("q_proj", "v_proj"),
                  rslora: bool = False, seed: int = 1) -> Path:
    """A PEFT adapter for the transformers `model` with random nonzero A and B."""
    import peft
    import torch
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                          init_lora_weights=False, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    pm.save_pretrained(str(path))
    pm.unload()     # the base model back without LoRA layers
    return path


def hf_model(path: Path, gguf_file: str | None = None):
    import torch
    import transformers
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()


def hf_logprobs(model, ids: list[int], adapter: Path | None) -> np.ndarray:
    """log_softmax of the logits [len(ids), V] under `adapter` (None: the base)."""
    import peft
    import torch
    m = peft.PeftModel.from_pretrained(model, str(adapter)) if adapter is not None else model
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0].double()
    if adapter is not None:
        m.unload()
    return torch.log_softmax(logits, -1).numpy()


def read_config(path: Path) -> dict:
    return json.loads((path / "adapter_config.json").read_text())
