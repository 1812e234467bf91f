"""Server-side reliability: a model step that raises is a 500 for its requests only and the
server keeps serving; `echo` with `max_tokens: 0`; a prompt longer than the whole KV pool is a
400 at admission; SIGTERM drains in-flight requests up to --shutdown-timeout.

The endpoint tests drive `OpenAIServing` in-process over the shared default-model engine (no
second model load); the SIGTERM test runs `serve()` over a fake engine on a real socket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
from server_fixtures import free_port
from test_server_async import FakeEngine

from jaxserve.config import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.server.openai.protocol import CompletionRequest, OpenAIError
from jaxserve.server.openai.serving import OpenAIServing

PROMPT = "The capital of France is"


class _Borrowed:
    """The shared engine, lent to an AsyncLLM: its shutdown() must not free the weights."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def shutdown(self):
        pass


def _serve(llm, coro_fn):
    async def main():
        async_llm = AsyncLLM(engine=_Borrowed(llm.llm_engine))
        await async_llm.start()
        try:
            return await coro_fn(OpenAIServing(async_llm, ["m"]), async_llm)
        finally:
            await async_llm.shutdown()
    return asyncio.run(main())


async def _chunks(stream) -> list[dict | str]:
    return [c if c.startswith("data: [DONE]") else json.loads(c[len("data: "):])
            async for c in stream]


def test_failed_step_is_a_500_for_its_requests_and_the_server_keeps_serving(llm):
    engine = llm.llm_engine

    def hook(sched):
        if any(row.request_id.startswith("boom") for row in sched.scheduled):
            raise RuntimeError("injected fault")

    async def run(serving, async_llm):
        with pytest.raises(OpenAIError) as info:
            await serving.create_completion(CompletionRequest(prompt=PROMPT, max_tokens=3),
                                            "boom-1")
        assert info.value.status == 500 and info.value.type == "InternalServerError"
        chunks = await _chunks(await serving.create_completion(
            CompletionRequest(prompt=PROMPT, max_tokens=3, stream=True), "boom-2"))
        assert chunks[-2]["error"]["code"] == 500 and chunks[-1].startswith("data: [DONE]")
        assert async_llm.is_ready and not async_llm.errored
        ok = await serving.create_completion(CompletionRequest(prompt=PROMPT, max_tokens=3,
                                                               temperature=0), "fine")
        assert ok["choices"][0]["finish_reason"] == "length"

    engine.fault_hook = hook
    try:
        _serve(llm, run)
    finally:
        engine.fault_hook = None
    assert engine.scheduler.kv_cache_usage == 0.0


def test_echo_with_max_tokens_zero_gives_the_prompt_and_its_logprobs_only(llm):
    n_prompt = len(llm.get_tokenizer().encode(PROMPT))

    async def run(serving, _):
        body = await serving.create_completion(CompletionRequest(
            prompt=PROMPT, echo=True, max_tokens=0, logprobs=1, temperature=0))
        (choice,) = body["choices"]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == n_prompt and lp["token_logprobs"][0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
        assert body["usage"]["completion_tokens"] == 0
        chunks = await _chunks(await serving.create_completion(CompletionRequest(
            prompt=PROMPT, echo=True, max_tokens=0, stream=True)))
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == PROMPT
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(OpenAIError) as info:      # without echo, 0 tokens asks for nothing
            await serving.create_completion(CompletionRequest(prompt=PROMPT, max_tokens=0))
        assert info.value.status == 400 and "max_tokens" in info.value.message

    _serve(llm, run)


def test_prompt_longer_than_the_whole_kv_pool_is_a_400_naming_the_prompt(llm, variant):
    async def run(serving, _):
        with pytest.raises(OpenAIError) as info:
            await serving.create_completion(CompletionRequest(prompt=PROMPT * 20, max_tokens=1))
        assert info.value.status == 400 and info.value.param == "prompt"
        assert "longer than the whole KV cache" in info.value.message
        ok = await serving.create_completion(CompletionRequest(prompt=PROMPT, max_tokens=2))
        assert ok["choices"][0]["finish_reason"] == "length"

    with variant(llm, num_blocks=4):               # 64 tokens in the whole pool
        _serve(llm, run)


class _ServableFake(FakeEngine):
    """FakeEngine plus what Server.start() logs about an engine."""

    def __init__(self, tokens: int):
        super().__init__(tokens=tokens)
        self.model_path = "fake"
        self.model_config.architecture, self.model_config.num_layers = "Fake", 0
        self.runner = SimpleNamespace(cache=SimpleNamespace(dtype="f32"),
                                      compiled_programs=[])
        self.cache_config = SimpleNamespace(num_blocks=1, block_size=16)
        self.warmup_seconds = 0.0

    def config_info(self) -> dict:
        return {"cache": {"block_size": "16", "num_gpu_blocks": "1"}}


async def _sigterm_while_streaming(tokens: int, shutdown_timeout: float):
    """serve() a fake engine; SIGTERM once a stream has started. Returns (exit code, the
    stream's finish_reason, the status of a request sent while draining, seconds to exit)."""
    import aiohttp

    from jaxserve.server.http.api_server import ServerArgs, serve
    port = free_port()
    args = ServerArgs(port=port, shutdown_timeout=shutdown_timeout, access_log=False,
                      log_stats_interval=0)
    server = asyncio.ensure_future(serve(EngineArgs(), args, engine=_ServableFake(tokens)))
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 60      # a loaded CI machine can be slow to bind
        while time.monotonic() < deadline and not server.done():
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.02)
        if server.done():
            server.result()                   # serve() ended early: raise what it raised
        body = {"prompt": "hi", "max_tokens": 5, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            finish, t0 = None, None
            async for line in r.content:
                if t0 is None:
                    os.kill(os.getpid(), signal.SIGTERM)
                    t0 = time.monotonic()
                    await asyncio.sleep(0.05)
                    async with session.post(url + "/v1/completions",
                                            json={"prompt": "hi", "max_tokens": 1}) as late:
                        late_status = late.status
                text = line.decode().strip()
                if text.startswith("data: {"):
                    finish = json.loads(text[6:])["choices"][0]["finish_reason"] or finish
    code = await asyncio.wait_for(server, 10)
    return code, finish, late_status, time.monotonic() - t0


def test_sigterm_drains_in_flight_requests_then_exits():
    code, finish, late, _ = asyncio.run(_sigterm_while_streaming(tokens=150,
                                                                 shutdown_timeout=10))
    assert (code, finish, late) == (0, "length", 503)     # finished, not cut; no new work
    code, finish, late, took = asyncio.run(_sigterm_while_streaming(tokens=100_000,
                                                                    shutdown_timeout=0.3))
    assert (code, finish, late) == (0, "abort", 503) and took < 5   # past the timeout: aborted
