"""Log-likelihood scoring as lm-evaluation-harness does it through a server, against transformers
computing the same log-likelihoods on the same weights (the default SmolLM2-135M GGUF, f32).

The workload is a multiple-choice task: each question is a ~100-token context and 4 short
continuations; each (context, continuation) pair is one `/v1/completions` request with the
token ids as prompt, `echo`, `logprobs` 1 and `max_tokens` 1 (lm-eval's `local-completions`
loglikelihood request), at most `--max-concurrency` in flight; its log-likelihood is the sum of
the continuation tokens' echoed logprobs. transformers scores the same pairs in padded batches of
`--hf-batch-size` (one forward each, log-softmax, gather), as lm-eval's HF backend does.

    python benchmarks/bench_scoring.py                 # 40 questions x 4 choices = 160 requests
    python benchmarks/bench_scoring.py --no-cache-too  # also a server with --no-enable-prefix-caching
    python benchmarks/bench_scoring.py --max-concurrency 1 --hf-batch-size 1   # lm-eval at batch 1
    python benchmarks/bench_scoring.py --latency 20    # one request at a time: scoring vs plain

`--latency N` times N single requests of each kind on a 20-token prompt, one at a time and
alternating: a plain completion (`max_tokens` 1) and the same prompt scored (`echo`, `logprobs`
1, `max_tokens` 1), each with a prompt of its own (no prefix-cache hits); reports the medians.

Rounds alternate (jaxserve, transformers[, jaxserve without prefix caching]) `--rounds` times;
every round uses its own contexts (a unique header), so no round hits what an earlier one cached.
Reports requests/s of each, the ratio, the prefix-cache hit rate the server's /metrics shows,
and the largest log-likelihood difference between the two (a check that both computed the same).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_engine import _TEXT  # noqa: E402
from server_fixtures import ServerProcess  # noqa: E402


def make_tasks(tok, num_questions: int, context_len: int, round_id: int, seed: int):
    """[(context ids, [4 continuation ids])]: windows of a fixed text behind a header unique to
    (round, question), so no two questions (or rounds) share a cached prefix."""
    rng = np.random.default_rng(seed + round_id)
    ids = tok.encode(_TEXT, add_special_tokens=False)
    tasks = []
    for q in range(num_questions):
        head = tok.encode(f"Round {round_id}, question {q}:", add_special_tokens=False)
        start = int(rng.integers(0, len(ids) - context_len - 1))
        context = head + ids[start:start + context_len - len(head)]
        choices = []
        for _ in range(4):
            s, n = int(rng.integers(0, len(ids) - 12)), int(rng.integers(2, 9))
            choices.append(ids[s:s + n])
        tasks.append((context, choices))
    return tasks


def pairs_of(tasks):
    return [(c, cont) for c, conts in tasks for cont in conts]


# -- jaxserve through the server ---------------------------------------------------------------
async def _score_server(base_url: str, model: str, pairs, concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    out = [0.0] * len(pairs)

    async def one(session, i, context, cont):
        body = {"model": model, "prompt": context + cont, "echo": True, "logprobs": 1,
                "max_tokens": 1, "temperature": 0}
        async with sem, session.post(base_url + "/v1/completions", json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"request {i}: HTTP {r.status}: {data}")
        lps = data["choices"][0]["logprobs"]["token_logprobs"]
        out[i] = float(sum(lps[len(context):len(context) + len(cont)]))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, i, c, x) for i, (c, x) in enumerate(pairs)))
    return out


def _metric(base_url: str, name: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(base_url + "/metrics").read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^jaxserve:{name}(?:{{[^}}]*}})? (\S+)$",
                                                       text, re.M))


def run_server(srv: ServerProcess, pairs, concurrency: int) -> dict:
    model = _model_name(srv.base_url)
    q0, h0 = _metric(srv.base_url, "prefix_cache_queries_total"), _metric(srv.base_url, "prefix_cache_hits_total")
    t0 = time.perf_counter()
    lls = asyncio.run(_score_server(srv.base_url, model, pairs, concurrency))
    s = time.perf_counter() - t0
    q1, h1 = _metric(srv.base_url, "prefix_cache_queries_total"), _metric(srv.base_url, "prefix_cache_hits_total")
    return dict(s=s, req_s=len(pairs) / s, lls=lls,
                hit_rate=(h1 - h0) / (q1 - q0) if q1 > q0 else 0.0)


def _model_name(base_url: str) -> str:
    import json
    import urllib.request
    return json.loads(urllib.request.urlopen(base_url + "/v1/models").read())["data"][0]["id"]


def latency(srv: ServerProcess, tok, n: int) -> dict:
    """Median seconds of a plain and a scoring request on 20-token prompts, one at a time."""
    import json
    import urllib.request
    model = _model_name(srv.base_url)
    ids = tok.encode(_TEXT, add_special_tokens=False)
    times = {"plain": [], "scoring": []}
    for i in range(n + 1):                       # the first pair warms up
        for kind in times:
            head = tok.encode(f"{kind} {i}:", add_special_tokens=False)
            prompt = (head + ids[i * 20:])[:20]
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            if kind == "scoring":
                body.update(echo=True, logprobs=1)
            req = urllib.request.Request(srv.base_url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            json.loads(urllib.request.urlopen(req).read())
            if i:
                times[kind].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


# -- transformers ----------------------------------------------------------------------------
def load_transformers():
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.default_model import default_model_path
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    return model


def run_transformers(model, pairs, batch_size: int) -> dict:
    import torch
    t0 = time.perf_counter()
    lls = []
    with torch.inference_mode():
        for b in range(0, len(pairs), batch_size):
            batch = pairs[b:b + batch_size]
            seqs = [c + x for c, x in batch]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits
            for i, (c, x) in enumerate(batch):
                pos = torch.arange(len(c) - 1, len(c) + len(x) - 1)
                logp = torch.log_softmax(logits[i, pos].float(), -1)       # the scored rows only
                lls.append(float(logp[torch.arange(len(x)), torch.tensor(x)].sum()))
    s = time.perf_counter() - t0
    return dict(s=s, req_s=len(pairs) / s, lls=lls, threads=torch.get_num_threads())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-questions", type=int, default=40)
    p.add_argument("--context-len", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-cache-too", action="store_true",
                   help="also time a server started with --no-enable-prefix-caching")
    p.add_argument("--server-args", default="--num-gpu-blocks-override 1024",
                   help="extra `jaxserve serve` flags (default: a 1024-block KV pool, 0.7 GiB, "
                        "instead of 2 GiB, for a shared machine)")
    p.add_argument("--latency", type=int, default=0, metavar="N",
                   help="only time N one-at-a-time plain and scoring requests (medians)")
    args = p.parse_args()
    if args.latency:
        return main_latency(args)

    model = load_transformers()
    from transformers import AutoTokenizer

    from jaxserve.default_model import default_model_path
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    extra = args.server_args.split()
    servers = {"jaxserve": ServerProcess(*extra, log_path="/tmp/bench_scoring_server.log")}
    if args.no_cache_too:
        servers["jaxserve, no prefix cache"] = ServerProcess(
            "--no-enable-prefix-caching", *extra, log_path="/tmp/bench_scoring_server_nocache.log")
    for name, srv in servers.items():
        t0 = time.perf_counter()
        srv.start()
        print(f"{name}: server ready in {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        # Warm-up: a few requests each (first-use allocations), outside the rounds' contexts.
        warm = pairs_of(make_tasks(tok, 2, args.context_len, 10_000, 0))
        for srv in servers.values():
            run_server(srv, warm, args.max_concurrency)
        run_transformers(model, warm, args.hf_batch_size)
        results = {n: [] for n in [*servers, "transformers"]}
        max_diff = 0.0
        for r in range(args.rounds):
            pairs = pairs_of(make_tasks(tok, args.num_questions, args.context_len, r, 0))
            for name, srv in servers.items():
                res = run_server(srv, pairs, args.max_concurrency)
                results[name].append(res)
                print(f"round {r} {name}: {res['req_s']:.1f} req/s ({res['s']:.1f} s), "
                      f"prefix-cache hit rate {res['hit_rate']:.2f}", flush=True)
                if name == "jaxserve":
                    ref = res["lls"]
            hf = run_transformers(model, pairs, args.hf_batch_size)
            results["transformers"].append(hf)
            print(f"round {r} transformers: {hf['req_s']:.1f} req/s ({hf['s']:.1f} s)", flush=True)
            max_diff = max(max_diff, float(np.max(np.abs(np.array(ref) - np.array(hf["lls"])))))
            choice_j = np.array(ref).reshape(-1, 4).argmax(1)
            choice_h = np.array(hf["lls"]).reshape(-1, 4).argmax(1)
            print(f"round {r}: same chosen answer on {np.mean(choice_j == choice_h):.3f} of "
                  f"questions, max |log-likelihood difference| {max_diff:.2e}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()

    best = {n: max(x["req_s"] for x in v) for n, v in results.items()}
    n = args.num_questions * 4
    print(f"\n| system | best req/s ({n} requests, {args.rounds} rounds) | vs transformers |")
    print("|---|---|---|")
    for name, v in best.items():
        extra = f" (hit rate {results[name][-1]['hit_rate']:.2f})" if name in servers else \
            f" (batch {args.hf_batch_size}, {hf['threads']} torch threads)"
        print(f"| {name}{extra} | {v:.1f} | {v / best['transformers']:.2f}x |")
    print(f"\nmax |log-likelihood difference| jaxserve vs transformers: {max_diff:.2e}")


def main_latency(args):
    from jaxserve.default_model import default_model_path
    from jaxserve.tokenizer.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(default_model_path())
    srv = ServerProcess(*args.server_args.split(), log_path="/tmp/bench_scoring_server.log")
    srv.start()
    try:
        # the background warm-up would compile beside the timed requests (twice their time)
        t0 = time.perf_counter()
        while "more building in the background" in srv.log() and "background warm-up done" not in srv.log() \
                and time.perf_counter() - t0 < 600:
            time.sleep(0.5)
        res = latency(srv, tok, args.latency)
    finally:
        srv.stop()
    print(f"median of {args.latency}, one at a time, 20-token prompts: plain {res['plain'] * 1e3:.1f} ms, "
          f"scoring (echo, logprobs 1) {res['scoring'] * 1e3:.1f} ms: {res['scoring'] / res['plain']:.2f}x")


if __name__ == "__main__":
    main()
