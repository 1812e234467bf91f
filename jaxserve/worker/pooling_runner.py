"""The pooling runner (`runner="pooling"`): the model runner's step with the sampler replaced by
pooling, for embedding models.

The step is the generate runner's (same input batch, token buckets, paged KV cache, chunked
prefill, AOT-compiled programs per bucket) up to the final hidden states (after the model's
last norm); then each row of the step is reduced to one vector [E] in f32 on the device: the
sum of its tokens' states (MEAN), its last token's (LAST) or its first token's (CLS). A prompt
prefilled in several chunks accumulates here on the host: MEAN sums its chunks and divides by
the prompt length when the last chunk (the row with `sample=True`) is done, LAST keeps the last
chunk's, CLS the first chunk's. Only [S, E] comes back per step, never [T, E].
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jaxserve.host_memory import release_freed_host_memory
from jaxserve.pooling_params import PoolerConfig
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.step import jit_step, pooling_step
from jaxserve.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


class PoolingRunner(ModelRunner):
    """`execute(scheduler_output) -> {request_id: pooled vector [E] f32}` for the requests whose
    prompt finished this step (before dimensions and normalization: those are per request)."""

    def __init__(self, model_config, weights, cache_config, scheduler_config, *,
                 pooler: PoolerConfig, dtype, backend: str, max_logprobs: int, kv_quantize=None,
                 kv_dtype=None, plan=None, num_speculative_tokens: int = 0, drafter=None):
        if num_speculative_tokens or drafter is not None:
            raise ValueError("speculative decoding does not apply to pooling models "
                             "(runner 'pooling'): leave speculative_config unset")
        super().__init__(model_config, weights, cache_config, scheduler_config, dtype=dtype,
                         backend=backend, max_logprobs=max_logprobs, kv_quantize=kv_quantize,
                         kv_dtype=kv_dtype, plan=plan)
        self.pooler = pooler
        self._step = jit_step(pooling_step, dataclasses.replace(self.step_context, pooling_type=pooler.pooling_type),
                              (self.plan.replicated, self._cache_sharding(self.cache.quantized, self.cache.codes),
                               self.plan.replicated))
        # request_id -> the pooled state of the chunks computed so far (MEAN: the sum; CLS: the
        # first token's state)
        self._partial: dict[str, np.ndarray] = {}

    def _width_buckets(self, backend: str, drafter) -> bool:
        return False        # one width: the pooling step's programs are keyed by tokens alone

    def run_model(self, inputs: StepInputs) -> jax.Array:
        """Run the compiled pooling step; returns the device [S, E] pooled rows."""
        exe = self._executable(len(inputs.tokens), False)
        pooled, self.cache, self.penalties = exe(self.weights, self.cache, self.penalties,
                                                 *self.device_inputs(inputs))
        return pooled

    def execute(self, scheduler_output) -> dict[str, np.ndarray]:
        batch = self.input_batch
        batch.update(scheduler_output)
        batch.take_penalty_writes()     # nothing samples: the penalty rows are never read
        for rid in (*scheduler_output.finished_request_ids,
                    *scheduler_output.preempted_request_ids):
            self._partial.pop(rid, None)
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return {}
        inputs, _ = self.prepare(scheduled, False)
        pooled = np.asarray(jax.device_get(self.run_model(inputs)))
        kind, done = self.pooler.pooling_type, {}
        for i, s in enumerate(scheduled):
            rid, row = s.request_id, pooled[i]
            if kind == "MEAN":
                # a chunk at position 0 starts the prompt over (a fresh or a resumed request)
                row = row if s.num_computed_tokens == 0 else self._partial[rid] + row
            elif kind == "CLS":
                row = row if s.num_computed_tokens == 0 else self._partial[rid]
            if not s.sample:            # more chunks to come
                self._partial[rid] = row
                continue
            self._partial.pop(rid, None)
            if kind == "MEAN":
                row = row / (s.num_computed_tokens + len(s.token_ids))
            done[rid] = row
        return done

    def profile_run(self) -> None:
        x, _ = self._build([], self.buckets[-1], False)
        jax.block_until_ready(self.run_model(x))

    def warmup(self) -> float:
        """Compile the pooling step of every token bucket (one program each)."""
        t0 = time.perf_counter()
        for T in self.buckets:
            self._executable(T, False)
        release_freed_host_memory()
        elapsed = time.perf_counter() - t0
        logger.info("warm-up: %d pooling step programs (%s) for token buckets %s in %.1f s",
                    len(self._executables), self.programs_obtained(), self.buckets, elapsed)
        return elapsed
