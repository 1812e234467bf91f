"""A small test-side driver that runs a model through the paged KV cache by hand.

Not a fake: it calls the real jitted family `forward` + `compute_logits` with `AttentionMetadata`
built as docs/internals.md specifies. Blocks come from a plain counter (no prefix caching, no
scheduler), so a failure here points at the model, the cache or attention, not the engine.

Shapes are padded to a few buckets (tokens T, sequences S) so jit compiles a handful of programs
per model: padding tokens get slot N * B, padding sequences kv_len 0 and q_len 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import AttentionMetadata
from jaxserve.attention import kv_cache as kvc
from jaxserve.config import ModelConfig
from jaxserve.models import get_model

# No 1-token bucket: on XLA:CPU a T=1 step with a large cache ran ~15x slower than T=8
# (2.3 s vs 0.16 s per decode step with 160 blocks), apparently copying the cache every layer.
TOKEN_BUCKETS = (8, 32, 128, 512)
SEQ_BUCKETS = (1, 4, 16, 32)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0            # tokens whose K/V are already in the cache


class PagedRunner:
    """Owns one paged KV cache and runs steps of (seq_id, new_token_ids) rows through the model."""

    def __init__(self, cfg: ModelConfig, weights, *, block_size: int = 16, num_blocks: int = 256,
                 max_blocks_per_seq: int = 16):
        self.cfg, self.weights = cfg, weights
        self.B, self.N, self.M = block_size, num_blocks, max_blocks_per_seq
        self.cache = kvc.allocate(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                  cfg.head_dim, weights.embed.dtype, latent=cfg.mla is not None)
        self.seqs: dict[object, _Seq] = {}
        self._next_block = itertools.count()

        model = get_model(cfg.architecture)      # the family's forward (llama.py, gemma.py, ...)

        def step(w, cache, tokens, positions, meta, logit_rows):
            hidden, cache = model.forward(w, cache, tokens, positions, meta, cfg=cfg)
            return model.compute_logits(w, hidden[logit_rows]), cache

        self._step = jax.jit(step, donate_argnums=(1,))

    def reset(self):
        """Forget every sequence and hand out blocks from 0 again. The cache is not zeroed, so
        stale K/V from earlier runs must be masked out by kv_lens, as in the engine."""
        self.seqs.clear()
        self._next_block = itertools.count()

    def _slot(self, seq: _Seq, pos: int) -> int:
        while len(seq.blocks) <= pos // self.B:
            block = next(self._next_block)
            if block >= self.N or len(seq.blocks) >= self.M:
                raise RuntimeError("PagedRunner ran out of KV blocks; raise num_blocks/M")
            seq.blocks.append(block)
        return seq.blocks[pos // self.B] * self.B + pos % self.B

    def step(self, rows: list[tuple[object, list[int]]], all_logits: bool = False):
        """Run one ragged step. rows: (seq_id, new token ids) with distinct seq ids; a new seq id
        starts a sequence. Returns per row the logits [q_len, V] of every new token when
        `all_logits`, else of its last token [V]."""
        assert rows and len({sid for sid, _ in rows}) == len(rows)
        num_tokens = sum(len(t) for _, t in rows)
        T = _bucket(num_tokens, TOKEN_BUCKETS)
        S = _bucket(len(rows), SEQ_BUCKETS)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, self.N * self.B, np.int32)
        tables = np.zeros((S, self.M), np.int32)
        kv_lens = np.zeros(S, np.int32)
        cu = np.zeros(S + 1, np.int32)
        t = 0
        for s, (sid, new) in enumerate(rows):
            assert len(new) > 0
            seq = self.seqs.setdefault(sid, _Seq())
            for i, tok in enumerate(new):
                pos = seq.num_cached + i
                tokens[t], positions[t], slots[t] = tok, pos, self._slot(seq, pos)
                t += 1
            seq.num_cached += len(new)
            tables[s, :len(seq.blocks)] = seq.blocks
            kv_lens[s] = seq.num_cached
            cu[s + 1] = t
        cu[len(rows) + 1:] = t
        if all_logits:
            logit_rows = np.zeros(T, np.int32)
            logit_rows[:num_tokens] = np.arange(num_tokens)
        else:
            logit_rows = np.zeros(S, np.int32)
            logit_rows[:len(rows)] = cu[1:len(rows) + 1] - 1
        meta = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
                                 kv_lens=jnp.asarray(kv_lens), cu_q_lens=jnp.asarray(cu),
                                 num_seqs=jnp.asarray([len(rows)], jnp.int32))
        logits, self.cache = self._step(self.weights, self.cache, jnp.asarray(tokens),
                                        jnp.asarray(positions), meta, jnp.asarray(logit_rows))
        logits = np.asarray(logits)
        if all_logits:
            return [logits[cu[s]:cu[s + 1]] for s in range(len(rows))]
        return [logits[s] for s in range(len(rows))]

    # --- drivers -------------------------------------------------------------------------------

    def prefill_logits(self, prompt: list[int], chunk_sizes=None) -> np.ndarray:
        """Logits [len(prompt), V] of every prompt position, prefilled whole or in chunks."""
        sid = object()
        out = [self.step([(sid, chunk)], all_logits=True)[0]
               for chunk in _split(prompt, chunk_sizes)]
        return np.concatenate(out)

    def generate(self, prompt: list[int], max_new_tokens: int, chunk_sizes=None) -> list[int]:
        """Greedy: prefill (whole, or in chunks of `chunk_sizes` cycled) then decode one token
        per step."""
        sid = object()
        for chunk in _split(prompt, chunk_sizes):
            logits = self.step([(sid, chunk)])[0]
        out = [int(np.argmax(logits))]
        while len(out) < max_new_tokens:
            out.append(int(np.argmax(self.step([(sid, [out[-1]])])[0])))
        return out

    def generate_batched(self, prompts: list[list[int]], max_new_tokens: int,
                         chunk_sizes=(5, 11, 3), max_seqs_per_step: int = 8,
                         token_budget: int = 32) -> list[list[int]]:
        """Greedy for all prompts in one stream of ragged steps. Sequences are admitted a few at a
        time, so most steps mix prefill chunks of different sizes with decode rows."""
        chunk_sizes = itertools.cycle(chunk_sizes)
        pending = [p for p in prompts]
        queued = list(range(len(prompts)))          # not yet started
        progress = [0] * len(prompts)               # prompt tokens sent
        outputs: list[list[int]] = [[] for _ in prompts]
        running: list[int] = []
        while queued or running:
            while queued and len(running) < max_seqs_per_step:
                running.append(queued.pop(0))
            rows, budget = [], token_budget
            for i in running:
                if budget == 0:
                    break
                if progress[i] < len(pending[i]):
                    n = min(next(chunk_sizes), len(pending[i]) - progress[i], budget)
                    rows.append((i, pending[i][progress[i]:progress[i] + n]))
                    progress[i] += n
                else:
                    n = 1
                    rows.append((i, [outputs[i][-1]]))
                budget -= n
            logits = self.step(rows)
            for (i, _), lg in zip(rows, logits):
                if progress[i] == len(pending[i]):   # prompt done: this row's logits sample
                    outputs[i].append(int(np.argmax(lg)))
            for i in list(running):
                if len(outputs[i]) >= max_new_tokens:
                    running.remove(i)
        return outputs


def _split(prompt: list[int], chunk_sizes):
    if not chunk_sizes:
        yield list(prompt)
        return
    i = 0
    for n in itertools.cycle(chunk_sizes):
        if i >= len(prompt):
            return
        yield list(prompt[i:i + n])
        i += n


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """log_softmax of a transformers model's logits [len(ids), V], f64."""
    import torch
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def prefill_logprobs(runner: PagedRunner, ids: list[int]) -> np.ndarray:
    """log_softmax of the runner's prefill logits [len(ids), V], f64."""
    logits = runner.prefill_logits(ids).astype(np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
