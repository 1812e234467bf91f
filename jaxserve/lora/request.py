"""`LoRARequest`: which adapter a request runs under (vLLM's class and field names).

Host side, no jax. Equal requests name the same adapter; `lora_name` is what the server's
`model` field says and what the prefix-cache hash is keyed on, `lora_int_id` (> 0) is its
numeric id, `lora_path` a folder holding a PEFT checkpoint (`adapter_config.json` +
`adapter_model.safetensors`).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str | os.PathLike) or not os.fspath(self.lora_path):
            raise ValueError(f"lora_path must be a folder holding a PEFT adapter, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    # vLLM's aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
