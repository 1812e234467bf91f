"""One step's inputs as one pytree, and the host code that builds it from a SchedulerOutput and
the worker's input batch.

T is the token bucket, S the sequence bucket (`min(T, max_num_seqs rounded up to a power of
two)`), M the blocks per sequence. The prompt-logprobs variant (some row wants prompt logprobs)
carries `prompt_targets` and `prompt_rows` and computes logits for the S sampling rows and, a
chunk of rows at a time, for the tokens listed in `prompt_rows` only (the tokens of chunks that
want prompt logprobs and have a next prompt token); otherwise both are None and only the S
sampling rows get logits. The two variants are two compiled programs per
token bucket.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import AttentionMetadata
from jaxserve.core.scheduler_output import PLACEHOLDER_TOKEN_ID
from jaxserve.sample.sampler import SamplingTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    tokens: jax.Array              # [T] i32
    positions: jax.Array           # [T] i32
    meta: AttentionMetadata        # slot_mapping [T], block_tables [S, M], kv_lens [S], ...
    logit_rows: jax.Array          # [S] i32, token index of each sampling row's last token
    sampling: SamplingTensors      # [S] per field
    prompt_targets: jax.Array | None = None   # [T] i32, next prompt token of each token (0 pad)
    prompt_rows: jax.Array | None = None      # [T] i32, tokens scored for prompt logprobs first, then T
    # [S, ceil(V / 32)] i32 structured-output token bitmask of the sampling rows (all ones when
    # unconstrained); the runner sets it (build_inputs leaves None).
    bitmask: jax.Array | None = None
    # Speculative decoding only (else None): the sampler has R = min(T, S * (k + 1)) rows, one
    # per draft position and bonus position of each sampling request, packed in schedule order.
    draft_ids: jax.Array | None = None        # [R] i32, draft the row's sample verifies; -1 none
    group_start: jax.Array | None = None      # [R] i32, row of its request's first sampling row
    # Multi-LoRA only (else None): the device slot of each token's adapter, 0 for the base model
    # and padding (jaxserve/lora/weight.py).
    lora_slots: jax.Array | None = None       # [T] i32


_WORDS = {"int32": lambda a: a, "uint32": lambda a: a.view(np.int32), "float32": lambda a: a.view(np.int32),
          "bool": lambda a: a.astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class Packing:
    """How one StepInputs (the bitmask aside) lies in one int32 array: the step's inputs reach the
    device in one transfer, not one per field (~21: tokens, positions, the attention metadata,
    the sampling parameters, ...), and the step program unpacks them (static slices, bitcasts).
    A program's packing is static (its token bucket and variant fix every field's shape)."""
    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]    # each field's shape and dtype name

    @classmethod
    def of(cls, x: StepInputs) -> Packing:
        leaves, treedef = jax.tree_util.tree_flatten(dataclasses.replace(x, bitmask=None))
        fields = tuple((tuple(np.shape(a)), np.dtype(a.dtype).name) for a in leaves)
        for _, dtype in fields:
            if dtype not in _WORDS:
                raise ValueError(f"a step input of dtype {dtype} cannot be packed (int32, uint32, float32, bool)")
        return cls(treedef, fields)

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)

    def pack(self, x: StepInputs) -> np.ndarray:
        """The host arrays of x (bitmask aside) as one int32 array [size]."""
        leaves = jax.tree_util.tree_leaves(dataclasses.replace(x, bitmask=None))
        return np.concatenate([_WORDS[dtype](np.ascontiguousarray(a, dtype)).reshape(-1)
                               for a, (_, dtype) in zip(leaves, self.leaves)])

    def unpack(self, packed: jax.Array, bitmask=None) -> StepInputs:
        """Traced: the StepInputs `pack` made, with `bitmask` set."""
        out, at = [], 0
        for shape, dtype in self.leaves:
            n = int(np.prod(shape))
            words = packed[at:at + n].reshape(shape)
            at += n
            out.append(words != 0 if dtype == "bool" else
                       words if dtype == "int32" else jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
        return dataclasses.replace(jax.tree_util.tree_unflatten(self.treedef, out), bitmask=bitmask)


@dataclasses.dataclass
class StepLayout:
    """Where each scheduled row landed: its first token's offset and, for sampling rows, the
    sampler row (rows are packed in schedule order)."""
    offsets: list[int]
    sample_rows: dict[str, int]     # request_id -> (first) row of the sampler's output


def build_inputs(scheduled, batch, *, num_tokens: int, num_seqs: int, num_blocks: int,
                 block_size: int, max_blocks_per_seq: int, with_prompt_logprobs: bool,
                 num_sample_rows: int | None = None, speculative: bool = False,
                 lora_slots: dict[str, int] | None = None):
    """Host arrays (numpy) for one step -> (StepInputs, StepLayout). `scheduled`: the step's
    ScheduledRequests; `batch`: the InputBatch already updated from this SchedulerOutput.
    `lora_slots` (multi-LoRA; None: disabled): adapter name -> device slot of this step."""
    T, S, B, N = num_tokens, num_seqs, block_size, num_blocks
    # Per-row Python gathers lists of ints; numpy then fills every array in one pass each
    # (a decode step at 256 sequences would otherwise run ~10 numpy calls per row).
    count = len(scheduled)
    lens = [len(s.token_ids) for s in scheduled]
    ends = list(itertools.accumulate(lens))
    offsets = [e - n for e, n in zip(ends, lens)]
    total = ends[-1] if ends else 0
    computed = np.array([s.num_computed_tokens for s in scheduled], np.int32)
    lens_np = np.array(lens, np.int32)
    row_of = np.repeat(np.arange(count, dtype=np.int32), lens_np)        # each token's row
    tokens = np.zeros(T, np.int32)
    tokens[:total] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in scheduled), np.int32, total)
    pos = np.arange(total, dtype=np.int32) - np.repeat(np.array(offsets, np.int32) - computed, lens_np)
    positions = np.zeros(T, np.int32)
    positions[:total] = pos
    tables = np.zeros((S, max_blocks_per_seq), np.int32)
    num_table = np.array([len(s.block_ids) for s in scheduled], np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(s.block_ids for s in scheduled), np.int32, int(num_table.sum()))
    tables[np.repeat(np.arange(count), num_table),
           np.arange(len(flat)) - np.repeat(np.cumsum(num_table) - num_table, num_table)] = flat
    slots = np.full(T, N * B, np.int32)              # N * B: padding, dropped by the KV write
    slots[:total] = tables[row_of, pos // B] * B + pos % B
    slot_of = [batch.slot_of(s.request_id) for s in scheduled]    # each row's input-batch slot
    held = tokens[:total] == PLACEHOLDER_TOKEN_ID    # taken from the step in flight, on the device
    if held.any():
        tokens[:total][held] = -1 - np.array(slot_of, np.int32)[row_of[held]]
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:count] = computed + lens_np
    cu = np.zeros(S + 1, np.int32)
    cu[1:count + 1] = ends
    cu[count + 1:] = total
    R = num_sample_rows or S
    token_lora = None
    if lora_slots is not None:
        token_lora = np.zeros(T, np.int32)
        lora_of = [batch.requests[s.request_id].lora_request for s in scheduled]
        token_lora[:total] = np.repeat(np.array([0 if a is None else lora_slots[a.lora_name] for a in lora_of],
                                                np.int32), lens_np)
    # The sampler's rows: one per sampling request, or 1 + drafts with speculation.
    sample_rows, logit_rows_l, sample_slots, row_offsets, drafts_l, group_l = {}, [], [], [], [], []
    for s, end, slot in zip(scheduled, ends, slot_of):
        if not s.sample:
            continue
        d = len(s.spec_token_ids)
        first, num_rows = end - 1 - d, len(logit_rows_l)    # the last known token's logits
        sample_rows[s.request_id] = num_rows
        logit_rows_l.extend(range(first, first + d + 1))
        sample_slots.extend([slot] * (d + 1))
        row_offsets.extend(range(d + 1))
        drafts_l.extend(s.spec_token_ids)
        drafts_l.append(-1)                         # the bonus position verifies nothing
        group_l.extend([num_rows] * (d + 1))
    logit_rows = np.zeros(R, np.int32)
    logit_rows[:len(logit_rows_l)] = logit_rows_l
    draft_ids = group_start = None
    if speculative:
        draft_ids = np.full(R, -1, np.int32)
        draft_ids[:len(drafts_l)] = drafts_l
        group_start = np.zeros(R, np.int32)
        group_start[:len(group_l)] = group_l
    targets = np.zeros(T, np.int32) if with_prompt_logprobs else None
    prompt_rows = np.full(T, T, np.int32) if with_prompt_logprobs else None
    num_prompt_rows = 0
    for s, start, n in zip(scheduled, offsets, lens):
        if targets is None or not s.prompt_logprobs:
            continue
        prompt = batch.requests[s.request_id].prompt_token_ids
        nxt = pos[start:start + n] + 1              # the token each position predicts
        inside = nxt < len(prompt)
        targets[start:start + n][inside] = np.asarray(prompt, np.int32)[nxt[inside]]
        scored = start + np.flatnonzero(inside).astype(np.int32)
        prompt_rows[num_prompt_rows:num_prompt_rows + len(scored)] = scored
        num_prompt_rows += len(scored)
    meta = AttentionMetadata(slots, tables, kv_lens, cu, np.array([len(scheduled)], np.int32))
    arrays = batch.sampling_arrays(sample_slots, R)
    if speculative and row_offsets:
        # Each draft position samples the output index it would fill.
        off = np.zeros(R, np.int32)
        off[:len(row_offsets)] = row_offsets
        before = arrays["positions"]
        arrays["positions"] = before + off
        # min_tokens_active was positions < min_tokens; shift it with the positions.
        min_tokens = batch.min_tokens_of(arrays["slots"])
        arrays["min_tokens_active"] = arrays["positions"] < min_tokens
    sampling = SamplingTensors(**arrays)
    inputs = StepInputs(tokens, positions, meta, logit_rows, sampling, prompt_targets=targets,
                        prompt_rows=prompt_rows, draft_ids=draft_ids, group_start=group_start,
                        lora_slots=token_lora)
    return inputs, StepLayout(offsets, sample_rows)


def step_bitmask(grammar, sample_rows: dict[str, int], num_rows: int, mask_words: int,
                 num_drafts: dict[str, int]) -> np.ndarray:
    """[R, W] host bitmask of a step: the grammar rows (a core.scheduler.GrammarBitmask; 1 + drafts
    rows per request, in order) at their request's sampling rows, all ones elsewhere."""
    mask = np.full((num_rows, mask_words), -1, np.int32)
    words = min(mask_words, grammar.bitmask.shape[1])
    src = 0
    for rid in grammar.request_ids:
        n = 1 + num_drafts.get(rid, 0)
        row = sample_rows.get(rid)
        if row is not None:
            mask[row:row + n, :words] = grammar.bitmask[src:src + n, :words]
        src += n
    return mask
