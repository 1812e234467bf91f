"""`LoraManager`: adapters between disk, host copies and device slots.

- `load(request)` reads and validates a PEFT checkpoint into a host copy (on the caller's thread,
  when a request arrives, so a step never waits on disk); up to `max_cpu_loras` host copies are
  kept, least recently used dropped first (a dropped one is read again when next needed).
- `activate(weights, requests)` gives each adapter of a step a device slot (1..max_loras),
  evicting the least recently used adapters the step does not use, and writes the new ones'
  padded A/B into every `LoraWeight`'s slot table (one compiled update, donated). The
  scheduler never puts more than `max_loras` distinct adapters in a step.
- `remove(name)` forgets an adapter (its slot is reused when needed).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict

import jax
import numpy as np

from jaxserve.lora.peft import LoraAdapter, load_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.weight import LoraWeight, lora_paths, wrap_weights

logger = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, params, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        self.params = params
        self.max_loras = max_loras
        self.max_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()   # name -> host copy, LRU first
        self._slots: OrderedDict[str, int] = OrderedDict()          # name -> device slot, LRU first
        self._slot_request: dict[int, LoRARequest] = {}
        self._write = None
        self.num_device_loads = 0
        # load() runs on request threads (AsyncLLM reads adapters off the engine loop) while
        # the engine thread activates; the host cache and slot map change under this lock.
        self._lock = threading.RLock()

    # -- host copies ---------------------------------------------------------------------------
    def load(self, request: LoRARequest) -> LoraAdapter:
        """The host copy of `request`'s adapter (read and validated on a miss); ValueError naming
        the field when the checkpoint cannot be served."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            have = self._host.get(request.lora_name)
            if have is not None and have.request.lora_path == request.lora_path:
                self._host.move_to_end(request.lora_name)
                return have
        adapter = load_adapter(request, self.params, self.max_rank)   # disk, outside the lock
        with self._lock:
            slot = self._slots.get(request.lora_name)
            if slot is not None and self._slot_request[slot].lora_path != request.lora_path:
                self._forget_slot(request.lora_name)       # same name, another checkpoint
            self._host[request.lora_name] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        return adapter

    def remove(self, name: str) -> bool:
        """Drop `name`'s host copy (False when there was none). Its device slot stays until
        another adapter needs it, so requests still running under it finish unchanged."""
        with self._lock:
            return self._host.pop(name, None) is not None

    def _forget_slot(self, name: str) -> None:
        slot = self._slots.pop(name, None)
        if slot is not None:
            self._slot_request.pop(slot, None)

    @property
    def host_loaded(self) -> list[str]:
        return list(self._host)

    @property
    def device_loaded(self) -> dict[str, int]:
        return dict(self._slots)

    # -- device slots --------------------------------------------------------------------------
    def activate(self, weights, requests) -> tuple[object, dict[str, int]]:
        """(weights with every adapter of `requests` in a slot, lora_name -> slot)."""
        with self._lock:
            return self._activate(weights, requests)

    def _activate(self, weights, requests):
        wanted = list(dict.fromkeys(r.lora_name for r in requests if r is not None))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step holds {len(wanted)} adapters, more than max_loras "
                             f"{self.max_loras}")
        by_name = {r.lora_name: r for r in requests if r is not None}
        for name in wanted:
            if name in self._slots:
                self._slots.move_to_end(name)
                continue
            used = set(self._slots.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if not free:       # evict the least recently used adapter this step does not use
                victim = next(n for n in self._slots if n not in wanted)
                free = [self._slots.pop(victim)]
            slot = free[0]
            weights = self._write_slot(weights, slot, self.load(by_name[name]))
            self._slots[name] = slot
            self._slot_request[slot] = by_name[name]
        return weights, {n: self._slots[n] for n in wanted}

    def _padded(self, weights, adapter: LoraAdapter | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """path -> (a [L, in, R], b [L, R, out]) in the slot tables' dtype, zero-padded to R."""
        out = {}
        for path, w in lora_paths(weights).items():
            *lead, _, n_in, R = w.a.shape
            n_out = w.b.shape[-1]
            a = np.zeros((*lead, n_in, R), w.a.dtype)
            b = np.zeros((*lead, R, n_out), w.b.dtype)
            if adapter is not None and path in adapter.weights:
                ha, hb = adapter.weights[path]
                a[..., :ha.shape[-1]] = ha
                b[..., :hb.shape[-2], :] = hb
            out[path] = (a, b)
        return out

    def _write_slot(self, weights, slot: int, adapter: LoraAdapter | None):
        tables = {p: (w.a, w.b) for p, w in lora_paths(weights).items()}
        if self._write is None:
            shardings = jax.tree.map(lambda x: x.sharding, tables)

            def write(tables, slot, new):
                return {p: tuple(jax.lax.dynamic_update_index_in_dim(t, n.astype(t.dtype), slot, t.ndim - 3)
                                 for t, n in zip(tables[p], new[p])) for p in tables}
            self._write = jax.jit(write, donate_argnums=0, out_shardings=shardings)
        new = self._write(tables, np.int32(slot), self._padded(weights, adapter))
        if adapter is not None:
            self.num_device_loads += 1
        return _replace_tables(weights, new)

    def warmup(self, weights):
        """Compile the slot write (zeros into slot 0, which holds zeros) so no adapter load
        compiles while serving. Writes into copies: `weights` stays valid for its other holders
        (the engine may build another runner from it)."""
        copies = _replace_tables(weights, {p: (w.a.copy(), w.b.copy()) for p, w in lora_paths(weights).items()})
        return self._write_slot(copies, 0, None)


def setup_lora(args, cfg, weights, dtype, mesh=None):
    """(weights with LoRA slot tables, LoraManager) for EngineArgs with enable_lora, else
    (weights, None)."""
    if not args.enable_lora:
        return weights, None
    from jaxserve.models import get_model
    max_loras, max_rank, max_cpu = args.lora_limits()
    weights = wrap_weights(weights, max_loras, max_rank, dtype, mesh)
    if not lora_paths(weights):
        raise ValueError(f"enable_lora: {cfg.architecture} has no projection LoRA can be served on")
    manager = LoraManager(get_model(cfg.architecture).declare(cfg), max_loras=max_loras,
                          max_lora_rank=max_rank, max_cpu_loras=max_cpu)
    logger.info("LoRA: %d device slots of rank %d, %d host copies, on %s", max_loras, max_rank,
                max_cpu, ", ".join(lora_paths(weights)))
    return weights, manager


def _replace_tables(weights, tables: dict):
    layers = weights.layers
    changes = {}
    for path, (a, b) in tables.items():
        name = path.split(".", 1)[1]
        w: LoraWeight = getattr(layers, name)
        changes[name] = dataclasses.replace(w, a=a, b=b)
    return dataclasses.replace(weights, layers=dataclasses.replace(layers, **changes))
