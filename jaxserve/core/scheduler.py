"""The token-budget scheduler (vLLM v1): continuous batching, chunked prefill, prefix caching,
preemption by recompute, FCFS or priority.

Host side, no jax. There is no prefill or decode phase: each step every scheduled request gets
some of the tokens it has not computed yet (`num_tokens - num_computed_tokens`), and all of them
share one budget of `max_num_batched_tokens`. Running requests are served first, in order; then
waiting ones are admitted while budget, `max_num_seqs` and KV blocks allow.

Contract with the engine:
- `schedule()` -> `SchedulerOutput`; the runner computes KV for each `ScheduledRequest.token_ids`
  and samples one token per row with `sample=True`.
- `update_from_output(output, {request_id: [token, ...]})` appends the tokens, applies stop
  token ids / EOS / min_tokens / max_tokens / max_model_len, frees finished requests and returns
  the requests that changed (read `status`, `stop_reason`, `output_token_ids` from them).
- Stop strings are the engine's: it calls `finish_requests(ids, RequestStatus.FINISHED_STOPPED)`.
- Structured output: a request with `request.structured` (the engine's StructuredRequest) has
  each sampled token fed to it here, and finishes "stop" once its grammar is complete.
- Async scheduling (`SchedulerConfig.async_scheduling`, vLLM's AsyncScheduler): `schedule()`
  advances each row's `num_computed_tokens` at once and counts its sampled token as an output
  placeholder, so the next `schedule()` may run before this step's `update_from_output`: a
  request whose last step is in flight gets a row for the position of the token that step
  samples (token id PLACEHOLDER_TOKEN_ID; the worker takes it from that step's output on the
  device). A request whose in-flight tokens reach max_tokens / max_model_len is not scheduled
  again; one that stops one step late (EOS, stop ids, stop strings) has its extra row's token
  dropped by `update_from_output` (the request is gone). Without it (synchronous steps)
  `num_computed_tokens` advances in `update_from_output`. Drafts under async scheduling: a row
  gets drafts only when none of its tokens is in flight (drafts proposed before that token would
  be stale); its drafts count as computed at `schedule()` and the rejected ones roll back in
  `update_from_output`, so the engine applies a step that verified drafts before it schedules
  the next (`LLMEngine.step`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from jaxserve.core.request import InvalidRequestError, Request, RequestStatus
from jaxserve.core.request_queue import WaitingQueue
from jaxserve.core.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    GrammarBitmask,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SpecDecodingStats,
)

__all__ = ["GrammarBitmask", "NewRequestData", "ScheduledRequest", "Scheduler", "SchedulerOutput",
           "SpecDecodingStats"]

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int | None = None) -> None:
        num_blocks = num_blocks or cache_config.num_blocks
        if not num_blocks:
            raise ValueError("Scheduler needs num_blocks (or cache_config.num_blocks) resolved")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               cache_config.prefix_caching_hash_algo,
                                               cache_config.num_host_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []
        self.num_preemptions_total = 0
        self.spec_stats = SpecDecodingStats()
        # Requests finished with FINISHED_ERROR while a step's results were applied (prompt
        # logprobs they were admitted on never came): the engine reports them (`take_errored`).
        self._errored: list[Request] = []

    # --- requests in and out -----------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """Raise InvalidRequestError (a ValueError naming the field) unless `add_request` would
        accept the request: a duplicate id, an empty prompt, a prompt longer than max_model_len,
        or a request that could not fit in the whole KV cache even alone (it would otherwise be
        preempted and recomputed forever). Changes nothing."""
        n = request.num_prompt_tokens
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in the "
                                      "scheduler", "request_id")
        if n == 0:
            raise InvalidRequestError("The decoder prompt cannot be empty", "prompt")
        if n > self.config.max_model_len:
            raise InvalidRequestError(f"The decoder prompt (length {n}) is longer than the "
                                      f"maximum model length of {self.config.max_model_len}.",
                                      "prompt")
        spec = self.config.num_speculative_tokens + self.config.num_lookahead_tokens
        capacity = self.kv_cache_manager.num_blocks * self.block_size
        if -(-(n + spec) // self.block_size) > self.kv_cache_manager.num_blocks:
            raise InvalidRequestError(
                f"The prompt ({n} tokens) is longer than the whole KV cache can hold "
                f"({self.kv_cache_manager.num_blocks} blocks of {self.block_size} tokens = "
                f"{capacity} tokens); shorten the prompt or give the KV cache more memory",
                "prompt")
        max_len = min(self.config.max_model_len, n + request.max_tokens) + spec
        need = -(-max_len // self.block_size)
        if need > self.kv_cache_manager.num_blocks:
            raise InvalidRequestError(
                f"request {request.request_id!r} may need {need} KV blocks of {self.block_size} "
                f"tokens ({n} prompt tokens + max_tokens {request.max_tokens}) but the cache has "
                f"only {self.kv_cache_manager.num_blocks}; lower max_tokens or max_model_len, or "
                "give the KV cache more memory", "max_tokens")

    def add_request(self, request: Request) -> None:
        """Queue a request after `check_request`."""
        self.check_request(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string) at any time; blocks are freed now.
        Unknown or already finished ids are ignored."""
        if not finished_status.is_finished():
            raise ValueError(f"finished_status must be a finished status, got {finished_status}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The step of `scheduler_output` raised before its results came back: finish every
        request it scheduled with FINISHED_ERROR, after unregistering the prefix-cache hashes of
        the blocks that step would have written (their K/V is unknown, so a later hit would read
        garbage). Requests outside the step are untouched. The worker never acknowledged the
        step, so its finished and preempted ids are handed to it again with the next one.
        Returns the failed requests (finished, blocks freed)."""
        self.kv_cache_manager.prompt_logprobs.settle(scheduler_output.step_id)
        copies = scheduler_output.host_copies
        if copies:      # copies that may not have run: their data is not what the hashes say
            pool = self.kv_cache_manager.block_pool
            for _, block_id in copies.restore:
                pool.uncache_block(pool.blocks[block_id])
            self.kv_cache_manager.host_tier.discard([slot for _, slot in copies.offload])
        failed = []
        for row in scheduler_output.scheduled:
            request = self.requests.get(row.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.kv_cache_manager.uncache_uncomputed_blocks(request, row.num_computed_tokens)
            self.running.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request)
            failed.append(request)
        # Removing an id the worker does not hold is a no-op, so resending is safe.
        self.finished_req_ids.extend(scheduler_output.finished_request_ids)
        self.finished_req_ids.extend(scheduler_output.preempted_request_ids)
        return failed

    def _free_request(self, request: Request) -> None:
        request.finished_time = time.time()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # --- the step -----------------------------------------------------------------------------

    def _drafts(self, request: Request, start: int, num_new: int, budget: int) -> list[int]:
        """The one place speculative tokens enter the budget: a row that samples this step
        (computes up to the last known token) carries the request's draft tokens, within what
        is left of the budget, of max_model_len and of max_tokens (the bonus token included)."""
        if (start + num_new < request.num_tokens or not request.spec_token_ids
                or request.num_output_placeholders):     # a token in flight: proposed before it
            return []
        room = min(self.config.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens - 1)
        n = max(0, min(len(request.spec_token_ids), self.config.num_speculative_tokens,
                       budget - num_new, room))
        return request.spec_token_ids[:n]

    def _lookahead(self, request: Request, end: int) -> int:
        """KV slots to allocate past position `end` (this row's last token + 1) for a draft
        model's proposals: only on a row that samples (reaches the last known token), never past
        max_model_len (the worker's block tables stop there)."""
        if not self.config.num_lookahead_tokens or end < request.num_tokens:
            return 0
        return max(0, min(self.config.num_lookahead_tokens, self.config.max_model_len - end))

    def _row(self, request: Request, num_new: int, drafts: list[int] = (),
             new: bool = False) -> ScheduledRequest:
        start = request.num_computed_tokens
        known = request.all_token_ids[start:start + num_new]
        scores_prompt = (request.sampling_params.prompt_logprobs is not None
                         and start < request.num_prompt_tokens)
        if scores_prompt:
            self.kv_cache_manager.promise_prompt_logprobs(request, start, start + num_new)
        new_request = NewRequestData(list(request.prompt_token_ids),
                                     list(request.output_token_ids), request.sampling_params,
                                     request.sample_seed, request.lora_request) if new else None
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=known + [PLACEHOLDER_TOKEN_ID] * (num_new - len(known)) + list(drafts),
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            sample=start + num_new == request.num_tokens + request.num_output_placeholders,
            prompt_logprobs=scores_prompt,
            new_request=new_request, spec_token_ids=list(drafts))

    def _lora_admissible(self) -> Request | None:
        """The first waiting request (queue order) whose adapter fits: the base model, an
        adapter a running request already uses, or a new one while fewer than max_loras are in
        use. Running requests are all that a step schedules besides the admitted ones, so no step
        holds more than max_loras distinct adapters."""
        active = {r.lora_request.lora_name for r in self.running if r.lora_request is not None}
        for request in self.waiting:
            lora = request.lora_request
            if lora is None or lora.lora_name in active or len(active) < self.config.max_loras:
                return request
        return None

    def _preemption_victim(self) -> Request:
        if self.config.policy == "priority":
            # Lowest priority = largest (priority, arrival_time); among equals the newest.
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens (outputs included), requeue at
        the front; it resumes exactly where it was once it has recomputed its tokens."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_output_placeholders = 0     # a step in flight still appends its token
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add(request, front=True)

    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """token_budget: a lower cap on this step's tokens than max_num_batched_tokens (the
        engine's, while larger step programs still compile in the background)."""
        budget = self.config.max_num_batched_tokens
        if token_budget is not None:
            budget = min(budget, token_budget)
        rows: dict[str, ScheduledRequest] = {}   # insertion order = batch order
        cost: dict[str, int] = {}
        preempted: list[str] = []
        step_id = self.kv_cache_manager.prompt_logprobs.new_step()
        prompt_logprob_hits: dict[str, int] = {}

        # 1. Running requests: decodes and unfinished prefill chunks, in order.
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:   # preempted earlier in this loop
                continue
            if self._at_length_limit(request):
                continue        # its in-flight token is its last: it finishes on update
            num_new = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                          budget)
            if num_new <= 0:
                continue
            drafts = self._drafts(request, request.num_computed_tokens, num_new, budget)
            lookahead = self._lookahead(request, request.num_computed_tokens + num_new + len(drafts))
            while self.kv_cache_manager.allocate_slots(request, num_new + len(drafts),
                                                       num_lookahead_tokens=lookahead) is None:
                victim = self._preemption_victim()
                if victim.request_id in rows:   # priority policy may pick a scheduled row
                    del rows[victim.request_id]
                    budget += cost.pop(victim.request_id)
                    # Its row will not run, so the blocks it was about to fill hold nothing.
                    self.kv_cache_manager.uncache_uncomputed_blocks(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            rows[request.request_id] = self._row(request, num_new, drafts)
            cost[request.request_id] = num_new + len(drafts)
            budget -= num_new + len(drafts)

        # 2. Waiting requests. Not after a preemption: blocks are short, admitting more now would
        # only thrash.
        while (not preempted and len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek() if not self.config.max_loras else self._lora_admissible()
            if request is None:
                break       # every waiting request needs an adapter slot that is taken
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break   # head of line waits for a step with room for its whole prompt
            num_new = min(num_new, budget)
            if self.kv_cache_manager.allocate_slots(
                    request, num_new, hits,
                    self._lookahead(request, num_hit_tokens + num_new)) is None:
                break
            if self.config.max_loras:       # not always the head (`_lora_admissible`)
                self.waiting.remove(request)
            else:
                self.waiting.pop()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            # Every request leaving the waiting queue is new to the worker: fresh, or resumed
            # after a preemption (the worker dropped it when it was preempted).
            request.spec_token_ids = []
            rows[request.request_id] = self._row(request, num_new, new=True)
            if rows[request.request_id].prompt_logprobs and hits:
                prompt_logprob_hits[request.request_id] = len(hits)
            budget -= num_new

        scheduled = list(rows.values())
        if self.config.async_scheduling:
            for row in scheduled:
                request = self.requests[row.request_id]
                request.num_computed_tokens += len(row.token_ids)
                request.num_output_placeholders += row.sample
        output = SchedulerOutput(scheduled=scheduled,
                                 num_scheduled_tokens=sum(len(r.token_ids) for r in scheduled),
                                 preempted_request_ids=preempted,
                                 finished_request_ids=self.finished_req_ids,
                                 step_id=step_id, prompt_logprob_hits=prompt_logprob_hits,
                                 host_copies=self.kv_cache_manager.take_host_copies() or None)
        self.finished_req_ids = []
        return output

    def _at_length_limit(self, request: Request) -> bool:
        """Async scheduling: the tokens of steps in flight take the request to max_tokens or
        max_model_len (it will finish when they are back; no further row)."""
        p = request.num_output_placeholders
        return p > 0 and (request.num_output_tokens + p >= request.max_tokens
                          or request.num_tokens + p >= self.config.max_model_len)

    def prompt_logprobs_of_step(self, scheduler_output: SchedulerOutput,
                                computed: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
        """Call with the runner's prompt-logprob entries of a step ({request id: [(position,
        entry)]}, each in position order) before `update_from_output`: records the full blocks
        in the prefix cache and returns the entries to deliver, the positions that admitted
        requests took from the cache prepended (all of them in position order). A request whose
        cached entries never came (the step promising them failed, or its request was aborted
        first) is finished with FINISHED_ERROR (`take_errored`)."""
        cache = self.kv_cache_manager
        hits = scheduler_output.prompt_logprob_hits
        if not computed and not hits:              # the common step: no scoring
            cache.prompt_logprobs.settle(scheduler_output.step_id)
            return computed
        for rid, entries in computed.items():
            request = self.requests.get(rid)
            if request is not None:
                cache.record_prompt_logprobs(request, entries)
        cache.prompt_logprobs.settle(scheduler_output.step_id)
        out = dict(computed)
        for rid, num_blocks in hits.items():
            request = self.requests.get(rid)
            if request is None:
                continue
            cached = cache.cached_prompt_logprobs(request, num_blocks)
            if cached is None:
                out.pop(rid, None)
                self.finish_requests(rid, RequestStatus.FINISHED_ERROR)
                self._errored.append(request)
            else:
                out[rid] = cached + list(computed.get(rid, ()))
        return out

    def take_errored(self) -> list[Request]:
        """The requests `prompt_logprobs_of_step` finished with an error since the last call."""
        errored, self._errored = self._errored, []
        return errored

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[Request]:
        """Advance each scheduled request by what was computed, append sampled tokens for the
        `sample` rows (several per row with speculative decoding; tokens after a stop are
        dropped; every sample row needs at least one), finish and free stopped requests. Returns
        the requests that got tokens or finished. Rows aborted since `schedule()` are skipped. With
        async scheduling `num_computed_tokens` advanced at `schedule()`, and a request preempted
        since (by a later `schedule()`) still gets its tokens: it resumes after them."""
        changed = []
        asynchronous = self.config.async_scheduling
        for row in scheduler_output.scheduled:
            request = self.requests.get(row.request_id)
            if request is None or not (request.status == RequestStatus.RUNNING or (
                    asynchronous and request.status == RequestStatus.PREEMPTED)):
                continue
            new_tokens = sampled.get(row.request_id, []) if row.sample else []
            if row.sample and not new_tokens:
                # Without a token the request would have nothing left to compute: a silent hang.
                raise ValueError(f"no sampled token for request {row.request_id!r}, whose row "
                                 "had sample=True")
            num_drafts = len(row.spec_token_ids)
            if len(new_tokens) > num_drafts + 1:
                raise ValueError(f"{len(new_tokens)} sampled tokens for request "
                                 f"{row.request_id!r}, whose row verified {num_drafts} drafts")
            # Rejected drafts roll back: their KV slots stay allocated but count as not
            # computed, so the next step overwrites them before anything reads them. Accepted
            # drafts are the first len(new_tokens) - 1 sampled tokens.
            num_accepted = max(0, len(new_tokens) - 1) if num_drafts else 0
            if asynchronous:
                request.num_output_placeholders = max(0, request.num_output_placeholders - row.sample)
                if request.status == RequestStatus.RUNNING:     # (a preempted one restarts at 0)
                    request.num_computed_tokens -= num_drafts - num_accepted
            else:
                request.num_computed_tokens += len(row.token_ids) - num_drafts + num_accepted
            if num_drafts:
                self.spec_stats.observe(num_drafts, num_accepted)
            request.spec_token_ids = []
            for token in new_tokens:
                request.append_output_token(int(token))
                if request.structured is not None and not request.structured.accept(int(token)):
                    # The bitmask allowed it, so this is a bug, not the model's fault: say so.
                    logger.error("request %s: sampled token %d is not allowed by its grammar "
                                 "(%s); finishing it with an error", request.request_id,
                                 int(token), request.structured.error)
                    request.status = RequestStatus.FINISHED_ERROR
                    break
                if self._check_stop(request):
                    break
            if request.is_finished():
                if request in self.running:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)        # preempted while its step ran
                self._free_request(request)
            if new_tokens or request.is_finished():
                changed.append(request)
        return changed

    def _check_stop(self, request: Request) -> bool:
        """vLLM's order: stop tokens only from min_tokens on; EOS (stop_reason None) before
        stop_token_ids (stop_reason = the token); then max_tokens / max_model_len."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in params.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if request.structured is not None and request.structured.is_finished:
            # The grammar is complete and allows nothing but EOS: done, without spending a step.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # --- counters -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.prefix_cache_stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
