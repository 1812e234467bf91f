"""Weights that live in host memory (`--cpu-offload-gb`, vLLM's): the largest stacked per-layer
weight arrays, up to N GiB per device, are placed in `pinned_host` memory and the layer scan
copies each layer's slice to the device inside the step, just before the layer uses it
(`on_device`, called by `layers.scan.scan_layers`); XLA schedules the copy of layer i + 1 while
layer i computes where the backend overlaps host transfers (a GPU's copy engines).

What moves is a whole stacked field (e.g. every layer's `w_up`): jaxserve stacks a weight across
layers, so the unit is one field, not vLLM's one parameter of one layer. Only plain arrays move
(dense bf16 / f32 / fp8 arrays); quantized containers (int4, fp8 with scales, experts, LoRA-wrapped
weights) stay on the device.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxserve.layers.linear import DenseWeight


def on_host(x) -> bool:
    """Whether a traced (or concrete) array lives in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def on_device(tree):
    """The tree's host-memory arrays copied to device memory (inside a jitted step)."""
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device) if on_host(a) else a, tree)


def device_bytes(x: jax.Array) -> int:
    """Bytes of one device's shard."""
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def to_host(a):
    """An array (or, compiling ahead of time, its `ShapeDtypeStruct`) in pinned_host memory."""
    sharding = a.sharding.with_memory_kind("pinned_host")
    if isinstance(a, jax.ShapeDtypeStruct):
        if sharding.memory_kind is None:    # a compile-only device lists no memories: say it abstractly
            sharding = jax.sharding.NamedSharding(a.sharding.mesh.abstract_mesh, a.sharding.spec,
                                                  memory_kind="pinned_host")
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return jax.device_put(a, sharding)


def offload_layer_weights(weights, gib: float):
    """(weights with stacked per-layer arrays of up to `gib` GiB per device moved to host memory,
    largest first, bytes moved per device). A field that would exceed what is left is skipped
    for a smaller one."""
    layers = getattr(weights, "layers", None)
    if layers is None or not dataclasses.is_dataclass(layers):
        raise ValueError("cpu_offload_gb: this model's weights have no stacked layers to offload")
    def array(x):
        a = x.w if isinstance(x, DenseWeight) else x
        return a if isinstance(a, jax.Array | jax.ShapeDtypeStruct) and a.ndim >= 3 else None

    fields = [(f.name, getattr(layers, f.name)) for f in dataclasses.fields(layers)]
    candidates = sorted(((n, x, array(x)) for n, x in fields if array(x) is not None),
                        key=lambda c: -device_bytes(c[2]))
    left, moved, total = gib * 2**30, {}, 0
    for name, x, a in candidates:
        if device_bytes(a) <= left:
            host = to_host(a)
            moved[name] = dataclasses.replace(x, w=host) if isinstance(x, DenseWeight) else host
            left -= device_bytes(a)
            total += device_bytes(a)
    return dataclasses.replace(weights, layers=dataclasses.replace(layers, **moved)), total
