"""The worker's input batch, driven by the real scheduler and a fake worker that knows only what
the SchedulerOutput and its own samples tell it (never a `Request`): it holds exactly the
running requests, survives preemption (recompute) and aborts, and builds sampling rows and
penalty rows from its own state."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_scheduler import VOCAB, add, make, next_token, reference_output

from jaxserve.core.request import RequestStatus
from jaxserve.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.input_batch import InputBatch


class FakeWorker:
    """Samples next_token(prompt + the outputs it sampled itself) for every `sample` row."""

    def __init__(self, max_num_seqs):
        self.batch = InputBatch(max_num_seqs, VOCAB)

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        self.batch.update(out)
        sampled = {}
        for row in out.scheduled:
            if row.sample:
                state = self.batch.requests[row.request_id]
                tok = next_token(state.prompt_token_ids + state.output_token_ids)
                self.batch.count_dispatched(row.request_id)
                self.batch.append_sampled(row.request_id, [tok])
                sampled[row.request_id] = [tok]
        return sampled


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_holds_exactly_the_running_requests_through_preemption_and_aborts(seed):
    rng = random.Random(seed)
    sched, _ = make(num_blocks=14, block_size=4, budget=24, max_model_len=64, max_num_seqs=6)
    worker = FakeWorker(6)
    prompts, aborted, preemptions, resumed_with_outputs = {}, set(), 0, 0
    for i in range(40):
        prompts[str(i)] = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
    pending = list(prompts)
    for _ in range(2000):
        while pending and rng.random() < 0.5:
            rid = pending.pop(0)
            add(sched, rid, prompts[rid], max_tokens=rng.randint(1, 12), ignore_eos=True)
        if not sched.has_unfinished_requests() and not pending:
            break
        if rng.random() < 0.03 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        out = sched.schedule()
        preemptions += len(out.preempted_request_ids)
        resumed_with_outputs += sum(1 for r in out.scheduled
                                    if r.new_request and r.new_request.output_token_ids)
        sampled = worker.execute(out)
        assert set(worker.batch.requests) == {r.request_id for r in sched.running}
        for rid, state in worker.batch.requests.items():
            req = sched.requests[rid]   # verification only: the worker never reads it
            assert state.output_token_ids == req.output_token_ids + sampled.get(rid, [])
            assert state.sampling_params is req.sampling_params
            assert worker.batch.num_output[state.slot] == len(state.output_token_ids)
        changed = sched.update_from_output(out, sampled)
        for req in changed:
            if req.is_finished() and req.request_id not in aborted:
                assert req.output_token_ids == reference_output(
                    prompts[req.request_id], req.max_tokens, 64)
    else:
        raise AssertionError("did not finish")
    assert preemptions > 0 and resumed_with_outputs > 0   # the test exercised recompute
    worker.execute(sched.schedule())                        # the last finished ids
    assert len(worker.batch) == 0 and sorted(worker.batch._free) == list(range(6))


def _new(prompt=(1, 2), output=(), **params):
    sp = SamplingParams(**params)
    sp.update_from_tokenizer({VOCAB - 1})
    return NewRequestData(list(prompt), list(output), sp, 7)


def _out(rows=(), finished=(), preempted=()):
    return SchedulerOutput(list(rows), 0, list(preempted), list(finished))


def test_rows_without_new_request_must_be_known_and_a_full_batch_is_an_error():
    batch = InputBatch(2, VOCAB)
    with pytest.raises(KeyError, match="'x'"):
        batch.update(_out([ScheduledRequest("x", [1], 0, [0], True)]))
    batch.add("a", _new())
    batch.add("b", _new())
    with pytest.raises(RuntimeError, match="max_num_seqs=2"):
        batch.add("c", _new())
    batch.update(_out(finished=["a"]))
    batch.add("c", _new())                               # a's slot is free again
    assert batch.slot_of("c") == 0


def test_sampling_arrays_follow_each_request_and_pad_with_slot_c():
    batch = InputBatch(4, VOCAB)
    batch.add("greedy", _new(temperature=0.0, logprobs=2))
    batch.add("seeded", _new(temperature=0.8, top_k=5, top_p=0.9, seed=123, min_tokens=3,
                             presence_penalty=0.5))
    batch.count_dispatched("seeded")
    batch.append_sampled("seeded", [4])
    a = batch.sampling_arrays([batch.slot_of("seeded"), batch.slot_of("greedy")], 4)
    np.testing.assert_array_equal(a["temperature"], np.float32([0.8, 0, 0, 0]))
    np.testing.assert_array_equal(a["top_k"], [5, 0, 0, 0])
    np.testing.assert_allclose(a["top_p"], [0.9, 1, 1, 1])
    np.testing.assert_array_equal(a["positions"], [1, 0, 0, 0])     # one output so far
    np.testing.assert_array_equal(a["slots"], [1, 0, 4, 4])         # padding: slot C
    np.testing.assert_array_equal(a["penalised"], [True, False, False, False])
    np.testing.assert_array_equal(a["min_tokens_active"], [True, False, False, False])
    np.testing.assert_array_equal(a["logprobs"], [False, True, False, False])
    assert a["seeds"][1] == 7          # the scheduler's sample_seed


def test_penalty_rows_are_written_only_for_penalised_requests_and_hold_counts():
    batch = InputBatch(3, VOCAB)
    batch.add("plain", _new())
    batch.add("pen", _new(prompt=[3, 3, 9], output=[5, 5, 6], repetition_penalty=1.2,
                          logit_bias={2: -5.0}, min_tokens=4, stop_token_ids=[8]))
    writes = batch.take_penalty_writes()
    assert [slot for slot, _ in writes] == [batch.slot_of("pen")]
    counts, prompt, bias, stop = writes[0][1]
    assert counts[5] == 2 and counts[6] == 1 and counts.sum() == 3
    assert prompt[[3, 9]].all() and prompt.sum() == 2
    assert bias[2] == -5.0 and np.count_nonzero(bias) == 1
    assert set(np.flatnonzero(stop)) == {8, VOCAB - 1}        # stop ids and EOS
    assert batch.take_penalty_writes() == []
    batch.add("gone", _new(presence_penalty=1.0))
    batch.remove("gone")                                   # removed before its write was taken
    assert batch.take_penalty_writes() == []
