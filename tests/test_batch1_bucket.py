"""Batch 1: a lone decode token runs in a 2-token step program (not 16 tokens through the
layers, the attention rows and the sampler; not 1, which XLA:CPU runs slowly), and gives the
greedy tokens the 16-token program gives (the same request decoding beside others)."""

from __future__ import annotations

from jaxserve import SamplingParams
from jaxserve.worker.model_runner import token_buckets

PROMPT = "The history of the printing press begins in the fifteenth century, when"
OTHERS = ["A river begins as rain on high ground.", "def merge_sort(items):"]


def test_buckets_start_with_two_tokens():
    assert token_buckets(2048) == [2, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert token_buckets(8) == [2, 8] and token_buckets(2) == [2] and token_buckets(1) == [1]


def test_lone_decode_uses_the_two_token_program_and_keeps_greedy_tokens(llm):
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
    finally:
        del runner.run_model
    assert alone_steps.count(2) == 23            # every decode step after the prefill
    assert 2 not in seen                         # three rows decode in the 16-token program
    assert alone == batched
    # Prompt logprobs never run in the 2-token program: a 1-token prompt scores in bucket 16.
    out = llm.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    assert (2, True) not in runner.compiled_programs
