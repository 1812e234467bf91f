"""Serving benchmark client, shaped like `vllm bench serve --dataset-name random`: N prompts of
exactly `--input-len` tokens (made with the model's own Hugging Face tokenizer, e.g. the one
`jaxserve export-model DIR --no-weights` writes), each asking for exactly `--output-len` tokens
(`ignore_eos`), streamed from `/v1/completions` with at most `--max-concurrency` in flight.

Reports request throughput, output token throughput, TTFT, TPOT and ITL (mean / p50 / p99), and
checks what the server says back: every request must succeed and its `usage.prompt_tokens` must
equal the prompt length the client built (so the tokenizer the client used is the server's).

    jaxserve export-model /tmp/smollm2 --no-weights
    jaxserve serve &
    python benchmarks/bench_serve.py --tokenizer /tmp/smollm2 --num-prompts 64 --max-concurrency 8

Exit code 0 when every request succeeded with the expected token counts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time

import aiohttp
import numpy as np
from tokenizers import Tokenizer


@dataclasses.dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


def make_prompts(tokenizer: Tokenizer, n: int, input_len: int, seed: int) -> list[str]:
    """Texts that encode to exactly `input_len` tokens (no special tokens): random ids decoded,
    re-encoded and trimmed until the round trip is stable."""
    rng = random.Random(seed)
    special = {tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>")}
    ids = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    prompts = []
    for _ in range(n):
        toks = [rng.choice(ids) for _ in range(input_len)]
        for _ in range(10):
            text = tokenizer.decode(toks, skip_special_tokens=True)
            toks = tokenizer.encode(text, add_special_tokens=False).ids
            if len(toks) < input_len:
                toks += [rng.choice(ids) for _ in range(input_len - len(toks))]
            toks = toks[:input_len]
            text = tokenizer.decode(toks, skip_special_tokens=True)
            if len(tokenizer.encode(text, add_special_tokens=False).ids) == input_len:
                break
        else:
            raise RuntimeError(f"could not build a prompt of exactly {input_len} tokens")
        prompts.append(text)
    return prompts


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                      output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "add_special_tokens": False}
    t0 = time.perf_counter()
    last, res = t0, Result(ok=False)
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return Result(ok=False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - t0
        res.ok = True
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


async def run(args) -> tuple[list[Result], float]:
    tokenizer = Tokenizer.from_file(f"{args.tokenizer}/tokenizer.json")
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)
    base = args.base_url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:
        model = args.model
        if model is None:
            async with session.get(base + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        gate = asyncio.Semaphore(args.max_concurrency)

        async def limited(p):
            async with gate:
                return await one_request(session, base + "/v1/completions", model, p, args.output_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float, input_len: int, output_len: int) -> dict:
    ok = [r for r in results if r.ok]
    wrong = [r for r in ok if r.prompt_tokens != input_len or r.output_tokens != output_len]

    def stats(xs):
        xs = np.asarray(xs, float) * 1000 if xs else np.zeros(1)
        return {"mean": float(xs.mean()), "p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))}

    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "requests": len(results), "succeeded": len(ok), "failed": len(results) - len(ok),
        "wrong_token_counts": len(wrong), "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration,
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats(tpot),
        "itl_ms": stats([x for r in ok for x in r.itl]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="Model name (default: the server's first model).")
    p.add_argument("--tokenizer", required=True, help="Directory holding tokenizer.json.")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", action="store_true", help="Print the summary as one JSON object.")
    args = p.parse_args(argv)
    results, duration = asyncio.run(run(args))
    s = summarize(results, duration, args.input_len, args.output_len)
    if args.json:
        print(json.dumps(s))
    else:
        print(f"requests {s['succeeded']}/{s['requests']} ok, {s['wrong_token_counts']} with wrong token counts, "
              f"{s['duration_s']:.1f} s")
        print(f"request throughput {s['request_throughput']:.2f} req/s, "
              f"output {s['output_token_throughput']:.1f} tok/s")
        for k in ("ttft_ms", "tpot_ms", "itl_ms"):
            v = s[k]
            print(f"{k[:-3].upper():5s} mean {v['mean']:8.1f} ms  p50 {v['p50']:8.1f} ms  p99 {v['p99']:8.1f} ms")
        for e in s["errors"]:
            print("error:", e)
    return 0 if s["failed"] == 0 and s["wrong_token_counts"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
