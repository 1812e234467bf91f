"""On-device sampling with vLLM's semantics, as one jitted function over a batch of logit rows.

Order of operations (vLLM v1): logprobs are taken from the raw logits; then logit_bias, min_tokens
(stop ids masked), repetition / frequency / presence penalties; greedy rows take the argmax;
random rows are divided by their temperature and filtered by min_p, top_k and top_p, then
sampled with the Gumbel-max trick. Each row's noise comes from its own key, derived from the
request's seed and its output position only, so a seeded request samples the same tokens
whatever else shares the batch.

Which optional stages run is static (`SamplerFlags`), so a batch that needs no penalties and no
filtering compiles a program without them; the set of programs stays small and known.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30


class SamplerFlags(NamedTuple):
    penalties: bool      # any row with repetition/frequency/presence penalty, logit_bias or min_tokens
    filters: bool        # any row with top_k, top_p or min_p
    num_logprobs: int    # top logprobs to return per row (0: none)
    random: bool = True  # any row that samples (temperature > 0); all-greedy skips the noise
    logprobs: bool = True  # any row that wants logprobs (else no log_softmax / rank is computed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    temperature: jax.Array       # [R] f32; 0 = greedy
    top_k: jax.Array             # [R] i32; 0 = off
    top_p: jax.Array             # [R] f32
    min_p: jax.Array             # [R] f32
    seeds: jax.Array             # [R] u32, per-request seed
    positions: jax.Array         # [R] i32, output index of the token being sampled
    # Used only when flags.penalties:
    presence: jax.Array | None = None    # [R] f32
    frequency: jax.Array | None = None   # [R] f32
    repetition: jax.Array | None = None  # [R] f32
    prompt_ids: jax.Array | None = None  # [R, P] i32, padded with -1
    output_ids: jax.Array | None = None  # [R, O] i32, padded with -1
    bias_ids: jax.Array | None = None    # [R, Bb] i32, padded with -1 (also min_tokens stop ids)
    bias_vals: jax.Array | None = None   # [R, Bb] f32


class SamplerOutput(NamedTuple):
    token_ids: jax.Array        # [R] i32
    logprob: jax.Array          # [R] f32, logprob of the sampled token (raw logits)
    rank: jax.Array             # [R] i32, its 1-based rank
    top_ids: jax.Array          # [R, k] i32
    top_logprobs: jax.Array     # [R, k] f32


def _counts(ids: jax.Array, vocab: int) -> jax.Array:
    """[R, n] ids padded with -1 -> [R, V] occurrence counts."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab), jnp.float32).at[rows, ids].add(
        (ids >= 0).astype(jnp.float32), mode="drop")


def _apply_penalties(logits, t: SamplingTensors):
    V = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, t.bias_ids].add(jnp.where(t.bias_ids >= 0, t.bias_vals, 0.0),
                                             mode="drop")
    out_counts = _counts(t.output_ids, V)
    seen = (out_counts > 0) | (_counts(t.prompt_ids, V) > 0)
    rep = t.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency[:, None] * out_counts
    return logits - t.presence[:, None] * (out_counts > 0)


def _apply_filters(logits, t: SamplingTensors):
    """min_p, then top_k, then top_p on temperature-scaled logits [R, V]."""
    probs = jax.nn.softmax(logits, axis=-1)
    max_p = probs.max(-1, keepdims=True)
    logits = jnp.where(probs < t.min_p[:, None] * max_p, _NEG, logits)
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]           # descending
    V = logits.shape[-1]
    k = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, V), V)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, _NEG, logits)
    sorted_logits = jnp.where(sorted_logits < kth, _NEG, sorted_logits)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = mass_before < t.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, _NEG, logits)


def _gumbel(seed, position, vocab):
    key = jax.random.fold_in(jax.random.key(seed), position)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


@partial(jax.jit, static_argnames=("flags",))
def sample(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags) -> SamplerOutput:
    """logits [R, V] f32 -> sampled ids and logprobs for every row."""
    R, V = logits.shape
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1) if flags.logprobs else None
    if flags.penalties:
        logits = _apply_penalties(logits, t)
    ids = jnp.argmax(logits, axis=-1)
    if flags.random:   # Gumbel noise for every row is ~3M random numbers a step: skip if greedy
        greedy = t.temperature <= 0
        scaled = logits / jnp.where(greedy, 1.0, t.temperature)[:, None]
        if flags.filters:
            scaled = _apply_filters(scaled, t)
        noise = jax.vmap(_gumbel, in_axes=(0, 0, None))(t.seeds, t.positions, V)
        ids = jnp.where(greedy, ids, jnp.argmax(scaled + noise, axis=-1))
    ids = ids.astype(jnp.int32)
    if not flags.logprobs:
        zeros = jnp.zeros((R, 0), jnp.float32)
        return SamplerOutput(ids, jnp.zeros(R, jnp.float32), jnp.zeros(R, jnp.int32),
                             zeros.astype(jnp.int32), zeros)
    chosen = jnp.take_along_axis(raw_logprobs, ids[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(raw_logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
    k = flags.num_logprobs
    if k:
        top_vals, top_ids = jax.lax.top_k(raw_logprobs, k)
    else:
        top_vals, top_ids = jnp.zeros((R, 0), jnp.float32), jnp.zeros((R, 0), jnp.int32)
    return SamplerOutput(ids, chosen, rank, top_ids.astype(jnp.int32), top_vals)


@partial(jax.jit, static_argnames=("k",))
def score(logits: jax.Array, targets: jax.Array, k: int):
    """Prompt logprobs: logprob and rank of `targets` [R] under logits [R, V], plus the top k."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
    top_vals, top_ids = jax.lax.top_k(logprobs, max(k, 1))
    return chosen, rank, top_ids[:, :k].astype(jnp.int32), top_vals[:, :k]
