"""`jaxserve bench serve|throughput|latency`: the flags, with vLLM's names and defaults.

    jaxserve bench serve --dataset-name random --random-input-len 512 --random-output-len 128 \
        --num-prompts 200 --max-concurrency 16 [--base-url URL | --host H --port P] [--plot lat.png]
    jaxserve bench throughput --model MODEL --input-len 256 --output-len 64 --num-prompts 100
    jaxserve bench latency --model MODEL --input-len 32 --output-len 128 --batch-size 8
"""

from __future__ import annotations

import argparse
import sys

from jaxserve.server.bench.datasets import DATASETS, check_dataset_flags
from jaxserve.server.bench.metrics import METRICS


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _range_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown metric(s) {', '.join(unknown) or repr(text)}; choose from "
                                         f"{','.join(METRICS)}")
    return names


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or not all(0 < p < 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100), got {text!r}")
    return values


def add_dataset_arguments(p: argparse.ArgumentParser, *, num_prompts: int = 1000) -> None:
    g = p.add_argument_group("Dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random",
                   help="random: prompts of exact token lengths; sharegpt: conversations from --dataset-path "
                        "(default: random).")
    g.add_argument("--dataset-path", default=None,
                   help="ShareGPT-format JSON file (e.g. ShareGPT_V3_unfiltered_cleaned_split.json).")
    g.add_argument("--num-prompts", type=_positive(int), default=num_prompts,
                   help=f"Number of prompts (default: {num_prompts}).")
    g.add_argument("--random-input-len", type=_positive(int), default=1024,
                   help="Prompt tokens of each random request (default: 1024).")
    g.add_argument("--random-output-len", type=_positive(int), default=128,
                   help="Output tokens of each random request (default: 128).")
    g.add_argument("--random-range-ratio", type=_range_ratio, default=0.0,
                   help="Lengths vary uniformly within +- this fraction (default: 0).")
    g.add_argument("--random-prefix-len", type=_non_negative_int, default=0,
                   help="Random tokens shared at the start of every random prompt (default: 0).")
    g.add_argument("--sharegpt-output-len", type=_positive(int), default=None,
                   help="Output tokens of each ShareGPT request (default: the conversation's answer length).")


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Server")
    g.add_argument("--backend", choices=["openai", "vllm", "openai-chat"], default="openai",
                   help="Request shape: openai (= vllm) streams /v1/completions, openai-chat "
                        "/v1/chat/completions (default: openai).")
    g.add_argument("--base-url", default=None, help="Server URL, e.g. http://10.0.0.2:8000 (overrides "
                                                    "--host and --port).")
    g.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    g.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/completions, /v1/chat/completions with --backend openai-chat).")
    g.add_argument("--model", default=None, help="Model to benchmark (default: the server's first model).")
    g.add_argument("--served-model-name", default=None,
                   help="Model name sent in requests, when it differs from --model (default: --model).")
    g.add_argument("--tokenizer", default=None,
                   help="Tokenizer the prompts are built with: HF directory, .gguf file or Hub name "
                        "(default: --model; jaxserve's default model is known by name).")
    g.add_argument("--ready-check-timeout-sec", type=_positive(float), default=600.0,
                   help="Seconds to wait for the server to answer the first request (default: 600).")
    add_dataset_arguments(p)
    t = p.add_argument_group("Traffic and sampling")
    t.add_argument("--request-rate", type=_positive(float), default=float("inf"),
                   help="Requests per second, sent as a Poisson process; inf sends all at once (default: inf).")
    t.add_argument("--burstiness", type=_positive(float), default=1.0,
                   help="Gamma shape of the arrival intervals: 1 is Poisson, lower is burstier (default: 1).")
    t.add_argument("--max-concurrency", type=_positive(int), default=None,
                   help="Most requests in flight at once (default: no limit).")
    t.add_argument("--num-warmups", type=_non_negative_int, default=0,
                   help="Requests sent and not measured before the run (default: 0).")
    t.add_argument("--ignore-eos", action="store_true", help="Send ignore_eos: every request generates its "
                                                             "full output length.")
    t.add_argument("--temperature", type=float, default=None, help="(default: 0, greedy)")
    t.add_argument("--top-p", type=float, default=None)
    t.add_argument("--top-k", type=int, default=None)
    t.add_argument("--min-p", type=float, default=None)
    t.add_argument("--seed", type=int, default=0, help="Seed of the dataset and the arrival times (default: 0).")
    t.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    r = p.add_argument_group("Results")
    r.add_argument("--percentile-metrics", type=_metric_names, default=list(METRICS),
                   help="Metrics to report percentiles of, from ttft,tpot,itl,e2el (default: all four).")
    r.add_argument("--metric-percentiles", type=_percentiles, default=[99.0],
                   help="Comma-separated percentiles to report, e.g. 25,50,75 (default: 99).")
    r.add_argument("--save-result", action="store_true", help="Write the result as JSON.")
    r.add_argument("--save-detailed", action="store_true",
                   help="Write the result with every request's lengths, timings, text and error.")
    r.add_argument("--result-dir", default=None, help="Folder of the result file (default: the current one).")
    r.add_argument("--result-filename", default=None,
                   help="Result file name (default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json).")
    r.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="Extra key=value pairs stored in the result file.")
    r.add_argument("--plot", default=None, metavar="FILE.png",
                   help="Draw TTFT/TPOT/ITL/E2EL histograms to this image (needs matplotlib: "
                        "pip install 'jaxserve[bench]').")


def _check_serve(ns: argparse.Namespace) -> None:
    if ns.endpoint is None:
        ns.endpoint = "/v1/chat/completions" if ns.backend == "openai-chat" else "/v1/completions"
    if not ns.endpoint.startswith("/"):
        raise ValueError(f"--endpoint {ns.endpoint}: must be a path starting with '/'")
    if ns.backend == "openai-chat" and not ns.endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"--backend openai-chat needs a chat endpoint (--endpoint {ns.endpoint})")
    if ns.base_url is not None and not ns.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {ns.base_url}: must start with http:// or https://")
    check_dataset_flags(ns)
    for item in ns.metadata or []:
        if "=" not in item:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
    if ns.plot:
        from jaxserve.server.bench.plot import require_matplotlib
        require_matplotlib()


def _offline_common(p: argparse.ArgumentParser) -> None:
    from jaxserve.server.cli.flags import add_engine_args
    g = p.add_argument_group("Benchmark")
    g.add_argument("--n", type=_positive(int), default=1, help="Outputs per prompt (default: 1).")
    g.add_argument("--output-json", default=None, help="Write the result to this JSON file.")
    g.add_argument("--disable-detokenize", action="store_true", help="Time without detokenizing outputs.")
    g.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_engine_args(p, model_positional=False)


def _throughput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["vllm"], default="vllm", help="Accepted for vLLM command lines: the "
                                                                       "offline engine of this process.")
    p.add_argument("--input-len", type=_positive(int), default=None, help="Same as --random-input-len.")
    p.add_argument("--output-len", type=_positive(int), default=None,
                   help="Output tokens of every request (overrides the dataset's).")
    add_dataset_arguments(p)
    _offline_common(p)


def _latency_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Batch")
    g.add_argument("--input-len", type=_positive(int), default=32, help="Prompt tokens (default: 32).")
    g.add_argument("--output-len", type=_positive(int), default=128, help="Output tokens (default: 128).")
    g.add_argument("--batch-size", type=_positive(int), default=8, help="Prompts per batch (default: 8).")
    g.add_argument("--num-iters-warmup", type=_non_negative_int, default=10,
                   help="Unmeasured runs first (default: 10).")
    g.add_argument("--num-iters", type=_positive(int), default=30, help="Measured runs (default: 30).")
    _offline_common(p)


def _serve(ns):
    from jaxserve.server.bench.serve import run_serve
    _check_serve(ns)
    return run_serve(ns)


def _throughput(ns):
    from jaxserve.server.bench.offline import run_throughput
    check_dataset_flags(ns)
    return run_throughput(ns)


def _latency(ns):
    from jaxserve.server.bench.offline import run_latency
    return run_latency(ns)


BENCHMARKS = {
    "serve": ("Load an OpenAI-compatible server (this one or any other) over HTTP and report TTFT, TPOT, "
              "ITL, end-to-end latency and throughput.", _serve_arguments, _serve),
    "throughput": ("Offline throughput of the LLM engine in this process.", _throughput_arguments, _throughput),
    "latency": ("Offline latency of one batch on the LLM engine in this process.", _latency_arguments, _latency),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="{" + ",".join(BENCHMARKS) + "}", required=True)
    for name, (help_text, add, _) in BENCHMARKS.items():
        child = sub.add_parser(name, help=help_text, description=help_text)
        add(child)
        child.set_defaults(_subparser=child)


def run(ns: argparse.Namespace) -> int:
    """The benchmark's exit code; bad input (a missing dataset file, an unreachable server) is
    one error line naming the flag and exit code 2, without the usage text."""
    try:
        return BENCHMARKS[ns.bench_command][2](ns)
    except ValueError as e:
        print(f"{ns._subparser.prog}: error: {e}", file=sys.stderr)
        return 2
