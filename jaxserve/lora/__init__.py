"""Multi-LoRA serving: `LoRARequest` (host, no jax) names an adapter; `peft.py` reads a PEFT
checkpoint into host arrays; `weight.py` is the `LoraWeight` type `linear` dispatches on (a base
weight plus a device slot table of adapters); `manager.py` moves adapters between host copies
and device slots (LRU both ways). Only the request type is imported here, so host code
(jaxserve.core) can name it without importing jax."""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
