"""--metrics-prefix: /metrics under vLLM's `vllm:` names (its Grafana dashboards and KEDA rules),
alone or beside `jaxserve:`, and vLLM's per-request phase and prompt-size histograms."""

from __future__ import annotations

from pathlib import Path

try:                     # the openai client's HTTP library (httpx2 in openai >= 3)
    import httpx2 as httpx
except ImportError:
    import httpx

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import ServerProcess

from jaxserve.engine.llm_engine import EngineStats
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.server.cli import main as cli
from jaxserve.server.http.metrics import ServerMetrics

TINY = str(Path(__file__).parent / "data" / "tiny-llama")
STATS = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions_total=1,
                    prefix_cache_queries=10, prefix_cache_hits=4, prompt_tokens_total=70,
                    generation_tokens_total=9)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus text page (parsing it also checks it is well formed)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _finished(prompt_len: int) -> RequestOutput:
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                       last_token_time=104.0, finished_time=104.0, time_in_queue=0.5,
                       inter_token_latencies=[1.0, 2.0])
    return RequestOutput("r", "p", list(range(prompt_len)), None,
                         [CompletionOutput(0, "abc", [5, 6, 7], None, None, finish_reason="stop")],
                         finished=True, metrics=m)


def test_both_prefixes_carry_the_same_metrics():
    metrics = ServerMetrics("m", lambda: STATS, ("jaxserve", "vllm"))
    metrics.observe(_finished(7), 100.0)
    samples = _samples(metrics.render().decode())
    label = (("model_name", "m"),)
    for name, value in [("num_requests_running", 3), ("num_requests_waiting", 2),
                        ("kv_cache_usage_perc", 0.25), ("gpu_cache_usage_perc", 0.25),
                        ("prompt_tokens_total", 70), ("generation_tokens_total", 9),
                        ("num_preemptions_total", 1), ("request_prompt_tokens_sum", 7),
                        ("request_queue_time_seconds_sum", 0.5), ("request_prefill_time_seconds_sum", 0.5),
                        ("request_decode_time_seconds_sum", 3.0), ("request_inference_time_seconds_sum", 3.5),
                        ("time_to_first_token_seconds_sum", 1.0), ("e2e_request_latency_seconds_sum", 4.0),
                        ("inter_token_latency_seconds_count", 2)]:
        for prefix in ("jaxserve", "vllm"):
            assert samples[(f"{prefix}:{name}", label)] == pytest.approx(value), (prefix, name)
    success = (("finished_reason", "stop"), ("model_name", "m"))
    assert samples[("vllm:request_success_total", success)] == samples[("jaxserve:request_success_total", success)] == 1
    assert samples[("vllm:time_to_first_token_seconds_bucket", (("le", "1.0"), ("model_name", "m")))] == 1


def test_vllm_alone_replaces_jaxserve_and_the_default_is_jaxserve():
    only = {n for n, _ in _samples(ServerMetrics("m", lambda: STATS, ("vllm",)).render().decode())}
    assert "vllm:num_requests_running" in only and not any(n.startswith("jaxserve:") for n in only)
    default = {n for n, _ in _samples(ServerMetrics("m", lambda: STATS).render().decode())}
    assert "jaxserve:num_requests_running" in default and not any(n.startswith("vllm:") for n in default)


def test_the_flag_parses_and_refuses_bad_prefixes(capsys):
    ns = cli.build_parser().parse_args(["serve", "--metrics-prefix", "jaxserve,vllm"])
    assert ns.metrics_prefix == ("jaxserve", "vllm")
    for bad in ("vllm:", "", "a b", "9x"):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(["serve", "--metrics-prefix", bad])
        assert e.value.code == 2 and "--metrics-prefix" in capsys.readouterr().err


def test_a_server_scrapes_with_vllm_names():
    srv = ServerProcess(TINY, "--load-format", "dummy", "--max-model-len", "64",
                        "--metrics-prefix", "vllm").start()
    try:
        r = httpx.post(srv.base_url + "/v1/completions", timeout=120,
                       json={"model": TINY, "prompt": "t5 t6 t7", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        samples = _samples(httpx.get(srv.base_url + "/metrics").text)
    finally:
        srv.stop()
    names = {n for n, _ in samples}
    assert not any(n.startswith("jaxserve:") for n in names)
    label = (("model_name", TINY),)
    assert samples[("vllm:generation_tokens_total", label)] >= 3
    assert samples[("vllm:request_prompt_tokens_sum", label)] == 3
    assert samples[("vllm:e2e_request_latency_seconds_count", label)] == 1
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", TINY)))] == 1
    # the router contract (Gateway API Inference Extension): the pool's block size and blocks
    [(info, value)] = [(dict(labels), v) for (n, labels), v in samples.items() if n == "vllm:cache_config_info"]
    assert value == 1 and info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 0
    assert info["enable_prefix_caching"] == "True" and info["cache_dtype"] == "auto"
    assert not any(n == "vllm:lora_requests_info" for n, _ in samples)       # no --enable-lora


def test_info_gauges_carry_the_cache_config_and_the_lora_adapters_in_use():
    """vLLM's `cache_config_info` (value 1) and `lora_requests_info` (value the scrape's time),
    labels only, no model_name: what llm-d's endpoint picker reads for block size, max_lora and
    the adapters each replica is running or has waiting."""
    import dataclasses
    import time
    stats = dataclasses.replace(STATS, running_lora_adapters=("a0", "b"), waiting_lora_adapters=("c",))
    info = {"cache": {"block_size": "16", "num_gpu_blocks": "512"}, "lora": {"max_lora": "2"}}
    t0 = time.time()
    samples = _samples(ServerMetrics("m", lambda: stats, ("vllm",), config_info=info).render().decode())
    assert samples[("vllm:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "512")))] == 1
    lora = (("max_lora", "2"), ("running_lora_adapters", "a0,b"), ("waiting_lora_adapters", "c"))
    assert t0 <= samples[("vllm:lora_requests_info", lora)] <= time.time()
    # before the engine's first snapshot: no adapters
    samples = _samples(ServerMetrics("m", lambda: None, config_info=info).render().decode())
    empty = (("max_lora", "2"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))
    assert ("jaxserve:lora_requests_info", empty) in samples


def test_throughput_gauges_are_token_rates_over_the_last_window_of_scrapes():
    """vLLM's avg_prompt/avg_generation_throughput_toks_per_s: counter growth per second."""
    import dataclasses
    now, stats = [1000.0], [STATS]
    metrics = ServerMetrics("m", lambda: stats[0], ("jaxserve", "vllm"), clock=lambda: now[0])
    label = (("model_name", "m"),)

    def rates():
        samples = _samples(metrics.render().decode())
        return (samples[("vllm:avg_prompt_throughput_toks_per_s", label)],
                samples[("vllm:avg_generation_throughput_toks_per_s", label)])

    assert rates() == (0.0, 0.0)                    # one scrape: no rate yet
    for _ in range(4):                              # 2 s apart: +40 prompt, +10 generated tokens
        now[0] += 2.0
        stats[0] = dataclasses.replace(stats[0], prompt_tokens_total=stats[0].prompt_tokens_total + 40,
                                       generation_tokens_total=stats[0].generation_tokens_total + 10)
        assert rates() == pytest.approx((20.0, 5.0))
    now[0] += 30.0                                  # idle: the window forgets the busy part
    rates()
    assert rates() == pytest.approx((0.0, 0.0))


def test_data_parallel_labels_the_request_series_by_replica():
    """-dp N: the per-request histograms and request_success carry vLLM's `engine` label (the
    replica that ran the request), like the engine series; every replica's series exist at 0."""
    metrics = ServerMetrics("m", lambda: [STATS, STATS], ("vllm",), data_parallel_size=2)
    before = _samples(metrics.render().decode())
    for rank in ("0", "1"):
        assert before[("vllm:time_to_first_token_seconds_count",
                       (("engine", rank), ("model_name", "m")))] == 0
    metrics.observe(_finished(7), 100.0, 1)
    metrics.observe(_finished(5), 100.0, 1)
    metrics.observe(_finished(3), 100.0, 0)
    samples = _samples(metrics.render().decode())
    for rank, count, prompt in (("0", 1, 3), ("1", 2, 12)):
        label = (("engine", rank), ("model_name", "m"))
        assert samples[("vllm:e2e_request_latency_seconds_count", label)] == count
        assert samples[("vllm:request_prompt_tokens_sum", label)] == prompt
        assert samples[("vllm:request_success_total", (("engine", rank), ("finished_reason", "stop"),
                                                      ("model_name", "m")))] == count
        assert samples[("vllm:num_requests_running", label)] == 3     # the engine series, per replica
