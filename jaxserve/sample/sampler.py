"""On-device sampling with vLLM's semantics, as one jitted function over a batch of logit rows.

Order of operations (vLLM v1): the structured-output bitmask first (forbidden tokens -> -1e30;
vLLM too masks the logits before its sampler, so logprobs show the constrained distribution);
logprobs are taken from these logits, before penalties; then logit_bias, min_tokens (stop ids
masked), repetition / frequency / presence penalties; greedy rows take the argmax;
random rows are divided by their temperature and filtered by min_p, top_k and top_p, then
sampled with the Gumbel-max trick. Each row's noise comes from its own key, derived from the
request's seed and its output position only, so a seeded request samples the same tokens
whatever else shares the batch.

Shapes are fixed, so one program per row count serves every mix of requests: the optional
stages (penalties, filters, noise, logprobs) are `lax.cond`s on whether any row needs them
(only the taken branch runs), penalties read fixed `[C, V]` state by slot (`penalties.py`), and
top logprobs are always `k` (the engine's max_logprobs) wide; callers slice what was asked for.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.sample.penalties import PenaltyState, apply_penalties
from jaxserve.sample.structured import maybe_apply_bitmask

_NEG = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    temperature: jax.Array       # [R] f32; 0 = greedy
    top_k: jax.Array             # [R] i32; 0 = off
    top_p: jax.Array             # [R] f32
    min_p: jax.Array             # [R] f32
    seeds: jax.Array             # [R] u32, per-request seed
    positions: jax.Array         # [R] i32, output index of the token being sampled
    slots: jax.Array             # [R] i32, the row's PenaltyState row; C for padding rows
    penalised: jax.Array         # [R] bool, any penalty / logit_bias / min_tokens
    min_tokens_active: jax.Array  # [R] bool, fewer outputs than min_tokens: mask stop ids
    presence: jax.Array          # [R] f32
    frequency: jax.Array         # [R] f32
    repetition: jax.Array        # [R] f32
    logprobs: jax.Array          # [R] bool, the row wants sample logprobs


class SamplerOutput(NamedTuple):
    token_ids: jax.Array        # [R] i32
    logprob: jax.Array          # [R] f32, logprob of the sampled token (raw logits)
    rank: jax.Array             # [R] i32, its 1-based rank
    top_ids: jax.Array          # [R, k] i32
    top_logprobs: jax.Array     # [R, k] f32

    def tokens_only(self) -> SamplerOutput:
        """The token ids alone (the rest None): what the host fetches when no request of the step
        asks for logprobs, each fetched array costing host time (~0.1 ms a token at batch 1)."""
        return self._replace(logprob=None, rank=None, top_ids=None, top_logprobs=None)


def _max_or_nan(a, b):
    return jnp.where((a >= b) | jnp.isnan(a), a, b)


def _min(a, b):
    return jnp.where(a <= b, a, b)


def argmax_last(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the maximum; the first NaN if any), as
    int32, in two plain reductions: XLA:CPU runs argmax's (value, index) pair reduction as a
    scalar loop, ~10x slower over a [64, 49152] vocabulary (28 -> 2.5 ms; RESULTS.md). The two
    reductions are written with `select` bodies rather than max / min: XLA:CPU (jaxlib 0.10)
    hands a plain max / min reduction to a YNNPACK fusion that, on an array computed in the same
    program (the step's logits), took 14-19 ms instead of 1.5-2 ms at [64, 49152] (RESULTS.md)."""
    nd = x.ndim - 1
    m = jax.lax.reduce(x, jnp.array(-jnp.inf, x.dtype), _max_or_nan, (nd,))   # NaN when the row holds one
    hit = (x == m[..., None]) | jnp.isnan(x)
    V = x.shape[-1]
    idx = jnp.where(hit, jax.lax.broadcasted_iota(jnp.int32, x.shape, nd), V)
    return jax.lax.reduce(idx, jnp.int32(V), _min, (nd,))


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


MAX_TEMPERATURE = 1e6


def _draw(logits, greedy_ids, t: SamplingTensors):
    """Temperature, filters and Gumbel noise; greedy rows keep `greedy_ids`."""
    V = logits.shape[-1]
    rand = t.temperature > 0
    # A huge temperature would lift the grammar's forbidden logits (-1e30, structured.py) and
    # logit_bias' -inf ones (NaN once 2.6e266 is inf in f32) into reach of the Gumbel noise.
    # Capped, they stay unreachable; at 1e6 every allowed logit is already ~0 (uniform draw).
    temp = jnp.minimum(jnp.where(rand, t.temperature, 1.0), MAX_TEMPERATURE)
    scaled = logits / temp[:, None]
    filtered = rand & ((t.top_k > 0) | (t.top_p < 1.0) | (t.min_p > 0))
    scaled = jax.lax.cond(jnp.any(filtered), _apply_filters, lambda x, _: x, scaled, t)
    noise = jax.vmap(_gumbel, in_axes=(0, 0, None))(t.seeds, t.positions, V)
    return jnp.where(rand, argmax_last(scaled + noise), greedy_ids).astype(jnp.int32)


def _logprobs(logits, ids, k: int):
    """(logprob, rank, top k ids, top k logprobs) of the sampled ids under the raw logits."""
    raw = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(raw, ids[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(raw > chosen[:, None], axis=-1).astype(jnp.int32)
    top_vals, top_ids = jax.lax.top_k(raw, k) if k else (raw[:, :0], raw[:, :0])
    return chosen, rank, top_ids.astype(jnp.int32), top_vals


def _no_logprobs(logits, ids, k: int):
    R = logits.shape[0]
    return (jnp.zeros(R, jnp.float32), jnp.zeros(R, jnp.int32), jnp.zeros((R, k), jnp.int32),
            jnp.zeros((R, k), jnp.float32))


@partial(jax.jit, static_argnames=("k",))
def sample(logits: jax.Array, t: SamplingTensors, state: PenaltyState, k: int = 0,
           bitmask: jax.Array | None = None) -> SamplerOutput:
    """logits [R, V] f32 -> sampled ids and logprobs for every row; top logprobs k wide.
    bitmask [R, ceil(V / 32)] i32: the tokens each row may sample (all ones: unconstrained)."""
    logits = raw = maybe_apply_bitmask(logits, bitmask)
    logits = jax.lax.cond(
        jnp.any(t.penalised),
        lambda x: apply_penalties(x, t.slots, t.penalised, t.min_tokens_active, t.presence,
                                  t.frequency, t.repetition, state),
        lambda x: x, logits)
    ids = argmax_last(logits)
    # Gumbel noise for every row is ~3M random numbers a step: skipped when all rows are greedy.
    ids = jax.lax.cond(jnp.any(t.temperature > 0), _draw, lambda x, g, _: g, logits, ids, t)
    lp = jax.lax.cond(jnp.any(t.logprobs), partial(_logprobs, k=k), partial(_no_logprobs, k=k),
                      raw, ids)
    return SamplerOutput(ids, *lp)


@partial(jax.jit, static_argnames=("k",))
def score(logits: jax.Array, targets: jax.Array, k: int):
    """Prompt logprobs: logprob and rank of `targets` [R] under logits [R, V], plus the top k."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
    top_vals, top_ids = jax.lax.top_k(logprobs, max(k, 1))
    return chosen, rank, top_ids[:, :k].astype(jnp.int32), top_vals[:, :k]


PROMPT_LOGPROB_ROWS = 64    # tokens whose logits [rows, V] exist at once in a prompt-logprobs step


def score_rows(logits_fn, hidden, rows, targets, k: int, chunk: int = PROMPT_LOGPROB_ROWS):
    """Prompt logprobs for the tokens `rows` [T] (the scored token indices first, then T) of
    hidden [T, E]: logits are computed `chunk` rows at a time for those tokens only (a loop
    with as many trips as the real rows need), never for all T tokens. Returns `score`'s
    (chosen [T], rank [T], top ids [T, k], top logprobs [T, k]); unscored tokens hold zeros."""
    T = hidden.shape[0]
    C = min(chunk, T)
    rows = jnp.pad(rows, (0, (-T) % C), constant_values=T)
    shapes = jax.eval_shape(lambda: score(logits_fn(hidden[:1]), targets[:1], k))
    init = tuple(jnp.zeros((T,) + s.shape[1:], s.dtype) for s in shapes)

    def body(i, out):
        idx = jax.lax.dynamic_slice_in_dim(rows, i * C, C)          # [C]; T: padding
        safe = jnp.minimum(idx, T - 1)
        res = score(logits_fn(hidden[safe]), targets[safe], k)
        return tuple(o.at[idx].set(r, mode="drop") for o, r in zip(out, res))

    return jax.lax.fori_loop(0, (jnp.sum(rows < T) + C - 1) // C, body, init)
