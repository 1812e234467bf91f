"""`jaxserve bench serve`: load any OpenAI-compatible server over HTTP (jaxserve, vLLM, a peer)
with streamed completions and measure each token's timing, as `vllm bench serve` does.

Requests leave on a Poisson schedule (`--request-rate`, gamma intervals with `--burstiness`;
`inf` sends them all at once) with at most `--max-concurrency` in flight. A first single request
checks the endpoint (retried while nothing listens, up to `--ready-check-timeout-sec`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import numpy as np

from jaxserve.server.bench.datasets import SampleRequest
from jaxserve.server.bench.metrics import RequestOutcome

CHAT_SUFFIX = "chat/completions"


def request_body(model: str, req: SampleRequest, chat: bool, ns) -> dict:
    """The streamed request vLLM's `openai` / `openai-chat` backends send."""
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": 0.0 if ns.temperature is None else ns.temperature}
    if chat:
        body.update(messages=[{"role": "user", "content": req.prompt}],
                    max_completion_tokens=req.expected_output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.expected_output_len)
    if ns.ignore_eos:
        body["ignore_eos"] = True
    for name in ("top_p", "top_k", "min_p"):
        if getattr(ns, name) is not None:
            body[name] = getattr(ns, name)
    return body


async def send_request(session: aiohttp.ClientSession, url: str, body: dict, req: SampleRequest,
                       chat: bool, tokenizer) -> RequestOutcome:
    """One streamed request, timed chunk by chunk (vLLM's async_request_openai_completions)."""
    out = RequestOutcome(prompt_len=req.prompt_len)
    st = out.start_time = time.perf_counter()
    last, text = st, []
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.strip().decode("utf-8")
                if not line or line.startswith(":"):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("error"):
                    out.error = json.dumps(chunk["error"])[:300]
                    return out
                if choices := chunk.get("choices"):
                    piece = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
                    now = time.perf_counter()
                    if out.ttft == 0.0:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    text.append(piece or "")
                if usage := chunk.get("usage"):
                    out.output_tokens = usage.get("completion_tokens") or 0
                    out.server_prompt_tokens = usage.get("prompt_tokens")
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(text)
    if out.ttft == 0.0:
        out.error = "Never received a valid chunk to calculate TTFT."
        return out
    if not out.output_tokens:          # a server without usage in its stream
        out.output_tokens = len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    out.latency = last - st
    out.success = True
    return out


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    """The server's first model (GET /v1/models), when --model is not given."""
    url = base_url + "/v1/models"
    try:
        async with session.get(url) as r:
            if r.status != 200:
                raise ValueError(f"GET {url} answered {r.status}: {(await r.text())[:200]}; pass --model")
            return (await r.json())["data"][0]["id"]
    except aiohttp.ClientError as e:
        raise ValueError(f"cannot reach {url} ({e}); is the server running? (--base-url, or --host and "
                         "--port)") from None
    except (KeyError, IndexError, TypeError, json.JSONDecodeError):
        raise ValueError(f"GET {url} did not list a model; pass --model") from None


async def ready_check(session, url: str, body: dict, req: SampleRequest, chat: bool, tokenizer,
                      timeout: float) -> None:
    """One request before the run (vLLM's initial test run); retried while the server is not
    reachable yet, then a ValueError with the server's answer."""
    deadline = time.monotonic() + timeout
    while True:
        out = await send_request(session, url, body, req, chat, tokenizer)
        if out.success:
            return
        if not out.error.startswith(("ClientConnectorError", "ServerDisconnectedError", "HTTP 503")) \
                or time.monotonic() >= deadline:
            raise ValueError(f"the initial test request to {url} failed: {out.error} (check --base-url, "
                             "--endpoint, --model and the dataset flags)")
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


async def run_requests(session, url: str, bodies: list[dict], requests: list[SampleRequest], chat: bool,
                       tokenizer, *, request_rate: float, burstiness: float, max_concurrency: int | None,
                       seed: int, progress=None) -> tuple[list[RequestOutcome], float]:
    """Send every request on the arrival schedule; returns the outcomes (input order) and the
    wall time from the first send to the last answer."""
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(body, req):
        if gate is None:
            out = await send_request(session, url, body, req, chat, tokenizer)
        else:
            async with gate:
                out = await send_request(session, url, body, req, chat, tokenizer)
        if progress is not None:
            progress.update(1)
        return out

    t0 = time.perf_counter()
    tasks = []
    for i, (body, req) in enumerate(zip(bodies, requests)):
        if i and not np.isinf(request_rate):   # gamma intervals: Poisson when burstiness is 1
            await asyncio.sleep(float(rng.gamma(burstiness, 1.0 / (request_rate * burstiness))))
        tasks.append(asyncio.create_task(one(body, req)))
    outcomes = await asyncio.gather(*tasks)
    return list(outcomes), time.perf_counter() - t0


def auth_headers() -> dict[str, str]:
    """OPENAI_API_KEY as a bearer token, as vLLM's benchmark sends it."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def load_tokenizer(name: str):
    """The tokenizer the prompts are built with: a HF directory, a .gguf file, a Hub name, or
    the served name of jaxserve's embedded default model."""
    from jaxserve.default_model import DEFAULT_MODEL_NAME, default_model_path
    from jaxserve.loader.hub import resolve_model
    from jaxserve.tokenizer.tokenizer import Tokenizer
    try:
        path = str(default_model_path()) if name == DEFAULT_MODEL_NAME else resolve_model(name, weights=False)
        return Tokenizer.from_model(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {name}: cannot load a tokenizer ({e}); pass --tokenizer as a Hugging "
                         "Face directory (`jaxserve export-model DIR --no-weights` writes one), a .gguf file "
                         "or a Hub name") from None


def run_serve(ns) -> int:
    """The whole `bench serve` run; 0 when every request succeeded."""
    return asyncio.run(_run_serve(ns))


async def _run_serve(ns) -> int:
    from jaxserve.server.bench import results
    from jaxserve.server.bench.datasets import sample_requests
    from jaxserve.server.bench.metrics import calculate_metrics, format_result

    base = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    url = base + ns.endpoint
    chat = ns.endpoint.rstrip("/").endswith(CHAT_SUFFIX)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0)        # --max-concurrency is the only bound
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=auth_headers(),
                                     trust_env=True) as session:
        model = ns.model or await fetch_model_name(session, base)
        served = ns.served_model_name or model
        tokenizer = load_tokenizer(ns.tokenizer or model)
        requests = sample_requests(ns, tokenizer)
        bodies = [request_body(served, r, chat, ns) for r in requests]
        print("Starting initial single prompt test run...")
        await ready_check(session, url, bodies[0], requests[0], chat, tokenizer, ns.ready_check_timeout_sec)
        print("Initial test run completed.")
        for i in range(ns.num_warmups):
            await send_request(session, url, bodies[i % len(bodies)], requests[i % len(requests)], chat,
                               tokenizer)
        print(f"Traffic request rate: {ns.request_rate}")
        print(f"Burstiness factor: {ns.burstiness}"
              + (" (Poisson process)" if ns.burstiness == 1.0 else ""))
        print(f"Maximum request concurrency: {ns.max_concurrency}")
        progress = None
        if not ns.disable_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(requests))
        outcomes, duration = await run_requests(
            session, url, bodies, requests, chat, tokenizer, request_rate=ns.request_rate,
            burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, seed=ns.seed or 0,
            progress=progress)
        if progress is not None:
            progress.close()
    result = calculate_metrics(outcomes, duration, ns.metric_percentiles)
    print(format_result(result, max_concurrency=ns.max_concurrency, request_rate=ns.request_rate,
                        selected=ns.percentile_metrics, percentiles=ns.metric_percentiles))
    errors = sorted({o.error for o in outcomes if not o.success})
    for e in errors[:5]:
        print("error:", e)
    mismatched = sum(1 for o in outcomes if o.success and o.server_prompt_tokens is not None
                     and o.server_prompt_tokens != o.prompt_len)
    if mismatched and not chat:         # a chat template adds tokens by design
        print(f"note: {mismatched} request(s) counted a different prompt length on the server than the "
              "benchmark's tokenizer (is --tokenizer the served model's?)")
    result.update(backend=ns.backend, model_id=served, tokenizer_id=ns.tokenizer or model,
                  num_prompts=ns.num_prompts, request_rate=ns.request_rate, burstiness=ns.burstiness,
                  max_concurrency=ns.max_concurrency, prompt_length_mismatches=mismatched)
    if ns.save_result or ns.save_detailed:
        path = results.save(result, ns, served)
        print(f"Saved the result to {path}")
    if ns.plot:
        from jaxserve.server.bench.plot import plot_latencies
        plot_latencies(result, outcomes, ns.plot)
        print(f"Saved the latency plot to {ns.plot}")
    return 0 if result["failed"] == 0 else 1
