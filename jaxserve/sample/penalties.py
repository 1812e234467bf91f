"""Penalty state on the device: per-slot token counts and masks, so penalised requests never
create new shapes.

One row per input-batch slot (`C = max_num_seqs` rows, `V = vocab` columns). A request's row is
written once when the worker adds it (`write_row`, from host rows built by `host_rows`) and its
output counts grow on the device by the tokens each step samples (`count_sampled`). The sampler
reads the rows of the step's requests by slot (`apply_penalties`). Rows of requests without any
penalty are never read (their `penalised` flag is off), so they are not written on add.

`last_token` [C] holds each slot's last sampled token: with async scheduling the next step's
input ids take a token still in flight from it (`take_placeholders`), on the device.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyState:
    output_counts: jax.Array   # [C, V] i32, occurrences of each token in the outputs
    prompt_mask: jax.Array     # [C, V] bool, token occurs in the prompt
    bias: jax.Array            # [C, V] f32, logit_bias (0 elsewhere)
    stop_mask: jax.Array       # [C, V] bool, ids masked while output < min_tokens
    last_token: jax.Array      # [C] i32, the token each slot sampled last


def zeros(capacity: int, vocab: int) -> PenaltyState:
    shape = (capacity, vocab)
    return PenaltyState(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool),
                        jnp.zeros(shape, jnp.float32), jnp.zeros(shape, bool), jnp.zeros(capacity, jnp.int32))


def host_rows(prompt_ids, output_ids, logit_bias: dict | None, stop_ids, vocab: int):
    """One request's rows as numpy arrays ([V] each, in PenaltyState's field order). Ids outside
    [0, vocab) are ignored (as the old scatter with mode="drop" did); a bias of -inf becomes
    -1e30 so that penalties stay finite."""
    ids = np.asarray(output_ids, np.int64)
    counts = np.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab).astype(np.int32)
    prompt = np.zeros(vocab, bool)
    p = np.asarray(prompt_ids, np.int64)
    prompt[p[(p >= 0) & (p < vocab)]] = True
    bias = np.zeros(vocab, np.float32)
    for tok, val in (logit_bias or {}).items():
        if 0 <= tok < vocab:
            bias[tok] = max(float(val), _NEG)
    stop = np.zeros(vocab, bool)
    s = np.asarray(sorted(stop_ids), np.int64)
    stop[s[(s >= 0) & (s < vocab)]] = True
    return counts, prompt, bias, stop


@partial(jax.jit, donate_argnums=0)
def write_row(state: PenaltyState, slot: jax.Array, counts, prompt, bias, stop) -> PenaltyState:
    """Replace row `slot` (i32 scalar; C = dropped) with the host rows ([V] each)."""
    put = lambda a, row: a.at[slot].set(row, mode="drop")   # noqa: E731
    return PenaltyState(put(state.output_counts, counts), put(state.prompt_mask, prompt),
                        put(state.bias, bias), put(state.stop_mask, stop), state.last_token)


def count_sampled(state: PenaltyState, slots: jax.Array, token_ids: jax.Array) -> PenaltyState:
    """Add one occurrence of token_ids [R] to rows slots [R] and make each slot's last token its
    sample; padding rows carry slot C and are dropped. (With speculative decoding a slot has
    several rows and `last_token` one of them: it is read by async scheduling only, which
    speculative decoding does not use.)"""
    counts = state.output_counts.at[slots, token_ids].add(1, mode="drop")
    return dataclasses.replace(state, output_counts=counts,
                               last_token=state.last_token.at[slots].set(token_ids, mode="drop"))


def take_placeholders(tokens: jax.Array, state: PenaltyState) -> jax.Array:
    """Input ids [T] with each placeholder (-1 - slot: a token a step in flight samples) replaced
    by that slot's last sampled token."""
    slot = jnp.clip(-1 - tokens, 0, state.last_token.shape[0] - 1)
    return jnp.where(tokens < 0, state.last_token[slot], tokens)


def apply_penalties(logits, slots, penalised, min_tokens_active, presence, frequency,
                    repetition, state: PenaltyState):
    """vLLM v1's order on logits [R, V]: logit_bias, min_tokens stop-id mask, then repetition
    (prompt and output tokens), frequency and presence (output tokens). Rows whose `penalised`
    flag is off come back unchanged."""
    take = lambda a: jnp.take(a, slots, axis=0, mode="clip")   # noqa: E731  [R, V]
    counts = take(state.output_counts).astype(jnp.float32)
    out = logits + take(state.bias)
    out = jnp.where(min_tokens_active[:, None] & take(state.stop_mask), _NEG, out)
    seen = (counts > 0) | take(state.prompt_mask)
    rep = repetition[:, None]
    out = jnp.where(seen, jnp.where(out > 0, out / rep, out * rep), out)
    out = out - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return jnp.where(penalised[:, None], out, logits)
