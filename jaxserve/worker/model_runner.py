"""The model runner: a SchedulerOutput -> padded, bucketed arrays -> one jitted model step (KV
cache donated) -> on-device sampling -> host token ids and logprobs.

Shapes are padded to a small fixed set of token buckets (powers of two up to
max_num_batched_tokens); the sequence dimension follows the token bucket, so one bucket is one
compiled model program. `compiled_programs` lists them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import kv_cache as kvc
from jaxserve.attention import AttentionMetadata
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.models import get_model
from jaxserve.sample.sampler import SamplerFlags, SamplingTensors, sample, score

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    buckets, b = [], smallest
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_tokens]


def _pow2_at_least(n: int, smallest: int = 16) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b


@dataclasses.dataclass
class RunnerOutput:
    sampled: dict[str, list[int]]                 # request_id -> new token ids
    # request_id -> (logprob of the sampled token, rank, top ids, top logprobs), for `sample` rows
    logprobs: dict[str, tuple[float, int, np.ndarray, np.ndarray]]
    # request_id -> [(target token, logprob, rank, top ids, top logprobs)] for prompt positions
    prompt_logprobs: dict[str, list[tuple]]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, *, dtype, backend: str, max_logprobs: int,
                 kv_quantize=None, kv_dtype=None):
        self.cfg = model_config
        self.weights = weights
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.max_seqs = scheduler_config.max_num_seqs
        self.max_blocks_per_seq = -(-scheduler_config.max_model_len // self.block_size)
        self.buckets = token_buckets(scheduler_config.max_num_batched_tokens)
        self.max_logprobs = max_logprobs
        self.cache = kvc.allocate(model_config.num_layers, self.num_blocks, self.block_size,
                                  model_config.num_kv_heads, model_config.head_dim,
                                  kv_dtype or dtype, quantized=kv_quantize is not None)
        model = get_model(model_config.architecture)
        self._model = model

        def step(weights, cache, tokens, positions, meta, logit_rows):
            hidden, cache = model.forward(weights, cache, tokens, positions, meta,
                                          cfg=model_config, backend=backend,
                                          kv_quantize=kv_quantize)
            return model.compute_logits(weights, hidden[logit_rows]), cache

        self._step = jax.jit(step, donate_argnames=("cache",))
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}

    # -- shapes -------------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def _seq_bucket(self, token_bucket: int) -> int:
        return min(token_bucket, _pow2_at_least(self.max_seqs, 1))

    # -- the step -----------------------------------------------------------------------------
    def prepare(self, scheduled, rows_for_all_tokens: bool):
        """Host arrays for one step. Returns (inputs, sample_rows, token_offsets)."""
        B, N = self.block_size, self.num_blocks
        total = sum(len(s.token_ids) for s in scheduled)
        T = self.bucket_for(total)
        S = self._seq_bucket(T)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, N * B, np.int32)
        tables = np.zeros((S, self.max_blocks_per_seq), np.int32)
        kv_lens = np.zeros(S, np.int32)
        cu = np.zeros(S + 1, np.int32)
        offsets = []
        start = 0
        for i, s in enumerate(scheduled):
            n = len(s.token_ids)
            pos = np.arange(s.num_computed_tokens, s.num_computed_tokens + n, dtype=np.int32)
            blocks = np.asarray(s.block_ids, np.int32)
            tokens[start:start + n] = s.token_ids
            positions[start:start + n] = pos
            slots[start:start + n] = blocks[pos // B] * B + pos % B
            tables[i, :len(blocks)] = blocks
            kv_lens[i] = s.num_computed_tokens + n
            offsets.append(start)
            start += n
            cu[i + 1] = start
        cu[len(scheduled) + 1:] = start
        meta = AttentionMetadata(slots, tables, kv_lens, cu,
                                 np.array([len(scheduled)], np.int32))
        if rows_for_all_tokens:
            logit_rows = np.arange(T, dtype=np.int32)
        else:
            logit_rows = np.zeros(S, np.int32)
            for i, s in enumerate(scheduled):
                logit_rows[i] = offsets[i] + len(s.token_ids) - 1
        return (tokens, positions, meta, logit_rows), offsets

    def _executable(self, num_tokens: int, num_rows: int):
        """The compiled model program for one (tokens, logit rows) shape, compiled ahead of time
        (no execution) on first use; JAX's persistent cache turns a repeat into a load."""
        key = (num_tokens, num_rows)
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            S, M = self._seq_bucket(num_tokens), self.max_blocks_per_seq
            i32 = partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
            meta = AttentionMetadata(i32((num_tokens,)), i32((S, M)), i32((S,)), i32((S + 1,)),
                                     i32((1,)))
            exe = self._step.lower(self.weights, self.cache, i32((num_tokens,)),
                                   i32((num_tokens,)), meta, i32((num_rows,))).compile()
            self._executables[key] = exe
            logger.info("compiled model program %d: %d tokens, %d logit rows (%.1f s)",
                        len(self._executables), num_tokens, num_rows, time.perf_counter() - t0)
        return exe

    @property
    def compiled_programs(self) -> list[tuple[int, int]]:
        return sorted(self._executables)

    def run_model(self, tokens, positions, meta, logit_rows):
        exe = self._executable(len(tokens), len(logit_rows))
        logits, self.cache = exe(self.weights, self.cache, tokens, positions, meta, logit_rows)
        return logits

    def execute(self, scheduled, requests: dict) -> RunnerOutput:
        """Run one step for `scheduled` (ScheduledRequest list); `requests` maps id -> Request."""
        want_prompt_lp = any(s.prompt_logprobs for s in scheduled)
        (tokens, positions, meta, logit_rows), offsets = self.prepare(scheduled, want_prompt_lp)
        logits = self.run_model(tokens, positions, meta, logit_rows)

        sample_idx = [i for i, s in enumerate(scheduled) if s.sample]
        out = RunnerOutput({}, {}, {})
        if want_prompt_lp:
            out.prompt_logprobs = self._prompt_logprobs(logits, scheduled, offsets, requests)
        if not sample_idx:
            return out
        if want_prompt_lp:
            rows = np.zeros(self._seq_bucket(len(tokens)), np.int32)
            for j, i in enumerate(sample_idx):
                rows[j] = offsets[i] + len(scheduled[i].token_ids) - 1
            logits = logits[rows]
            row_of = {i: j for j, i in enumerate(sample_idx)}
        else:
            row_of = {i: i for i in sample_idx}
        reqs = [requests[scheduled[i].request_id] for i in sample_idx]
        tensors, flags = self.sampling_tensors(reqs, [row_of[i] for i in sample_idx],
                                               logits.shape[0])
        res = jax.device_get(sample(logits, tensors, flags))
        for i, req in zip(sample_idx, reqs):
            r = row_of[i]
            out.sampled[req.request_id] = [int(res.token_ids[r])]
            if req.sampling_params.logprobs is not None:
                out.logprobs[req.request_id] = (float(res.logprob[r]), int(res.rank[r]),
                                                res.top_ids[r], res.top_logprobs[r])
        return out

    def _prompt_logprobs(self, logits, scheduled, offsets, requests):
        """Score each prompt token of a chunk under the logits of the token before it."""
        targets = np.zeros(logits.shape[0], np.int32)
        for i, s in enumerate(scheduled):
            if not s.prompt_logprobs:
                continue
            req = requests[s.request_id]
            for j in range(len(s.token_ids)):
                nxt = s.num_computed_tokens + j + 1
                if nxt < req.num_prompt_tokens:
                    targets[offsets[i] + j] = req.prompt_token_ids[nxt]
        chosen, rank, top_ids, top_vals = jax.device_get(
            score(logits, targets, self.max_logprobs))
        result = {}
        for i, s in enumerate(scheduled):
            if not s.prompt_logprobs:
                continue
            req = requests[s.request_id]
            k = req.sampling_params.prompt_logprobs
            entries = []
            for j in range(len(s.token_ids)):
                r, nxt = offsets[i] + j, s.num_computed_tokens + j + 1
                if nxt < req.num_prompt_tokens:
                    entries.append((int(targets[r]), float(chosen[r]), int(rank[r]),
                                    top_ids[r][:k], top_vals[r][:k]))
            result[s.request_id] = entries
        return result

    def sampling_tensors(self, reqs, rows, num_rows: int):
        """Per-row sampling parameters for the sampled requests, padded to `num_rows`."""
        R = num_rows
        temp = np.zeros(R, np.float32)
        top_k = np.zeros(R, np.int32)
        top_p = np.ones(R, np.float32)
        min_p = np.zeros(R, np.float32)
        seeds = np.zeros(R, np.uint32)
        out_pos = np.zeros(R, np.int32)
        penalties = filters = random = want_lp = False
        num_lp = 0
        for r, req in zip(rows, reqs):
            sp = req.sampling_params
            temp[r] = 0.0 if sp.is_greedy else sp.temperature
            top_k[r], top_p[r], min_p[r] = sp.top_k, sp.top_p, sp.min_p
            seeds[r] = req.sample_seed
            out_pos[r] = req.num_output_tokens
            penalties |= _needs_penalties(req)
            filters |= sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0
            random |= not sp.is_greedy
            if sp.logprobs is not None:
                want_lp = True
                num_lp = self.max_logprobs if sp.logprobs else num_lp
        t = SamplingTensors(temp, top_k, top_p, min_p, seeds, out_pos)
        if penalties:
            t = _penalty_tensors(t, reqs, rows, R)
        return t, SamplerFlags(penalties, filters and random, num_lp, random, want_lp)

    def warmup(self):
        """Compile every token bucket ahead of time (and the greedy sampler for each), so serving
        never waits on XLA. Nothing big is executed: with a warm persistent cache this is loads."""
        t0 = time.perf_counter()
        for T in self.buckets:
            S = self._seq_bucket(T)
            self._executable(T, S)
            z = np.zeros(S, np.float32)
            t = SamplingTensors(z, z.astype(np.int32), z + 1, z, z.astype(np.uint32),
                                z.astype(np.int32))
            logits = np.zeros((S, self.cfg.vocab_size), np.float32)
            jax.block_until_ready(sample(logits, t, SamplerFlags(False, False, 0, False, False)))
        elapsed = time.perf_counter() - t0
        logger.info("warm-up: %d model programs for token buckets %s in %.1f s",
                    len(self._executables), self.buckets, elapsed)
        return elapsed


def _needs_penalties(req) -> bool:
    sp = req.sampling_params
    return bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
                or sp.logit_bias or (sp.min_tokens and req.num_output_tokens < sp.min_tokens))


def _penalty_tensors(t: SamplingTensors, reqs, rows, R: int) -> SamplingTensors:
    P = _pow2_at_least(max(req.num_prompt_tokens for req in reqs))
    O = _pow2_at_least(max(req.num_output_tokens for req in reqs) + 1)
    bias_lists = []
    for req in reqs:
        sp = req.sampling_params
        bias = dict(sp.logit_bias or {})
        if sp.min_tokens and req.num_output_tokens < sp.min_tokens:
            for tok in sp.all_stop_token_ids:   # no stop token before min_tokens
                bias[tok] = -float("inf")
        bias_lists.append(bias)
    Bb = _pow2_at_least(max((len(b) for b in bias_lists), default=1), 4)
    presence = np.zeros(R, np.float32)
    frequency = np.zeros(R, np.float32)
    repetition = np.ones(R, np.float32)
    prompt_ids = np.full((R, P), -1, np.int32)
    output_ids = np.full((R, O), -1, np.int32)
    bias_ids = np.full((R, Bb), -1, np.int32)
    bias_vals = np.zeros((R, Bb), np.float32)
    for r, req, bias in zip(rows, reqs, bias_lists):
        sp = req.sampling_params
        presence[r], frequency[r] = sp.presence_penalty, sp.frequency_penalty
        repetition[r] = sp.repetition_penalty
        prompt_ids[r, :req.num_prompt_tokens] = req.prompt_token_ids
        output_ids[r, :req.num_output_tokens] = req.output_token_ids
        bias_ids[r, :len(bias)] = list(bias.keys())
        bias_vals[r, :len(bias)] = np.maximum(np.array(list(bias.values()), np.float32), -1e30)
    return dataclasses.replace(t, presence=presence, frequency=frequency, repetition=repetition,
                               prompt_ids=prompt_ids, output_ids=output_ids, bias_ids=bias_ids,
                               bias_vals=bias_vals)
