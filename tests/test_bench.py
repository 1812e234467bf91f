"""`jaxserve bench serve|throughput|latency` (vLLM's benchmark commands): `serve` against a real
server with random prompts and with a ShareGPT file, reporting vLLM's layout and saving its JSON;
`throughput` and `latency` on the tiny dummy model in this process; bad input is one clear error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from server_fixtures import ServerProcess

from jaxserve.server.bench.datasets import random_requests
from jaxserve.server.bench.metrics import RequestOutcome, calculate_metrics
from jaxserve.server.cli import main as cli

TINY = str(Path(__file__).parent / "data" / "tiny-llama")
SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "Tell me a short story about a brave little dragon who learns to fly."},
        {"from": "gpt", "value": "Once upon a time, a small dragon named Ember tried every day to fly."}]},
    {"id": "b", "conversations": [
        {"from": "human", "value": "What is the capital of France, and why is it famous?"},
        {"from": "gpt", "value": "Paris is the capital of France, famous for its art and its food."}]},
    {"id": "one turn", "conversations": [{"from": "human", "value": "Only a question, no answer here."}]},
    {"id": "too short", "conversations": [{"from": "human", "value": "Hi"},
                                          {"from": "gpt", "value": "Hello there, how can I help?"}]},
]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _default_gguf() -> str:
    from jaxserve.default_model import default_model_path
    return str(default_model_path())


# -- serve ----------------------------------------------------------------------------------------
def test_bench_serve_random_prints_vllms_report_and_saves_result_and_plot(server, tmp_path, capsys):
    code = cli.main(["bench", "serve", "--base-url", server.base_url, "--dataset-name", "random",
                     "--random-input-len", "32", "--random-output-len", "6", "--num-prompts", "6",
                     "--max-concurrency", "3", "--request-rate", "50", "--ignore-eos", "--disable-tqdm",
                     "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(tmp_path),
                     "--result-filename", "run.json", "--metadata", "note=ci", "--plot",
                     str(tmp_path / "latency.png")])
    out = capsys.readouterr().out
    assert code == 0, out
    report = out[out.index("=" * 12 + " Serving Benchmark Result "):]
    for line in ("Successful requests:                     6", "Failed requests:                         0",
                 "Maximum request concurrency:             3", "Request rate configured (RPS):           50.00",
                 "Total input tokens:                      192", "Total generated tokens:                  36",
                 "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Total Token throughput (tok/s):", "-" * 15 + "Time to First Token" + "-" * 16,
                 "-----Time per Output Token (excl. 1st token)------", "Median ITL (ms):", "P50 TTFT (ms):",
                 "P99 E2EL (ms):", "=" * 50):
        assert line in report, line
    assert "different prompt length" not in out      # the default model's tokenizer is the server's
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0 and saved["note"] == "ci"
    assert saved["total_input_tokens"] == 6 * 32 and saved["total_output_tokens"] == 6 * 6
    assert saved["prompt_length_mismatches"] == 0 and saved["model_id"] == "SmolLM2-135M-Instruct"
    assert 0 < saved["median_ttft_ms"] <= saved["mean_e2el_ms"] and saved["p99_itl_ms"] > 0
    assert saved["max_concurrent_requests"] <= 3 and saved["request_rate"] == 50.0
    assert "ttfts" not in saved                        # per-request lists with --save-detailed only
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_sharegpt_chat_with_a_gguf_tokenizer(server, tmp_path, capsys):
    """A tiny ShareGPT file through the chat endpoint: conversations without two turns or under
    4 tokens are dropped and the rest repeated up to --num-prompts (vLLM's oversampling)."""
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    code = cli.main(["bench", "serve", "--host", "127.0.0.1", "--port", str(server.port), "--backend",
                     "openai-chat", "--dataset-name", "sharegpt", "--dataset-path", str(path),
                     "--sharegpt-output-len", "4", "--num-prompts", "3", "--ignore-eos", "--disable-tqdm",
                     "--tokenizer", _default_gguf(), "--percentile-metrics", "ttft,e2el", "--save-detailed",
                     "--result-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Successful requests:                     3" in out and "Mean E2EL (ms):" in out
    assert "Mean TPOT" not in out and "Inter-token Latency" not in out     # not selected
    (saved_path,) = tmp_path.glob("openai-chat-infqps-SmolLM2-135M-Instruct-*.json")
    saved = json.loads(saved_path.read_text())
    assert saved["output_lens"] == [4, 4, 4] and all(saved["generated_texts"]) and saved["errors"] == [""] * 3
    assert len(set(saved["input_lens"])) <= 2           # the two usable conversations, one repeated


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,message", [
    (["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent/sharegpt.json"],
     "--dataset-path /nonexistent/sharegpt.json: no such file"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--dataset-path", "x.json"], "--dataset-path is read with --dataset-name sharegpt only"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat needs a chat endpoint"),
    (["--base-url", "localhost:8000"], "--base-url localhost:8000: must start with http://"),
    (["--metadata", "novalue"], "--metadata 'novalue': expected KEY=VALUE"),
])
def test_bench_serve_bad_flag_combinations_are_one_clear_error(flags, message, capsys):
    assert cli.main(["bench", "serve", *flags]) == 2
    err = capsys.readouterr().err
    assert f"jaxserve bench serve: error: {message}" in err and "usage:" not in err


@pytest.mark.parametrize("flags,message", [
    (["--dataset-name", "csv"], "argument --dataset-name: invalid choice: 'csv'"),
    (["--request-rate", "0"], "argument --request-rate: must be > 0, got 0"),
    (["--num-prompts", "many"], "argument --num-prompts: not a number: 'many'"),
    (["--percentile-metrics", "ttft,latency"], "unknown metric(s) latency; choose from ttft,tpot,itl,e2el"),
    (["--metric-percentiles", "50,100"], "percentiles must be in (0, 100)"),
    (["--random-range-ratio", "1.5"], "must be in [0, 1), got 1.5"),
    (["--num-promts", "5"], "unrecognized arguments: --num-promts (did you mean --num-prompts?)"),
])
def test_bench_serve_bad_flags_exit_2_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "serve", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_serve_unreachable_server_and_bad_sharegpt_file(tmp_path, capsys):
    from server_fixtures import free_port
    base = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["bench", "serve", "--base-url", base]) == 2
    assert f"cannot reach {base}/v1/models" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--base-url", base, "--model", "SmolLM2-135M-Instruct",
                     "--random-input-len", "8", "--num-prompts", "2", "--ready-check-timeout-sec", "1"]) == 2
    assert f"the initial test request to {base}/v1/completions failed" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"conversations": []}))
    assert cli.main(["bench", "serve", "--base-url", base, "--model", "SmolLM2-135M-Instruct",
                     "--dataset-name", "sharegpt", "--dataset-path", str(bad)]) == 2
    assert f"--dataset-path {bad}: expected ShareGPT's format" in capsys.readouterr().err


def test_bench_serve_plot_without_matplotlib_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib -> ImportError
    assert cli.main(["bench", "serve", "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib, an optional extra: pip install 'jaxserve[bench]'" in capsys.readouterr().err


# -- the pieces -----------------------------------------------------------------------------------
def test_random_prompts_have_exact_token_lengths_within_the_range():
    from jaxserve.tokenizer.tokenizer import Tokenizer
    tok = Tokenizer.from_model(_default_gguf())
    reqs = random_requests(tok, 12, 40, 10, range_ratio=0.25, prefix_len=5, seed=3)
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 5 + 30 <= r.prompt_len <= 5 + 50 and 7 <= r.expected_output_len <= 12
    assert len({r.prompt_len for r in reqs}) > 1
    assert reqs == random_requests(tok, 12, 40, 10, range_ratio=0.25, prefix_len=5, seed=3)   # seeded


def test_metrics_follow_vllms_definitions():
    a = RequestOutcome(success=True, prompt_len=10, output_tokens=3, ttft=0.1, itl=[0.2, 0.3], latency=0.6,
                       start_time=100.0)
    b = RequestOutcome(success=True, prompt_len=20, output_tokens=1, ttft=0.5, latency=0.5, start_time=100.2)
    failed = RequestOutcome(prompt_len=5, error="HTTP 500")
    m = calculate_metrics([a, b, failed], duration=2.0, percentiles=[50])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 4)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0 and m["total_token_throughput"] == 17
    assert m["mean_tpot_ms"] == pytest.approx(250.0)        # (0.6 - 0.1) / (3 - 1); b has one token
    assert m["mean_ttft_ms"] == pytest.approx(300.0) and m["p50_itl_ms"] == pytest.approx(250.0)
    assert m["mean_e2el_ms"] == pytest.approx(550.0)
    assert m["max_concurrent_requests"] == 2 and m["max_output_tokens_per_s"] == 4.0


# -- offline --------------------------------------------------------------------------------------
TINY_ENGINE = ["--model", TINY, "--load-format", "dummy", "--max-model-len", "64", "--max-num-batched-tokens",
               "64", "--max-num-seqs", "8", "--kv-cache-memory-bytes", "4M"]


@pytest.mark.slow
def test_bench_throughput_on_the_tiny_model(tmp_path, capsys):
    out_json = tmp_path / "throughput.json"
    assert cli.main(["bench", "throughput", *TINY_ENGINE, "--input-len", "16", "--output-len", "4",
                     "--num-prompts", "6", "--disable-tqdm", "--output-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "Throughput: " in out and " requests/s, " in out and " output tokens/s" in out
    assert "Total num prompt tokens:  96" in out and "Total num output tokens:  24" in out
    saved = json.loads(out_json.read_text())
    assert saved["num_requests"] == 6 and saved["total_num_tokens"] == 120 and saved["requests_per_second"] > 0


@pytest.mark.slow
def test_bench_latency_on_the_tiny_model(tmp_path, capsys):
    out_json = tmp_path / "latency.json"
    assert cli.main(["bench", "latency", *TINY_ENGINE, "--input-len", "8", "--output-len", "4", "--batch-size",
                     "2", "--num-iters-warmup", "1", "--num-iters", "3", "--disable-tqdm",
                     "--output-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "Avg latency: " in out and "99% percentile latency: " in out
    saved = json.loads(out_json.read_text())
    assert len(saved["latencies"]) == 3 and set(saved["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(saved["latencies"]) <= saved["avg_latency"] <= max(saved["latencies"])
