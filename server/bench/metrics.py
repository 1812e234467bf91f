"""Serving metrics from per-request timings, computed and printed as `vllm bench serve` does.

TTFT: request sent -> first streamed chunk with text. ITL: between consecutive chunks.
TPOT: (E2EL - TTFT) / (output tokens - 1) per request. E2EL: request sent -> last chunk.
Times are seconds in `RequestOutcome`, milliseconds in the result dict (`mean_ttft_ms`, ...).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

METRICS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"),
           "e2el": ("E2EL", "End-to-end Latency")}


@dataclasses.dataclass
class RequestOutcome:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0        # the server's usage.completion_tokens (else the text re-tokenized)
    server_prompt_tokens: int | None = None   # the server's usage.prompt_tokens, when sent
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0       # perf_counter when the request was sent
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile_label(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(outcomes: list[RequestOutcome], duration: float, percentiles: list[float]) -> dict:
    """vLLM's BenchmarkMetrics as a flat dict: counts, throughputs, and for each metric
    mean/median/std and each percentile in ms, plus the per-request lists."""
    ok = [o for o in outcomes if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    values = {"ttft": [o.ttft for o in ok], "tpot": [o.tpot for o in ok if o.tpot is not None],
              "itl": [x for o in ok for x in o.itl], "e2el": [o.latency for o in ok]}
    peak_tokens, peak_concurrency = _peaks(ok)
    result = {
        "duration": duration, "completed": len(ok), "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration, "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_concurrency,
    }
    for key, xs in values.items():
        ms = np.asarray(xs or [0.0], float) * 1000
        result[f"mean_{key}_ms"] = float(ms.mean())
        result[f"median_{key}_ms"] = float(np.median(ms))
        result[f"std_{key}_ms"] = float(ms.std())
        for p in percentiles:
            result[f"p{percentile_label(p)}_{key}_ms"] = float(np.percentile(ms, p))
    result.update({"input_lens": [o.prompt_len for o in outcomes],
                   "output_lens": [o.output_tokens for o in outcomes],
                   "ttfts": [o.ttft for o in outcomes], "itls": [o.itl for o in outcomes],
                   "e2els": [o.latency for o in outcomes],
                   "generated_texts": [o.generated_text for o in outcomes],
                   "errors": [o.error for o in outcomes]})
    return result


def _peaks(ok: list[RequestOutcome]) -> tuple[float, int]:
    """Most chunks (tokens) streamed within one second of the run, and most requests in flight
    at once (vLLM's 'Peak output token throughput' and 'Peak concurrent requests')."""
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    per_second: dict[int, int] = {}
    events = []
    for o in ok:
        t = o.start_time + o.ttft
        for dt in [0.0, *o.itl]:
            t += dt
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
    running = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):   # an end before a start at a tie
        running += step
        peak = max(peak, running)
    return float(max(per_second.values())), peak


def format_result(result: dict, *, max_concurrency: int | None, request_rate: float,
                  selected: list[str], percentiles: list[float]) -> str:
    """The report block of `vllm bench serve`, line for line."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name, value, fmt=""):
        lines.append("{:<40} {:<10{}}".format(name, value, fmt))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for key in selected:
        name, header = METRICS[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", result[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", result[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            label = percentile_label(p)
            row(f"P{label} {name} (ms):", result[f"p{label}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
