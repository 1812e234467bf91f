"""`LLMEngine`, the engine core: one step = schedule -> dispatch -> collect -> update (+ detokenise
into RequestOutputs); with async scheduling step N + 1 is dispatched before step N is collected.

`engine/builder.py` makes the parts from `EngineArgs` (model, tokenizer, the runner with its
programs and KV pool); the engine adds the scheduler (host), the output processor (host) and
the loop over them, and takes requests in and out.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import random
import time
from collections.abc import Callable

import jax

from jaxserve.config import EngineArgs
from jaxserve.core.request import InvalidRequestError, Request, RequestStatus
from jaxserve.core.scheduler import GrammarBitmask, Scheduler, SchedulerOutput
from jaxserve.engine import multihost
from jaxserve.engine.builder import build_engine, enable_compilation_cache
from jaxserve.engine.drafting import draft_lengths, propose_drafts
from jaxserve.engine.kv_event_publisher import make_publisher
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.pooling import PoolingRequests
from jaxserve.loader.fp8 import kernels_in
from jaxserve.loader.pooling_config import matryoshka_of
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode import make_proposer
from jaxserve.structured_output import StructuredOutputManager

logger = logging.getLogger("jaxserve")

__all__ = ["EngineStats", "LLMEngine", "enable_compilation_cache"]


@dataclasses.dataclass
class EngineStats:
    """A snapshot for logging and /metrics."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Speculative decoding counters (zeros without it).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # LoRA adapters (names) of the running and the waiting requests, each once, sorted.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # The host KV tier (--kv-offloading-size; zeros without it): prompt tokens looked up and found
    # there (vLLM's external prefix cache), its usage in [0, 1], bytes copied each way.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_host_usage: float = 0.0
    kv_offload_bytes_to_host: int = 0
    kv_offload_bytes_to_device: int = 0


def freeze_startup_heap() -> None:
    """Move every object alive now out of the garbage collector's sight (vLLM's
    `freeze_gc_heap`, run when its engine core is up): the ~0.4M objects that imports, loading
    and compiling leave behind are never garbage, yet each oldest-generation collection walks
    them all, ~0.2 s on one core, a stall every ~60 steps at 256 sequences. `shutdown` undoes
    it."""
    gc.collect()
    gc.freeze()


def _adapters(requests) -> tuple[str, ...]:
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))


class LLMEngine:
    def __init__(self, args: EngineArgs, *, warmup: bool | str = True):
        """warmup: True compiles every step program before returning; "background" only those
        for decode and short prompts, the rest on a background thread while the engine serves
        (steps stay within the built programs, or wait for the one they need: nothing compiles
        on the step's thread); False compiles each on first use."""
        t0 = time.perf_counter()
        parts = build_engine(args, warmup)
        # The parts become the engine's attributes (model_config, tokenizer, runner, ...).
        for f in dataclasses.fields(parts):
            setattr(self, f.name, getattr(parts, f.name))
        args, cfg, spec = self.args, self.model_config, self.args.spec_config()
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config)
        self.processor = OutputProcessor(self.tokenizer, stream_interval=args.stream_interval)
        so_config = args.structured_config()
        self.structured = StructuredOutputManager(self.tokenizer, cfg.vocab_size,
                                                  self._eos_token_ids(cfg),
                                                  reasoning_parser=args.reasoning_parser,
                                                  whitespace_pattern=so_config.whitespace_pattern,
                                                  disable_any_whitespace=so_config.disable_any_whitespace)
        self.proposer = make_proposer(spec)
        # KV-cache events (--kv-events-config): the block pool records, each step publishes
        # (process 0 only: the others schedule nothing).
        self.kv_events = None if self.group is not None and not self.group.is_leader else make_publisher(
            args.kv_events(), args.data_parallel_rank if args.data_parallel_size > 1 else None,
            hash_bytes=self.scheduler.kv_cache_manager.hasher.digest_bytes)
        if self.kv_events is not None:
            self.scheduler.kv_cache_manager.record_events()
        self.pooling = None if self.pooler is None else PoolingRequests(
            self, self.pooler, matryoshka_of(self.model_path))
        self._rng = random.Random(args.seed)
        self._pending = []          # outputs produced outside step() (aborts)
        # Async scheduling: the step launched by the last step() call, read by the next one:
        # (SchedulerOutput, the runner's StepInFlight), or None.
        self._in_flight = None
        self._eos_ids = self._eos_token_ids(cfg)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Test hook: called with each non-empty SchedulerOutput just before the runner executes
        # it; an exception it raises is handled as a failure of that model step.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        self.num_failed_steps = 0
        self.last_step_error: Exception | None = None
        freeze_startup_heap()
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine ready in %.1f s (%d model programs: %s)", self.startup_seconds,
                    len(self.runner.compiled_programs), self.runner.programs_obtained())

    @property
    def fp8_linear(self) -> bool:
        """Whether the linear layers are FP8 (`--quantization fp8` or an FP8 checkpoint)."""
        return bool(kernels_in(self.runner.weights))

    def _eos_token_ids(self, cfg) -> set[int]:
        ids = set(cfg.eos_token_ids) | set(self.generation_eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A str, a list of token ids, {"prompt_token_ids": [...]} or {"prompt": "..."}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict with "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: list[int]):
        if not token_ids:
            raise ValueError("The decoder prompt cannot be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (prompt_token_ids must be "
                             f"in [0, {vocab}))")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(token_ids)}) is longer than the "
                             f"maximum model length of {self.max_model_len}. Make sure that "
                             "`max_model_len` is no smaller than the number of text tokens.")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, lora_request=None) -> None:
        """Queue a request; `lora_request` (a jaxserve.LoRARequest) runs it under that adapter,
        read from disk here (not in a step) and refused with a ValueError naming the field."""
        if lora_request is not None:
            self.load_lora(lora_request)
        if self.pooling is not None or isinstance(params, PoolingParams):
            if self.pooling is None:
                raise InvalidRequestError("This model does not support embeddings: it runs as a "
                                          "generative model (start it with --runner pooling)",
                                          "model")
            return self.pooling.add(request_id, prompt, params, arrival_time, priority)
        params = (params or SamplingParams()).clone()
        if params.logprobs is not None and params.logprobs > self.args.max_logprobs:
            raise ValueError(f"Requested sample logprobs of {params.logprobs}, which is greater "
                             f"than max allowed: {self.args.max_logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.args.max_logprobs:
            raise ValueError(f"Requested prompt logprobs of {params.prompt_logprobs}, which is "
                             f"greater than max allowed: {self.args.max_logprobs}")
        if params.best_of is not None and params.best_of != params.n:
            # best_of > n would sample extra sequences and keep the best: not built; refusing
            # beats silently returning n plain samples.
            raise InvalidRequestError(f"best_of different from n is not supported (best_of="
                                      f"{params.best_of}, n={params.n})", "best_of")
        if self.processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        params.update_from_tokenizer(self._eos_ids)
        if params.n == 1:
            ids, child_params = [request_id], [params]
        else:
            ids = [f"{i}_{request_id}" for i in range(params.n)]
            child_params = [params.replace(n=1, best_of=None,
                                           seed=None if params.seed is None else params.seed + i)
                            for i in range(params.n)]
        requests = [Request(cid, token_ids, p, arrival_time=arrival_time, priority=priority,
                            max_model_len=self.max_model_len,
                            sample_seed=self._rng.getrandbits(32), lora_request=lora_request)
                    for cid, p in zip(ids, child_params)]
        if params.structured_outputs is not None:
            self.compile_structured(params)     # a cache hit when AsyncLLM compiled it already
            for req in requests:
                req.structured = self.structured.new_request(req.sampling_params, token_ids)
        # Validate every child before adding any, so a refusal leaves nothing behind.
        for req in requests:
            if self.processor.has_child(req.request_id):
                raise InvalidRequestError(f"request id {req.request_id!r} (child of "
                                          f"{request_id!r}) is already in use", "request_id")
            self.scheduler.check_request(req)
        for req in requests:
            self.scheduler.add_request(req)
        self.processor.add_request(request_id, text, token_ids, params, ids, child_params)

    def load_lora(self, lora_request) -> None:
        """Read and check an adapter's host copy (InvalidRequestError naming the field)."""
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters are not enabled: start the engine with "
                                      "enable_lora=True (--enable-lora)", "lora_request")
        try:
            self.lora.load(lora_request)
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(str(e), "lora_request") from None

    def remove_lora(self, lora_name: str) -> bool:
        """Drop an adapter's host copy (False: none was loaded); thread-safe."""
        return self.lora is not None and self.lora.remove(lora_name)

    def compile_structured(self, params: SamplingParams) -> None:
        """Compile (or find cached) the grammar of `params.structured_outputs`; raises
        InvalidRequestError naming the field when it is invalid. Thread-safe: AsyncLLM calls it
        in a thread pool before queueing the request."""
        if params.structured_outputs is None:
            return
        try:
            self.structured.compile(params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from None

    def abort_request(self, request_ids) -> None:
        if self.pooling is not None:
            return self.pooling.abort(request_ids)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            children = self.processor.child_ids(rid)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            outs, _ = self.processor.process([], {}, {}, aborted=children)
            self._pending.extend(outs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending) or self._in_flight is not None

    # -- the step -----------------------------------------------------------------------------
    def step(self):
        """One engine iteration; returns the RequestOutputs that have something new.

        Synchronous: schedule, run the step, read its tokens, update. Async scheduling: schedule
        and launch step N + 1, then read step N's tokens and update while N + 1 runs (vLLM's
        async scheduler): each call returns the outputs of the step launched by the call before,
        so the device always has the next step queued while the host works. A step whose
        schedule needs the tokens of the one in flight first waits for them (`_waits_for`).

        When the model step raises, only the requests of that step fail (finish_reason
        "error"); the engine keeps serving the rest. An error that leaves the runner unusable
        (its KV cache gone), or any error in the host bookkeeping, is raised: the engine is dead.
        """
        if self.pooling is not None:
            outputs = self.pooling.step()
            self._publish_kv_events()
            return outputs
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self._waits_for(previous[0]):
            outputs = self._finish(*previous)
            previous = None
        else:
            outputs = []
        sched = self.scheduler.schedule(self._ready_token_budget())
        sched.grammar_bitmask = self._grammar_bitmask(sched)
        if self.runner.drafter is not None:
            sched.draft_lengths = draft_lengths(self.proposer, self.scheduler, sched) if self.proposer else {}
        launched, failed = self._launch(sched)
        if previous is not None:
            outputs += self._finish(*previous)
        outputs += failed
        if launched is not None:
            if self.scheduler.config.async_scheduling:
                self._in_flight = (sched, launched)
            else:
                outputs += self._finish(sched, launched)
        if self._pending:
            outputs, self._pending = self._pending + outputs, []
        self._publish_kv_events()
        return outputs

    def _waits_for(self, in_flight: SchedulerOutput) -> bool:
        """Whether the next schedule needs the tokens of the step in flight: a running request
        under a grammar (its bitmask follows the last token); a row of that step verifying drafts
        (how many are accepted sets where its request goes on); a request with drafts proposed
        (from the tokens before that step's: it would verify them a token late). So with ngram
        or suffix drafts the steps that draft run one at a time, and the others run ahead."""
        return (any(r.structured is not None or r.spec_token_ids for r in self.scheduler.running)
                or any(row.spec_token_ids for row in in_flight.scheduled))

    def _publish_kv_events(self) -> None:
        log = self.scheduler.kv_cache_manager.block_pool.event_log
        if self.kv_events is not None and log is not None:
            self.kv_events.publish(log.take())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (False, nothing done, while requests hold blocks);
        subscribers of KV-cache events get AllBlocksCleared now."""
        done = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def _launch(self, sched: SchedulerOutput) -> tuple:
        """Dispatch a step: (its StepInFlight, or None when nothing is scheduled or it raised; the
        outputs of its failed requests when it raised). Even an empty schedule goes to the runner:
        it carries the finished / preempted ids the worker must drop from its input batch."""
        try:
            if self.fault_hook is not None and not sched.is_empty:
                self.fault_hook(sched)
            if self.group is not None:
                self.group.send(sched)      # the followers run the same step
            return self.runner.dispatch(sched), []
        except multihost.PeerLostError:
            raise                           # no step can run again: the engine is dead
        except Exception as e:
            if sched.is_empty or not self._runner_usable():
                raise
            return None, self._fail_step(sched, e)

    def _finish(self, sched: SchedulerOutput, step) -> list:
        """Read a launched step's results and apply them: prompt logprobs, the scheduler's update
        (stop tokens, lengths), drafts for the next step, detokenised outputs and stop strings."""
        try:
            result = self.runner.collect(step)
        except Exception as e:
            if not self._runner_usable():
                raise
            return self._fail_step(sched, e)
        # Each chunk's entries score the prompt positions after its first token, in order.
        first_pos = {row.request_id: row.num_computed_tokens + 1 for row in sched.scheduled}
        prompt_lps = {rid: [(first_pos[rid] + j, entry) for j, entry in enumerate(entries)]
                      for rid, entries in result.prompt_logprobs.items()}
        # Cache the full blocks' entries; add the positions prefix-cache hits cover.
        prompt_lps = self.scheduler.prompt_logprobs_of_step(sched, prompt_lps)
        errored = self.scheduler.take_errored()
        prompt_rows = [self.scheduler.get_request(r) for r in prompt_lps]
        updated = self.scheduler.update_from_output(sched, result.sampled)
        if self.proposer is not None:
            self.proposer.model_drafts = result.draft_token_ids
            propose_drafts(self.proposer, self.scheduler, self.runner, updated)
        for req in updated:
            new = len(result.sampled.get(req.request_id, ()))
            self.generation_tokens_total += new
            if new and req.num_output_tokens == new:      # its prefill just finished
                self.prompt_tokens_total += req.num_prompt_tokens
        seen = {r.request_id for r in updated}
        extra = [r for r in prompt_rows if r is not None and r.request_id not in seen]
        outputs, stopped = self.processor.process(updated + extra, result.logprobs, prompt_lps)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if errored:
            logger.error("%d request(s) admitted on cached prompt logprobs that never came "
                         "finish with finish_reason 'error'", len(errored))
            outputs += self.processor.process(errored, {}, {})[0]
        return outputs

    def _grammar_bitmask(self, sched: SchedulerOutput) -> GrammarBitmask | None:
        """The allowed tokens of this step's constrained sampling rows, one row per verified
        position (None: no row is constrained, e.g. all inside their reasoning)."""
        ids, states, drafts = [], [], []
        for row in sched.scheduled:
            if row.sample:
                req = self.scheduler.get_request(row.request_id)
                if req is not None and req.structured is not None and (
                        req.structured.constrains or row.spec_token_ids):
                    ids.append(row.request_id)
                    states.append(req.structured)
                    drafts.append(row.spec_token_ids)
        if not ids:
            return None
        mask = self.structured.bitmask(states, drafts)
        return GrammarBitmask(ids, mask) if (mask != -1).any() else None

    def _runner_usable(self) -> bool:
        """False when the failed step consumed the donated KV cache (nothing can run again)."""
        runner = self.runner
        return runner is not None and not any(
            x.is_deleted() for x in jax.tree_util.tree_leaves(
                (runner.cache, runner.penalties, runner.drafter and runner.drafter.cache)))

    def _fail_step(self, sched, error: Exception):
        """Finish the failed step's requests with "error" (uncaching the blocks it would have
        written) and return their outputs."""
        failed = self.scheduler.fail_step(sched)
        self.num_failed_steps += 1
        self.last_step_error = error
        logger.error("a model step failed; finishing its %d request(s) with finish_reason "
                     "'error': %r", len(failed), error, exc_info=error)
        outputs, _ = self.processor.process(failed, {}, {})
        return outputs

    def stats(self) -> EngineStats:
        pc = self.scheduler.prefix_cache_stats
        sd = self.scheduler.spec_stats
        tier, copies = self.scheduler.kv_cache_manager.host_tier, getattr(self.runner, "host_tier", None)
        offload = {} if tier is None or copies is None else dict(
            external_prefix_cache_queries=pc.queries, external_prefix_cache_hits=pc.host_hits,
            kv_offload_host_usage=tier.usage, kv_offload_bytes_to_host=copies.bytes_offloaded,
            kv_offload_bytes_to_device=copies.bytes_restored)
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting,
                           self.scheduler.kv_cache_usage, self.scheduler.num_preemptions_total,
                           pc.queries, pc.hits, self.prompt_tokens_total,
                           self.generation_tokens_total, sd.num_drafts, sd.num_draft_tokens,
                           sd.num_accepted_tokens, tuple(sd.num_accepted_tokens_per_pos),
                           _adapters(self.scheduler.running), _adapters(self.scheduler.waiting),
                           **offload)

    def config_info(self) -> dict[str, dict[str, str]]:
        """What /metrics reports of the configuration, vLLM's `*_config_info` info gauges: the
        KV cache's (`cache_config_info`: block size and the pool's blocks, what a router such as
        the Gateway API Inference Extension reads) and, with LoRA, `max_lora`. Values are
        strings, as vLLM gives them ("True", "None")."""
        c, a = self.cache_config, self.args
        cache = {"block_size": c.block_size, "cache_dtype": c.kv_cache_dtype,
                 "enable_prefix_caching": c.enable_prefix_caching,
                 "gpu_memory_utilization": c.gpu_memory_utilization, "num_gpu_blocks": c.num_blocks,
                 "num_gpu_blocks_override": a.num_gpu_blocks_override,
                 "num_cpu_blocks": c.num_host_blocks or None,
                 "prefix_caching_hash_algo": c.prefix_caching_hash_algo}
        info = {"cache": {k: str(v) for k, v in cache.items()}}
        if a.enable_lora:
            info["lora"] = {"max_lora": str(a.max_loras)}
        return info

    def follow(self) -> int:
        """A process with node_rank > 0: run the steps process 0 sends until it stops (exit code
        0) or is gone (1)."""
        if self.group is None or self.group.is_leader:
            raise RuntimeError("follow() is for processes with node_rank > 0")
        return multihost.follow(self.group, self.runner.execute)

    def _ready_token_budget(self) -> int | None:
        """While a background warm-up compiles the larger buckets, steps stay within the built
        programs (prefills are chunked smaller) instead of waiting for a compile; without
        chunked prefill a long prompt would wait anyway, so no cap there."""
        if not self.scheduler_config.enable_chunked_prefill:
            return None
        return self.runner.ready_token_budget()

    def wait_for_programs(self, timeout: float | None = None) -> None:
        """Block until a background warm-up (`warmup="background"`) has built every program."""
        self.runner.wait_for_programs(timeout)

    def shutdown(self) -> None:
        """Free the KV pool and the weights (device memory) now; the objects start-up froze go
        back to the garbage collector (a dropped engine's cycles can be freed)."""
        gc.unfreeze()
        group = getattr(self, "group", None)
        if group is not None and group.is_leader:
            group.close()
        publisher, self.kv_events = getattr(self, "kv_events", None), None
        if publisher is not None:
            publisher.shutdown()
        runner = getattr(self, "runner", None)
        if runner is not None:
            in_flight, self._in_flight = getattr(self, "_in_flight", None), None
            if in_flight is not None:       # let it finish before its buffers go
                jax.block_until_ready(in_flight[1].results)
            runner.stop_compiling()
            if runner.drafter is not None:
                runner.drafter.release()
            for x in jax.tree_util.tree_leaves((runner.cache, runner.weights, runner.penalties)):
                x.delete()
            runner.cache = runner.weights = runner.penalties = None
            self.runner = None


