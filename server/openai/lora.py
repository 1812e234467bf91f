"""LoRA adapters as models of the server (vLLM's shapes): `--lora-modules name=path` (or the JSON
form `{"name", "path", "base_model_name"}`) names adapters at start; a request's `model` picks
one; `/v1/models` lists them with the base model as `parent`; `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (`{"lora_name", "lora_path"}`) add and remove adapters at run time when
the server runs with `--allow-runtime-lora-updating` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading

from pydantic import BaseModel, Field

from jaxserve.lora import LoRARequest
from jaxserve.server.openai.protocol import OpenAIError, model_card, validate_request


class LoadLoRAAdapterRequest(BaseModel):
    """The body of `POST /v1/load_lora_adapter` (vLLM's shape); also its /openapi.json schema."""
    lora_name: str = Field(min_length=1, description="the name requests give as `model`")
    lora_path: str = Field(min_length=1, description="a PEFT adapter directory")
    base_model_name: str | None = Field(None, description="shown as the adapter's `parent` in /v1/models")


class UnloadLoRAAdapterRequest(BaseModel):
    """The body of `POST /v1/unload_lora_adapter` (vLLM's shape)."""
    lora_name: str = Field(min_length=1)


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """One --lora-modules value -> (name, path, base_model_name)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON ({e})") from None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str) \
                or not d["name"] or not d["path"]:
            raise argparse.ArgumentTypeError('the JSON form needs string "name" and "path" '
                                             '(and optionally "base_model_name")')
        unknown = set(d) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown key(s) {sorted(unknown)}; allowed: name, path, "
                                             "base_model_name")
        return d["name"], d["path"], d.get("base_model_name")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return name, path, None


class LoraModels:
    """The adapters the server knows by name (thread-safe: loads run in worker threads)."""

    def __init__(self, engine, base_name: str, allow_runtime_updating: bool = False):
        self.engine = engine            # an AsyncLLM or a DataParallelLLM (loads reach every replica)
        self.base_name = base_name
        self.allow_runtime_updating = allow_runtime_updating
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name else None

    def __contains__(self, name) -> bool:
        return name in self._by_name

    def add_now(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Read and check the adapter (ValueError naming the field), then serve it as `name`."""
        with self._lock:
            if name in self._by_name:
                raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.",
                                  param="lora_name")
            request = LoRARequest(name, next(self._ids), path, base_model_name)
        self.engine.load_lora(request)
        with self._lock:
            self._by_name[name] = request
        return request

    def cards(self, root: str, max_model_len: int) -> list[dict]:
        cards = []
        for r in list(self._by_name.values()):
            card = model_card(r.lora_name, r.lora_path, max_model_len)
            card["parent"] = r.base_model_name or self.base_name
            cards.append(card)
        return cards

    # -- the runtime endpoints -----------------------------------------------------------------
    def _check_allowed(self) -> None:
        if not self.allow_runtime_updating:
            raise OpenAIError(404, "Loading and unloading LoRA adapters at run time is off: start the "
                                   "server with --enable-lora --allow-runtime-lora-updating",
                              "NotFoundError")

    async def load(self, body: dict) -> str:
        self._check_allowed()
        req = validate_request(LoadLoRAAdapterRequest, body)
        name, path = req.lora_name, req.lora_path
        if name == self.base_name:
            raise OpenAIError(400, f"lora_name {name!r} is the base model's name", param="lora_name")
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.add_now, name, path,
                                                             req.base_model_name)
        except OpenAIError:
            raise
        except ValueError as e:
            # the checkpoint at lora_path is what was refused (the message names its field)
            raise OpenAIError(400, str(e), param="lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: dict) -> str:
        self._check_allowed()
        name = validate_request(UnloadLoRAAdapterRequest, body).lora_name
        with self._lock:
            request = self._by_name.pop(name, None)
        if request is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                              param="lora_name")
        self.engine.remove_lora(name)
        return f"Success: LoRA adapter '{name}' removed successfully."


async def lora_models_at_start(llm, base_name: str, modules, allow_runtime_updating: bool = False):
    """LoraModels with every --lora-modules adapter read (a bad one raises ValueError naming
    it), or None when the engine runs without enable_lora."""
    if not llm.engine.args.enable_lora:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    lora = LoraModels(llm, base_name, allow_runtime_updating)
    for name, path, base in modules or ():
        try:
            await asyncio.get_running_loop().run_in_executor(None, lora.add_now, name, path, base)
        except (ValueError, OpenAIError) as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}") from None
    return lora
