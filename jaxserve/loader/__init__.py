"""Checkpoint readers (Hugging Face safetensors, GGUF, dummy weights) -> model weights."""
