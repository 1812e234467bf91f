"""The step programs of a model runner: which ones a runner needs (a token bucket with and without
prompt logprobs; the penalty-row write), and how each comes to be — loaded from a compiled
directory or program cache (`jaxserve.aot.store`), or lowered from shapes and compiled ahead of
time (JAX's persistent cache turning a repeat into a load), at warm-up or by a background
compiler while the engine serves. Nothing here runs a step: `ModelRunner` does (model_runner.py).
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np

from jaxserve.host_memory import release_freed_host_memory
from jaxserve.sample import penalties
from jaxserve.worker.compile_cache import compile_noting_cache_hit, how_obtained
from jaxserve.worker.compile_queue import BackgroundCompiler

logger = logging.getLogger("jaxserve.worker.model_runner")

# A background warm-up builds the plain programs of buckets up to this many tokens before the
# engine reports ready (batch-1 decode and short prompts), the rest while it serves.
FIRST_PROGRAM_TOKENS = 16

PENALTY_PROGRAM = "penalty_write"     # the penalty-row write's name in a compiled directory


class StepPrograms:
    """The program half of `ModelRunner` (a base class: it reads the runner's jitted step, state,
    buckets and build methods): `_executables` by (token bucket, with prompt logprobs)."""

    def step_key(self, num_tokens: int, with_prompt_logprobs: bool, width: int | None = None) -> tuple:
        """A step program's key: (token bucket, with prompt logprobs), and its block tables' width
        in blocks where that is not the widest (`kv_widths`; None: the widest)."""
        if width is None or width == self.kv_widths[-1]:
            return (num_tokens, with_prompt_logprobs)
        return (num_tokens, with_prompt_logprobs, width)

    def step_key_of(self, x) -> tuple:
        """The key of the program that runs the step inputs x."""
        return self.step_key(len(x.tokens), x.prompt_targets is not None, x.meta.block_tables.shape[1])

    def _program_spec(self, num_tokens: int, with_prompt_logprobs: bool, width: int | None = None) -> tuple:
        """(packed inputs, bitmask, Packing) of one program, as shapes (built from an empty batch:
        call it on the engine's thread, the input batch is not the compiler thread's to read)."""
        x, _ = self._build([], num_tokens, with_prompt_logprobs,
                           self.kv_widths[-1] if width is None else width)      # shapes only
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
        logger.info("step program %d: %d tokens%s%s, %s (%.1f s)%s", n, key[0],
                    ", prompt logprobs" if key[1] else "",
                    f", KV {key[2] * self.block_size} tokens wide" if len(key) > 2 else "",
                    how_obtained(from_cache),
                    time.perf_counter() - t0,
                    " (background)" if threading.current_thread().name.startswith("jaxserve-compile")
                    else "")
        return exe

    def _executable(self, num_tokens: int, with_prompt_logprobs: bool, width: int | None = None):
        """The compiled step for one token bucket, variant and block-table width (None: the
        widest): built at warm-up, or (a background warm-up) waited for from the compiler
        thread, or (no warm-up) compiled on first use."""
        key = self.step_key(num_tokens, with_prompt_logprobs, width)
        exe = self._executables.get(key)
        if exe is None:
            exe = self._compiler.get(key) if self._compiler is not None else self._compile(key)
        return exe

    @staticmethod
    def program_name(key: tuple) -> str:
        """A step program's file name in a compiled directory: "step_16", "step_64_prompt_logprobs",
        "step_16_kv32blocks" (block tables 32 blocks wide, not the widest)."""
        width = f"_kv{key[2]}blocks" if len(key) > 2 else ""
        return f"step_{key[0]}" + ("_prompt_logprobs" if key[1] else "") + width

    @property
    def compiled_programs(self) -> list[tuple]:
        """The keys (`step_key`) of every compiled step program."""
        with self._lock:
            return sorted(self._executables)

    def programs_obtained(self) -> str:
        """How the step programs came to be: "3 loaded from the compilation cache, 1 compiled"."""
        with self._lock:
            loaded, from_dir, n = self._from_cache, self._from_dir, len(self._executables)
        pre = f"{from_dir} loaded from the {self.programs.kind}, " if self.programs is not None else ""
        return f"{pre}{loaded} loaded from the compilation cache, {n - loaded - from_dir} compiled"

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

    def warmup_keys(self) -> list[tuple]:
        """Every step program a step can need, in the order warm-up builds them: the plain
        programs by token bucket, smallest first (each block-table width of a bucket, widest
        first), then the prompt-logprobs variants (rare; the widest tables only)."""
        keys = [self.step_key(T, False, w) for T in self.buckets for w in reversed(self.kv_widths)]
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
        if getattr(self, "host_tier", None) is not None:   # the host KV tier's copies
            self.cache = self.host_tier.warmup(self.cache)
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
            if any(self.step_key(T, False, w) not in self._executables for w in self.kv_widths):
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
