"""Prometheus metrics with vLLM's names under the `jaxserve:` prefix, label `model_name`;
`prefixes` serves them under other prefixes too (`--metrics-prefix jaxserve,vllm`: vLLM's
Grafana dashboards and autoscaling rules query `vllm:` names).

Each server owns its own `CollectorRegistry` (tests run several servers in one process). Gauges
and engine-wide counters are read from the engine loop's last `EngineStats` snapshot when
/metrics is scraped; per-request histograms and `request_success_total` are fed by
`ServerMetrics.observe(output, arrival_time)`, the `AsyncLLM` output hook.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jaxserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000, 200000, 500000, 1000000)
_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)


THROUGHPUT_WINDOW_S = 10.0     # the throughput gauges average over about this long


class _Throughput:
    """vLLM's avg_prompt/avg_generation_throughput_toks_per_s gauges: token counters' growth per
    second over the last ~THROUGHPUT_WINDOW_S seconds of scrapes (one sample a scrape, so any
    number of scrapers read the same rate; 0 until two scrapes are apart in time)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.samples: deque[tuple[float, float, float]] = deque()

    def rates(self, prompt_total: float, generation_total: float) -> tuple[float, float]:
        now = self.clock()
        self.samples.append((now, prompt_total, generation_total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= THROUGHPUT_WINDOW_S:
            self.samples.popleft()      # keep the newest sample at least a window old as the base
        t0, p0, g0 = self.samples[0]
        if now - t0 <= 0:
            return 0.0, 0.0
        return (prompt_total - p0) / (now - t0), (generation_total - g0) / (now - t0)


class _EngineCollector:
    """Gauges and counters from the latest EngineStats (None before the engine exists). With
    data-parallel replicas `get_stats` returns a list, one EngineStats per replica: every series
    then carries vLLM's `engine` label (the replica's rank)."""

    def __init__(self, model_name: str, get_stats: Callable, clock: Callable[[], float] = time.monotonic,
                 config_info: dict | None = None):
        self.model_name = model_name
        self.get_stats = get_stats
        self.clock = clock
        self.throughput: dict[tuple, _Throughput] = {}
        self.config_info = config_info or {}

    def describe(self):
        return []

    def collect(self):
        got = self.get_stats()
        if isinstance(got, list):
            names, series = ["model_name", "engine"], [([self.model_name, str(rank)], s)
                                                       for rank, s in enumerate(got)]
        else:
            names, series = ["model_name"], [([self.model_name], got)]

        def getter(s):
            return (lambda f: getattr(s, f)) if s is not None else (lambda f: 0)

        def family(kind, name, doc, value):
            """value(get) of each series; kind GaugeMetricFamily or CounterMetricFamily."""
            m = kind(f"jaxserve:{name}", doc, labels=names)
            for label, s in series:
                m.add_metric(label, value(getter(s)))
            return m

        def gauge(name, doc, field):
            return family(GaugeMetricFamily, name, doc, lambda get: get(field))

        def counter(name, doc, field):
            return family(CounterMetricFamily, name, doc, lambda get: get(field))

        yield gauge("num_requests_running", "Number of requests in model execution batches.",
                    "num_running")
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                    "num_waiting")
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    "kv_cache_usage")
        # vLLM's name before 0.10 (older dashboards and KEDA rules still query it)
        yield gauge("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                    "(vLLM's older name of kv_cache_usage_perc).", "kv_cache_usage")
        rates = {}
        for label, s in series:
            get = getter(s)
            meter = self.throughput.setdefault(tuple(label), _Throughput(self.clock))
            rates[tuple(label)] = meter.rates(get("prompt_tokens_total"), get("generation_tokens_total"))
        for name, doc, i in (("avg_prompt_throughput_toks_per_s", "Average prefill throughput in "
                              "tokens/s.", 0),
                             ("avg_generation_throughput_toks_per_s", "Average generation "
                              "throughput in tokens/s.", 1)):
            g = GaugeMetricFamily(f"jaxserve:{name}", doc, labels=names)
            for label, _ in series:
                g.add_metric(label, rates[tuple(label)][i])
            yield g
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                      "num_preemptions_total")
        yield counter("prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens_total")
        yield counter("generation_tokens", "Number of generation tokens processed.",
                      "generation_tokens_total")
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of "
                      "queried tokens.", "prefix_cache_queries")
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                      "tokens.", "prefix_cache_hits")
        yield counter("external_prefix_cache_queries", "External prefix cache queries (the host "
                      "KV tier), in terms of number of queried tokens.", "external_prefix_cache_queries")
        yield counter("external_prefix_cache_hits", "External prefix cache hits (blocks restored "
                      "from the host KV tier), in terms of number of cached tokens.",
                      "external_prefix_cache_hits")
        yield gauge("kv_offload_host_usage_perc", "Host KV tier usage (--kv-offloading-size). 1 "
                    "means 100 percent usage.", "kv_offload_host_usage")
        offload = CounterMetricFamily("jaxserve:kv_offload_bytes", "Bytes of KV blocks copied "
                                      "between the device pool and the host KV tier.",
                                      labels=names + ["transfer_type"])
        for label, s in series:
            get = getter(s)
            offload.add_metric(label + ["GPU_to_CPU"], get("kv_offload_bytes_to_host"))
            offload.add_metric(label + ["CPU_to_GPU"], get("kv_offload_bytes_to_device"))
        yield offload
        yield counter("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts")
        yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.",
                      "spec_num_draft_tokens")
        yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      "spec_num_accepted_tokens")
        per_pos = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=names + ["position"])
        for label, s in series:
            for pos, n in enumerate(getter(s)("spec_num_accepted_tokens_per_pos") or ()):
                per_pos.add_metric(label + [str(pos)], n)
        yield per_pos
        yield from self._info(series)

    def _info(self, series):
        """vLLM's info gauges, without `model_name` (as vLLM has them): `cache_config_info` (the
        configuration in labels, value 1) and, with LoRA, `lora_requests_info` (max_lora and the
        adapters of the running and waiting requests, comma-separated; value the time of the
        scrape, which routers read as the newest series)."""
        cache = self.config_info.get("cache")
        if cache:
            g = GaugeMetricFamily("jaxserve:cache_config_info", "Information of the LLMEngine "
                                  "CacheConfig", labels=list(cache))
            g.add_metric(list(cache.values()), 1)
            yield g
        lora = self.config_info.get("lora")
        if lora:
            def adapters(field):
                return ",".join(dict.fromkeys(a for _, st in series if st is not None
                                              for a in getattr(st, field) or ()))
            labels = {"max_lora": lora["max_lora"],
                      "running_lora_adapters": adapters("running_lora_adapters"),
                      "waiting_lora_adapters": adapters("waiting_lora_adapters")}
            g = GaugeMetricFamily("jaxserve:lora_requests_info", "Running stats on lora requests.",
                                  labels=list(labels))
            g.add_metric(list(labels.values()), time.time())
            yield g


def check_prefixes(prefixes: Iterable[str]) -> tuple[str, ...]:
    """The metric name prefixes, validated (ValueError naming --metrics-prefix)."""
    prefixes = tuple(dict.fromkeys(p.strip() for p in prefixes))
    if not prefixes or not all(_PREFIX.fullmatch(p) for p in prefixes):
        raise ValueError(f"--metrics-prefix must be comma-separated Prometheus names (letters, "
                         f"digits, '_'), e.g. 'jaxserve,vllm', got {','.join(prefixes)!r}")
    return prefixes


class _Prefixed:
    """The registry's metrics under each prefix ("jaxserve:x" -> "vllm:x"): one set of
    collectors and histograms, renamed when rendered."""

    def __init__(self, registry: CollectorRegistry, prefixes: tuple[str, ...]):
        self.registry, self.prefixes = registry, prefixes

    def collect(self):
        families = list(self.registry.collect())
        for prefix in self.prefixes:
            for m in families:
                if prefix == "jaxserve":
                    yield m
                    continue
                renamed = Metric(_rename(m.name, prefix), m.documentation, m.type, m.unit)
                renamed.samples = [s._replace(name=_rename(s.name, prefix)) for s in m.samples]
                yield renamed


def _rename(name: str, prefix: str) -> str:
    return prefix + name[len("jaxserve"):] if name.startswith("jaxserve:") else name


class ServerMetrics:
    def __init__(self, model_name: str, get_stats: Callable, prefixes: Iterable[str] = ("jaxserve",),
                 clock: Callable[[], float] = time.monotonic, config_info: dict | None = None,
                 data_parallel_size: int = 1):
        """config_info: `LLMEngine.config_info()`, for the info gauges. data_parallel_size > 1:
        the per-request series carry vLLM's `engine` label too (the replica's rank, which
        `observe` is given), as the engine series do when `get_stats` returns one EngineStats
        per replica."""
        self.registry = CollectorRegistry()
        self.view = _Prefixed(self.registry, check_prefixes(prefixes))
        self.model_name = model_name
        self.registry.register(_EngineCollector(model_name, get_stats, clock, config_info))
        r = self.registry
        self.labels = ["model_name", "engine"] if data_parallel_size > 1 else ["model_name"]
        self._request_success = Counter(
            "jaxserve:request_success", "Count of successfully processed requests.",
            self.labels + ["finished_reason"], registry=r)

        def histogram(name, doc, buckets):
            return Histogram(f"jaxserve:{name}", doc, self.labels, buckets=buckets, registry=r)
        self._histograms = {
            "ttft": histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _LATENCY_BUCKETS),
            "itl": histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS),
            "e2e": histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", _LATENCY_BUCKETS),
            "queue": histogram("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS),
            # vLLM's per-request phases: queued -> scheduled -> first token (prefill) -> last (decode)
            "inference": histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", _LATENCY_BUCKETS),
            "prefill": histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", _LATENCY_BUCKETS),
            "decode": histogram("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", _LATENCY_BUCKETS),
            "prompt_tokens": histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                       _TOKEN_BUCKETS),
        }
        # each replica's series, bound once; every one exists (at 0) from the start, as a scrape
        # before the first request expects
        self._bound = [{name: hist.labels(*self._label(rank)) for name, hist in self._histograms.items()}
                       for rank in range(data_parallel_size)]
        self._counted: dict[str, set[int]] = {}     # request id -> choice indices counted

    def _label(self, engine: int | None) -> list[str]:
        return [self.model_name, *([str(engine or 0)] if len(self.labels) > 1 else [])]

    def observe(self, out: RequestOutput, arrival_time: float, engine: int | None = None) -> None:
        """Feed one RequestOutput (any output kind); histograms are observed when it finishes.
        engine: the data-parallel replica that ran it (with data_parallel_size > 1)."""
        label = self._label(engine)
        counted = self._counted.setdefault(out.request_id, set())
        for c in out.outputs:
            if c.finish_reason is not None and c.index not in counted:
                counted.add(c.index)
                self._request_success.labels(*label, c.finish_reason).inc()
        if not out.finished:
            return
        self._counted.pop(out.request_id, None)
        m = out.metrics
        if m is None:
            return
        h = self._bound[engine or 0]
        h["prompt_tokens"].observe(len(out.prompt_token_ids))
        if m.time_in_queue is not None:
            h["queue"].observe(max(0.0, m.time_in_queue))
        if m.first_token_time is not None:
            h["ttft"].observe(max(0.0, m.first_token_time - arrival_time))
        for gap in m.inter_token_latencies:
            h["itl"].observe(max(0.0, gap))
        end = m.finished_time or m.last_token_time
        if end is not None:
            h["e2e"].observe(max(0.0, end - arrival_time))
        if m.first_scheduled_time is not None and end is not None:
            h["inference"].observe(max(0.0, end - m.first_scheduled_time))
            if m.first_token_time is not None:
                h["prefill"].observe(max(0.0, m.first_token_time - m.first_scheduled_time))
                h["decode"].observe(max(0.0, end - m.first_token_time))

    def render(self) -> bytes:
        return generate_latest(self.view)
