"""The scheduler under multi-LoRA (host only, no jax): no step holds more distinct adapters than
max_loras, requests whose adapter cannot get a slot wait without blocking others, and the prefix
cache never shares blocks across adapters."""

from __future__ import annotations

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams

LORAS = [LoRARequest(f"a{i}", i + 1, f"/adapters/a{i}") for i in range(4)]


def _sched(max_loras=2, **kw):
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=kw.pop("budget", 256),
                          max_model_len=128, max_loras=max_loras)
    return Scheduler(cfg, CacheConfig(block_size=4, num_blocks=kw.pop("num_blocks", 64)))


def _req(rid, prompt, lora, max_tokens=3):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), lora_request=lora)


def _run(sched, steps=50):
    """Run to completion with a fake runner; returns the adapter names of each step."""
    seen = []
    for _ in range(steps):
        out = sched.schedule()
        if not out.scheduled:
            if not sched.has_unfinished_requests():
                break
            continue
        seen.append({sched.requests[r.request_id].lora_request.lora_name
                     for r in out.scheduled if sched.requests[r.request_id].lora_request})
        sched.update_from_output(out, {r.request_id: [1] for r in out.scheduled if r.sample})
    return seen


def test_no_step_holds_more_distinct_adapters_than_max_loras():
    sched = _sched(max_loras=2)
    for i in range(12):
        sched.add_request(_req(str(i), [1, 2, 3, i], LORAS[i % 4]))
    sched.add_request(_req("base", [9, 9], None))
    first = sched.schedule()
    names = {sched.requests[r.request_id].lora_request.lora_name
             for r in first.scheduled if sched.requests[r.request_id].lora_request}
    assert names == {"a0", "a1"}
    # requests of a2/a3 wait, but they do not block the base request behind them
    assert "base" in {r.request_id for r in first.scheduled}
    sched.update_from_output(first, {r.request_id: [1] for r in first.scheduled if r.sample})
    steps = _run(sched)
    assert all(len(s) <= 2 for s in steps)
    assert {"a2", "a3"} <= set().union(*steps)       # they ran once slots freed
    assert not sched.has_unfinished_requests()


def test_two_adapters_with_the_same_prompt_do_not_share_blocks():
    sched = _sched(max_loras=4)
    prompt = list(range(1, 14))                      # 3 full blocks of 4
    a = _req("a", prompt, LORAS[0])
    sched.add_request(a)
    _run(sched)
    for rid, lora, hit in (("b", LORAS[1], 0), ("base", None, 0), ("a-again", LORAS[0], 12)):
        r = _req(rid, prompt, lora)
        sched.add_request(r)
        out = sched.schedule()
        assert r.num_cached_tokens == hit, rid
        sched.update_from_output(out, {x.request_id: [1] for x in out.scheduled if x.sample})
        _run(sched)


def test_preempted_request_keeps_its_adapter_and_the_cap():
    sched = _sched(max_loras=1, num_blocks=6, budget=64)
    sched.add_request(_req("x", list(range(1, 9)), LORAS[0], max_tokens=8))
    sched.add_request(_req("y", list(range(1, 9)), LORAS[0], max_tokens=8))
    sched.add_request(_req("z", [5, 6], LORAS[1], max_tokens=2))
    steps = _run(sched, steps=200)
    assert sched.num_preemptions_total > 0
    assert all(len(s) <= 1 for s in steps)
    assert not sched.has_unfinished_requests()
