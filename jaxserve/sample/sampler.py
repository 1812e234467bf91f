"""On-device sampling with vLLM's semantics, as one jitted function over a batch of logit rows.

Order of operations (vLLM v1): the structured-output bitmask first (forbidden tokens -> -1e30;
vLLM too masks the logits before its sampler, so logprobs show the constrained distribution);
logprobs are taken from these logits, before penalties; then logit_bias, min_tokens (stop ids
masked), repetition / frequency / presence penalties; greedy rows take the argmax;
random rows are divided by their temperature and filtered by min_p, top_k and top_p, then
sampled with the Gumbel-max trick. Each row's noise comes from its own key, derived from the
request's seed and its output position only, so a seeded request samples the same tokens
whatever else shares the batch.

Shapes are fixed, so one program per row count serves every mix of requests: on CPU the
optional stages (penalties, filters, noise, logprobs) are `lax.cond`s on whether any row needs
them (only the taken branch runs); on GPU, where XLA runs a conditional by copying its predicate
to the host and blocking the stream, every stage runs branch-free (the form is chosen at trace
time from the compile target, `target_platform`). Penalties read fixed `[C, V]` state by slot
(`penalties.py`), and top logprobs are always `k` (the engine's max_logprobs) wide; callers
slice what was asked for. The filters never sort the vocabulary (`_apply_filters`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.pallas.common import target_platform
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


CANDIDATES = 64      # the top-k width whose values usually settle top_k and top_p (CPU)
_RADIX_BITS = {"gpu": 4}   # key bits a pass of the exact search settles (15 thresholds a pass); else 1


def _keys(x):
    """f32 [..] -> u32 keys in the same order (-0.0 counted as +0.0; NaN unordered)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _value(key):
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_key(holds, rows: int, bits: int):
    """The largest u32 key a [rows] with holds(a), for holds monotone (true up to some key) and
    true at 0: `bits` bits a pass (32 / bits passes, a static trip count: no host sync on GPU),
    each pass one call holds(keys [rows, n]) -> [rows, n] bool at n = 2**bits - 1 keys."""
    j = jnp.arange(1, 2 ** bits, dtype=jnp.uint32)

    def body(i, a):
        shift = (32 - bits * (i + 1)).astype(jnp.uint32)
        held = holds(a[:, None] | (j << shift))
        return a | (jnp.sum(held, axis=-1, dtype=jnp.uint32) << shift)

    return jax.lax.fori_loop(0, 32 // bits, body, jnp.zeros(rows, jnp.uint32))


def _kth_largest(x, k, bits: int):
    """The k-th largest value of each row of x [R, V] (k [R] i32 in [1, V]), ties counted. The
    keys are made once, before the passes: each pass reads them alone (made inside the loop,
    XLA:GPU wrote them out and read them back every pass: 3x the bytes)."""
    keys = _keys(x)
    return _value(_largest_key(
        lambda c: jnp.sum(keys[:, None, :] >= c[..., None], axis=-1) >= k[:, None], x.shape[0], bits))


def _top_p_cutoff(x, thr_k, m, total, top_p, bits: int):
    """The smallest value v of each row of x [R, V] whose higher values' mass is below top_p [R],
    the mass of a value being the reference's probability exp(x - m) / total where x >= thr_k
    ([R, 1] each): the lowest value the sorted reference keeps. -inf when the whole mass is below
    top_p. Keys and probabilities are made once, before the passes (as `_kth_largest`'s keys)."""
    keys = _keys(x)
    probs = jnp.where(x >= thr_k, jnp.exp(x - m), 0) / total

    def holds(c):
        return jnp.sum(jnp.where(keys[:, None, :] > c[..., None], probs[:, None, :], 0),
                       axis=-1) >= top_p[:, None]

    a = _largest_key(holds, x.shape[0], bits)
    return jnp.where(jnp.sum(probs, axis=-1) >= top_p, _value(a + 1), -jnp.inf)


def _apply_filters(x, t: SamplingTensors, platform: str | None = None):
    """min_p, then top_k, then top_p on temperature-scaled logits x [R, V] (vLLM's order): the
    removed tokens set to -1e30, the kept set that of sorting the vocabulary (tests' reference
    `ref_apply_filters`) without sorting it. Rows without filters come back unchanged; top_p >= 1
    keeps every token. Each filter is a threshold on the value, so ties at a cutoff are kept.

    min_p is the reference's elementwise test. top_k and top_p: on CPU from the top CANDIDATES
    values (`lax.top_k`), exact whenever k <= CANDIDATES and the candidates' mass settles top_p;
    rows they do not settle take the exact search (`_largest_key`, under a cond). On GPU the
    search runs for every row, branch-free (XLA:GPU's top_k over 16 is a full sort). `platform`:
    the form to trace (default: the compile target's)."""
    R, V = x.shape
    platform = platform or target_platform()
    gpu = platform == "gpu"
    bits = _RADIX_BITS.get(platform, 1)

    def min_p(x):
        probs = jax.nn.softmax(x, axis=-1)
        return jnp.where(probs < t.min_p[:, None] * probs.max(-1, keepdims=True), _NEG, x)

    x = min_p(x) if gpu else jax.lax.cond(jnp.any(t.min_p > 0), min_p, lambda x: x, x)
    k = jnp.where((t.top_k > 0) & (t.top_k < V), t.top_k, V)             # V: off
    use_p = t.top_p < 1.0
    m = x.max(-1, keepdims=True)
    if gpu:
        kth = _kth_largest(x, k, bits)
    else:
        vals = _kept_top_k(x, min(CANDIDATES, V))[0]                  # [R, K] descending
        K = vals.shape[1]
        kth = jnp.take_along_axis(vals, jnp.minimum(k, K)[:, None] - 1, axis=-1)[:, 0]
        need = (k < V) & (k > K)
        kth = jax.lax.cond(jnp.any(need), lambda: jnp.where(need, _kth_largest(x, k, bits), kth),
                           lambda: kth)
    thr_k = jnp.where(k < V, kth, -jnp.inf)[:, None]                   # [R, 1]
    # The reference's probabilities after top_k: softmax over the kept values.
    e = jnp.where(x >= thr_k, jnp.exp(x - m), 0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    if gpu:
        thr_p = _top_p_cutoff(x, thr_k, m, total, t.top_p, bits)
    else:
        p = jnp.where(vals >= thr_k, jnp.exp(vals - m), 0) / total       # [R, K]
        kept = (jnp.cumsum(p, axis=-1) - p) < t.top_p[:, None]
        # Candidates whose mass before them is known: those above every other token, and, when
        # top_k keeps candidates only, those top_k removed (no mass).
        w = vals[:, -1:]
        known = (vals > w) | ((thr_k > w) & (vals < thr_k)) | (K == V)
        settled = jnp.any(known & ~kept, axis=-1) | (K == V)
        thr_p = jnp.min(jnp.where(kept & known, vals, jnp.inf), axis=-1)
        need = use_p & ~settled
        thr_p = jax.lax.cond(
            jnp.any(need), lambda: jnp.where(need, _top_p_cutoff(x, thr_k, m, total, t.top_p, bits), thr_p),
            lambda: thr_p)
    thr_p = jnp.where(use_p, thr_p, -jnp.inf)[:, None]
    return jnp.where(x >= jnp.maximum(thr_k, thr_p), x, _NEG)


def _kept_top_k(x: jax.Array, k: int):
    """lax.top_k by XLA:CPU's top-k kernel. Its rewrite matches only a sort whose both outputs are
    sliced, which simplifying the uses of the values alone undoes (a full sort, ~100x slower at
    [32, 32000]), as does XLA moving the slices out of a loop body (prompt logprobs of 20
    tokens: 265 ms instead of 9); a barrier over both outputs keeps them. One array, not the
    (values, indices) tuple: a tuple barrier crashes XLA's SPMD partitioner under tensor
    parallelism ("cannot be downcasted to HloGetTupleElementInstruction", jaxlib 0.10.2)."""
    v, i = jax.lax.top_k(x, k)
    both = jax.lax.optimization_barrier(jnp.stack([v, jax.lax.bitcast_convert_type(i, v.dtype)]))
    return both[0], jax.lax.bitcast_convert_type(both[1], i.dtype)


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
    # Greedy rows' filters are void: they neither run the exact search nor keep the cond open.
    t = dataclasses.replace(t, top_k=jnp.where(rand, t.top_k, 0), top_p=jnp.where(rand, t.top_p, 1.0),
                            min_p=jnp.where(rand, t.min_p, 0.0))
    if target_platform() == "gpu":
        scaled = _apply_filters(scaled, t)
    else:
        filtered = (t.top_k > 0) | (t.top_p < 1.0) | (t.min_p > 0)
        scaled = jax.lax.cond(jnp.any(filtered), _apply_filters, lambda x, _: x, scaled, t)
    noise = jax.vmap(_gumbel, in_axes=(0, 0, None))(t.seeds, t.positions, V)
    return jnp.where(rand, argmax_last(scaled + noise), greedy_ids).astype(jnp.int32)


def _top_k(x, k: int):
    """lax.top_k over the last axis. On GPU past 16 (where XLA sorts the whole row instead of
    running its top-k kernel) as rounds of 16, each round's picks set to -inf for the next."""
    if target_platform() != "gpu":
        return _kept_top_k(x, k)
    if k <= 16:
        return jax.lax.top_k(x, k)
    rows = jnp.arange(x.shape[0])[:, None]
    vals, ids = [], []
    for _ in range(-(-k // 16)):
        v, i = jax.lax.top_k(x, 16)
        vals.append(v)
        ids.append(i)
        x = x.at[rows, i].set(-jnp.inf)
    return jnp.concatenate(vals, -1)[:, :k], jnp.concatenate(ids, -1)[:, :k]


def _logprobs(logits, ids, k: int):
    """(logprob, rank, top k ids, top k logprobs) of the sampled ids under the raw logits."""
    raw = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(raw, ids[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(raw > chosen[:, None], axis=-1).astype(jnp.int32)
    top_vals, top_ids = _top_k(raw, k) if k else (raw[:, :0], raw[:, :0])
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
    penalise = lambda x: apply_penalties(x, t.slots, t.penalised, t.min_tokens_active,  # noqa: E731
                                         t.presence, t.frequency, t.repetition, state)
    if target_platform() == "gpu":
        # XLA:GPU runs a conditional by copying its predicate to the host and blocking the
        # stream: every stage runs, each leaving the rows that did not ask for it as they were.
        logits = penalise(logits)
        ids = _draw(logits, argmax_last(logits), t)
        lp = _logprobs(raw, ids, k)
        lp = jax.tree.map(lambda a, b: jnp.where(jnp.any(t.logprobs), a, b), lp, _no_logprobs(raw, ids, k))
        return SamplerOutput(ids, *lp)
    # On CPU a stage no row needs is skipped (only the taken branch runs).
    logits = jax.lax.cond(jnp.any(t.penalised), penalise, lambda x: x, logits)
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
    top_vals, top_ids = _top_k(logprobs, max(k, 1))
    return chosen, rank, top_ids[:, :k].astype(jnp.int32), top_vals[:, :k]


PROMPT_LOGPROB_ROWS = 64    # tokens whose logits [rows, V] exist at once in a prompt-logprobs step


def score_rows(logits_fn, hidden, rows, targets, k: int, chunk: int = PROMPT_LOGPROB_ROWS):
    """Prompt logprobs for the tokens `rows` [T] (the scored token indices first, then T) of
    hidden [T, E]: logits are computed `chunk` rows at a time for those tokens only (a loop
    with as many trips as the real rows need), never for all T tokens. On a GPU the loop runs
    every chunk of T (a trip count known at compile time: XLA:GPU reads a dynamic one's
    condition on the host every trip); a scoring step's prompt fills most of its bucket anyway,
    and chunks past the scored rows score padding. Returns `score`'s (chosen [T], rank [T], top
    ids [T, k], top logprobs [T, k]); unscored tokens hold zeros."""
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

    trips = rows.shape[0] // C if target_platform() == "gpu" else (jnp.sum(rows < T) + C - 1) // C
    return jax.lax.fori_loop(0, trips, body, init)
