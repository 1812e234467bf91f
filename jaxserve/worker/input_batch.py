"""The worker's persistent input batch (vLLM v1's `InputBatch`): what the worker knows about each
request it serves, kept across steps and changed only by the scheduler's output and by the
tokens the worker itself sampled.

Host side (numpy). Each request holds one slot in `[0, max_num_seqs)`; per-slot sampling
parameters live in `[C]` arrays, so one step's sampling tensors are a gather by slot. Lifecycle:
- `update(scheduler_output)`: drop finished and preempted ids, then add every row carrying
  `new_request` (first schedule, or resume after a preemption, which recomputes from scratch);
- `count_dispatched(request_id)`: a step that samples its next token was launched (the next
  step's sampling positions count it, before it is back: async scheduling);
- `append_sampled(request_id, token_ids)`: the tokens that step sampled for it;
- `take_penalty_writes()`: rows the device penalty state must receive for the requests just
  added with a penalty (`jaxserve.sample.penalties.write_row`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sample.penalties import host_rows
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class CachedRequestState:
    request_id: str
    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]     # known outputs: from the scheduler on add, then sampled here
    sampling_params: SamplingParams
    sample_seed: int
    lora_request: object = None     # jaxserve.lora.LoRARequest, or None: the base model

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def needs_penalties(sp: SamplingParams) -> bool:
    return bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
                or sp.logit_bias or sp.min_tokens)


class InputBatch:
    def __init__(self, max_num_seqs: int, vocab_size: int):
        C = self.capacity = max_num_seqs
        self.vocab_size = vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self._free = list(range(C - 1, -1, -1))          # pop() gives the lowest slot
        self._penalty_writes: list[tuple[int, tuple]] = []
        # Per-slot sampling parameters, [C] each.
        self.temperature = np.zeros(C, np.float32)      # 0 = greedy
        self.top_k = np.zeros(C, np.int32)
        self.top_p = np.ones(C, np.float32)
        self.min_p = np.zeros(C, np.float32)
        self.seed = np.zeros(C, np.uint32)
        self.presence = np.zeros(C, np.float32)
        self.frequency = np.zeros(C, np.float32)
        self.repetition = np.ones(C, np.float32)
        self.penalised = np.zeros(C, bool)
        self.min_tokens = np.zeros(C, np.int32)
        self.wants_logprobs = np.zeros(C, bool)
        self.num_output = np.zeros(C, np.int32)     # outputs, those of dispatched steps included

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def update(self, scheduler_output) -> None:
        """Apply one SchedulerOutput: removals first (an id may finish and be reused in one
        step), then the rows that carry `new_request`."""
        for rid in (*scheduler_output.finished_request_ids,
                    *scheduler_output.preempted_request_ids):
            self.remove(rid)
        for row in scheduler_output.scheduled:
            if row.new_request is not None:
                self.add(row.request_id, row.new_request)
            elif row.request_id not in self.requests:
                raise KeyError(f"scheduled request {row.request_id!r} is unknown to the worker "
                               "and its row carries no new_request")

    def add(self, request_id: str, new) -> None:
        """Hold a request (a NewRequestData). A held id is replaced (it was re-added)."""
        self.remove(request_id)
        if not self._free:
            raise RuntimeError(f"the input batch is full (max_num_seqs={self.capacity}); "
                               f"cannot add request {request_id!r}")
        s = self._free.pop()
        sp = new.sampling_params
        state = CachedRequestState(request_id, s, list(new.prompt_token_ids),
                                   list(new.output_token_ids), sp, new.sample_seed,
                                   getattr(new, "lora_request", None))
        self.requests[request_id] = state
        greedy = sp.is_greedy
        self.temperature[s] = 0.0 if greedy else sp.temperature
        self.top_k[s], self.top_p[s], self.min_p[s] = sp.top_k, sp.top_p, sp.min_p
        self.seed[s] = new.sample_seed & 0xFFFFFFFF
        self.presence[s], self.frequency[s] = sp.presence_penalty, sp.frequency_penalty
        self.repetition[s] = sp.repetition_penalty
        self.min_tokens[s] = sp.min_tokens
        self.wants_logprobs[s] = sp.logprobs is not None
        self.num_output[s] = len(state.output_token_ids)
        self.penalised[s] = needs_penalties(sp)
        if self.penalised[s]:
            stop = sp.all_stop_token_ids if sp.min_tokens else ()
            self._penalty_writes.append((s, host_rows(state.prompt_token_ids,
                                                      state.output_token_ids, sp.logit_bias,
                                                      stop, self.vocab_size)))

    def remove(self, request_id: str) -> None:
        """Forget a request (finished, aborted or preempted); unknown ids are ignored."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self._penalty_writes = [w for w in self._penalty_writes if w[0] != state.slot]
        self.penalised[state.slot] = False
        self._free.append(state.slot)

    def count_dispatched(self, request_id: str) -> None:
        self.num_output[self.requests[request_id].slot] += 1

    def append_sampled(self, request_id: str, token_ids: list[int]) -> None:
        """The tokens a step counted by `count_dispatched` sampled (speculative decoding: the
        accepted drafts and one more)."""
        state = self.requests[request_id]
        state.output_token_ids.extend(token_ids)
        self.num_output[state.slot] += len(token_ids) - 1

    def take_penalty_writes(self) -> list[tuple[int, tuple]]:
        """(slot, host rows) for requests added since the last call; the caller writes them."""
        writes, self._penalty_writes = self._penalty_writes, []
        return writes

    def min_tokens_of(self, slots: np.ndarray) -> np.ndarray:
        """min_tokens of each slot in `slots` [R] (slot C, padding: 0)."""
        padded = np.append(self.min_tokens, 0)
        return padded[np.minimum(slots, self.capacity)]

    def slot_of(self, request_id: str) -> int:
        return self.requests[request_id].slot

    def sampling_arrays(self, slots: list[int], num_rows: int) -> dict[str, np.ndarray]:
        """The fields of SamplingTensors for rows `slots` (in order), padded to `num_rows` with
        greedy rows that point at slot C (dropped by every device write)."""
        C, n = self.capacity, len(slots)
        idx = np.full(num_rows, C, np.int64)
        idx[:n] = slots

        def take(a, pad):
            out = np.full(num_rows, pad, a.dtype)
            out[:n] = a[idx[:n]]
            return out

        num_output = take(self.num_output, 0)
        return dict(temperature=take(self.temperature, 0), top_k=take(self.top_k, 0),
                    top_p=take(self.top_p, 1), min_p=take(self.min_p, 0),
                    seeds=take(self.seed, 0), positions=num_output,
                    slots=idx.astype(np.int32), penalised=take(self.penalised, False),
                    min_tokens_active=num_output < take(self.min_tokens, 0),
                    presence=take(self.presence, 0), frequency=take(self.frequency, 0),
                    repetition=take(self.repetition, 1),
                    logprobs=take(self.wants_logprobs, False))
