"""How one model is split over a mesh's tensor-parallel axis: the rules table adapted to the
model's head counts, and the few places where XLA must not be left to partition by itself
(the paged attention call and the vocabulary-parallel embedding lookup), written as
`jax.shard_map`s from logical axes. Model code receives a `ShardingPlan` and never names a mesh
axis.

Attention over `tp` devices, as vLLM does it:
- heads split when `num_heads % tp == 0` and `num_kv_heads % tp == 0`;
- when `tp % num_kv_heads == 0` (fewer KV heads than devices) the K/V projections stay
  replicated and the KV cache holds each KV head `tp // num_kv_heads` times, so every device keeps
  exactly the one KV head its query heads read;
- otherwise (SmolLM2-135M's 9 heads and 3 KV heads over 2, 4 or 8 devices) attention is
  replicated: every device computes all heads and holds the whole KV pool; the MLP and the
  vocabulary are still split.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.sharding.rules import RULES, partition_spec

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """mesh: the device mesh. rules: logical axis -> mesh axis for this model.
    kv_repeat: copies of each checkpoint KV head in the cache (> 1 only when KV heads < tp).
    Hashable: jitted functions take it as a static argument."""

    mesh: Mesh
    rules: tuple[tuple[str, str | None], ...]
    kv_repeat: int = 1

    @property
    def tp(self) -> int:
        return self.mesh.shape["tp"]

    def spec(self, axes: Sequence[str]) -> PartitionSpec:
        return partition_spec(axes, self.rules)

    def sharding(self, axes: Sequence[str]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def mesh_axis(self, logical: str) -> str | None:
        return dict(self.rules)[logical]

    def cache_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads the cache holds in all (each device holds this / tp when they are split)."""
        return num_kv_heads * self.kv_repeat

    def kv_heads_per_device(self, num_kv_heads: int) -> int:
        heads = self.cache_kv_heads(num_kv_heads)
        return heads // self.tp if self.mesh_axis("kv_cache_heads") else heads


def place(x, sharding):
    """`x` on `sharding`: `jax.device_put` for an array; an abstract one (a `jax.ShapeDtypeStruct`,
    compiling without the devices: jaxserve.aot) takes the sharding as its own."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.device_put(x, sharding)


def put(tree, sharding):
    """Host values that every process holds the same of -> arrays on `sharding` (one sharding
    for every leaf, or a tree of them). One process: `jax.device_put`. Several (a multi-host
    engine): each process places the shards of its own devices (`jax.make_array_from_callback`),
    without the all-gather `jax.device_put` runs to check that the processes agree — per step
    a collective on the step's path, and a put that one process skips (an array it cached)
    would pair with another process's next one. `JAXSERVE_CHECK_HOST_INPUTS=1` keeps the check
    (a process whose inputs differ fails loudly; for debugging a multi-host engine)."""
    if jax.process_count() == 1 or os.environ.get("JAXSERVE_CHECK_HOST_INPUTS") == "1":
        return jax.device_put(tree, sharding)

    def one(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda index: x[index])
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, sharding), tree)
    return jax.tree.map(one, tree, sharding)


def plan_for(cfg, mesh: Mesh, expert_parallel: bool = False) -> ShardingPlan:
    """The plan for a model config (`jaxserve.config.ModelConfig`) on `mesh`. Raises ValueError
    when the MLP size does not divide over the tensor-parallel devices, or (mixture-of-experts
    models) the experts over the expert-parallel ones.

    `expert_parallel` (vLLM's --enable-expert-parallel): each expert stays whole and the experts
    split over all ep x tp devices; otherwise the experts' inner dimension splits over tp (and the
    experts over the mesh's ep axis, if it has one)."""
    tp, ep = mesh.shape["tp"], mesh.shape["ep"]
    rules = dict(RULES)
    H, K, F, V = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size
    moe = getattr(cfg, "moe", None)
    dense_layers = moe is None or len(moe.sparse_layers(cfg.num_layers)) < cfg.num_layers
    if dense_layers and F % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's intermediate_size "
                         f"({F})")
    if moe is not None:
        X, MF = moe.num_experts, moe.moe_intermediate_size
        if expert_parallel:
            rules.update(experts=("ep", "tp"), moe_mlp=None)
            if X % (ep * tp):
                raise ValueError(f"expert parallelism over {ep * tp} devices must divide the "
                                 f"model's num_experts ({X})")
        else:
            if X % ep:
                raise ValueError(f"expert_parallel_size ({ep}) must divide the model's "
                                 f"num_experts ({X})")
            if MF % tp:
                raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's "
                                 f"moe_intermediate_size ({MF}); or enable expert parallelism")
    if V % tp:
        logger.warning("vocab_size %d does not divide over %d devices: embedding and lm_head are "
                       "replicated", V, tp)
        rules["vocab"] = None
    kv_repeat = 1
    if H % tp == 0 and K % tp == 0:
        pass
    elif H % tp == 0 and tp % K == 0:
        rules["kv_heads"] = None          # K/V projections replicated; the cache repeats heads
        kv_repeat = tp // K
    else:
        logger.warning("%d attention heads and %d KV heads do not split over %d devices: attention "
                       "is replicated (MLP and vocabulary still split)", H, K, tp)
        rules.update(q_heads=None, kv_heads=None, kv_cache_heads=None)
    return ShardingPlan(mesh, tuple(rules.items()), kv_repeat)


def shard_experts(plan: ShardingPlan | None, fn: Callable, x, weights, ids, w_gate, w_up,
                  w_down, *, biases=None):
    """Run the experts `fn(x, weights, ids, w_gate, w_up, w_down, first_expert) -> [T, E]` on
    each device's slice of the expert weights and sum the devices' outputs. `biases` (gpt-oss):
    None or the experts' (gate [X, F], up [X, F], down [X, E]) biases, passed on as
    `fn(..., biases=...)`, split like their matrices' outputs; the down bias is added by the
    first device of the MLP split only, so the sum counts it once.

    x [T, E] and the routing (weights, ids [T, k]) are replicated; w_gate, w_up
    [X, E, F] and w_down [X, F, E] (`ExpertWeight`s of any weight type, `expert_specs`) split on
    X over the expert axes and on F over the MLP axis.
    A device computes only the assignments to its own experts (a grouped matmul over its tokens),
    with its slice of F, and one all-reduce sums the partial outputs, as jax-llm-examples'
    qwen3 does: no expert weight ever leaves its device."""
    extra = {} if biases is None else {"biases": tuple(biases)}
    if plan is None or plan.mesh.size == 1:
        return fn(x, weights, ids, w_gate, w_up, w_down, 0, **extra)
    experts_axes = _axes(plan.mesh_axis("experts"))
    mlp_axes = _axes(plan.mesh_axis("moe_mlp"))
    sum_axes = experts_axes + mlp_axes

    def local(x, weights, ids, w_gate, w_up, w_down, *biases):
        first = 0
        for a in experts_axes:                  # this device's place along the expert split
            first = first * plan.mesh.shape[a] + jax.lax.axis_index(a)
        extra = {}
        if biases:
            b_gate, b_up, b_down = biases
            first_of_mlp = sum(jax.lax.axis_index(a) for a in mlp_axes) == 0 if mlp_axes else True
            extra = {"biases": (b_gate, b_up, jnp.where(first_of_mlp, b_down, 0))}
        out = fn(x, weights, ids, w_gate, w_up, w_down, first * w_gate.num_experts, **extra)
        return jax.lax.psum(out, sum_axes) if sum_axes else out

    up_axes, down_axes = ("experts", "embed", "moe_mlp"), ("experts", "moe_mlp", "embed")
    rep = PartitionSpec()
    specs = (expert_specs(plan, w_gate, up_axes), expert_specs(plan, w_up, up_axes),
             expert_specs(plan, w_down, down_axes))
    args = (x, weights, ids, w_gate, w_up, w_down)
    if biases is not None:
        specs += (plan.spec(("experts", "moe_mlp")), plan.spec(("experts", "moe_mlp")),
                  plan.spec(("experts", "embed")))
        args += tuple(biases)
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(rep, rep, rep, *specs),
                         out_specs=rep, check_vma=False)(*args)


def expert_specs(plan: ShardingPlan, experts, axes: Sequence[str]):
    """PartitionSpecs for every array of an `ExpertWeight` [X, in, out] with logical `axes`,
    whatever its weight type: the matrix as the axes say (its last two swapped when stored
    `k_major`); an array of scales (or zeros) [X, r, c] split like the matrix where it has more
    than one entry per expert ([X, 1, out]: per channel; [X, in/b, out/b]: blocks; int4 codes
    [X, in/8, out] and group scales), whole where
    it has one; a per-expert vector [X] split on X. A split of blocks must fall on block edges."""
    inner = experts.w
    spec = tuple(plan.spec(axes)) + (None,) * (len(axes) - len(plan.spec(axes)))
    shape = experts.shape[-3:]

    def one(a):
        if a is getattr(inner, "w", None):      # layers lead where the scan kept the stack whole
            lead = (None,) * (a.ndim - 3)
            return PartitionSpec(*lead, *spec[:1], spec[2], spec[1]) if getattr(inner, "k_major", False) \
                else PartitionSpec(*lead, *spec)
        if a.ndim < 3:
            return PartitionSpec(*spec[:a.ndim])
        out = [spec[0]]
        for d in (1, 2):
            parts = 1
            for m in _axes(spec[d]):
                parts *= plan.mesh.shape[m]
            split = spec[d] if a.shape[-3 + d] > 1 else None
            if split is not None and (a.shape[-3 + d] % parts or (shape[d] // parts) % -(-shape[d] // a.shape[-3 + d])):
                raise ValueError(f"expert {axes[d]} ({shape[d]}) split over {parts} devices does not fall on "
                                 f"the edges of its {a.shape[-3 + d]} scale blocks")
            out.append(split)
        return PartitionSpec(*out)
    return jax.tree.map(one, experts)


def _axes(mesh_axis) -> tuple[str, ...]:
    if mesh_axis is None:
        return ()
    return tuple(mesh_axis) if isinstance(mesh_axis, (tuple, list)) else (mesh_axis,)


def single_device_plan(cfg) -> ShardingPlan:
    from jaxserve.sharding.mesh import make_mesh
    return plan_for(cfg, make_mesh(devices=jax.devices()[:1]))


def shard_attention(plan: ShardingPlan | None, fn: Callable, q, k, v, cache, *args, sinks=None):
    """Run `fn(q, k, v, cache, *args) -> (out, cache)` on each device's heads.

    q [T, H, D], k, v [T, K, D] (replicated K heads are repeated here to the cache's count),
    cache a KVCache split on its heads; `args` (layer index, attention metadata) replicated;
    `sinks` [H] (gpt-oss; None: none) split like q's heads, passed on as `fn(..., sinks=...)`.
    XLA does not partition Pallas calls, so the kernel only ever sees one device's heads; the
    reference path goes the same way (no collective is needed: heads are independent)."""
    if plan is not None and plan.kv_repeat > 1:     # v None: a latent cache (one latent head, repeated)
        k = jnp.repeat(k, plan.kv_repeat, axis=1)
        v = None if v is None else jnp.repeat(v, plan.kv_repeat, axis=1)
    if sinks is not None:
        fn, args = _with_sinks(fn), (sinks, *args)
    if plan is None or plan.tp == 1:
        return fn(q, k, v, cache, *args)
    from jaxserve.attention import kv_cache as kvc
    q_spec = plan.spec(("tokens", "q_heads", "head_dim"))
    kv_spec = plan.spec(("tokens", "kv_cache_heads", "head_dim"))
    pages, scales = plan.spec(kvc.KV_AXES), plan.spec(kvc.SCALE_AXES)
    latent = cache.latent
    cache_spec = kvc.KVCache(pages, None if latent else pages,
                             *((scales, None if latent else scales) if cache.quantized else (None, None)),
                             codes=cache.codes)
    rest = tuple(jax.tree.map(lambda _: PartitionSpec(), a) for a in args)
    if sinks is not None:
        rest = (plan.spec(("q_heads",)), *rest[1:])
    mapped = jax.shard_map(fn, mesh=plan.mesh, in_specs=(q_spec, kv_spec, None if latent else kv_spec, cache_spec,
                                                         *rest),
                           out_specs=(q_spec, cache_spec), check_vma=False)
    return mapped(q, k, v, cache, *args)


def _with_sinks(fn: Callable) -> Callable:
    """fn(q, k, v, cache, *args, sinks=s) called as g(q, k, v, cache, s, *args): the sinks travel
    as a positional operand of the shard_map."""
    def call(q, k, v, cache, sinks, *args):
        return fn(q, k, v, cache, *args, sinks=sinks)
    return call


def embed_lookup(plan: ShardingPlan | None, table, tokens: jax.Array) -> jax.Array:
    """table [V, E] (split on V over tp; or a quantized [E, V] `Int4Weight`, layers/embedding.py),
    tokens [T] -> [T, E] replicated: each device looks up the tokens in its vocabulary slice
    (zeros elsewhere) and one all-reduce sums them, so the table is never gathered."""
    from jaxserve.layers.embedding import embed_rows, num_rows

    axis = None if plan is None else plan.mesh_axis("vocab")
    if axis is None or plan.tp == 1:
        return embed_rows(table, tokens)

    def local(tab, tok):
        n = num_rows(tab)
        idx = tok - jax.lax.axis_index(axis) * n
        mine = (idx >= 0) & (idx < n)
        rows = jnp.where(mine[:, None], embed_rows(tab, jnp.clip(idx, 0, n - 1)), 0)
        return jax.lax.psum(rows, axis)

    spec = plan.spec(("vocab", "embed"))
    if not isinstance(table, jax.Array):     # quantized [E, V]: every array of it split on V
        spec = jax.tree.map(lambda _: plan.spec(("embed", "vocab")), table)
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec, PartitionSpec()),
                         out_specs=PartitionSpec(), check_vma=False)(table, tokens)
