"""`LoraWeight`: a base weight plus a device slot table of adapters, a weight type for `linear`.

    y = linear(x, base) + (x @ a[slot]) @ b[slot]      per token, slot = token_slots[t]

Slot 0 holds zeros (tokens of requests without an adapter, and padding); adapters occupy slots
1..max_loras. The compute is SGMV-style: `lora_delta` loops over the adapters the step uses,
each computing x @ a[slot] @ b[slot] for every token and keeping its own tokens' rows, so a
step's cost grows with its tokens, the rank and the adapters it uses, never with the number of
adapters loaded (no one-hot over slots; XLA's CPU ragged_dot would be a masked dense dot over
every slot). A step with no adapter token skips the LoRA term (`lax.cond`).

`token_slots` is not part of the loaded weights: the step binds it (`bind_token_slots`) from
its inputs, broadcast over the stacked layers so `lax.scan` slices it with the rest; model code
is unchanged. B carries the adapter's scale (folded in at load).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.layers.linear import DenseWeight, linear, register_linear
from jaxserve.lora.peft import LORA_TARGETS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraWeight:
    base: Any                          # any weight type [..., in, out]
    a: jax.Array                       # [..., slots, in, r]
    b: jax.Array                       # [..., slots, r, out] (scale folded in)
    token_slots: jax.Array | None = None   # [..., T] i32, bound per step; None: base only

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, in], a [S, in, r], b [S, r, out], slots [T] -> [T, out] f32: x[t] @ a[s] @ b[s].

    A loop over the adapters this step uses (slot 0, no adapter, is skipped): each multiplies
    every token by its A and B, and keeps the rows of its own tokens. The trip count is the
    number of distinct adapters in the step, never the slots loaded; gathering each token's own
    A and B instead ([T, in, r] + [T, r, out] copies a linear) cost ~20% of a decode step at
    batch 32 with the GGUF weights kept quantized (RESULTS.md)."""
    S = a.shape[0]
    pref = jnp.float32
    present = jnp.zeros(S, bool).at[slots].set(True).at[0].set(False)
    used = jnp.argsort(~present, stable=True)           # the used slots first, in slot order

    def one(i, acc):
        s = used[i]
        xa = jnp.einsum("ti,ir->tr", x, a[s], preferred_element_type=pref)
        d = jnp.einsum("tr,ro->to", xa.astype(b.dtype), b[s], preferred_element_type=pref)
        return jnp.where((slots == s)[:, None], d, acc)

    return jax.lax.fori_loop(0, jnp.sum(present), one, jnp.zeros((x.shape[0], b.shape[-1]), pref))


@register_linear(LoraWeight)
def _lora(x: jax.Array, weight: LoraWeight, out_dtype=None) -> jax.Array:
    y = linear(x, weight.base, out_dtype=out_dtype)
    slots = weight.token_slots
    if slots is None:
        return y
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if slots.shape != (x2.shape[0],):
        raise ValueError(f"LoRA token slots {slots.shape} do not match the activations' tokens {lead}")

    def with_lora(y):
        d = lora_delta(x2, weight.a, weight.b, slots)
        return (y.astype(jnp.float32) + d.reshape(*lead, -1)).astype(y.dtype)

    return jax.lax.cond(jnp.any(slots > 0), with_lora, lambda y: y, y)


def _is_lora(x) -> bool:
    return isinstance(x, LoraWeight)


def bind_token_slots(weights, token_slots: jax.Array):
    """The model pytree with every LoraWeight's `token_slots` set to `token_slots` [T],
    broadcast over its stacked leading axes."""
    def bind(w):
        if not _is_lora(w):
            return w
        lead = w.a.shape[:-3]
        return dataclasses.replace(w, token_slots=jnp.broadcast_to(token_slots, (*lead, token_slots.shape[0])))
    return jax.tree.map(bind, weights, is_leaf=_is_lora)


def _slot_sharding(base, dim: int, mesh) -> NamedSharding | None:
    """A's sharding splits `in` like the base's input dim (dim -2), B's `out` like its output dim
    (dim -1); everything else replicated. None when the base is not a placed DenseWeight."""
    w = base.w if isinstance(base, DenseWeight) else None
    if w is None or not isinstance(getattr(w, "sharding", None), NamedSharding):
        return None if mesh is None else NamedSharding(mesh, PartitionSpec())
    spec = tuple(w.sharding.spec) + (None,) * (w.ndim - len(w.sharding.spec))
    lead = (None,) * (w.ndim - 2)
    axis = spec[dim]
    parts = (*lead, None, axis, None) if dim == -2 else (*lead, None, None, axis)
    return NamedSharding(w.sharding.mesh, PartitionSpec(*parts))


def wrap_weights(weights, max_loras: int, max_rank: int, dtype, mesh=None):
    """The model pytree with each LoRA target of `weights.layers` (a DenseWeight or other
    matmul weight, not experts) wrapped in a LoraWeight of zero slots [..., max_loras + 1, ...]."""
    layers = weights.layers
    changes = {}
    for path in LORA_TARGETS:
        name = path.split(".", 1)[1]
        base = getattr(layers, name, None)
        if base is None or not hasattr(base, "shape") or type(base).__name__ == "ExpertWeight":
            continue
        *lead, n_in, n_out = base.shape
        S = max_loras + 1
        a = jnp.zeros((*lead, S, n_in, max_rank), dtype)
        b = jnp.zeros((*lead, S, max_rank, n_out), dtype)
        sa, sb = _slot_sharding(base, -2, mesh), _slot_sharding(base, -1, mesh)
        if sa is not None:
            a, b = jax.device_put(a, sa), jax.device_put(b, sb)
        changes[name] = LoraWeight(base, a, b)
    return dataclasses.replace(weights, layers=dataclasses.replace(layers, **changes))


def lora_paths(weights) -> dict[str, LoraWeight]:
    """model path ("layers.wq") -> its LoraWeight."""
    layers = weights.layers
    return {p: getattr(layers, p.split(".", 1)[1]) for p in LORA_TARGETS
            if _is_lora(getattr(layers, p.split(".", 1)[1], None))}
