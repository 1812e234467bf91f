"""The one table mapping logical axis names (declared by the model files and the KV cache) to
mesh axes. Model code never names a mesh axis; `flax.linen.logical_to_mesh_axes` applies the
table.

Tensor parallelism (Megatron style): attention heads, KV heads, the MLP's inner dimension and
the vocabulary split over "tp"; the embedding dimension stays whole, so only the outputs of `wo`
and `w_down` need a sum across devices. Mixture-of-experts weights `[experts, ..., moe_mlp]`
split their inner dimension over "tp" like a dense MLP and their experts over "ep" (size 1
unless the mesh has one); with expert parallelism (`plan_for(..., expert_parallel=True)`, vLLM's
`--enable-expert-parallel`) the experts split over "ep" x "tp" instead and each expert stays
whole on its device. This is the table for a model
whose heads divide over the devices; `sharding/plan.py` adapts it to one model's head counts
(KV heads of the weights vs. of the cache, replicated attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis (None: replicated)
RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "tp"),
    ("embed", None),
    ("q_heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("experts", "ep"),
    ("moe_mlp", "tp"),
    ("router", None),        # the router's expert scores: small, replicated
    ("latent", None),        # multi-head latent attention's compressed q and kv: shared by all heads
    ("layers", None),
    # the paged KV cache (jaxserve/attention/kv_cache.py)
    ("kv_blocks", None),
    ("kv_block_tokens", None),
    ("kv_cache_heads", "tp"),
    # activations
    ("tokens", None),
)
LOGICAL_AXES = tuple(name for name, _ in RULES)


def partition_spec(axes: Sequence[str], rules=RULES) -> PartitionSpec:
    """Logical axes (one per array dimension) -> PartitionSpec; unknown names are an error."""
    unknown = [a for a in axes if a not in dict(rules)]
    if unknown:
        raise ValueError(f"logical axes {unknown} have no sharding rule; known: "
                         f"{', '.join(dict(rules))}")
    return nn.logical_to_mesh_axes(tuple(axes), rules)


def named_sharding(mesh: Mesh, axes: Sequence[str], rules=RULES) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, rules))
