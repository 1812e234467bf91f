"""Data parallelism (`--data-parallel-size`, `engine/data_parallel.py`): the balancer's choice
(load, prefix-cache hits, dead replicas), the replicas' devices, the flags; two fake replicas
behind one front, one of which dies; and a real server of 2 replicas x TP 2 on 8 simulated CPU
devices: a burst spread over both, repeated prefixes sent back to the replica that cached them,
greedy tokens equal to one engine's, /metrics labelled by replica, LoRA adapters on both. Replicas on
other hosts: test_dp_remote.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from server_fixtures import ServerProcess
from test_server_async import FakeEngine, delta

from jaxserve.config import EngineArgs, ParallelConfig
from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError
from jaxserve.engine.data_parallel import DataParallelLLM, choose_replica, sum_stats
from jaxserve.engine.kv_event_publisher import offset_endpoint_port
from jaxserve.engine.llm_engine import EngineStats

TINY = str(Path(__file__).parent / "data" / "tiny-llama")


# -- the balancer ------------------------------------------------------------------------------

def test_choose_replica_least_loaded_then_prefix_then_round_robin():
    up = [True, True, True]
    assert choose_replica([3, 1, 2], [0, 0, 0], up) == 1
    # equal loads: round robin from `start`
    assert [choose_replica([0, 0, 0], [0, 0, 0], up, s) for s in range(3)] == [0, 1, 2]
    # a replica holding the prefix wins while its load is near the least ...
    assert choose_replica([2, 0, 0], [0, 0, 5], up) == 2
    assert choose_replica([4, 0, 0], [6, 0, 0], up) == 0
    # ... not when it is much busier (margin 4 + a quarter of the least load)
    assert choose_replica([5, 0, 0], [6, 0, 0], up) == 1
    assert choose_replica([29, 20, 40], [9, 0, 0], up) == 0        # 29 <= 20 + 4 + 5
    assert choose_replica([30, 20, 40], [9, 0, 0], up) == 1
    assert choose_replica([30, 20, 40], [0, 0, 9], up) == 1
    # then a replica whose device slots hold the request's adapter, within the same margin
    assert choose_replica([2, 0, 0], [0, 0, 0], up, 0, [False, False, True]) == 2
    assert choose_replica([2, 0, 0], [0, 3, 0], up, 0, [False, False, True]) == 1   # prefix first
    assert choose_replica([9, 0, 0], [0, 0, 0], up, 0, [True, False, False]) == 1   # too busy
    # dead replicas take nothing; none alive is EngineDeadError
    assert choose_replica([0, 5, 5], [9, 0, 0], [False, True, True]) == 1
    with pytest.raises(EngineDeadError):
        choose_replica([0, 0], [0, 0], [False, False])


def test_sum_stats_adds_counts_and_averages_usage():
    a = EngineStats(2, 1, 0.5, 0, 10, 4, 100, 50, 1, 3, 2, (1, 1), ("x",), ())
    b = EngineStats(1, 0, 0.25, 1, 6, 0, 60, 20, 2, 6, 3, (2, 1, 0), ("y", "x"), ("z",))
    s = sum_stats([a, b])
    assert (s.num_running, s.num_waiting, s.num_preemptions_total) == (3, 1, 1)
    assert s.kv_cache_usage == pytest.approx(0.375)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.generation_tokens_total) == (16, 4, 70)
    assert s.spec_num_accepted_tokens_per_pos == (3, 2, 0)
    assert s.running_lora_adapters == ("x", "y") and s.waiting_lora_adapters == ("z",)


# -- devices, flags, endpoints -----------------------------------------------------------------

def test_each_rank_takes_its_own_devices():
    devices = list(range(8))
    cfg = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4)
    assert [cfg.replica_devices(devices, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ParallelConfig(2, data_parallel_size=1).replica_devices(devices) == devices
    # external balancing: rank 3 with two ranks per host takes local rank 1's devices
    ext = ParallelConfig(2, data_parallel_size=4, data_parallel_rank=3, data_parallel_size_local=2)
    assert ext.replica_devices(devices) == [2, 3]
    # a host that shows one replica's devices (CUDA_VISIBLE_DEVICES per rank) gives them all
    assert ext.replica_devices([6, 7]) == [6, 7]
    with pytest.raises(ValueError, match="data_parallel_rank 3 .* this host has 6"):
        ParallelConfig(2, data_parallel_size=4, data_parallel_rank=3).replica_devices(devices[:6])
    for bad, field in (({"data_parallel_size": 0}, "data_parallel_size"),
                       ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank"),
                       ({"data_parallel_size": 2, "data_parallel_size_local": 3},
                        "data_parallel_size_local")):
        with pytest.raises(ValueError, match=field):
            EngineArgs(**bad)
    with pytest.raises(ValueError, match="nnodes"):
        EngineArgs(data_parallel_size=2, nnodes=2)


def test_an_engine_alone_is_one_replica():
    from jaxserve import LLM
    with pytest.raises(ValueError, match="data_parallel_size 2: an engine is one replica"):
        LLM(model=TINY, load_format="dummy", data_parallel_size=2)
    with pytest.raises(ValueError, match="needs 256 devices, but this host has"):
        DataParallelLLM(EngineArgs(data_parallel_size=2, tensor_parallel_size=2 * 64))


def test_flags():
    from jaxserve.server.cli.flags import engine_args_from
    from jaxserve.server.cli.main import build_parser
    parser = build_parser()
    ns = parser.parse_args(["serve", "m", "-dp", "2", "-tp", "2", "--data-parallel-address",
                            "10.0.0.1", "--data-parallel-rpc-port", "13345"])
    args = engine_args_from(ns)
    assert (args.data_parallel_size, args.tensor_parallel_size, args.data_parallel_rank) == (2, 2, None)
    ns = parser.parse_args(["serve", "m", "--data-parallel-size", "4", "-dpr", "3", "-dpl", "2"])
    args = engine_args_from(ns)
    assert (args.data_parallel_rank, args.data_parallel_size_local) == (3, 2)
    ns = parser.parse_args(["serve", "m", "--headless", "-dp", "4", "-dpl", "2",
                            "--data-parallel-start-rank", "2", "-dpa", "10.0.0.1", "-dpp", "13345"])
    args = engine_args_from(ns)
    assert ns.headless and (args.data_parallel_start_rank, args.data_parallel_address,
                            args.data_parallel_rpc_port) == (2, "10.0.0.1", 13345)
    p = args.parallel_config()
    assert list(p.local_ranks) == [2, 3]
    assert [p.replica_devices(["d0", "d1"], r) for r in (2, 3)] == [["d0"], ["d1"]]
    for bad, field in (({"data_parallel_start_rank": 3, "data_parallel_size_local": 2},
                        "data_parallel_start_rank"),
                       ({"data_parallel_rpc_port": 70000}, "data_parallel_rpc_port"),
                       ({"data_parallel_address": ""}, "data_parallel_address")):
        with pytest.raises(ValueError, match=field):
            EngineArgs(data_parallel_size=4, **bad)
    from jaxserve.server.cli.serve import _headless
    with pytest.raises(ValueError, match="--headless .* needs"):
        _headless(EngineArgs(data_parallel_size=2))
    with pytest.raises(ValueError, match="headless host's first rank"):
        DataParallelLLM(EngineArgs(data_parallel_size=4, data_parallel_size_local=2,
                                   data_parallel_start_rank=2))


def test_kv_event_endpoints_move_by_rank():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://127.0.0.1:6000", 1) == "tcp://127.0.0.1:6001"
    assert offset_endpoint_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint_port(None, 1) is None


# -- two fake replicas behind one front ----------------------------------------------------------

def _front(*engines) -> DataParallelLLM:
    return DataParallelLLM(EngineArgs(data_parallel_size=len(engines)),
                           replicas=[AsyncLLM(engine=e) for e in engines])


async def _collect(stream) -> list:
    return [out async for out in stream]


def test_a_dead_replica_fails_only_its_requests_and_the_other_keeps_serving():
    async def main():
        healthy, doomed = FakeEngine(tokens=40), FakeEngine(fail_at=30, tokens=40)
        front = _front(healthy, doomed)
        await front.start()
        try:
            streams = [await front.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3]}, delta(40))
                       for i in range(4)]
            assert front.routed == [2, 2]             # spread, round robin between equals
            results = await asyncio.gather(*(_collect(s) for s in streams), return_exceptions=True)
            died = [i for i, r in enumerate(results) if isinstance(r, EngineDeadError)]
            assert died == [1, 3]                     # the requests doomed took
            assert all(sum(len(o.outputs[0].token_ids) for o in results[i]) == 40 for i in (0, 2))
            assert front.dead_ranks == [1] and front.is_ready and not front.errored
            # new work goes to the live replica only
            more = [await front.add_request(f"s{i}", {"prompt_token_ids": [4]}, delta(3))
                    for i in range(3)]
            assert front.routed == [5, 2]
            assert all(len(outs) >= 1 for outs in await asyncio.gather(*map(_collect, more)))
            assert sum_stats([s for s in front.replica_stats if s is not None]) is not None
        finally:
            await front.shutdown()

    asyncio.run(main())


def test_health_reports_a_dead_replica():
    from aiohttp.test_utils import make_mocked_request

    from jaxserve.server.http.api_server import Server, ServerArgs

    async def main():
        server = Server(EngineArgs(), ServerArgs(), engine=FakeEngine())
        server.llm = _front(FakeEngine(), FakeEngine(fail_at=1))
        await server.llm.start()
        server.serving = object()           # what start() builds once the engine is up
        try:
            fine = await server.llm.add_request("a", {"prompt_token_ids": [1]}, delta(100))
            doomed = await server.llm.add_request("b", {"prompt_token_ids": [1]}, delta(100))
            with pytest.raises(EngineDeadError):
                await _collect(doomed)
            response = await server.health(make_mocked_request("GET", "/health"))
            assert response.status == 503
            assert json.loads(response.body)["dead_data_parallel_ranks"] == [1]
            assert server.llm.is_ready and len(await _collect(fine)) >= 1
        finally:
            await server.llm.shutdown()

    asyncio.run(main())


# -- a real server: 2 replicas x TP 2 on 8 CPU devices ----------------------------------------------

def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _post_text(url: str, body: dict) -> str:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


def _metrics(base: str) -> dict[tuple[str, str], float]:
    """{(name, engine label): value} of the engine series."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:") and 'engine="' in line:
            name = line.split("{")[0]
            engine = line.split('engine="')[1].split('"')[0]
            out[(name, engine)] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.slow
def test_two_replicas_spread_a_burst_return_to_cached_prefixes_and_equal_one_engine(monkeypatch, tmp_path):
    from jaxserve import LLM, SamplingParams
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(5 + i % 7)] for i in range(64)]
    with LLM(model=TINY, load_format="dummy", warmup=False, max_model_len=512,
             max_num_batched_tokens=128, max_num_seqs=64, num_gpu_blocks_override=512) as one:
        expected = [o.outputs[0].text for o in one.generate(
            [{"prompt_token_ids": p} for p in prompts[:8]],
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)]

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    server = ServerProcess(TINY, "--load-format", "dummy", "-dp", "2", "-tp", "2",
                           log_path=tmp_path / "server.log")
    server.start(timeout=600)
    try:
        url = server.base_url + "/v1/completions"
        body = {"model": TINY, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        # a burst of 64 requests at once
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            outs = list(pool.map(lambda p: _post(url, {**body, "prompt": p}), prompts))
        got = [o["choices"][0] for o in outs]
        assert all(c["finish_reason"] == "length" for c in got)
        m = _metrics(server.base_url)
        per_engine = [m[("jaxserve:generation_tokens_total", str(r))] for r in (0, 1)]
        assert sum(per_engine) == 64 * 4 and max(per_engine) <= 0.65 * 64 * 4, per_engine
        # the per-request series too: each replica's requests under its engine label
        done = [m[("jaxserve:e2e_request_latency_seconds_count", str(r))] for r in (0, 1)]
        assert sum(done) == 64 and all(done), done
        # greedy tokens equal one engine's, whichever replica ran them
        assert [c["text"] for c in got[:8]] == expected
        # a long shared prefix, sent one request at a time while idle: every later one goes
        # back to the replica that cached it
        prefix = [(13 * j) % 1000 + 3 for j in range(96)]
        before = _metrics(server.base_url)
        for i in range(5):
            _post(url, {**body, "prompt": prefix + [500 + i, 600 + i]})
        after = _metrics(server.base_url)
        hits = [after[("jaxserve:prefix_cache_hits_total", str(r))] -
                before[("jaxserve:prefix_cache_hits_total", str(r))] for r in (0, 1)]
        assert sorted(hits) == [0, 4 * 96], hits
        assert "engine=\"1\"" in urllib.request.urlopen(server.base_url + "/metrics").read().decode()
    finally:
        server.stop()
    log = server.log()
    assert "data-parallel replica 1 of 2 ready" in log, log[-3000:]
    assert os.environ.get("XLA_FLAGS")


@pytest.mark.slow
def test_two_replicas_serve_lora_adapters_loaded_and_unloaded_on_both(monkeypatch, tmp_path):
    """-dp 2 with --enable-lora: an adapter named at start and one loaded at run time serve the
    single engine's greedy tokens from both replicas; unloading reaches both."""
    pytest.importorskip("peft")
    from lora_helpers import hf_model, write_adapter, write_tiny
    from server_fixtures import post_json

    from jaxserve import LLM, LoRARequest, SamplingParams
    base = write_tiny(tmp_path / "base")
    model = hf_model(base)
    a0 = write_adapter(model, tmp_path / "a0", targets=("q_proj", "v_proj"), seed=1)
    a1 = write_adapter(model, tmp_path / "a1", r=4, targets=("o_proj", "down_proj"), seed=2)
    prompts = [[(11 * i + j) % 250 + 3 for j in range(4 + i % 5)] for i in range(16)]
    # Long enough that the replica holding the adapter is still busy when the burst's later
    # requests arrive (the balancer prefers it until its load passes the margin): with a few
    # tokens a fast CPU finished each request before the next came, and one replica ran them all.
    n_tokens = 32
    sp = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    with LLM(model=str(base), dtype="float32", enable_lora=True, max_lora_rank=8, warmup=False,
             max_model_len=128, compilation_cache_dir="") as one:
        expected = {name: [o.outputs[0].text for o in one.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
            lora_request=None if path is None else LoRARequest(name, i + 1, str(path)))]
            for i, (name, path) in enumerate([("a0", a0), ("a1", a1), ("base", None)])}
    assert expected["a0"] != expected["base"] != expected["a1"]

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    server = ServerProcess(str(base), "--dtype", "float32", "-dp", "2", "--enable-lora",
                           "--max-lora-rank", "8", "--max-model-len", "128", "--lora-modules", f"a0={a0}",
                           "--allow-runtime-lora-updating", "--compilation-cache-dir", "",
                           log_path=tmp_path / "server.log")
    server.start(timeout=600)
    try:
        url = server.base_url + "/v1/completions"

        def burst(model_name):
            """16 requests at once -> their texts; each replica must have run some."""
            body = {"model": model_name, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
            before = _metrics(server.base_url)
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                outs = list(pool.map(lambda p: post_json(url, {**body, "prompt": p}), prompts))
            assert all(status == 200 for status, _ in outs), outs
            after = _metrics(server.base_url)
            served = [after[("jaxserve:generation_tokens_total", r)] -
                      before[("jaxserve:generation_tokens_total", r)] for r in ("0", "1")]
            assert sum(served) == 16 * n_tokens and min(served) > 0, (model_name, served)
            return [o["choices"][0]["text"] for _, o in outs]

        assert burst("a0") == expected["a0"]
        # vLLM's answer to a load or unload is plain text
        assert "added successfully" in _post_text(server.base_url + "/v1/load_lora_adapter",
                                                  {"lora_name": "a1", "lora_path": str(a1)})
        assert burst("a1") == expected["a1"]
        assert burst(str(base)) == expected["base"]
        assert "removed successfully" in _post_text(server.base_url + "/v1/unload_lora_adapter",
                                                    {"lora_name": "a1"})
        status, body = post_json(url, {"model": "a1", "prompt": prompts[0], "max_tokens": 1})
        assert status == 404, body
        models = json.loads(urllib.request.urlopen(server.base_url + "/v1/models").read())
        assert sorted(m["id"] for m in models["data"]) == sorted([str(base), "a0"])
    finally:
        server.stop()
    assert "data-parallel replica 1 of 2 ready" in server.log()
