"""`scan_layers`: the layer scan of every model, which hands some stacks to its body whole.

A `lax.scan` copies each step's slice of its stacked inputs out of the stack. Stacks whose kernels
read a layer in place (the fused CPU kernel's `Int4Weight`s, a `LayerMixWeight`, experts on the
grouped GPU matmul) are passed whole with their `layer` set instead; stacks in host memory are
copied a layer ahead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.layers.experts import ExpertWeight, experts_read_in_place
from jaxserve.layers.host_weights import on_device, on_host
from jaxserve.layers.int4 import Int4Weight
from jaxserve.layers.layer_mix import LayerMixWeight
from jaxserve.pallas.common import target_platform


def _kept_whole(w) -> bool:
    """Stacks the layer scan hands to its body whole (their kernels read layer `layer` in place):
    an `Int4Weight` on the fused CPU kernel, a `LayerMixWeight` (its parts hold different layers), and
    on a GPU dense experts (the grouped matmul)."""
    if isinstance(w, Int4Weight):
        return (w.fused_max_rows is not None or w.amx_min_rows is not None) and len(w.shape) == 3
    if isinstance(w, LayerMixWeight):
        return True
    return isinstance(w, ExpertWeight) and experts_read_in_place(w)


def scan_layers(body, carry, xs):
    """`lax.scan(body, carry, xs)` over stacked layers `xs = (layer weights, layer indices, ...)`,
    except that each stack `_kept_whole` says is not sliced by the scan: the body gets it whole
    with `layer` set to the step's index, and its kernel reads that layer in place (a scan copies
    each step's slice of its inputs out of the stack first).

    Stacks in host memory (`--cpu-offload-gb`, `layers.host_weights`) are not sliced by the scan
    either: the scan carries the next layer's slice, copied to the device while this layer
    computes (the copy of layer i + 1 starts in iteration i; layer 0's before the loop). On the CPU
    (host and device memory are the same RAM) each layer's slice is taken in place instead."""
    weights, ids, *rest = xs
    whole_leaf = lambda x: isinstance(x, (Int4Weight, LayerMixWeight, ExpertWeight))     # noqa: E731
    leaves, tree = jax.tree.flatten(weights, is_leaf=whole_leaf)
    kept = {i: w for i, w in enumerate(leaves) if _kept_whole(w)}
    host = {i: w for i, w in enumerate(leaves) if not whole_leaf(w) and on_host(w)}
    if host and target_platform() == "cpu":
        # one memory: a carried copy would be a real memcpy per layer, where a slice feeds the
        # matmul in place, so the host stacks are sliced by the scan like any other
        host, inner = {}, body
        body = lambda carry, xs: inner(carry, (on_device(xs[0]), *xs[1:]))     # noqa: E731
    if not kept and not host:
        return jax.lax.scan(body, carry, xs)[0]
    sliced = [None if i in kept or i in host else w for i, w in enumerate(leaves)]
    last = ids.shape[0] - 1

    def fetch(layer):       # one layer of the host stacks, on the device
        return {i: on_device(jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)) for i, w in host.items()}

    def step(state, xs):
        carry, here = state
        part, layer, *rest = xs
        ahead = fetch(jnp.minimum(layer + 1, last)) if host else {}
        whole = [dataclasses.replace(kept[i], layer=layer) if i in kept else here[i] if i in host else w
                 for i, w in enumerate(part)]
        carry, y = body(carry, (tree.unflatten(whole), layer, *rest))
        return (carry, ahead), y
    return jax.lax.scan(step, (carry, fetch(ids[0]) if host else {}), (sliced, ids, *rest))[0][0]
