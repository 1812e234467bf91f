"""The model runner: a SchedulerOutput -> the worker's input batch -> one StepInputs pytree ->
one jitted step (model, prompt scoring, sampling; KV cache and penalty state donated) -> host
token ids and logprobs.

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

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import kv_cache as kvc
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.host_memory import release_freed_host_memory
from jaxserve.lora.weight import bind_token_slots
from jaxserve.models import get_model
from jaxserve.sample import penalties
from jaxserve.sample.rejection import accept, emitted_mask
from jaxserve.sample.sampler import sample, score_rows
from jaxserve.sharding.plan import ShardingPlan, single_device_plan
from jaxserve.worker.buckets import pow2_at_least, token_buckets
from jaxserve.worker.compile_cache import compile_noting_cache_hit, how_obtained, step_compiler_options
from jaxserve.worker.compile_queue import BackgroundCompiler
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.kv_sizing import allocate_sharded_kv_cache, is_latent, kv_cache_sharding
from jaxserve.worker.step_inputs import Packing, StepInputs, build_inputs, step_bitmask

logger = logging.getLogger(__name__)


# A background warm-up builds the plain programs of buckets up to this many tokens before the
# engine reports ready (batch-1 decode and short prompts), the rest while it serves.
FIRST_PROGRAM_TOKENS = 16

PENALTY_PROGRAM = "penalty_write"     # the penalty-row write's name in a compiled directory


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


class ModelRunner:
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
                                     one_token=not num_speculative_tokens)
        self.max_logprobs = max_logprobs
        # Speculative decoding: each sampling request may verify this many drafts in a step.
        self.num_spec = num_speculative_tokens
        # A draft model (worker/draft_runner.DraftRunner) or None.
        self.drafter = drafter
        # Measured wall seconds of a step (host inputs, device run, results back) per token
        # bucket, a moving average over steps without prompt logprobs: what speculation weighs
        # its drafts against when they would push a step into a larger bucket.
        self.step_seconds: dict[int, float] = {}
        self.cache = self._allocate_cache(kv_dtype or dtype, kv_quantize is not None)
        self.input_batch = InputBatch(self.max_seqs, model_config.vocab_size)
        # [max_num_seqs, vocab] x 4 on the device: the penalties never change shape.
        if abstract:
            self.penalties = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=plan.replicated),
                jax.eval_shape(lambda: penalties.zeros(self.max_seqs, model_config.vocab_size)))
        else:
            self.penalties = jax.device_put(penalties.zeros(self.max_seqs, model_config.vocab_size),
                                            plan.replicated)
        model = get_model(model_config.architecture)
        self._model = model
        self.backend = backend          # the attention backend the step programs use
        k = max_logprobs

        def step(weights, cache, pen, x: StepInputs):
            if x.lora_slots is not None:      # each token's adapter slot reaches every LoraWeight
                weights = bind_token_slots(weights, x.lora_slots)
            hidden, cache = model.forward(weights, cache, x.tokens, x.positions, x.meta,
                                          cfg=model_config, backend=backend,
                                          kv_quantize=kv_quantize, plan=plan)

            def logits_of(h):
                # Vocabulary-parallel head: each device scores its slice of the vocabulary, then
                # the rows are gathered (not the head), so the sampler reads whole rows.
                logits = jax.lax.with_sharding_constraint(model.compute_logits(weights, h),
                                                          plan.sharding(("tokens", "vocab")))
                return jax.lax.with_sharding_constraint(logits, plan.replicated)

            logits, scores = logits_of(hidden[x.logit_rows]), None
            if x.prompt_targets is not None:
                scores = score_rows(logits_of, hidden, x.prompt_rows, x.prompt_targets, k)
            out = sample(logits, x.sampling, pen, k=k, bitmask=x.bitmask)
            slots = x.sampling.slots
            if x.draft_ids is not None:
                # Only emitted samples join the output history (rejected rows are dropped).
                keep = emitted_mask(out.token_ids, x.draft_ids, x.group_start)
                slots = jnp.where(keep, slots, pen.output_counts.shape[0])
            pen = penalties.count_sampled(pen, slots, out.token_ids)
            return out, scores, cache, pen

        # Donated state leaves with the sharding it came in with, so the buffers are reused.
        rep = plan.replicated
        self._step = self._jit_step(step, (rep, rep, self._cache_sharding(self.cache.quantized, self.cache.codes),
                                           rep))
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

    @staticmethod
    def _jit_step(step, out_shardings):
        """`step(weights, cache, pen, x: StepInputs)` jitted to take x packed (`Packing`): one
        int32 array, one transfer, plus the structured-output bitmask (device-resident when no
        row is constrained); the cache and penalty state donated."""
        def packed_step(weights, cache, pen, packed, bitmask, *, packing: Packing):
            return step(weights, cache, pen, packing.unpack(packed, bitmask))
        return jax.jit(packed_step, donate_argnames=("cache", "pen"), static_argnames=("packing",),
                       out_shardings=out_shardings)

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

    def _build(self, scheduled, num_tokens: int, with_prompt_logprobs: bool):
        inputs, layout = build_inputs(scheduled, self.input_batch, num_tokens=num_tokens,
                                      num_seqs=self._seq_bucket(num_tokens),
                                      num_blocks=self.num_blocks, block_size=self.block_size,
                                      max_blocks_per_seq=self.max_blocks_per_seq,
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
                mask = jax.device_put(mask, self.plan.replicated)
            self._all_allowed[num_rows] = mask
        return mask

    def _program_spec(self, num_tokens: int, with_prompt_logprobs: bool) -> tuple:
        """(packed inputs, bitmask, Packing) of one program, as shapes (built from an empty batch:
        call it on the engine's thread, the input batch is not the compiler thread's to read)."""
        x, _ = self._build([], num_tokens, with_prompt_logprobs)   # shapes only
        packing = self._packing(x)
        # Inputs are replicated (an abstract runner's devices may be compile-only ones).
        rep = self.plan.replicated
        return (jax.ShapeDtypeStruct((packing.size,), np.int32, sharding=rep),
                jax.ShapeDtypeStruct(x.bitmask.shape, x.bitmask.dtype, sharding=rep), packing)

    def _state_specs(self):
        """Weights, KV pool and penalty state as shapes and shardings: a program is lowered from
        these, never from the arrays (the pool and penalties are donated and replaced every step,
        so a background compile must not read them)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding,
                                                           weak_type=a.weak_type),
                            (self.weights, self.cache, self.penalties))

    def _compile(self, key: tuple[int, bool], spec: tuple | None = None, state=None):
        """Compile one step program ahead of time (no execution); JAX's persistent cache turns
        a repeat into a load. Runs on the engine's thread or the background compiler's."""
        t0 = time.perf_counter()
        packed, bitmask, packing = spec if spec is not None else self._program_spec(*key)
        weights, cache, pen = state if state is not None else self._state_specs()
        exe, from_cache = self._load_or_compile(
            self.program_name(key), lambda: self._step.lower(weights, cache, pen, packed, bitmask, packing=packing))
        with self._lock:
            self._executables[key] = exe
            self._from_cache += int(from_cache is True)
            self._from_dir += int(isinstance(from_cache, str))
            n = len(self._executables)
        logger.info("step program %d: %d tokens%s, %s (%.1f s)%s", n, key[0],
                    ", prompt logprobs" if key[1] else "", how_obtained(from_cache),
                    time.perf_counter() - t0,
                    " (background)" if threading.current_thread().name.startswith("jaxserve-compile")
                    else "")
        return exe

    def _executable(self, num_tokens: int, with_prompt_logprobs: bool):
        """The compiled step for one token bucket and variant: built at warm-up, or (a background
        warm-up) waited for from the compiler thread, or (no warm-up) compiled on first use."""
        key = (num_tokens, with_prompt_logprobs)
        exe = self._executables.get(key)
        if exe is None:
            exe = self._compiler.get(key) if self._compiler is not None else self._compile(key)
        return exe

    @staticmethod
    def program_name(key: tuple[int, bool]) -> str:
        """A step program's file name in a compiled directory: "step_16", "step_64_prompt_logprobs"."""
        return f"step_{key[0]}" + ("_prompt_logprobs" if key[1] else "")

    @property
    def compiled_programs(self) -> list[tuple[int, bool]]:
        """(token bucket, with prompt logprobs) of every compiled step program."""
        with self._lock:
            return sorted(self._executables)

    def programs_obtained(self) -> str:
        """How the step programs came to be: "3 loaded from the compilation cache, 1 compiled"."""
        with self._lock:
            loaded, from_dir, n = self._from_cache, self._from_dir, len(self._executables)
        pre = f"{from_dir} loaded from the {self.programs.kind}, " if self.programs is not None else ""
        return f"{pre}{loaded} loaded from the compilation cache, {n - loaded - from_dir} compiled"

    def run_model(self, inputs: StepInputs):
        """Run the compiled step (cache and penalty state replaced by the donated results);
        returns the device (SamplerOutput, prompt scores or None)."""
        exe = self._executable(len(inputs.tokens), inputs.prompt_targets is not None)
        out, scores, self.cache, self.penalties = exe(self.weights, self.cache, self.penalties,
                                                      *self.device_inputs(inputs))
        return out, scores

    def device_inputs(self, inputs: StepInputs) -> tuple:
        """(packed inputs, bitmask) on the devices: one host -> device transfer of the packed
        inputs, and one of the bitmask when some row is constrained (else the resident mask)."""
        rep = self.plan.replicated
        bitmask = inputs.bitmask
        if not isinstance(bitmask, jax.Array):
            bitmask = jax.device_put(bitmask, rep)
        return jax.device_put(self._packing(inputs).pack(inputs), rep), bitmask

    def _packing(self, x: StepInputs) -> Packing:
        """How the inputs of x's program pack (fixed by the program: planned once, kept)."""
        key = (len(x.tokens), x.prompt_targets is not None)
        packing = self._packings.get(key)
        if packing is None:
            packing = self._packings[key] = Packing.of(x)
        return packing

    def _write_penalty_rows(self) -> None:
        for slot, rows in self.input_batch.take_penalty_writes():
            self._write_penalty_row(slot, rows)

    def _write_penalty_row(self, slot: int, rows) -> None:
        # a compiled program takes its inputs where it was compiled for them: on every device
        args = jax.device_put((np.asarray(slot, np.int32), *rows), self.plan.replicated)
        self.penalties = self.penalty_program()(self.penalties, *args)

    def penalty_program(self):
        """The penalty-row write (`penalties.write_row`), compiled ahead like the step programs, or
        loaded from `programs` ("penalty_write")."""
        if self._penalty_exe is None:
            rep = self.plan.replicated
            spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)   # noqa: E731
            rows = penalties.host_rows([], [], None, (), self.cfg.vocab_size)
            self._penalty_exe, _ = self._load_or_compile(PENALTY_PROGRAM, lambda: penalties.write_row.lower(
                self._state_specs()[2], spec(np.int32(0)), *map(spec, rows)))
        return self._penalty_exe

    def _load_or_compile(self, name: str, lower):
        """(executable, how it came): `programs`' copy of `name` (how: the store's kind), or
        `lower()` compiled here (how: whether JAX's persistent cache answered), then kept in a
        writable store (the program cache)."""
        exe = None if self.programs is None else self.programs.load(name, self.plan.mesh.devices.flat)
        if exe is not None:
            return exe, self.programs.kind
        with self.lower_context():
            exe, from_cache = compile_noting_cache_hit(lambda: lower().compile(self.compiler_options))
        if self.programs is not None and self.programs.writable:
            self.programs.save(name, exe)
        return exe, from_cache

    def execute(self, scheduler_output) -> RunnerOutput:
        """Run one step for a SchedulerOutput (its finished / preempted ids are applied even
        when nothing is scheduled)."""
        batch = self.input_batch
        batch.update(scheduler_output)
        self._write_penalty_rows()
        scheduled = scheduler_output.scheduled
        out = RunnerOutput({}, {}, {})
        if not scheduled:
            return out
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
        compiled = (len(inputs.tokens), want_prompt_lp) in self._executables
        step_out = self.run_model(inputs)
        if self.drafter is not None:        # the draft's K/V for the same tokens (async)
            self.drafter.catch_up(inputs)
        want_lp = any(batch.requests[rid].sampling_params.logprobs is not None for rid in layout.sample_rows)
        res, scores = jax.device_get((step_out[0] if want_lp else step_out[0].tokens_only(), step_out[1]))
        if compiled and not want_prompt_lp:          # a first run's compile is not its cost
            self._time_step(len(inputs.tokens), time.perf_counter() - t0)
        for rid, r in layout.sample_rows.items():
            d = drafts[rid]
            n = accept(res.token_ids[r:r + len(d) + 1], d) + 1 if d else 1
            tokens = [int(t) for t in res.token_ids[r:r + n]]
            out.sampled[rid] = tokens
            if batch.requests[rid].sampling_params.logprobs is not None:
                out.logprobs[rid] = [(float(res.logprob[i]), int(res.rank[i]), res.top_ids[i],
                                      res.top_logprobs[i]) for i in range(r, r + n)]
            batch.append_sampled(rid, tokens)
        if self.drafter is not None:
            out.draft_token_ids = self.drafter.propose(
                scheduled, out.sampled, getattr(scheduler_output, "draft_lengths", None))
        if want_prompt_lp:
            out.prompt_logprobs = self._prompt_logprobs(scheduled, layout.offsets,
                                                        inputs.prompt_targets, scores)
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

    def _prompt_logprobs(self, scheduled, offsets, targets, scores):
        """Each prompt token of a chunk scored under the logits of the token before it."""
        chosen, rank, top_ids, top_vals = scores
        result = {}
        for i, s in enumerate(scheduled):
            if not s.prompt_logprobs:
                continue
            state = self.input_batch.requests[s.request_id]
            k = state.sampling_params.prompt_logprobs
            entries = []
            for j in range(len(s.token_ids)):
                r, nxt = offsets[i] + j, s.num_computed_tokens + j + 1
                if nxt < state.num_prompt_tokens:
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
            x, _ = self._build([], T, with_prompt_logprobs)
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

    def warmup_keys(self) -> list[tuple[int, bool]]:
        """Every step program a step can need, in the order warm-up builds them: the plain
        programs by token bucket, smallest first, then the prompt-logprobs variants (rare)."""
        keys = [(T, False) for T in self.buckets]
        keys += [(self._variant_bucket(T, True), True) for T in self.buckets]
        return list(dict.fromkeys(keys))

    def warmup(self, background: bool = False):
        """Compile every program a step can need: each token bucket with and without prompt
        logprobs, and the penalty-row write. Nothing big is executed; with a warm persistent
        cache this is loads.

        background: build only the plain programs of buckets up to FIRST_PROGRAM_TOKENS now (what
        decodes and short prompts need) and the rest on a background thread, smallest first
        (`ready_token_budget` lets the scheduler keep steps within the built ones; a step that
        needs one still queued waits for it, see `BackgroundCompiler`)."""
        t0 = time.perf_counter()
        keys = self.warmup_keys()
        now = [k for k in keys if not background or (not k[1] and k[0] <= FIRST_PROGRAM_TOKENS)]
        later = [k for k in keys if k not in now]
        state = self._state_specs()
        for key in now:
            self._compile(key, state=state)
        # Writing to slot C is dropped: this builds the write and changes nothing.
        self._write_penalty_row(self.max_seqs, penalties.host_rows([], [], None, (), self.cfg.vocab_size))
        jax.block_until_ready(self.penalties)
        if self.lora is not None:       # the adapter slot write
            self.weights = self.lora.warmup(self.weights)
        if self.drafter is not None:
            self.drafter.warmup(lambda T: self._build([], T, False)[0], self.buckets)
        if later:
            specs = {k: self._program_spec(*k) for k in later}     # on this thread (module doc)
            self._compiler = BackgroundCompiler(
                lambda k: self._compile(k, specs.get(k), state), later, on_done=self._warmup_done)
        release_freed_host_memory()     # what the compiler freed
        elapsed = time.perf_counter() - t0
        logger.info("warm-up: %d step programs (%s) for token buckets %s%s in %.1f s%s",
                    len(self._executables), self.programs_obtained(), self.buckets,
                    "" if self.drafter is None else
                    f" and {len(self.drafter.compiled_programs)} draft-model programs", elapsed,
                    f"; {len(later)} more building in the background" if later else "")
        return elapsed

    def _warmup_done(self, seconds: float) -> None:
        release_freed_host_memory()
        logger.info("background warm-up done: %d step programs (%s) in %.1f s", len(self._executables),
                    self.programs_obtained(), seconds)

    def ready_token_budget(self) -> int | None:
        """While programs compile in the background: the most tokens a step may schedule so
        that its plain program is built (every bucket up to it is); None when all are."""
        c = self._compiler
        if c is None or c.pending == 0:
            return None
        budget = None
        for T in self.buckets:
            if (T, False) not in self._executables:
                break
            budget = T
        return budget

    def wait_for_programs(self, timeout: float | None = None) -> None:
        """Block until the background warm-up (if any) has built every program."""
        if self._compiler is not None:
            self._compiler.wait(timeout)

    def stop_compiling(self, timeout: float | None = 120.0) -> None:
        """Cancel the background warm-up's queued programs and wait (up to `timeout` s) for the
        one compiling (shutdown)."""
        if self._compiler is not None:
            self._compiler.close(timeout)
