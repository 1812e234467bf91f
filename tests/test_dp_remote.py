"""Data-parallel replicas on other hosts (`engine/dp_remote.py`, vLLM's `--headless` layout): a
remote replica over ZeroMQ on 127.0.0.1 behind one front (fake engines: serving, refusals,
aborts, adapter loads, the head's shutdown, a silent replica found dead, a crashed head's
requests aborted and a restarted head served), and two real processes as two hosts (a burst over
both ranks, /metrics per rank, the headless host killed and reported)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import urllib.error
import urllib.request

import pytest
from server_fixtures import ServerProcess
from test_data_parallel import TINY, _collect, _metrics, _post
from test_server_async import FakeEngine, delta

from jaxserve.config import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError
from jaxserve.engine.data_parallel import DataParallelLLM


async def _remote_pair(remote_engine, port):
    """A front of one local fake replica and one remote one served by a ReplicaLink."""
    import zmq.asyncio

    from jaxserve.engine import dp_remote
    hub = dp_remote.RemoteHub(port)
    front = DataParallelLLM(EngineArgs(data_parallel_size=2),
                            replicas=[AsyncLLM(engine=FakeEngine(tokens=3)),
                                      dp_remote.RemoteReplica(hub, 1)])
    front.hub = hub
    ctx = zmq.asyncio.Context()
    link = dp_remote.ReplicaLink(ctx, AsyncLLM(engine=remote_engine), 1, "127.0.0.1", port)
    await asyncio.gather(front.start(), link.start())
    return front, link, ctx, asyncio.ensure_future(link.run())


async def _until(cond, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


def test_a_remote_replica_serves_refuses_aborts_loads_and_follows_the_heads_shutdown():
    from server_fixtures import free_port

    from jaxserve.core.request import InvalidRequestError
    from jaxserve.lora import LoRARequest

    async def main():
        remote_engine = FakeEngine(tokens=3)

        def no_adapter(request):
            raise InvalidRequestError(f"no adapter at {request.lora_path}", "lora_request")
        remote_engine.load_lora = no_adapter
        front, link, ctx, run = await _remote_pair(remote_engine, free_port())
        remote = front.replicas[1]
        try:
            streams = [await front.add_request(f"r{i}", {"prompt_token_ids": [1]}, delta(3))
                       for i in range(4)]
            assert front.routed == [2, 2]
            for outs in await asyncio.gather(*map(_collect, streams)):
                assert sum(len(o.outputs[0].token_ids) for o in outs) == 3 and outs[-1].finished
            assert remote.stats is not None and remote.num_requests() == 0
            # the remote engine's refusal comes back as the same error
            with pytest.raises(ValueError, match="cannot be empty"):
                await remote.add_request("bad", {"prompt_token_ids": []}, delta(3))
            # a stream closed early aborts its request there
            remote_engine.tokens = 1000
            stream = await remote.add_request("long", {"prompt_token_ids": [1]}, delta(1000))
            await stream.__anext__()
            stream.close()
            await _until(lambda: remote_engine.aborted == ["long"])
            # an adapter load is answered (here refused, naming the field)
            with pytest.raises(InvalidRequestError, match="no adapter at /nowhere") as e:
                await asyncio.get_running_loop().run_in_executor(
                    None, remote.load_lora, LoRARequest("a", 1, "/nowhere"))
            assert e.value.param == "lora_request"
            # the head's shutdown ends the headless side
            await front.shutdown()
            await asyncio.wait_for(link.done.wait(), 10)
        finally:
            run.cancel()
            await link.shutdown()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_a_headless_rank_aborts_its_requests_when_the_head_goes_quiet_and_serves_a_new_head(monkeypatch):
    """The head crashes (no shutdown message): its requests on the headless rank are aborted
    after DEAD_AFTER, the rank keeps running, and a head restarted on the same port finds it
    ready (its heartbeat) and is served."""
    from server_fixtures import free_port

    from jaxserve.engine import dp_remote
    monkeypatch.setattr(dp_remote, "DEAD_AFTER", 1.0)

    async def main():
        port = free_port()
        remote_engine = FakeEngine(tokens=1000)
        front, link, ctx, run = await _remote_pair(remote_engine, port)
        hub = None
        try:
            held = await front.replicas[1].add_request("held", {"prompt_token_ids": [1]}, delta(1000))
            await held.__anext__()
            front.hub.close()                # the head process is gone: no ping, no shutdown
            await _until(lambda: remote_engine.aborted == ["held"] and not link._serving)
            assert not link.done.is_set()
            hub = dp_remote.RemoteHub(port)
            again = dp_remote.RemoteReplica(hub, 1, ready_timeout=10)
            await again.start()
            remote_engine.tokens = 3
            outs = await _collect(await again.add_request("new", {"prompt_token_ids": [2]}, delta(3)))
            assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 3
        finally:
            for r in front.replicas[:1]:
                await r.shutdown(graceful=False)
            if hub is not None:
                await again.shutdown(graceful=False)
                hub.close()
            run.cancel()
            await link.shutdown()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_a_silent_remote_replica_is_dead_its_requests_fail_and_the_rest_serve(monkeypatch):
    from server_fixtures import free_port

    from jaxserve.engine import dp_remote
    monkeypatch.setattr(dp_remote, "DEAD_AFTER", 1.0)

    async def main():
        remote_engine = FakeEngine(tokens=1000)
        front, link, ctx, run = await _remote_pair(remote_engine, free_port())
        try:
            held = await front.replicas[1].add_request("held", {"prompt_token_ids": [1]}, delta(1000))
            run.cancel()                    # the host goes quiet: no heartbeat, no outputs
            for task in list(link._serving.values()):
                task.cancel()
            with pytest.raises(EngineDeadError, match="sent nothing"):
                await asyncio.wait_for(_collect(held), 10)
            assert front.dead_ranks == [1] and front.is_ready
            more = [await front.add_request(f"s{i}", {"prompt_token_ids": [4]}, delta(3))
                    for i in range(2)]
            assert front.routed[0] == 2
            assert all(outs[-1].finished for outs in await asyncio.gather(*map(_collect, more)))
        finally:
            await front.shutdown(graceful=False)
            await link.shutdown()
            ctx.destroy(linger=0)

    asyncio.run(main())


@pytest.mark.slow
def test_a_headless_host_serves_its_ranks_behind_the_server_and_its_death_is_reported(tmp_path):
    """Two processes as two hosts: the server runs rank 0 (-dpl 1), a `--headless` process rank
    1 dialling its RPC port. A burst spreads over both with one engine's greedy texts, /metrics
    labels the remote rank; killing the headless host fails only its requests, /health names
    rank 1, rank 0 keeps serving."""
    import signal
    import subprocess
    import sys
    import time

    from server_fixtures import SMALL_ENGINE, free_port, greedy_texts, http_status

    from jaxserve import LLM, SamplingParams
    prompts = [[(5 * i + j) % 1000 + 3 for j in range(4 + i % 6)] for i in range(24)]
    with LLM(model=TINY, load_format="dummy", warmup=False, max_model_len=512,
             max_num_batched_tokens=128, max_num_seqs=64, num_gpu_blocks_override=512) as one:
        expected = [o.outputs[0].text for o in one.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)]
    rpc = free_port()
    group = ["--load-format", "dummy", "-dp", "2", "-dpl", "1", "--data-parallel-address",
             "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    log = open(tmp_path / "headless.log", "w")
    headless = subprocess.Popen([sys.executable, "-m", "jaxserve.server.cli", "serve", TINY,
                                 *SMALL_ENGINE, *group, "--headless", "--data-parallel-start-rank", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    server = ServerProcess(TINY, *group, log_path=tmp_path / "server.log")
    try:
        server.start(timeout=600)
        url = server.base_url + "/v1/completions"
        body = {"model": TINY, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            outs = list(pool.map(lambda p: _post(url, {**body, "prompt": p}), prompts))
        assert [o["choices"][0]["text"] for o in outs] == expected
        m = _metrics(server.base_url)
        per_engine = [m[("jaxserve:generation_tokens_total", r)] for r in ("0", "1")]
        assert sum(per_engine) == 24 * 4 and min(per_engine) > 0, per_engine
        assert ("jaxserve:kv_cache_usage_perc", "1") in m
        # the headless host dies: /health names its rank, rank 0 serves on
        headless.send_signal(signal.SIGKILL)
        headless.wait(30)
        deadline = time.monotonic() + 60
        while http_status(server.base_url + "/health") != 503 and time.monotonic() < deadline:
            time.sleep(0.5)
        try:
            urllib.request.urlopen(server.base_url + "/health", timeout=10)
            raise AssertionError("/health answered 200 with a dead rank")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and json.loads(e.read())["dead_data_parallel_ranks"] == [1]
        assert greedy_texts(server.base_url, prompts[:4], 4) == expected[:4]
    finally:
        server.stop()
        if headless.poll() is None:
            headless.kill()
            headless.wait()
        log.close()
    assert "data-parallel rank 1 ready" in (tmp_path / "headless.log").read_text()
