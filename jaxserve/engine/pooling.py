"""The engine's side of pooling models (`runner="pooling"`): prefill-only requests.

A pooling request is an ordinary scheduler `Request` (so batching, chunked prefill, the token
budget, preemption and the KV pool all apply) that finishes the step its prompt is fully
computed: the `PoolingRunner` returns the pooled vector instead of sampling a token, and this
module finishes the request (no token is appended) and emits a `PoolingRequestOutput` with the
vector truncated to `dimensions` and normalized as the request asks. `LLMEngine` hands its
`add_request`, `abort_request` and `step` here when it runs a pooling model.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxserve.core.request import InvalidRequestError, Request, RequestStatus
from jaxserve.outputs import PoolingOutput, PoolingRequestOutput
from jaxserve.pooling_params import PoolerConfig, PoolingParams, check_dimensions, finish_vector
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class _Pooled:
    prompt: str | None
    token_ids: list[int]
    params: PoolingParams
    request: Request


def engine_args_for_pooling(args, pooler: PoolerConfig):
    """The engine arguments a pooling model runs with: MEAN and CLS read hidden states of
    every prompt token, which a prefix-cache hit would skip, so prefix caching is off for them.
    Steps are synchronous (nothing is sampled, so nothing feeds the next step: no overlap to win)."""
    if args.async_scheduling:
        raise ValueError("async_scheduling does not apply to pooling models (runner 'pooling'): leave it unset")
    args = args.replace(async_scheduling=False)
    if args.speculative_config:
        raise ValueError("speculative_config does not apply to pooling models (runner 'pooling')")
    if args.nnodes > 1:
        raise ValueError("nnodes > 1 is not supported for pooling models (runner 'pooling')")
    if pooler.needs_every_token and args.enable_prefix_caching:
        logger.info("prefix caching is off: %s pooling reads every prompt token's hidden state",
                    pooler.pooling_type)
        return args.replace(enable_prefix_caching=False)
    return args


def truncate_prompt(token_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: the last k tokens; -1 keeps the last max_model_len."""
    if k is None:
        return token_ids
    k = max_model_len if k == -1 else k
    return token_ids[-k:] if len(token_ids) > k else token_ids


class PoolingRequests:
    """The live pooling requests of one engine and the model's pooler."""

    def __init__(self, engine, pooler: PoolerConfig, matryoshka: bool | tuple[int, ...]):
        self.engine = engine
        self.pooler = pooler
        self.matryoshka = matryoshka
        self.requests: dict[str, _Pooled] = {}

    def check_params(self, params: PoolingParams) -> None:
        """Raise ValueError naming the field when the model cannot honour `params`."""
        dims = params.dimensions if params.dimensions is not None else self.pooler.dimensions
        check_dimensions(dims, self.engine.model_config.hidden_size, self.matryoshka)

    def add(self, request_id: str, prompt, params, arrival_time: float | None = None,
            priority: int = 0) -> None:
        engine = self.engine
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("This model runs as a pooling model (runner 'pooling'): it "
                                      "computes embeddings and cannot generate text; use "
                                      "LLM.embed / /v1/embeddings, or start it with --runner "
                                      "generate", "prompt")
        if request_id in self.requests or engine.scheduler.get_request(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_params(params)
        text, token_ids = engine.tokenize_prompt(prompt)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, engine.max_model_len)
        engine.validate_prompt(token_ids)
        # Prefill only: one "output" position is the row that finishes the prompt (no token is
        # ever sampled or appended; max_tokens 1 sizes the admission check).
        request = Request(request_id, token_ids, SamplingParams(max_tokens=1),
                          arrival_time=arrival_time, priority=priority,
                          max_model_len=engine.max_model_len, sample_seed=0)
        engine.scheduler.add_request(request)
        self.requests[request_id] = _Pooled(text, token_ids, params, request)

    def abort(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = [rid for rid in ids if rid in self.requests]
        self.engine.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self.engine._pending.extend(self._output(rid, None, "abort") for rid in live)

    def _output(self, rid: str, vector, finish_reason: str) -> PoolingRequestOutput:
        p = self.requests.pop(rid)
        cached = max(p.request.num_cached_tokens, 0)
        return PoolingRequestOutput(rid, None if vector is None else PoolingOutput(vector),
                                    p.token_ids, True, cached, p.prompt, finish_reason,
                                    p.request.metrics())

    def step(self) -> list[PoolingRequestOutput]:
        """One engine step: schedule, run the pooling step, finish the requests whose prompt
        is done. A failed model step fails its requests (finish_reason "error"), as the
        generate engine does."""
        engine, scheduler = self.engine, self.engine.scheduler
        sched = scheduler.schedule()
        try:
            if engine.fault_hook is not None and not sched.is_empty:
                engine.fault_hook(sched)
            pooled = engine.runner.execute(sched)
        except Exception as e:
            if sched.is_empty or not engine._runner_usable():
                raise
            failed = scheduler.fail_step(sched)
            engine.num_failed_steps += 1
            engine.last_step_error = e
            logger.error("a pooling step failed; failing its %d request(s): %r", len(failed), e,
                         exc_info=e)
            return self._drain([self._output(r.request_id, None, "error") for r in failed
                                if r.request_id in self.requests])
        # Advance every row by what it computed; no row appends a token.
        rows = [dataclasses.replace(r, sample=False) for r in sched.scheduled]
        scheduler.update_from_output(dataclasses.replace(sched, scheduled=rows), {})
        outputs = []
        for rid, vector in pooled.items():
            p = self.requests.get(rid)
            if p is None:
                continue
            scheduler.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
            engine.prompt_tokens_total += len(p.token_ids)
            params = p.params
            dims = params.dimensions if params.dimensions is not None else self.pooler.dimensions
            normalize = self.pooler.normalize if params.normalize is None else params.normalize
            outputs.append(self._output(rid, finish_vector(vector, dims, normalize), "stop"))
        return self._drain(outputs)

    def _drain(self, outputs: list) -> list:
        if self.engine._pending:
            outputs, self.engine._pending = self.engine._pending + outputs, []
        return outputs
