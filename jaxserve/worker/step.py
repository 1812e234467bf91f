"""The step: what one jitted step program computes, in one place.

`generate_step(ctx, weights, cache, pen, x)` is the whole device side of an engine step for a
generating model: the model forward over the step's tokens (paged KV cache written in place),
the logits of the sampling rows (vocabulary-parallel head, rows gathered), prompt-logprob scoring
when the step's variant asks for it, sampling (penalties, filters, structured-output bitmask,
speculative rows) and the per-slot sampling state's update. `pooling_step` is the pooling
runner's: the forward, then one pooled vector per row. Both are module-level functions of one
frozen `StepContext` (the model, its config, the attention backend, the KV quantisation, the
sharding plan, the logprobs width); `jit_step` jits one with its context bound and its inputs
packed (`step_inputs.Packing`: one int32 array, one transfer), the KV cache and the sampling
state donated.

Async scheduling: an input id below 0 is a placeholder (-1 - slot) for the token a step still
in flight samples for that slot; `penalties.take_placeholders` reads it from the sampling
state's `last_token`, which every step writes, so the ids never go through the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.lora.weight import bind_token_slots
from jaxserve.sample import penalties
from jaxserve.sample.rejection import emitted_mask
from jaxserve.sample.sampler import sample, score_rows
from jaxserve.sharding.plan import ShardingPlan
from jaxserve.worker.step_inputs import Packing, StepInputs


@dataclasses.dataclass(frozen=True, eq=False)
class StepContext:
    """Everything a step program closes over besides its arguments (fixed for a runner's life)."""
    model: Any                          # the family's module (`jaxserve.models.get_model`)
    cfg: ModelConfig
    backend: str                        # the attention backend
    plan: ShardingPlan
    max_logprobs: int = 0               # top logprobs computed per sampled / scored row
    kv_quantize: Callable | None = None
    pooling_type: str | None = None     # pooling models: "MEAN", "LAST" or "CLS"
    # EAGLE-3: the target layers whose inputs the step also returns (the head's features)
    aux_layers: tuple[int, ...] = ()
    # DeepSeek MTP: the step also returns the final hidden states (the MTP layer's features)
    final_hidden: bool = False


def _forward(ctx: StepContext, weights, cache, pen, x: StepInputs):
    if x.lora_slots is not None:      # each token's adapter slot reaches every LoraWeight
        weights = bind_token_slots(weights, x.lora_slots)
    tokens = penalties.take_placeholders(x.tokens, pen)
    aux = {"aux_layers": ctx.aux_layers} if ctx.aux_layers else {}
    hidden, cache, *aux = ctx.model.forward(weights, cache, tokens, x.positions, x.meta, cfg=ctx.cfg,
                                            backend=ctx.backend, kv_quantize=ctx.kv_quantize,
                                            plan=ctx.plan, **aux)
    return weights, hidden, cache, aux


def generate_step(ctx: StepContext, weights, cache, pen, x: StepInputs):
    """-> (SamplerOutput [R], prompt scores or None, cache, sampling state), and with
    `ctx.aux_layers` the aux hidden states [T, n * E] last (left on the device for the head),
    with `ctx.final_hidden` the final hidden states [T, E]."""
    weights, hidden, cache, aux = _forward(ctx, weights, cache, pen, x)
    if ctx.final_hidden:
        aux = [hidden]
    plan = ctx.plan

    def logits_of(h):
        # Vocabulary-parallel head: each device scores its slice of the vocabulary, then the
        # rows are gathered (not the head), so the sampler reads whole rows.
        logits = jax.lax.with_sharding_constraint(ctx.model.compute_logits(weights, h),
                                                  plan.sharding(("tokens", "vocab")))
        return jax.lax.with_sharding_constraint(logits, plan.replicated)

    logits, scores = logits_of(hidden[x.logit_rows]), None
    if x.prompt_targets is not None:
        scores = score_rows(logits_of, hidden, x.prompt_rows, x.prompt_targets, ctx.max_logprobs)
    out = sample(logits, x.sampling, pen, k=ctx.max_logprobs, bitmask=x.bitmask)
    slots = x.sampling.slots
    if x.draft_ids is not None:
        # Only emitted samples join the output history (rejected rows are dropped).
        keep = emitted_mask(out.token_ids, x.draft_ids, x.group_start)
        slots = jnp.where(keep, slots, pen.output_counts.shape[0])
    pen = penalties.count_sampled(pen, slots, out.token_ids)
    return (out, scores, cache, pen, *aux)


def pool_rows(hidden: jax.Array, cu_q_lens: jax.Array, pooling_type: str) -> jax.Array:
    """hidden [T, E], cu_q_lens [S + 1] (padding rows repeat the total) -> [S, E] f32: per row
    of the step the sum of its tokens' hidden states (MEAN), its last token's (LAST) or its
    first token's (CLS). Padding rows hold garbage; the caller reads only real rows."""
    T = hidden.shape[0]
    S = cu_q_lens.shape[0] - 1
    if pooling_type == "MEAN":
        # Row of each token: padding tokens (at or past the total) land in row S, dropped.
        row = jnp.searchsorted(cu_q_lens[1:], jnp.arange(T, dtype=cu_q_lens.dtype), side="right")
        return jax.ops.segment_sum(hidden.astype(jnp.float32), row, num_segments=S)
    index = cu_q_lens[1:] - 1 if pooling_type == "LAST" else cu_q_lens[:-1]
    return hidden[jnp.clip(index, 0, T - 1)].astype(jnp.float32)


def pooling_step(ctx: StepContext, weights, cache, pen, x: StepInputs):
    """-> (pooled rows [S, E] f32, cache, sampling state untouched): the generate step's
    signature, so the runner's AOT compilation per bucket applies as it is."""
    _, hidden, cache, _ = _forward(ctx, weights, cache, pen, x)
    pooled = pool_rows(hidden, x.meta.cu_q_lens, ctx.pooling_type)
    return jax.lax.with_sharding_constraint(pooled, ctx.plan.replicated), cache, pen


def jit_step(step: Callable, ctx: StepContext, out_shardings):
    """`step(ctx, weights, cache, pen, x: StepInputs)` jitted with `ctx` bound, taking x packed
    (`Packing`): `(weights, cache, pen, packed, bitmask, *, packing)` — one int32 array, one
    transfer, plus the structured-output bitmask (device-resident when no row is constrained);
    the cache and the sampling state donated."""
    def packed_step(weights, cache, pen, packed, bitmask, *, packing: Packing):
        return step(ctx, weights, cache, pen, packing.unpack(packed, bitmask))
    packed_step.__name__ = packed_step.__qualname__ = step.__name__     # the program's name in dumps
    return jax.jit(packed_step, donate_argnames=("cache", "pen"), static_argnames=("packing",),
                   out_shardings=out_shardings)
