"""A decode step's host -> device transfers (the GPU-step issue: each is its own copy on a GPU,
~21 of them a step before): the step's inputs go packed into one int32 array (`Packing`), the
structured-output bitmask stays on the device unless a row is constrained, so a decode step makes
at most 2 transfers, and no implicit one (a numpy array handed to a program)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.worker.step_inputs import Packing


def _count_device_puts(monkeypatch):
    arrays = []
    real = jax.device_put

    def counting(x, *args, **kwargs):
        arrays.extend(a for a in jax.tree_util.tree_leaves(x) if not isinstance(a, jax.Array))
        return real(x, *args, **kwargs)
    monkeypatch.setattr(jax, "device_put", counting)
    return arrays


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, presence_penalty=0.5, max_tokens=6,
                   ignore_eos=True, logprobs=2)], ids=["greedy", "sampled-penalised-logprobs"])
def test_a_decode_step_makes_at_most_two_host_to_device_transfers(llm, monkeypatch, params):
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"transfers-{i}", f"Count to {i + 3}:", params)
    engine.step()                               # the prefill (penalty rows are written as requests join)
    arrays = _count_device_puts(monkeypatch)
    decode_steps = 0
    with jax.transfer_guard_host_to_device("disallow"):      # an implicit transfer raises
        while engine.has_unfinished_requests():
            arrays.clear()
            engine.step()
            decode_steps += 1
            assert len(arrays) <= 2, [np.shape(a) for a in arrays]
    assert decode_steps >= 4


def test_packing_round_trips_every_field(llm):
    runner = llm.llm_engine.runner
    x, _ = runner._build([], 16, True)
    packing = Packing.of(x)
    packed = packing.pack(x)
    assert packed.dtype == np.int32 and packed.shape == (packing.size,)
    back = packing.unpack(jax.numpy.asarray(packed), x.bitmask)
    for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(back)):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(np.asarray(a), np.asarray(b))
