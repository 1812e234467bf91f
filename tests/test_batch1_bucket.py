"""Batch 1 and 2: a lone decode token runs in a 1-token step program, two in a 2-token one (not
16 tokens through the layers, the attention rows and the sampler), and they give the greedy
tokens the 16-token program gives (the same request decoding beside others). The 1-token step
writes the KV cache in place (XLA:CPU copies the whole pool for a one-element scatter)."""

from __future__ import annotations

from jaxserve import SamplingParams
from jaxserve.layers.int4 import fused_kernel_rows
from jaxserve.worker.buckets import token_buckets

PROMPT = "The history of the printing press begins in the fifteenth century, when"
OTHERS = ["A river begins as rain on high ground.", "def merge_sort(items):"]


def test_buckets_start_with_one_and_two_tokens():
    assert token_buckets(2048) == [1, 2, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert token_buckets(8) == [1, 2, 8] and token_buckets(2) == [1, 2] and token_buckets(1) == [1]
    # speculative decoding: a lone request's step keeps a free draft slot in the 2-token bucket
    # steps whose matmuls cost in proportion to their rows (the fused CPU kernel) get 4 and 8
    assert token_buckets(2048, few_rows=True)[:6] == [1, 2, 4, 8, 16, 32]
    assert token_buckets(6, few_rows=True) == [1, 2, 4, 6]


def test_buckets_past_512_tokens_step_by_512_not_by_doubling():
    """A 4,100-token step runs at 4,608 tokens, not 8,192 (the GPU-step issue)."""
    buckets = token_buckets(8192)
    assert buckets[:8] == [1, 2, 16, 32, 64, 128, 256, 512]
    assert buckets[8:] == list(range(1024, 8193, 512)) and len(buckets) == 23
    assert min(b for b in buckets if b >= 4100) == 4608
    assert token_buckets(600) == [1, 2, 16, 32, 64, 128, 256, 512, 600]


def test_one_token_step_writes_the_kv_cache_in_place(llm):
    """No copy of the KV pool in the compiled 1-token program (it would cost seconds a step)."""
    runner = llm.llm_engine.runner
    hlo = runner._executable(1, False).as_text()
    pool = "[" + ",".join(map(str, runner.cache.k.shape)) + "]"
    copies = [ln for ln in hlo.splitlines() if " copy(" in ln and pool in ln.split("=", 1)[-1].split(" ", 2)[1]]
    assert not copies, copies[:2]


def test_lone_decode_uses_the_one_token_program_and_keeps_greedy_tokens(llm):
    runner = llm.llm_engine.runner
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seen = []
    orig = runner.run_model

    def run_model(inputs):
        seen.append(len(inputs.tokens))
        return orig(inputs)

    runner.run_model = run_model
    try:
        alone = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids
        alone_steps, seen[:] = list(seen), []
        batched = llm.generate([PROMPT] + OTHERS, sp, use_tqdm=False)[0].outputs[0].token_ids
        batched_steps, seen[:] = list(seen), []
        pair = llm.generate([PROMPT, OTHERS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
        pair_steps = list(seen)
    finally:
        del runner.run_model
    assert alone_steps.count(1) == 23            # every decode step after the prefill
    # three rows: the 4-token program where the fused CPU kernel multiplies them, else 16 tokens
    few = 4 in runner.buckets
    assert few == (fused_kernel_rows(runner.weights) >= 8)
    assert set(batched_steps[1:]) == {4 if few else 16}
    assert 2 in pair_steps and 1 not in pair_steps
    assert alone == batched == pair
    # Prompt logprobs never run in the 1- or 2-token programs: a 1-token prompt scores in bucket 16.
    out = llm.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    assert (1, True) not in runner.compiled_programs and (2, True) not in runner.compiled_programs
