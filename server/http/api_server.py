"""The aiohttp application: routes, auth, error mapping, SSE, start-up and graceful shutdown.

The HTTP listener starts first and answers /health with 503 while the engine loads (in the engine
worker thread), then 200. Endpoint logic lives in serving.py; this file only moves bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import signal
import time

from aiohttp import web
from pydantic import BaseModel

import jaxserve
from jaxserve.config import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.data_parallel import DataParallelLLM
from jaxserve.outputs import PoolingRequestOutput
from jaxserve.server.http.docs import add_docs_routes
from jaxserve.server.http.metrics import CONTENT_TYPE, ServerMetrics
from jaxserve.server.http.openapi import openapi_document
from jaxserve.server.openai.embeddings import EmbeddingRequest, create_embedding
from jaxserve.server.openai.lora import lora_models_at_start
from jaxserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    check_json_body,
    validate_request,
)
from jaxserve.server.openai.responses import ResponsesServing
from jaxserve.server.openai.responses_protocol import ResponsesRequest
from jaxserve.server.openai.serving import OpenAIServing
from jaxserve.server.openai.templates import load_chat_template

# Routes behind --api-key besides /v1/*: the tokenizer's (vLLM leaves them open; they read
# prompts, so they sit with the API).
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
# Health probes (load balancers poll them every few seconds) log their access lines at DEBUG.
PROBE_PATHS = frozenset({"/health", "/ping"})
# The access log's status of a request whose client went away before the answer (nginx's).
CLIENT_CLOSED = 499

logger = logging.getLogger("jaxserve.server")
access_logger = logging.getLogger("jaxserve.access")
stats_logger = logging.getLogger("jaxserve.stats")


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """Frontend flags (vLLM's names)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] | None = None
    max_waiting_requests: int | None = None
    response_role: str = "assistant"
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = 8 << 20
    access_log: bool = True           # one line per request (--disable-access-log silences it)
    allowed_origins: tuple[str, ...] = ()   # CORS: off unless origins are named ("*" for any)
    log_stats_interval: float = 10.0  # seconds between stats lines while busy; 0: never
    chat_template: str | None = None  # a file path or the template text
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # /metrics name prefixes: ("jaxserve", "vllm") serves every metric under both
    metrics_prefix: tuple[str, ...] = ("jaxserve",)
    # --lora-modules: (name, path, base_model_name) adapters served from the start (--enable-lora)
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    # /v1/load_lora_adapter and /v1/unload_lora_adapter answer (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False


def _error_response(err: OpenAIError) -> web.Response:
    return web.json_response(err.to_dict(), status=err.status)


class Server:
    """One server: an AsyncLLM, its OpenAIServing, metrics and the aiohttp app."""

    def __init__(self, engine_args: EngineArgs, server_args: ServerArgs = ServerArgs(), *,
                 warmup: bool | str = True, engine=None):
        """engine: an already built LLMEngine (or a stand-in with its interface) to serve
        instead of building one from engine_args."""
        names = server_args.served_model_name
        if names:
            engine_args = engine_args.replace(served_model_name=names[0])
        if server_args.reasoning_parser and engine_args.reasoning_parser is None:
            # the engine applies structured output after the reasoning this server splits off
            engine_args = engine_args.replace(reasoning_parser=server_args.reasoning_parser)
        self.engine_args = engine_args
        self.args = server_args
        self.chat_template = load_chat_template(server_args.chat_template)
        if engine is None and engine_args.data_parallel_size > 1 and \
                engine_args.data_parallel_rank is None:
            # replicas behind this server's balancer (engine/data_parallel.py)
            self.llm = DataParallelLLM(engine_args, warmup=warmup,
                                       max_waiting_requests=server_args.max_waiting_requests,
                                       on_output=self._on_output)
        else:
            self.llm = AsyncLLM(None if engine is not None else engine_args, engine=engine,
                                warmup=warmup, max_waiting_requests=server_args.max_waiting_requests,
                                on_output=self._on_output)
        self.serving: OpenAIServing | None = None
        self.responses: ResponsesServing | None = None
        self.metrics: ServerMetrics | None = None
        self.app = self._build_app()
        self.runner: web.AppRunner | None = None
        self.stopping = False
        self._stats_task: asyncio.Future | None = None

    def _on_output(self, out, arrival, engine: int | None = None):
        if self.metrics is not None and not isinstance(out, PoolingRequestOutput):
            self.metrics.observe(out, arrival, engine)

    # -- app ----------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        # A larger body is a 413 before it is read, so one client cannot tie up the loop and
        # the server's memory with a huge prompt.
        app = web.Application(middlewares=[self._middleware],
                              client_max_size=self.args.max_request_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)       # vLLM's (SageMaker's) health probe
        app.router.add_post("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", self.openapi)
        add_docs_routes(app)                            # /docs, /redoc over /openapi.json
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.create_response)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve_response)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        t0 = time.perf_counter()
        status = CLIENT_CLOSED     # unless an answer comes back: the client went away first
        try:
            response = await self._answer(request, handler)
            status = response.status
            return response
        finally:   # also when a disconnect cancels the handler: one line per request
            if self.args.access_log:
                self._log_access(request, status, time.perf_counter() - t0)

    @staticmethod
    def _log_access(request: web.Request, status: int, seconds: float) -> None:
        usage = request.get("usage")      # a request that generated: "12+3 tokens"; others say nothing
        tokens = f" {usage['prompt_tokens']}+{usage.get('completion_tokens', 0)} tokens" if usage else ""
        level = logging.DEBUG if request.path in PROBE_PATHS else logging.INFO
        access_logger.log(level, '%s "%s %s" %d%s %.3f s', request.remote, request.method,
                          request.path, status, tokens, seconds)

    async def _answer(self, request: web.Request, handler):
        origin = request.headers.get("Origin")
        allowed = origin is not None and ("*" in self.args.allowed_origins
                                          or origin in self.args.allowed_origins)
        if request.method == "OPTIONS" and allowed:        # CORS preflight
            return web.Response(status=204, headers=self._cors_headers(origin, preflight=True))
        if allowed:
            request["cors"] = self._cors_headers(origin)   # streams send headers early
        response = await self._handle(request, handler)
        if allowed and not response.prepared:
            response.headers.update(request["cors"])
        return response

    @staticmethod
    def _cors_headers(origin: str, preflight: bool = False) -> dict[str, str]:
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if preflight:
            headers.update({"Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                            "Access-Control-Allow-Headers": "Authorization, Content-Type",
                            "Access-Control-Max-Age": "600"})
        return headers

    async def _handle(self, request: web.Request, handler):
        try:
            if self.args.api_key and (request.path.startswith("/v1")
                                      or request.path in KEYED_PATHS):
                given = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(given, f"Bearer {self.args.api_key}".encode()):
                    raise OpenAIError(401, "Unauthorized: a valid API key is required "
                                           "(Authorization: Bearer <key>)", "AuthenticationError")
            return await handler(request)
        except OpenAIError as e:
            return _error_response(e)
        except web.HTTPException as e:
            status = e.status if e.status != 405 else 405
            return web.json_response(OpenAIError(status, e.reason or str(e),
                                                 "NotFoundError" if status == 404 else
                                                 "BadRequestError").to_dict(), status=status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:
            logger.exception("internal error on %s", request.path)
            return _error_response(OpenAIError(500, f"Internal server error: {e!r}",
                                               "InternalServerError"))

    def _require_ready(self) -> OpenAIServing:
        if self.llm.errored:
            raise OpenAIError(503, f"The engine is dead: {self.llm.error!r}")
        if self.stopping or self.serving is None or not self.llm.is_ready:
            raise OpenAIError(503, "The server is not ready (loading the model or shutting "
                                   "down).")
        return self.serving

    async def _body(self, request: web.Request, model: type[BaseModel]):
        ctype = request.content_type
        if ctype != "application/json":
            raise OpenAIError(400, f"Unsupported Content-Type {ctype!r}; send application/json",
                              param="Content-Type")
        raw = await request.read()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"Invalid JSON body: {e}") from None
        except RecursionError:
            raise OpenAIError(400, "Invalid JSON body: nested too deeply") from None
        if not isinstance(data, dict):
            raise OpenAIError(400, "The request body must be a JSON object")
        check_json_body(data)
        return validate_request(model, data)

    # -- handlers -----------------------------------------------------------------------------
    async def health(self, request):
        # ready once the endpoints are too (--lora-modules adapters are read after the engine)
        dead = getattr(self.llm, "dead_ranks", None)
        if dead:        # data parallelism: the live replicas still serve; the pod needs a restart
            return web.json_response({"status": "unhealthy", "dead_data_parallel_ranks": dead,
                                      "error": repr(self.llm.error)}, status=503)
        if self.llm.is_ready and not self.stopping and self.serving is not None:
            return web.Response(status=200)
        return web.Response(status=503)

    async def openapi(self, request):
        return web.json_response(openapi_document(jaxserve.__version__))

    async def version(self, request):
        return web.json_response({"version": jaxserve.__version__})

    async def prometheus(self, request):
        body = self.metrics.render() if self.metrics is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request):
        return web.json_response(self._require_ready().show_models())

    async def tokenize(self, request):
        serving = self._require_ready()
        return web.json_response(await serving.tokenize(await self._body(request,
                                                                         TokenizeRequest)))

    async def detokenize(self, request):
        serving = self._require_ready()
        return web.json_response(await serving.detokenize(await self._body(request,
                                                                           DetokenizeRequest)))

    async def tokenizer_info(self, request):
        return web.json_response(self._require_ready().tokenizer_info())

    def _require_generating(self, api: str) -> OpenAIServing:
        """A pooling model (--runner pooling) answers only /v1/embeddings (vLLM's 400)."""
        serving = self._require_ready()
        if self.llm.pooler is not None:
            raise OpenAIError(400, f"The model does not support {api} API: it runs as a pooling "
                                   "model (--runner pooling); use /v1/embeddings", param="model")
        return serving

    async def _lora_models(self, request):
        serving = self._require_generating("LoRA adapter")
        if serving.lora is None:
            raise OpenAIError(400, "LoRA adapters are not enabled: start the server with --enable-lora",
                              param="lora_name")
        raw = await request.read()
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"Invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "The request body must be a JSON object")
        return serving.lora, body

    async def load_lora_adapter(self, request):
        lora, body = await self._lora_models(request)
        return web.Response(text=await lora.load(body))

    async def unload_lora_adapter(self, request):
        lora, body = await self._lora_models(request)
        return web.Response(text=await lora.unload(body))

    async def embeddings(self, request):
        serving = self._require_ready()
        body = await self._body(request, EmbeddingRequest)
        return await self._respond(request, await create_embedding(
            serving, body, request.headers.get("X-Request-Id")))

    async def completions(self, request):
        serving = self._require_generating("Completions")
        body = await self._body(request, CompletionRequest)
        return await self._respond(request, await serving.create_completion(
            body, request.headers.get("X-Request-Id")))

    async def chat_completions(self, request):
        serving = self._require_generating("Chat Completions")
        body = await self._body(request, ChatCompletionRequest)
        return await self._respond(request, await serving.create_chat_completion(
            body, request.headers.get("X-Request-Id")))

    async def create_response(self, request):
        self._require_ready()
        body = await self._body(request, ResponsesRequest)
        result = await self.responses.create_response(body, request.headers.get("X-Request-Id"))
        response = await self._respond(request, result)
        if isinstance(result, dict) and result["usage"]:   # the access log reads chat's names
            request["usage"] = {"prompt_tokens": result["usage"]["input_tokens"],
                                "completion_tokens": result["usage"]["output_tokens"]}
        return response

    async def retrieve_response(self, request):
        self._require_ready()
        return web.json_response(self.responses.retrieve(request.match_info["response_id"]))

    async def delete_response(self, request):
        self._require_ready()
        return web.json_response(self.responses.delete(request.match_info["response_id"]))

    async def _respond(self, request: web.Request, result):
        if isinstance(result, dict):
            request["usage"] = result.get("usage")      # for the access log line
            return web.json_response(result)
        request["usage"] = result.usage     # filled in as the stream ends
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **request.get("cors", {})})
        try:
            await resp.prepare(request)
            async for chunk in result:
                await resp.write(chunk.encode())
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            logger.debug("client went away mid-stream; request aborted")
            raise
        finally:
            await result.aclose()           # aborts unfinished requests (frees KV blocks)
        return resp

    # -- lifetime -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen first (so /health answers 503 while loading), then load the engine."""
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.args.host, self.args.port)
        await site.start()
        logger.info("HTTP listener on http://%s:%d (/health is 503 until the model is ready)",
                    self.args.host, self.args.port)
        t0 = time.perf_counter()
        await self.llm.start()
        engine = self.llm.engine
        names = self.args.served_model_name or [engine.model_name]
        # data parallelism: one series per replica, labelled engine="<rank>" (vLLM's)
        get_stats = (lambda: self.llm.replica_stats) if isinstance(self.llm, DataParallelLLM) \
            else (lambda: self.llm.stats)
        self.metrics = ServerMetrics(names[0], get_stats, self.args.metrics_prefix,
                                     config_info=engine.config_info(),
                                     data_parallel_size=len(getattr(self.llm, "replicas", [0])))
        self.serving = OpenAIServing(self.llm, names, self.args.response_role,
                                     model_root=engine.model_path,
                                     enable_auto_tools=self.args.enable_auto_tool_choice,
                                     tool_parser=self.args.tool_call_parser,
                                     reasoning_parser=self.args.reasoning_parser,
                                     chat_template=self.chat_template,
                                     lora=await lora_models_at_start(self.llm, names[0], self.args.lora_modules,
                                                                     self.args.allow_runtime_lora_updating))
        self.responses = ResponsesServing(self.serving)
        cfg = engine.model_config
        blocks, bs = engine.cache_config.num_blocks, engine.cache_config.block_size
        logger.info("loaded %s (%s, %d layers%s, KV cache %s) from %s", names[0], cfg.architecture,
                    cfg.num_layers, ", linear layers fp8" if getattr(engine, "fp8_linear", False) else "",
                    engine.runner.cache.dtype, engine.model_path)
        logger.info("KV pool: %d blocks x %d tokens = %d tokens; max concurrency at "
                    "max_model_len %d: %.2fx", blocks, bs, blocks * bs, engine.max_model_len,
                    blocks * bs / engine.max_model_len)
        logger.info("step programs (tokens, prompt logprobs): %s; warm-up %.1f s",
                    sorted(engine.runner.compiled_programs), engine.warmup_seconds)
        logger.info("ready in %.1f s: serving %s on http://%s:%d", time.perf_counter() - t0,
                    ", ".join(names), self.args.host, self.args.port)
        if self.args.log_stats_interval > 0:
            self._stats_task = asyncio.ensure_future(self._log_stats())

    async def _log_stats(self) -> None:
        """vLLM's periodic stats line, written only while the engine has work or just had."""
        last, last_t = self.llm.stats, time.perf_counter()
        while True:
            await asyncio.sleep(self.args.log_stats_interval)
            now, now_t = self.llm.stats, time.perf_counter()
            if now is None or last is None:
                last, last_t = now, now_t
                continue
            prompt = now.prompt_tokens_total - last.prompt_tokens_total
            gen = now.generation_tokens_total - last.generation_tokens_total
            if prompt or gen or now.num_running or now.num_waiting:
                dt = now_t - last_t
                queries = now.prefix_cache_queries - last.prefix_cache_queries
                hits = now.prefix_cache_hits - last.prefix_cache_hits
                stats_logger.info(
                    "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%", prompt / dt, gen / dt, now.num_running,
                    now.num_waiting, 100 * now.kv_cache_usage,
                    100 * hits / queries if queries else 0.0)
            last, last_t = now, now_t

    async def stop(self, graceful: bool = True) -> None:
        """Stop accepting, let in-flight requests finish (or abort them), close the listener."""
        self.stopping = True
        if self._stats_task is not None:
            self._stats_task.cancel()
        await self.llm.shutdown(graceful=graceful, timeout=self.args.shutdown_timeout)
        if self.serving is not None:
            self.serving.close()
        if self.runner is not None:
            await self.runner.cleanup()


async def serve(engine_args: EngineArgs, server_args: ServerArgs, *, engine=None) -> int:
    """Run until SIGINT/SIGTERM, then drain: no new requests (503), in-flight ones finish for up
    to `server_args.shutdown_timeout` seconds, the rest are aborted. Returns the exit code (0
    after a graceful shutdown). engine: see `Server`."""
    # /health turns 200 once decode and short prompts can run; the larger step programs
    # compile in the background while it serves (LLMEngine's warmup="background").
    server = Server(engine_args, server_args, engine=engine, warmup="background")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.ensure_future(server.start())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([start, stopper], return_when=asyncio.FIRST_COMPLETED)
    if start.done() and start.exception() is not None:
        logger.error("start-up failed: %s", start.exception())
        stopper.cancel()
        await server.stop(graceful=False)
        return 1
    await stopper
    logger.info("shutting down: no new requests; finishing in-flight ones")
    if not start.done():
        start.cancel()
        try:
            await start
        except BaseException:
            pass
    await server.stop(graceful=True)
    logger.info("shutdown complete")
    return 0
