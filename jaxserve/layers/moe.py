"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek): a router picks the top-k
experts of every token (`route`: softmax; `route_grouped`: DeepSeek's group-limited routing),
and the experts run as grouped matmuls (`layers/experts.py`) over the (token, expert)
assignments: each assignment costs one expert's FLOPs, never all of them.

`route` is the router; `expert_mlp` runs the experts of one weight slice — all experts on one
device, or the slice `[first_expert, first_expert + X_local)` a device holds under expert
parallelism, in which case assignments to other experts contribute zero and the caller sums the
devices' outputs (`sharding/plan.py: shard_experts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.layers.experts import ExpertWeight, default_layout, group_rows, grouped_linear


def route(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """logits [T, X] -> (weights [T, k] f32, expert ids [T, k] int32): softmax over all experts,
    the top k kept, renormalised to sum 1 when `renormalize` (Qwen3-MoE's norm_topk_prob;
    Mixtral's top-k-then-softmax is the same thing)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's expert activation: (up + 1) * g * sigmoid(alpha * g), with the gate clamped
    from above and up on both sides at `limit`."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def route_grouped(logits: jax.Array, k: int, *, scoring: str, method: str, n_group: int = 1,
                  topk_group: int = 1, renormalize: bool = False, scale: float = 1.0,
                  bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's router: logits [T, X] -> (weights [T, k] f32, expert ids [T, k] int32).

    scores: softmax (V2) or sigmoid (V3). method "greedy": the top k scores; "group_limited_greedy"
    (V2): only experts of the `topk_group` groups (of `n_group` equal groups) with the highest best
    score; "noaux_tc" (V3): the choice ranks score + `bias` [X] (e_score_correction_bias), groups by
    the sum of their two best, while the weights are the chosen experts' plain scores. The weights
    are renormalised to sum 1 when `renormalize`, then multiplied by `scale`
    (routed_scaling_factor)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if method != "greedy":
        T, X = choice.shape
        grouped = choice.reshape(T, n_group, X // n_group)
        group_score = (jax.lax.top_k(grouped, 2)[0].sum(-1) if method == "noaux_tc"
                       else grouped.max(-1))                                     # [T, n_group]
        kept = jax.lax.top_k(group_score, topk_group)[1]                         # [T, topk_group]
        keep = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], kept].set(True)
        keep = jnp.repeat(keep, X // n_group, axis=1)                            # [T, X]
        # V2 zeroes the other groups' scores, V3 takes them out of the choice
        choice = jnp.where(keep, choice, -jnp.inf if method == "noaux_tc" else 0.0)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, ids.astype(jnp.int32)


def expert_mlp(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: ExpertWeight,
               w_up: ExpertWeight, w_down: ExpertWeight, first_expert=0,
               layout: str | None = None, *, biases=None, act=swiglu) -> jax.Array:
    """Gated experts (SwiGLU unless `act(gate, up)` says otherwise) over the tokens routed to them.

    x [T, E]; weights, ids [T, k] from `route`; w_gate, w_up [X_local, E, F], w_down
    [X_local, F, E] hold experts first_expert .. first_expert + X_local - 1; `biases` (gpt-oss)
    None or (gate [X_local, F], up [X_local, F], down [X_local, E]), each added to its expert's
    matmul (the down bias inside the routing weight, as transformers does). Returns [T, E]: each
    token's weighted sum over its experts that lie in this slice (zero for the others).
    `layout` ("tiles" or "ragged", `layers/experts.py`): None picks by backend and weight type."""
    T, k = ids.shape
    layout = layout or default_layout(w_gate, w_up, w_down)
    groups = group_rows(ids, w_gate.num_experts, first_expert, layout)
    valid = groups.rows < T * k                                 # padding, other devices' experts
    token = groups.rows // k                                    # T for padding rows
    xs = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token]      # [M, E]
    b_gate = b_up = b_down = None
    if biases is not None:      # each row's local expert (0 for rows that are dropped below)
        expert = jnp.concatenate([ids.reshape(-1), jnp.zeros((1,), ids.dtype)])[groups.rows] - first_expert
        expert = jnp.where(valid, expert, 0)
        b_gate, b_up, b_down = (b[expert] for b in biases)
    h = act(linear_bias(grouped_linear(xs, w_gate, groups), b_gate),
            linear_bias(grouped_linear(xs, w_up, groups), b_up))
    y = linear_bias(grouped_linear(h.astype(x.dtype), w_down, groups), b_down)  # [M, E]
    scale = jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), weights.dtype)])[groups.rows]
    # rows of other devices' experts (ragged: past the groups) are dropped, not trusted
    y = jnp.where(valid[:, None], y.astype(jnp.float32) * scale[:, None], 0.0)
    out = jnp.zeros((T + 1, x.shape[1]), jnp.float32).at[token].add(y)
    return out[:T].astype(x.dtype)


def linear_bias(y: jax.Array, b: jax.Array | None) -> jax.Array:
    return y if b is None else y + b.astype(y.dtype)
