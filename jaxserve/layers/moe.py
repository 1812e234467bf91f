"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a softmax router picks the top-k
experts of every token, and the experts run as grouped matmuls over the tokens sorted by expert
(`jax.lax.ragged_dot`): each (token, expert) assignment costs one expert's FLOPs, never all of
them.

`route` is the router; `expert_mlp` runs the experts of one weight slice — all experts on one
device, or the slice `[first_expert, first_expert + X_local)` a device holds under expert
parallelism, in which case assignments to other experts contribute zero and the caller sums the
devices' outputs (`sharding/plan.py: shard_experts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """logits [T, X] -> (weights [T, k] f32, expert ids [T, k] int32): softmax over all experts,
    the top k kept, renormalised to sum 1 when `renormalize` (Qwen3-MoE's norm_topk_prob;
    Mixtral's top-k-then-softmax is the same thing)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def expert_mlp(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array, first_expert=0) -> jax.Array:
    """SwiGLU experts over the tokens routed to them.

    x [T, E]; weights, ids [T, k] from `route`; w_gate, w_up [X_local, E, F], w_down
    [X_local, F, E] hold experts first_expert .. first_expert + X_local - 1. Returns [T, E]: each
    token's weighted sum over its experts that lie in this slice (zero for the others)."""
    T, k = ids.shape
    X = w_gate.shape[0]
    local = ids.reshape(-1) - first_expert                      # [T*k]
    mine = (local >= 0) & (local < X)
    key = jnp.where(mine, local, X)                             # other experts sort last
    order = jnp.argsort(key, stable=True)                       # [T*k] grouped by expert
    token = order // k                                          # source row of each sorted slot
    group_sizes = jnp.bincount(key, length=X + 1)[:X].astype(jnp.int32)    # [X]

    pref = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    xs = x[token]                                               # [T*k, E]
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes, preferred_element_type=pref)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes, preferred_element_type=pref)
    h = (jax.nn.silu(gate) * up).astype(x.dtype)                # [T*k, F]
    y = jax.lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=pref)  # [T*k, E]
    # rows past the groups (assignments to other devices' experts) are dropped, not trusted
    scale = jnp.where(mine[order], weights.reshape(-1)[order], 0.0)
    y = jnp.where(mine[order][:, None], y.astype(jnp.float32) * scale[:, None], 0.0)
    out = jnp.zeros((T, x.shape[1]), jnp.float32).at[token].add(y)
    return out.astype(x.dtype)
