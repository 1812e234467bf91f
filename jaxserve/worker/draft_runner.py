"""The draft model of speculative decoding (`speculative_config={"model": PATH, ...}`): a smaller
model sharing the target's tokenizer, in the same process and mesh, with its own paged KV pool.

The draft's pool has the target's number of blocks and block size and is indexed by the same
block tables and slot mappings, so the scheduler and the KV cache manager know nothing of it
(vLLM v1's draft-model design). Each step, after the target's step:

1. `catch_up`: the draft runs the step's own tokens (prompt chunks, known tokens, the drafts the
   target verified) with the step's attention metadata, so its KV is valid wherever the
   target's is: every position below `num_computed_tokens`, in every block the prefix cache may
   hand out later. K/V it wrote for rejected drafts lies past `num_computed_tokens` and is
   overwritten before anything reads it, as in the target's pool.
2. `propose`: for each row that sampled, the draft feeds the last emitted token at its position
   and then its own argmax, k single-token steps in one jitted loop batched over the rows,
   writing K/V at the next k positions (the scheduler allocates those slots:
   `SchedulerConfig.num_lookahead_tokens`). The argmax drafts are point masses, so the
   rejection sampler keeps the target's distribution exact for every sampling setting.

Programs: one catch-up per token bucket (the target's buckets) and one proposal loop per
sequence bucket, compiled ahead of time in `warmup()`.
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import AttentionMetadata
from jaxserve.attention import kv_cache as kvc
from jaxserve.config import ModelConfig
from jaxserve.models import get_model
from jaxserve.sample.sampler import argmax_last
from jaxserve.sharding.plan import ShardingPlan, single_device_plan
from jaxserve.worker.compile_cache import compile_noting_cache_hit, how_obtained, step_compiler_options
from jaxserve.worker.kv_sizing import allocate_sharded_kv_cache, is_latent, kv_cache_sharding

logger = logging.getLogger(__name__)


def read_draft_config(path: str | os.PathLike, target: ModelConfig, target_tokenizer=None,
                      load_format: str = "auto", reader=None) -> ModelConfig:
    """The draft's ModelConfig, checked against the target's before any weight is read: same
    vocabulary size and, where the draft ships a tokenizer, the same token -> id map. `reader`:
    an open GGUF reader of a .gguf draft. Raises ValueError naming `speculative_config.model`."""
    from jaxserve.loader.loader import ModelLoadError, gguf_config_of, load_hf_config
    p = Path(path)
    if not p.exists():
        raise ValueError(f"speculative_config.model: {str(path)!r} is not a local model path (a "
                         "Hugging Face directory or a .gguf file)")
    try:
        cfg = gguf_config_of(p, reader) if p.is_file() else load_hf_config(p)
    except (ModelLoadError, OSError, KeyError) as e:
        raise ValueError(f"speculative_config.model: cannot read the draft model at "
                         f"{str(path)!r}: {e}") from None
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft model's vocabulary ({cfg.vocab_size}"
                         f" tokens) differs from the target's ({target.vocab_size}); a draft "
                         "must share the target's tokenizer")
    if target_tokenizer is not None and load_format != "dummy":
        draft_vocab = _draft_vocab(p, reader)
        if draft_vocab is not None and draft_vocab != target_tokenizer.get_vocab():
            raise ValueError("speculative_config.model: the draft model's tokenizer maps tokens "
                             "to ids differently from the target's; a draft must share the "
                             "target's tokenizer")
    return cfg


def _draft_vocab(path: Path, reader) -> dict[str, int] | None:
    from jaxserve.tokenizer.tokenizer import Tokenizer
    if path.is_file():
        return Tokenizer.from_gguf(reader if reader is not None else path).get_vocab()
    if not (path / "tokenizer.json").exists():
        return None
    return Tokenizer.from_pretrained_dir(path).get_vocab()


def lookahead_meta(tables, pos, limits, num_rows, block_size: int, num_blocks: int) -> AttentionMetadata:
    """The attention metadata of one chained single-token draft step: row i (real below
    num_rows [1]) writes its token at `pos[i]` into its block table `tables[i]` [S, M]. Past
    the allocated slots (`limits`: max_model_len or the blocks held) the write is dropped; such
    drafts are never scheduled (no room), so what they read does not matter."""
    S, M = tables.shape
    B, N = block_size, num_blocks
    real = jnp.arange(S) < num_rows[0]
    cu = jnp.minimum(jnp.arange(S + 1, dtype=jnp.int32), num_rows[0])
    block = jnp.take_along_axis(tables, jnp.minimum(pos // B, M - 1)[:, None], 1)[:, 0]
    slot = jnp.where(real & (pos < limits), block * B + pos % B, N * B)
    return AttentionMetadata(slot, tables, jnp.where(real, pos + 1, 0), cu, num_rows)


def row_tables(blocks_of_rows, num_rows: int, max_blocks_per_seq: int, block_size: int,
               max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Host block tables [num_rows, M] and write limits [num_rows] of the drafting rows (each
    row's block ids; missing rows are padding)."""
    tables = np.zeros((num_rows, max_blocks_per_seq), np.int32)
    limits = np.zeros(num_rows, np.int32)
    for i, blocks in enumerate(blocks_of_rows):
        tables[i, :len(blocks)] = blocks
        limits[i] = min(len(blocks) * block_size, max_model_len)
    return tables, limits


class DraftRunner:
    """The draft's weights, KV pool and programs. `catch_up(inputs)` after the target's step,
    then `propose(scheduled, sampled)` -> request id -> k greedy draft ids."""

    def __init__(self, model_config: ModelConfig, weights, *, num_blocks: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, num_speculative_tokens: int, dtype,
                 backend: str, kv_quantize=None, kv_dtype=None, plan: ShardingPlan | None = None):
        self.cfg = cfg = model_config
        self.plan = plan = plan or single_device_plan(model_config)
        self.weights = weights
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.k = k = num_speculative_tokens
        # Sequence buckets of the proposal loop: powers of two from 8 (XLA:CPU runs a 1-row
        # step far slower than an 8-row one) to cover max_num_seqs.
        self.seq_buckets, b = [], 8
        while True:
            self.seq_buckets.append(b)
            if b >= max_num_seqs:
                break
            b *= 2
        quantized = kv_quantize is not None
        self.cache = self._allocate_cache(kv_dtype or dtype, quantized)
        model = get_model(cfg.architecture)
        forward = partial(model.forward, cfg=cfg, backend=backend, kv_quantize=kv_quantize,
                          plan=plan)
        def catch_up(weights, cache, tokens, positions, meta):
            _, cache = forward(weights, cache, tokens, positions, meta)
            return cache

        def propose(weights, cache, tokens, positions, tables, limits, num_seqs, num_steps):
            # tokens, positions, limits [S]; tables [S, M]; num_seqs, num_steps [1] (<= k)
            S = tokens.shape[0]

            def body(j, carry):
                cache, tok, pos, out = carry
                meta = lookahead_meta(tables, pos, limits, num_seqs, block_size, num_blocks)
                hidden, cache = forward(weights, cache, tok, pos, meta)
                logits = jax.lax.with_sharding_constraint(model.compute_logits(weights, hidden),
                                                          plan.sharding(("tokens", "vocab")))
                logits = jax.lax.with_sharding_constraint(logits, plan.replicated)
                nxt = argmax_last(logits)
                return cache, nxt, pos + 1, out.at[:, j].set(nxt)

            init = (cache, tokens, positions, jnp.zeros((S, k), jnp.int32))
            cache, _, _, out = jax.lax.fori_loop(0, num_steps[0], body, init)
            return out, cache

        cache_sharding = self._cache_sharding(quantized, self.cache.codes)
        self._catch_up = jax.jit(catch_up, donate_argnames=("cache",), out_shardings=cache_sharding)
        self._propose = jax.jit(propose, donate_argnames=("cache",),
                                out_shardings=(plan.replicated, cache_sharding))
        self._executables: dict[tuple[str, int], jax.stages.Compiled] = {}

    # -- the pool (the target's layout: [L, N, B, K, D], split on KV heads) ----------------------
    def _cache_sharding(self, quantized: bool, codes: str | None) -> kvc.KVCache:
        return kv_cache_sharding(self.plan, quantized, codes, is_latent(self.cfg))

    def _allocate_cache(self, dtype, quantized: bool) -> kvc.KVCache:
        return allocate_sharded_kv_cache(self.cfg, self.plan, self.num_blocks, self.block_size,
                                         dtype, quantized)

    # -- programs --------------------------------------------------------------------------------
    def _seq_bucket(self, n: int) -> int:
        for b in self.seq_buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} proposing rows exceed the largest bucket {self.seq_buckets[-1]}")

    def _executable(self, kind: str, size: int, example):
        key = (kind, size)
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                                example)
            fn = self._catch_up if kind == "catch_up" else self._propose
            options = step_compiler_options(jax.tree_util.tree_leaves(self.weights)[0].devices(), self.weights)
            exe, from_cache = compile_noting_cache_hit(
                lambda: fn.lower(self.weights, self.cache, *spec).compile(options))
            self._executables[key] = exe
            logger.info("draft %s program: %d %s, %s (%.1f s)", kind, size,
                        "tokens" if kind == "catch_up" else "rows", how_obtained(from_cache),
                        time.perf_counter() - t0)
        return exe

    @property
    def compiled_programs(self) -> list[tuple[str, int]]:
        return sorted(self._executables)

    def _proposal_inputs(self, rows, S: int, num_steps: int = 0):
        """rows: (last token, its position, block ids) -> the proposal loop's host arrays."""
        tokens = np.zeros(S, np.int32)
        positions = np.zeros(S, np.int32)
        for i, (tok, pos, _) in enumerate(rows):
            tokens[i], positions[i] = tok, pos
        tables, limits = row_tables([b for *_, b in rows], S, self.max_blocks_per_seq, self.block_size,
                                    self.max_model_len)
        return (tokens, positions, tables, limits, np.array([len(rows)], np.int32),
                np.array([num_steps], np.int32))

    # -- the step --------------------------------------------------------------------------------
    def catch_up(self, inputs, aux=None) -> None:
        """Write the draft's K/V for the target step's tokens (a StepInputs; dispatched
        asynchronously, the pool donated). `aux`: the target's features (EAGLE-3's; unused)."""
        args = (inputs.tokens, inputs.positions, inputs.meta)
        exe = self._executable("catch_up", len(inputs.tokens), args)
        self.cache = exe(self.weights, self.cache, *args)

    def propose(self, scheduled, sampled: dict[str, list[int]],
                lengths: dict[str, int] | None = None, batch=None) -> dict[str, list[int]]:
        """Greedy drafts after the tokens emitted this step for each sampling row: as many as
        `lengths` asks for the request (None: k for every row; a row asking 0 is skipped). The
        loop runs the longest asked length, so a batch whose drafts are paused costs nothing."""
        ids, rows, steps = [], [], 0
        for s in scheduled:
            new = sampled.get(s.request_id)
            n = self.k if lengths is None else min(self.k, lengths.get(s.request_id, 0))
            if not s.sample or not new or n <= 0:
                continue
            steps = max(steps, n)
            known = len(s.token_ids) - len(s.spec_token_ids)
            ids.append(s.request_id)
            rows.append((new[-1], s.num_computed_tokens + known + len(new) - 1, s.block_ids))
        if not rows:
            return {}
        out = {}
        for start in range(0, len(rows), self.seq_buckets[-1]):
            chunk = rows[start:start + self.seq_buckets[-1]]
            args = self._proposal_inputs(chunk, self._seq_bucket(len(chunk)), steps)
            exe = self._executable("propose", len(args[0]), args)
            drafts, self.cache = exe(self.weights, self.cache, *args)
            drafts = np.asarray(jax.device_get(drafts))
            for i, rid in enumerate(ids[start:start + len(chunk)]):
                out[rid] = drafts[i, :steps].tolist()
        return out

    def warmup(self, step_inputs_of, token_buckets) -> None:
        """Compile every program: a catch-up per token bucket (`step_inputs_of(T)`: the
        target's StepInputs of bucket T, shapes only) and a proposal loop per sequence bucket."""
        for T in token_buckets:
            x = step_inputs_of(T)
            self._executable("catch_up", T, (x.tokens, x.positions, x.meta))
        for S in self.seq_buckets:
            self._executable("propose", S, self._proposal_inputs([], S))

    def release(self) -> None:
        for x in jax.tree_util.tree_leaves((self.cache, self.weights)):
            x.delete()
        self.cache = self.weights = None
        self._executables.clear()


def load_draft(path, target: ModelConfig, target_tokenizer, *, dtype, mesh, load_format: str,
               seed: int, quantization: str | None, expert_parallel: bool):
    """Check (`read_draft_config`) then load the draft model on the target's mesh ->
    (ModelConfig, weights)."""
    from jaxserve.loader.gguf import read_gguf
    from jaxserve.loader.loader import load_model
    reader = read_gguf(path) if str(path).endswith(".gguf") and os.path.isfile(path) else None
    read_draft_config(path, target, target_tokenizer, load_format, reader)
    cfg, weights = load_model(path, dtype, gguf_reader=reader, mesh=mesh, load_format=load_format,
                              seed=seed, quantization=quantization,
                              expert_parallel=expert_parallel)
    logger.info("draft model %s: %s, %d layers, hidden %d", path, cfg.architecture,
                cfg.num_layers, cfg.hidden_size)
    return cfg, weights
