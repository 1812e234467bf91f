"""`build_inputs` fills a step's arrays with a few numpy calls for the whole step; checked here
against a row-at-a-time oracle (the loop it replaced) on random steps that mix prefill chunks,
prompt-logprob chunks, decode rows with async placeholders, rows verifying drafts, rows that do
not sample, and LoRA slots."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.core.scheduler_output import PLACEHOLDER_TOKEN_ID, NewRequestData, ScheduledRequest, SchedulerOutput
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_inputs import build_inputs

B, N = 4, 64          # block size, blocks in the pool


def oracle(scheduled, batch, T, S, M, R, with_prompt_logprobs, speculative, lora_slots):
    """Row-at-a-time: what each array must hold."""
    tokens, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
    slots, tables = np.full(T, N * B, np.int32), np.zeros((S, M), np.int32)
    kv_lens, cu = np.zeros(S, np.int32), np.zeros(S + 1, np.int32)
    logit_rows, draft_ids, group_start = np.zeros(R, np.int32), np.full(R, -1, np.int32), np.zeros(R, np.int32)
    targets, prompt_rows = np.zeros(T, np.int32), np.full(T, T, np.int32)
    token_lora = np.zeros(T, np.int32)
    start = rows = prompt_count = 0
    sample_rows, slot_list = {}, []
    for i, s in enumerate(scheduled):
        n = len(s.token_ids)
        for j in range(n):
            p = s.num_computed_tokens + j
            t = s.token_ids[j]
            tokens[start + j] = -1 - batch.slot_of(s.request_id) if t == PLACEHOLDER_TOKEN_ID else t
            positions[start + j] = p
            slots[start + j] = s.block_ids[p // B] * B + p % B
            lora = batch.requests[s.request_id].lora_request
            token_lora[start + j] = 0 if lora is None or lora_slots is None else lora_slots[lora.lora_name]
            prompt = batch.requests[s.request_id].prompt_token_ids
            if with_prompt_logprobs and s.prompt_logprobs and p + 1 < len(prompt):
                targets[start + j] = prompt[p + 1]
                prompt_rows[prompt_count] = start + j
                prompt_count += 1
        tables[i, :len(s.block_ids)] = s.block_ids
        kv_lens[i] = s.num_computed_tokens + n
        if s.sample:
            d = len(s.spec_token_ids)
            sample_rows[s.request_id] = rows
            for j in range(d + 1):
                logit_rows[rows + j] = start + n - 1 - d + j
                group_start[rows + j] = rows
                draft_ids[rows + j] = s.spec_token_ids[j] if j < d else -1
                slot_list.append(batch.slot_of(s.request_id))
            rows += d + 1
        start += n
        cu[i + 1:] = start
    return dict(tokens=tokens, positions=positions, slots=slots, tables=tables, kv_lens=kv_lens, cu=cu,
                logit_rows=logit_rows, draft_ids=draft_ids, group_start=group_start, targets=targets,
                prompt_rows=prompt_rows, token_lora=token_lora), sample_rows, slot_list


@pytest.mark.parametrize("seed", range(6))
def test_build_inputs_matches_a_row_at_a_time_oracle(seed):
    rng = random.Random(seed)
    speculative, with_plp, with_lora = seed % 2 == 0, seed % 3 == 0, seed >= 3
    batch = InputBatch(16, 1000)
    adapters = [None, LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")]
    lora_slots = {"a": 1, "b": 2} if with_lora else None
    rows, free_blocks = [], list(range(N))
    rng.shuffle(free_blocks)
    for i in range(rng.randint(1, 12)):
        rid = f"r{i}"
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))]
        computed = rng.randint(0, len(prompt) + 8)
        kind = rng.choice(["prefill", "decode", "placeholder", "drafts", "chunk"])
        drafts = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 3))] if kind == "drafts" and speculative else []
        if kind in ("prefill", "chunk"):
            computed = rng.randint(0, len(prompt) - 1)
            known = prompt[computed:rng.randint(computed + 1, len(prompt))] if kind == "chunk" \
                else prompt[computed:]
        else:
            known = [PLACEHOLDER_TOKEN_ID] if kind == "placeholder" else [rng.randrange(3, 1000)]
        token_ids = known + drafts
        need = -(-(computed + len(token_ids)) // B) + rng.randint(0, 1)
        blocks = [free_blocks.pop() for _ in range(need)]
        sp = SamplingParams(max_tokens=50, prompt_logprobs=2 if with_plp and rng.random() < 0.5 else None)
        new = NewRequestData(prompt, [], sp, 0, adapters[i % 3] if with_lora else None)
        rows.append(ScheduledRequest(rid, token_ids, computed, blocks, sample=kind != "chunk",
                                     prompt_logprobs=sp.prompt_logprobs is not None and computed < len(prompt),
                                     new_request=new, spec_token_ids=drafts))
    batch.update(SchedulerOutput(scheduled=rows))
    T = sum(len(r.token_ids) for r in rows) + rng.randint(0, 5)
    S, M = 16, max(len(r.block_ids) for r in rows) + rng.randint(0, 2)
    R = S * 4 if speculative else S
    inputs, layout = build_inputs(rows, batch, num_tokens=T, num_seqs=S, num_blocks=N, block_size=B,
                                  max_blocks_per_seq=M, with_prompt_logprobs=with_plp, num_sample_rows=R,
                                  speculative=speculative, lora_slots=lora_slots)
    want, sample_rows, slot_list = oracle(rows, batch, T, S, M, R, with_plp, speculative, lora_slots)
    meta = inputs.meta
    got = dict(tokens=inputs.tokens, positions=inputs.positions, slots=meta.slot_mapping,
               tables=meta.block_tables, kv_lens=meta.kv_lens, cu=meta.cu_q_lens, logit_rows=inputs.logit_rows)
    if speculative:
        got.update(draft_ids=inputs.draft_ids, group_start=inputs.group_start)
    if with_plp:
        got.update(targets=inputs.prompt_targets, prompt_rows=inputs.prompt_rows)
    if with_lora:
        got.update(token_lora=inputs.lora_slots)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    assert layout.sample_rows == sample_rows
    assert layout.offsets == [sum(len(r.token_ids) for r in rows[:i]) for i in range(len(rows))]
    np.testing.assert_array_equal(np.asarray(inputs.sampling.slots)[:len(slot_list)], slot_list)
