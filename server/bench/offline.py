"""`jaxserve bench throughput` and `jaxserve bench latency`: the offline `LLM` engine in this
process, as vLLM's `bench throughput` / `bench latency` run it (ignore_eos, temperature 1).

throughput: every prompt of the dataset in one `generate`; requests/s, total and output tokens/s.
latency: one batch of `--batch-size` random prompts, `--num-iters` times after warm-up runs; the
mean and percentiles of the batch's end-to-end time.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

LATENCY_PERCENTILES = [10, 25, 50, 75, 90, 99]


def _llm(ns):
    from jaxserve.llm import LLM
    from jaxserve.server.cli.flags import engine_args_from
    return LLM(**dataclasses.asdict(engine_args_from(ns)))


def _write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=4)
        print(f"Saved the result to {path}")


def run_throughput(ns) -> int:
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.server.bench.datasets import sample_requests
    if ns.input_len is not None:
        ns.random_input_len = ns.input_len
    if ns.output_len is not None:
        ns.random_output_len = ns.sharegpt_output_len = ns.output_len
    llm = _llm(ns)
    try:
        requests = sample_requests(ns, llm.get_tokenizer())
        params = [SamplingParams(n=ns.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                                 max_tokens=r.expected_output_len, detokenize=not ns.disable_detokenize)
                  for r in requests]
        start = time.perf_counter()
        outs = llm.generate([r.prompt for r in requests], params, use_tqdm=not ns.disable_tqdm)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(f"Throughput: {len(requests) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    _write_json(ns.output_json, {"elapsed_time": elapsed, "num_requests": len(requests),
                                 "total_num_tokens": total, "total_output_tokens": output_tokens,
                                 "requests_per_second": len(requests) / elapsed,
                                 "tokens_per_second": total / elapsed})
    return 0


def run_latency(ns) -> int:
    from tqdm import tqdm

    from jaxserve.sampling_params import SamplingParams
    llm = _llm(ns)
    try:
        limit = llm.llm_engine.max_model_len
        if ns.input_len + ns.output_len > limit:
            raise ValueError(f"--input-len {ns.input_len} + --output-len {ns.output_len} exceeds the model's "
                             f"max_model_len {limit}; lower them or raise --max-model-len")
        rng = np.random.default_rng(ns.seed or 0)
        vocab = min(10000, llm.get_tokenizer().vocab_size)      # vLLM draws ids below 10000
        prompts = [{"prompt_token_ids": row} for row in
                   rng.integers(0, vocab, size=(ns.batch_size, ns.input_len)).tolist()]
        params = SamplingParams(n=ns.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                                max_tokens=ns.output_len, detokenize=not ns.disable_detokenize)

        def run_once() -> float:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        print("Warming up...")
        for _ in tqdm(range(ns.num_iters_warmup), desc="Warmup iterations", disable=ns.disable_tqdm):
            run_once()
        latencies = np.array([run_once() for _ in tqdm(range(ns.num_iters), desc="Profiling iterations",
                                                        disable=ns.disable_tqdm)])
    finally:
        llm.shutdown()
    percentiles = np.percentile(latencies, LATENCY_PERCENTILES)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for p, value in zip(LATENCY_PERCENTILES, percentiles):
        print(f"{p}% percentile latency: {value} seconds")
    _write_json(ns.output_json, {"avg_latency": float(np.mean(latencies)), "latencies": latencies.tolist(),
                                 "percentiles": dict(zip(LATENCY_PERCENTILES, percentiles.tolist()))})
    return 0
