"""Training batches: (prompt, completion) token lists packed as one flat step of prefill rows.

A batch is laid out exactly as a serving step is (docs/internals.md): tokens [T] of S sequences one
after another, each prefilled whole into its own M blocks of a fresh cache, so the model's own
`forward` runs it. Every batch of the same (num_seqs, max_len) has the same shapes: one compiled
train step. The loss reads the logits of the `rows`: the tokens followed by a completion token.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.attention import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
    tokens: jax.Array       # [T] int32, T = S * max_len; padding 0
    positions: jax.Array    # [T] int32
    meta: AttentionMetadata
    rows: jax.Array         # [R] int32, the tokens whose next token is a completion token (0: padding)
    targets: jax.Array      # [R] int32, that next token
    mask: jax.Array         # [R] f32, 1 for a real row, 0 for padding
    block_size: int = dataclasses.field(default=16, metadata=dict(static=True))

    @property
    def num_blocks(self) -> int:
        """Blocks the batch's fresh cache needs: S * M."""
        return self.meta.block_tables.size


def make_batch(examples: list[tuple[list[int], list[int]]], *, num_seqs: int, max_len: int,
               max_targets: int | None = None, block_size: int = 16, num_tokens: int | None = None) -> TrainBatch:
    """Pack up to `num_seqs` (prompt ids, completion ids) pairs, each cut to `max_len` tokens.
    Fewer examples than `num_seqs` leave padding sequences (kv_len 0). `max_targets` (default
    num_seqs * max_len): the loss rows R; fewer than all tokens saves the head's matmul on the
    prompts (its [R, V] logits are a fifth of the step on the default model). `num_tokens`
    (default num_seqs * max_len): T, the step's tokens; fewer packs short sequences densely (the
    examples' tokens must fit)."""
    if not 0 < len(examples) <= num_seqs:
        raise ValueError(f"examples: 1 to num_seqs={num_seqs} pairs per batch, got {len(examples)}")
    S, B = num_seqs, block_size
    M = -(-max_len // B)
    T = S * max_len if num_tokens is None else num_tokens
    used = sum(min(max_len, len(p) + len(c)) for p, c in examples)
    if used > T:
        raise ValueError(f"num_tokens={T} is less than the examples' {used} tokens")
    tokens, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
    R = T if max_targets is None else max_targets
    rows, targets = [], []
    slots = np.full(T, S * M * B, np.int32)           # N * B: dropped by the cache write
    tables = np.arange(S * M, dtype=np.int32).reshape(S, M)   # sequence s owns blocks s*M ..
    kv_lens, cu = np.zeros(S, np.int32), np.zeros(S + 1, np.int32)
    t = 0
    for s, (prompt, completion) in enumerate(examples):
        if not prompt or not completion:
            raise ValueError(f"examples[{s}]: prompt and completion must both be non-empty token lists")
        ids = (list(prompt) + list(completion))[:max_len]
        n = len(ids)
        pos = np.arange(n)
        tokens[t:t + n], positions[t:t + n] = ids, pos
        slots[t:t + n] = tables[s, pos // B] * B + pos % B
        for i in range(len(prompt) - 1, n - 1):        # the next token belongs to the completion
            rows.append(t + i)
            targets.append(ids[i + 1])
        kv_lens[s] = n
        t += n
        cu[s + 1] = t
    cu[len(examples) + 1:] = t
    if len(rows) > R:
        raise ValueError(f"max_targets={R} is less than the batch's {len(rows)} completion tokens")
    mask = np.zeros(R, np.float32)
    mask[:len(rows)] = 1.0
    rows = np.asarray(rows + [0] * (R - len(rows)), np.int32)
    targets = np.asarray(targets + [0] * (R - len(targets)), np.int32)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, kv_lens=kv_lens, cu_q_lens=cu,
                             num_seqs=np.asarray([len(examples)], np.int32))
    return TrainBatch(tokens, positions, meta, rows, targets, mask, B)


def packed_chunks(lengths: list[int], num_tokens: int, max_seqs: int) -> list[list[int]]:
    """Indices of sequences of `lengths` (each <= num_tokens) in passes of at most `num_tokens`
    tokens and `max_seqs` sequences: first fit, longest first (little padding)."""
    chunks, used = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        c = next((c for c in range(len(chunks))
                  if used[c] + lengths[i] <= num_tokens and len(chunks[c]) < max_seqs), len(chunks))
        if c == len(chunks):
            chunks.append([])
            used.append(0)
        chunks[c].append(i)
        used[c] += lengths[i]
    return chunks
