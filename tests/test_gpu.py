"""GPU-only checks (`pytest -m gpu`): the Pallas kernels compiled for the device (not interpreted)
against the dense oracle, and the whole engine on the Pallas backend. Skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from test_paged_attention_kernel import CASES, DECODE_CASES, TOL, make_batch, max_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].q_lens])
def test_ragged_kernel_compiled_matches_oracle(name):
    from jaxserve.pallas.paged_attention import ragged_paged_attention, ref_ragged_paged_attention
    case = CASES[name]
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window,
                soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    out = ragged_paged_attention(q, k, v, meta, interpret=False, block_sizes=case.blocks, **args)
    assert max_err(out, ref_ragged_paged_attention(q, k, v, meta, **args)) <= TOL[case.dtype]


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_split_k_decode_compiled_matches_oracle(name):
    from jaxserve.pallas.paged_attention import ref_ragged_paged_attention
    from jaxserve.pallas.paged_attention_decode import ragged_paged_attention_decode
    case = DECODE_CASES[name]
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window,
                soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    out = ragged_paged_attention_decode(q, k, v, meta, interpret=False, **args)
    assert max_err(out, ref_ragged_paged_attention(q, k, v, meta, **args)) <= TOL[case.dtype]


def test_engine_pallas_backend_matches_reference_on_gpu():
    from jaxserve import LLM, SamplingParams
    prompts = ["The capital of France is", "def add(a, b):", "List three colors:"]
    sp = SamplingParams(temperature=0, max_tokens=16)
    tokens = {}
    for backend in ("reference", "pallas"):
        with LLM(dtype="float32", max_model_len=512, max_num_batched_tokens=128,
                 kv_cache_memory_bytes=1 << 30, attention_backend=backend) as llm:
            tokens[backend] = [o.outputs[0].token_ids for o in
                               llm.generate(prompts, sp, use_tqdm=False)]
    assert tokens["pallas"] == tokens["reference"]
