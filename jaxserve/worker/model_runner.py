"""The model runner: a SchedulerOutput -> the worker's input batch -> one StepInputs pytree ->
one jitted step (`worker/step.py`: model, prompt scoring, sampling; KV cache and sampling state
donated) -> host token ids and logprobs.

A step is `dispatch` (inputs built, the program launched, its results' copy to the host started;
nothing waits for the device) then `collect` (the results read, the input batch told what was
sampled); `execute` is both. With async scheduling the engine dispatches step N + 1 before it
collects step N: N + 1's rows for positions whose tokens N samples carry placeholders, and the
step program reads those tokens from the device (`worker/step.py`).

The runner never sees the scheduler's `Request` objects: what it knows about a request comes
from the SchedulerOutput (`new_request` rows, finished / preempted ids) and from what it sampled
itself (`InputBatch`). Shapes are padded to a fixed set of token buckets (powers of two up to
max_num_batched_tokens, after 1- and 2-token buckets for batch-1 and batch-2 decode; the
sequence dimension follows the token bucket), and every program a step can need (two variants
per bucket: with and without prompt logprobs, except the 1- and 2-token ones; the penalty-row
write) is compiled in
`warmup()`, so no XLA compilation happens while serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxserve.attention import kv_cache as kvc
from jaxserve.attention import reference
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.layers.int4 import fused_kernel_rows
from jaxserve.models import get_model
from jaxserve.sample import penalties
from jaxserve.sample.rejection import accept
from jaxserve.sharding.plan import ShardingPlan, put, single_device_plan
from jaxserve.worker.buckets import kv_widths, pow2_at_least, token_buckets
from jaxserve.worker.compile_cache import step_compiler_options
from jaxserve.worker.compile_queue import BackgroundCompiler
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.kv_host_tier import HostTierCopies
from jaxserve.worker.kv_sizing import allocate_sharded_kv_cache, is_latent, kv_cache_sharding
from jaxserve.worker.programs import FIRST_PROGRAM_TOKENS, PENALTY_PROGRAM, StepPrograms
from jaxserve.worker.step import StepContext, generate_step, jit_step
from jaxserve.worker.step_inputs import Packing, StepInputs, StepLayout, build_inputs, step_bitmask

__all__ = ["FIRST_PROGRAM_TOKENS", "PENALTY_PROGRAM", "ModelRunner", "RunnerOutput", "StepInFlight"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunnerOutput:
    sampled: dict[str, list[int]]                 # request_id -> new token ids
    # request_id -> [(logprob of the sampled token, rank, top ids, top logprobs)], one per new
    # token, for `sample` rows
    logprobs: dict[str, list[tuple[float, int, np.ndarray, np.ndarray]]]
    # request_id -> [(target token, logprob, rank, top ids, top logprobs)] for prompt positions
    prompt_logprobs: dict[str, list[tuple]]
    # request_id -> the draft model's next drafts, for each row that sampled (draft model only)
    draft_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StepInFlight:
    """A dispatched step: what `collect` needs to read its results."""
    scheduler_output: Any
    inputs: StepInputs
    layout: StepLayout
    drafts: dict[str, list[int]]        # request_id -> the drafts its row verifies
    want_logprobs: set[str]             # the sampling rows' requests that asked for logprobs
    results: tuple                      # device (SamplerOutput or its tokens only, prompt scores)
    prompt_scoring: dict[str, tuple[int, int]]     # `_prompt_scoring`; empty: no prompt logprobs
    timed: bool                         # its program was built before: its wall time is its cost
    t0: float


class ModelRunner(StepPrograms):
    def __init__(self, model_config: ModelConfig, weights, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, *, dtype, backend: str, max_logprobs: int,
                 kv_quantize=None, kv_dtype=None, plan: ShardingPlan | None = None,
                 num_speculative_tokens: int = 0, drafter=None, lora=None, abstract: bool = False,
                 programs=None):
        """abstract: the weights are `jax.ShapeDtypeStruct`s with shardings, and the KV pool and
        penalty state are made as such too: the runner can compile its programs (for a device this
        process may not have: `jaxserve.aot`) but not run them. programs: a store of compiled
        programs to load instead of compiling (`jaxserve.aot.store.ProgramStore`), or None."""
        self.cfg = model_config
        self.abstract = abstract
        self.programs = programs
        # What the programs are lowered under and compiled with (`jaxserve.aot`: the target's
        # abstract mesh, and XLA options a compile-only device needs besides the step's own).
        self.lower_context = contextlib.nullcontext
        self.plan = plan = plan or single_device_plan(model_config)
        self.compiler_options: dict | None = step_compiler_options(plan.mesh.devices.flat, weights)
        # Multi-LoRA: a jaxserve.lora.LoraManager (weights already wrapped in LoraWeights), or None.
        self.lora = lora
        self._lora_slots: dict[str, int] = {}     # this step's adapter name -> device slot
        # How weights, KV pool and the step split over the devices (default: one device): above.
        self.weights = weights
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.max_seqs = scheduler_config.max_num_seqs
        self.max_blocks_per_seq = -(-scheduler_config.max_model_len // self.block_size)
        self.buckets = token_buckets(scheduler_config.max_num_batched_tokens,
                                     few_rows=fused_kernel_rows(weights) >= 8)
        self.max_logprobs = max_logprobs
        # Speculative decoding: each sampling request may verify this many drafts in a step.
        self.num_spec = num_speculative_tokens
        # A draft model (worker/draft_runner.DraftRunner), an EAGLE-3 head or an MTP layer
        # (worker/head_runner.HeadRunner) or None.
        self.drafter = drafter
        # Measured wall seconds of a step (host inputs, device run, results back) per token
        # bucket, a moving average over steps without prompt logprobs: what speculation weighs
        # its drafts against when they would push a step into a larger bucket.
        self.step_seconds: dict[int, float] = {}
        self.cache = self._allocate_cache(kv_dtype or dtype, kv_quantize is not None)
        # The host KV tier's memory and copies (--kv-offloading-size), or None.
        self.host_tier = None if abstract or not cache_config.kv_offloading_size else HostTierCopies(
            self.cache, self._cache_sharding(self.cache.quantized, self.cache.codes),
            cache_config.kv_offloading_size)
        self.input_batch = InputBatch(self.max_seqs, model_config.vocab_size)
        # [max_num_seqs, vocab] x 4 on the device: the penalties never change shape.
        if abstract:
            self.penalties = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=plan.replicated),
                jax.eval_shape(lambda: penalties.zeros(self.max_seqs, model_config.vocab_size)))
        else:
            self.penalties = put(penalties.zeros(self.max_seqs, model_config.vocab_size),
                                 plan.replicated)
        model = get_model(model_config.architecture)
        self._model = model
        self.backend = backend          # the attention backend the step programs use
        # Block-table widths (blocks) the step programs are compiled for, ascending: one
        # (max_model_len) unless attention loops over the table's whole width (`_width_buckets`).
        self.kv_widths = (kv_widths(self.max_blocks_per_seq, self.block_size)
                          if self._width_buckets(backend, drafter) else (self.max_blocks_per_seq,))
        # An EAGLE-3 head reads the target's residual stream at a few layers, an MTP layer its
        # final hidden states: the step returns them.
        aux_layers = tuple(getattr(drafter, "aux_layers", ()))
        final_hidden = bool(getattr(drafter, "final_hidden", False))
        self.step_context = StepContext(model, model_config, backend, plan, max_logprobs, kv_quantize,
                                        aux_layers=aux_layers, final_hidden=final_hidden)
        # Donated state leaves with the sharding it came in with, so the buffers are reused.
        rep = plan.replicated
        self._step = jit_step(generate_step, self.step_context,
                              (rep, rep, self._cache_sharding(self.cache.quantized, self.cache.codes), rep)
                              + ((rep,) if aux_layers or final_hidden else ()))
        self._executables: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self._packings: dict[tuple[int, bool], Packing] = {}     # by program: how its inputs pack
        self._from_cache = 0        # how many of them the persistent compilation cache supplied
        self._from_dir = 0          # how many were loaded from `programs` (a compiled directory)
        self._penalty_exe = None    # the compiled penalty-row write (`penalty_program`)
        self._lock = threading.Lock()   # the two above, with a background compiler beside us
        # warmup(background=True): the programs left to build after the first ones, or None.
        self._compiler: BackgroundCompiler | None = None
        # Structured output: [S, W] bitmask words per sampling row; an unconstrained step passes
        # a device-resident all-ones mask (no transfer; the sampler's cond skips the masking).
        self.mask_words = -(-model_config.vocab_size // 32)
        self._all_allowed: dict[int, jax.Array] = {}

    # -- the KV pool ---------------------------------------------------------------------------
    def _cache_sharding(self, quantized: bool, codes: str | None) -> kvc.KVCache:
        return kv_cache_sharding(self.plan, quantized, codes, is_latent(self.cfg))

    def _allocate_cache(self, dtype, quantized: bool) -> kvc.KVCache:
        return allocate_sharded_kv_cache(self.cfg, self.plan, self.num_blocks, self.block_size,
                                         dtype, quantized, abstract=self.abstract)

    # -- shapes -------------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def _seq_bucket(self, token_bucket: int) -> int:
        return min(token_bucket, pow2_at_least(self.max_seqs, 1))

    def _width_buckets(self, backend: str, drafter) -> bool:
        """Whether a step chooses its block-table width from `kv_widths`: where attention has
        static loops over the table's width (the reference path on a GPU, `reference.static_form`)
        and no drafter reads the step's tables (its programs are built for one width)."""
        platform = self.plan.mesh.devices.flat[0].platform
        return backend == "reference" and drafter is None and reference.static_form(platform)

    def kv_width(self, scheduled, with_prompt_logprobs: bool) -> int:
        """The block-table width (blocks) a step runs at: the smallest of `kv_widths` that holds
        every scheduled sequence's blocks (prompt-logprobs programs: the widest, the one compiled)."""
        if with_prompt_logprobs:
            return self.kv_widths[-1]
        need = max((len(s.block_ids) for s in scheduled), default=0)
        return next((w for w in self.kv_widths if w >= need), self.kv_widths[-1])

    # -- the step -----------------------------------------------------------------------------
    def prepare(self, scheduled, with_prompt_logprobs: bool):
        """Host arrays for one step -> (StepInputs, StepLayout)."""
        T = self.bucket_for(sum(len(s.token_ids) for s in scheduled))
        return self._build(scheduled, self._variant_bucket(T, with_prompt_logprobs),
                           with_prompt_logprobs)

    def _variant_bucket(self, bucket: int, with_prompt_logprobs: bool) -> int:
        """The 1- and 2-token buckets are compiled for plain decode only: a step of 1-2 tokens
        that scores a prompt (rare) runs in the next bucket, which saves compiling programs for it."""
        bigger = [b for b in self.buckets if b > 2]
        if bucket <= 2 and with_prompt_logprobs and bigger:
            return bigger[0]
        return bucket

    def _sample_rows(self, token_bucket: int) -> int:
        """Sampler rows of a bucket: one per sequence, or with speculation one per draft and
        bonus position (never more than the bucket's tokens: each row is a distinct token)."""
        S = self._seq_bucket(token_bucket)
        return min(token_bucket, S * (self.num_spec + 1)) if self.num_spec else S

    def _build(self, scheduled, num_tokens: int, with_prompt_logprobs: bool, width: int | None = None):
        """Host inputs of a step at `num_tokens` tokens and block tables `width` blocks wide
        (None: `kv_width`'s choice)."""
        if width is None:
            width = self.kv_width(scheduled, with_prompt_logprobs)
        inputs, layout = build_inputs(scheduled, self.input_batch, num_tokens=num_tokens,
                                      num_seqs=self._seq_bucket(num_tokens),
                                      num_blocks=self.num_blocks, block_size=self.block_size,
                                      max_blocks_per_seq=width,
                                      with_prompt_logprobs=with_prompt_logprobs,
                                      num_sample_rows=self._sample_rows(num_tokens),
                                      speculative=self.num_spec > 0,
                                      lora_slots=None if self.lora is None else self._lora_slots)
        # One mask row per sampler row (S, or S x (k + 1) rows with speculation).
        inputs.bitmask = self._all_allowed_mask(self._sample_rows(num_tokens))
        return inputs, layout

    def _all_allowed_mask(self, num_rows: int) -> jax.Array:
        mask = self._all_allowed.get(num_rows)
        if mask is None:
            mask = np.full((num_rows, self.mask_words), -1, np.int32)
            if not self.abstract:
                mask = put(mask, self.plan.replicated)
            self._all_allowed[num_rows] = mask
        return mask

    def run_model(self, inputs: StepInputs):
        """Run the compiled step (cache and penalty state replaced by the donated results);
        returns the device (SamplerOutput, prompt scores or None)."""
        exe = self._executable(*self.step_key_of(inputs))
        out, scores, self.cache, self.penalties, *aux = exe(self.weights, self.cache, self.penalties,
                                                            *self.device_inputs(inputs))
        self.aux_hidden = aux[0] if aux else None     # EAGLE-3's or MTP's features, for the drafter
        return out, scores

    def device_inputs(self, inputs: StepInputs) -> tuple:
        """(packed inputs, bitmask) on the devices: one host -> device transfer of the packed
        inputs, and one of the bitmask when some row is constrained (else the resident mask)."""
        rep = self.plan.replicated
        bitmask = inputs.bitmask
        if not isinstance(bitmask, jax.Array):
            bitmask = put(bitmask, rep)
        return put(self._packing(inputs).pack(inputs), rep), bitmask

    def _packing(self, x: StepInputs) -> Packing:
        """How the inputs of x's program pack (fixed by the program: planned once, kept)."""
        key = self.step_key_of(x)
        packing = self._packings.get(key)
        if packing is None:
            packing = self._packings[key] = Packing.of(x)
        return packing

    def _write_penalty_rows(self) -> None:
        for slot, rows in self.input_batch.take_penalty_writes():
            self._write_penalty_row(slot, rows)

    def _write_penalty_row(self, slot: int, rows) -> None:
        # a compiled program takes its inputs where it was compiled for them: on every device
        args = put((np.asarray(slot, np.int32), *rows), self.plan.replicated)
        self.penalties = self.penalty_program()(self.penalties, *args)

    def execute(self, scheduler_output) -> RunnerOutput:
        """Run one step for a SchedulerOutput (its finished / preempted ids are applied even
        when nothing is scheduled): `dispatch` then `collect`."""
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(self, scheduler_output) -> StepInFlight | None:
        """Apply a SchedulerOutput to the input batch and launch its step; returns at once (the
        device runs it; None when nothing is scheduled). The copy of its sampled ids (and
        logprobs, prompt scores) to the host starts now. Rows may carry placeholder ids for the
        tokens a step dispatched before samples (async scheduling)."""
        copies = getattr(scheduler_output, "host_copies", None)
        if copies and self.host_tier is not None:     # before anything of the step touches the pool
            self.cache = self.host_tier.apply(self.cache, copies, scheduler_output.step_id)
        batch = self.input_batch
        batch.update(scheduler_output)
        self._write_penalty_rows()
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return None
        want_prompt_lp = any(s.prompt_logprobs for s in scheduled)
        t0 = time.perf_counter()
        if self.lora is not None:       # this step's adapters into device slots
            self.weights, self._lora_slots = self.lora.activate(
                self.weights, [batch.requests[s.request_id].lora_request for s in scheduled])
        inputs, layout = self.prepare(scheduled, want_prompt_lp)
        drafts = {s.request_id: s.spec_token_ids for s in scheduled}
        grammar = getattr(scheduler_output, "grammar_bitmask", None)
        if grammar is not None and grammar.request_ids:
            inputs.bitmask = step_bitmask(grammar, layout.sample_rows, len(inputs.logit_rows), self.mask_words,
                                          {r: len(d) for r, d in drafts.items()})
        timed = self.step_key_of(inputs) in self._executables and not want_prompt_lp
        out, scores = self.run_model(inputs)
        if self.drafter is not None:        # the draft's K/V for the same tokens (async)
            self.drafter.catch_up(inputs, self.aux_hidden)
        for rid in layout.sample_rows:      # the next step's sampling positions count this token
            batch.count_dispatched(rid)
        want_lp = {rid for rid in layout.sample_rows if batch.requests[rid].sampling_params.logprobs is not None}
        results = (out if want_lp else out.tokens_only(), scores)
        for a in jax.tree_util.tree_leaves(results):
            a.copy_to_host_async()
        return StepInFlight(scheduler_output, inputs, layout, drafts, want_lp, results,
                            self._prompt_scoring(scheduled) if want_prompt_lp else {}, timed, t0)

    def collect(self, step: StepInFlight | None) -> RunnerOutput:
        """Wait for a dispatched step and read its results: the tokens each sampling row keeps
        (speculative rows: the accepted drafts and one more), their logprobs, prompt logprobs, the
        draft model's next drafts. A request the batch dropped since (finished, aborted or
        preempted by a later step's SchedulerOutput) still gets its tokens (the scheduler keeps
        those of a preempted one, which resumes after them), but the batch has none to extend."""
        out = RunnerOutput({}, {}, {})
        if step is None:
            return out
        batch = self.input_batch
        res, scores = jax.device_get(step.results)
        if self.host_tier is not None:      # this step's offloads are on the host by now
            self.host_tier.land(step.scheduler_output.step_id)
        if step.timed:          # a first run's compile is not its cost
            self._time_step(len(step.inputs.tokens), time.perf_counter() - step.t0)
        for rid, r in step.layout.sample_rows.items():
            d = step.drafts[rid]
            n = accept(res.token_ids[r:r + len(d) + 1], d) + 1 if d else 1
            tokens = [int(t) for t in res.token_ids[r:r + n]]
            out.sampled[rid] = tokens
            if rid in step.want_logprobs:
                out.logprobs[rid] = [(float(res.logprob[i]), int(res.rank[i]), res.top_ids[i],
                                      res.top_logprobs[i]) for i in range(r, r + n)]
            if rid in batch.requests:
                batch.append_sampled(rid, tokens)
        scheduled = step.scheduler_output.scheduled
        if self.drafter is not None:
            out.draft_token_ids = self.drafter.propose(
                scheduled, out.sampled, getattr(step.scheduler_output, "draft_lengths", None), batch)
        if step.prompt_scoring:
            out.prompt_logprobs = self._prompt_logprobs(scheduled, step.layout.offsets,
                                                        step.inputs.prompt_targets, scores, step.prompt_scoring)
        return out

    def _time_step(self, bucket: int, seconds: float) -> None:
        prev = self.step_seconds.get(bucket)
        self.step_seconds[bucket] = seconds if prev is None else 0.75 * prev + 0.25 * seconds

    def step_cost(self, num_tokens: int) -> float | None:
        """Expected seconds of a step of `num_tokens` tokens: its bucket's measured time, or
        interpolated linearly in tokens between the nearest measured buckets below and above,
        or (nothing measured above) the nearest below's; None when nothing is measured at or
        below its bucket."""
        if num_tokens > self.buckets[-1]:
            return None
        b = self.bucket_for(num_tokens)
        t = self.step_seconds
        if b in t:
            return t[b]
        lo = max((x for x in t if x < b), default=None)
        hi = min((x for x in t if x > b), default=None)
        if lo is None:
            return None
        if hi is None:
            return t[lo]
        return t[lo] + (t[hi] - t[lo]) * (b - lo) / (hi - lo)

    def _prompt_scoring(self, scheduled) -> dict[str, tuple[int, int]]:
        """request_id -> (prompt logprobs asked, prompt length) of the rows that score prompt
        tokens (taken at dispatch: the batch may have dropped the request by collection)."""
        requests = self.input_batch.requests
        return {s.request_id: (requests[s.request_id].sampling_params.prompt_logprobs,
                               requests[s.request_id].num_prompt_tokens) for s in scheduled if s.prompt_logprobs}

    def _prompt_logprobs(self, scheduled, offsets, targets, scores, scoring: dict[str, tuple[int, int]]):
        """Each prompt token of a chunk scored under the logits of the token before it."""
        chosen, rank, top_ids, top_vals = scores
        result = {}
        for i, s in enumerate(scheduled):
            if s.request_id not in scoring:
                continue
            k, num_prompt_tokens = scoring[s.request_id]
            entries = []
            for j in range(len(s.token_ids)):
                r, nxt = offsets[i] + j, s.num_computed_tokens + j + 1
                if nxt < num_prompt_tokens:
                    entries.append((int(targets[r]), float(chosen[r]), int(rank[r]),
                                    top_ids[r][:k], top_vals[r][:k]))
            result[s.request_id] = entries
        return result

    def profile_run(self) -> None:
        """Run the largest token bucket's programs (with and without prompt logprobs) once on an
        all-padding batch, for `kv_sizing.profile_peak_bytes`: XLA allocates a program's buffers
        by shape, so the device's peak memory is what a real step of that bucket needs."""
        T = self.buckets[-1]
        for with_prompt_logprobs in (False, True):
            x, _ = self._build([], T, with_prompt_logprobs, self.kv_widths[-1])
            jax.block_until_ready(self.run_model(x))

    def release(self) -> None:
        """Free the pool and the penalty state now (a probe runner, before the real pool)."""
        for x in jax.tree_util.tree_leaves((self.cache, self.penalties)):
            x.delete()
        self.cache = self.penalties = None
        self.stop_compiling()
        self._executables.clear()
        self._from_cache = self._from_dir = 0
        self._penalty_exe = None
        self._all_allowed.clear()

