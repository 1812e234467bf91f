"""What one step of the scheduler hands to the engine and the worker (vLLM v1's
`sched/output.py`): the scheduled rows, the requests the worker must add or drop, and the
structured-output bitmask and draft lengths the engine fills in. Host side, no jax."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.host_tier import HostCopies
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams

# A token id a row carries for a position whose token a step in flight samples (async
# scheduling): the worker takes it from that step's output on the device.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class NewRequestData:
    """What the worker needs about a request it does not hold yet: on its first schedule, and
    again when it resumes after a preemption (the worker dropped it then). `output_token_ids`
    is empty for a fresh request and the tokens generated so far for a resumed one."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    sample_seed: int
    lora_request: LoRARequest | None = None     # the adapter it runs under (None: base model)


@dataclass
class ScheduledRequest:
    """One row of a step. `token_ids` are the tokens whose KV this step computes, starting at
    position `num_computed_tokens`; `block_ids` is the request's whole block table. `sample`:
    the step's last logits for this row give a new token. `prompt_logprobs`: this chunk covers
    prompt positions and the request asked for prompt logprobs (after a preemption a chunk may
    cover positions already reported; keep the first). `num_lookahead_tokens`: KV slots reserved
    after the known tokens for speculative tokens (0 without speculative decoding).
    `new_request`: set on the row that (re)admits a request from the waiting queue, None on the
    rows of requests the worker already holds (vLLM's NewRequestData / CachedRequestData)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    prompt_logprobs: bool = False
    num_lookahead_tokens: int = 0
    new_request: NewRequestData | None = None
    # Draft tokens appended at the end of `token_ids` (speculative decoding): the row's logits
    # at each of them and at its last known token are sampled and verified.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SpecDecodingStats:
    """Counters since start (vLLM's spec_decode metrics)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.append(0)
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1


@dataclass
class GrammarBitmask:
    """The tokens the structured-output rows of a step may sample (vLLM's GrammarOutput), filled
    by the engine after `schedule()`: `bitmask` ([n, ceil(V / 32)] int32 numpy; bit j of word w
    set = token 32 * w + j allowed) holds, for each of `request_ids` in turn, 1 + len(its row's
    spec_token_ids) rows: its sampling position, then the position after each draft."""

    request_ids: list[str]
    bitmask: Any


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0                  # sum of len(token_ids)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # freed since the last step
    grammar_bitmask: GrammarBitmask | None = None  # None: no constrained row samples this step
    # Draft model only: request_id -> drafts the worker should propose after this step (filled
    # by the engine from the proposer's opt-out; None: k for every sampling row).
    draft_lengths: dict[str, int] | None = None
    # Which schedule this is (prompt-logprob promises end when its results are applied), and
    # request_id -> prefix-cache hit blocks whose prompt logprobs it takes from the cache, for
    # the requests it admitted (`Scheduler.prompt_logprobs_of_step`).
    step_id: int = 0
    prompt_logprob_hits: dict[str, int] = field(default_factory=dict)
    # The host KV tier's copies to run before this step (`core/host_tier.py`); None: none.
    host_copies: HostCopies | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
