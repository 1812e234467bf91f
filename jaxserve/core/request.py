"""`Request`: the scheduler's record of one sequence, and `RequestStatus`.

Host side, no jax. A request has no prefill/decode phase: `num_computed_tokens` (tokens of
`all_token_ids` whose KV is in the cache) catches up to `num_tokens`; when it does, the step's last
logits give the next token. n > 1 is the engine's business: it adds n child requests.
"""

from __future__ import annotations

import enum
import secrets
import time

from jaxserve.outputs import RequestMetrics
from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Order matters: every status after PREEMPTED is a finished one (as in vLLM)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def is_finished(self) -> bool:
        """Works as `status.is_finished()` and as vLLM's `RequestStatus.is_finished(status)`."""
        return self > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        """OpenAI finish_reason: "stop", "length", "abort", "error", or None while not
        finished."""
        return _FINISHED_REASON.get(self)


# IGNORED (prompt too long for the cache) reports "length", as vLLM does.
_FINISHED_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",     # its step raised (vLLM's FINISHED_ERROR)
}


class InvalidRequestError(ValueError):
    """A request refused at admission; `param` names the request field at fault (the server
    reports it in the OpenAI error's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Request:
    """One sequence being generated.

    `max_tokens` is resolved here: SamplingParams.max_tokens, or (when None) whatever fits in
    max_model_len. `num_cached_tokens` is -1 until the first schedule, then the prefix-cache hit.
    `block_hashes` is the prefix-cache hash chain over full blocks of `all_token_ids`, filled
    lazily by the KV cache manager; tokens are append-only, so it stays valid across preemption.
    `sample_seed` (u32) seeds the sampler's noise together with the output position, so a
    preempted request resamples the same tokens: SamplingParams.seed when set, else the
    `sample_seed` argument (the engine derives it from its own seed for reproducible runs),
    else a fresh random value.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, arrival_time: float | None = None,
                 priority: int = 0, max_model_len: int | None = None,
                 sample_seed: int | None = None, lora_request=None) -> None:
        self.request_id = request_id
        # The LoRA adapter it runs under (jaxserve.lora.LoRARequest), or None: the base model.
        self.lora_request = lora_request
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        # Structured output: the grammar state (jaxserve.structured_output.StructuredRequest:
        # accept(token) -> bool, is_finished, error) that the scheduler advances with each
        # sampled token; None when unconstrained. Kept across preemption.
        self.structured = None
        # Draft tokens proposed for the positions after all_token_ids (speculative decoding);
        # never part of all_token_ids until the target has verified them.
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens sampled by steps in flight, not yet appended (each has its
        # KV position scheduled: the next row computes it from the device-side token).
        self.num_output_placeholders = 0
        if sampling_params.seed is not None:
            sample_seed = sampling_params.seed
        elif sample_seed is None:
            sample_seed = secrets.randbits(32)
        self.sample_seed = sample_seed & 0xFFFFFFFF
        if sampling_params.max_tokens is not None:
            self.max_tokens = sampling_params.max_tokens
        elif max_model_len is not None:
            self.max_tokens = max(1, max_model_len - len(self.prompt_token_ids))
        else:
            self.max_tokens = 1 << 62
        # Timestamps for RequestMetrics (time.time()).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.token_gaps: list[float] = []      # seconds between consecutive output tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        now = time.time()
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.token_gaps.append(now - self.last_token_time)
        self.last_token_time = now

    def is_finished(self) -> bool:
        return self.status.is_finished()

    def get_finished_reason(self) -> str | None:
        return self.status.get_finished_reason()

    def metrics(self) -> RequestMetrics:
        queued = (None if self.first_scheduled_time is None
                  else self.first_scheduled_time - self.arrival_time)
        return RequestMetrics(arrival_time=self.arrival_time, last_token_time=self.last_token_time,
                              first_scheduled_time=self.first_scheduled_time,
                              first_token_time=self.first_token_time, time_in_queue=queued,
                              finished_time=self.finished_time,
                              inter_token_latencies=self.token_gaps)

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, "
                f"num_output_tokens={self.num_output_tokens})")
