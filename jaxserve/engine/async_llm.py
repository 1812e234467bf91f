"""`AsyncLLM`: the engine behind an asyncio server.

The engine core runs on its own thread ("jaxserve-engine-core", vLLM's EngineCore busy loop):
apply the adds and aborts queued since the last step, run `LLMEngine.step()`, hand the outputs
to the event loop (`call_soon_threadsafe`), step again — it never waits for the event loop, so
HTTP work (parsing, JSON encoding, writing SSE chunks) never sits between two steps and a slow
client never slows one (with async scheduling the next step is already running on the device
while the host works). Only that thread touches the engine (it is not thread-safe); request
handlers queue adds and aborts, which the thread applies between steps. Every request has its
own `RequestStream`, one slot that merges outputs while the consumer is behind; a consumer that
stops iterating, or whose task is cancelled (client disconnect), aborts its request at once so
its KV blocks are freed.

    llm = AsyncLLM(EngineArgs(...))
    await llm.start()                      # builds the engine in the worker thread
    async for out in llm.generate("Hi", SamplingParams(output_kind=DELTA), "req-1"):
        ...
    await llm.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from jaxserve.config import EngineArgs
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxserve")


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served any more."""


class EngineOverloadedError(RuntimeError):
    """More requests are waiting than --max-waiting-requests allows."""


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: object
    params: SamplingParams
    priority: int
    arrival_time: float
    accepted: asyncio.Future
    lora_request: object = None


class RequestStream:
    """The outputs of one request, as an async iterator. `close()` aborts it if unfinished.

    One slot, not a queue (vLLM's `RequestOutputCollector`): when the engine gets ahead of a slow
    consumer, a new output is merged into the one still waiting (DELTA outputs are appended,
    CUMULATIVE / FINAL_ONLY ones replace it), so a slow streaming client costs one pending
    output, not one per token. An error replaces whatever is pending.
    """

    def __init__(self, llm: AsyncLLM, request_id: str,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        self.request_id = request_id
        self.finished = False
        self._llm = llm
        self._aggregate = output_kind == RequestOutputKind.DELTA
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop by AsyncLLM with each output (or the error that ends it)."""
        if self._pending is None or isinstance(item, BaseException) \
                or isinstance(self._pending, BaseException):
            if not isinstance(self._pending, BaseException):
                self._pending = item
        else:
            self._pending.add(item, aggregate=self._aggregate)
        self._ready.set()

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except BaseException:       # cancelled (client gone): free the request's blocks now
            self.close()
            raise
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)


def deliver(front, out: RequestOutput) -> None:
    """Hand one output to its request's stream and to the front's `on_output` hook (on the event
    loop); a finished one leaves `front._streams` / `front._arrivals` (AsyncLLM, RemoteReplica)."""
    arrival = front._arrivals.get(out.request_id, time.time())
    if out.finished:
        front._arrivals.pop(out.request_id, None)
        stream = front._streams.pop(out.request_id, None)
    else:
        stream = front._streams.get(out.request_id)
    if front.on_output is not None:
        try:
            front.on_output(out, arrival)
        except Exception:
            logger.exception("metrics hook failed")
    if stream is not None and not stream.finished:
        stream.put(out)


class AsyncLLM:
    """Async front of `LLMEngine`; see the module docstring.

    engine_args: how to build the engine (in the worker thread, on `start()`); or pass a built
    `engine` instead. max_waiting_requests: adds beyond this many waiting requests raise
    `EngineOverloadedError` (HTTP 503). on_output: called on the event loop with every
    RequestOutput and its arrival time (the server's metrics hook).
    """

    def __init__(self, engine_args: EngineArgs | None = None, *, engine=None, warmup: bool | str = True,
                 max_waiting_requests: int | None = None,
                 on_output: Callable[[RequestOutput, float], None] | None = None):
        if (engine_args is None) == (engine is None):
            raise ValueError("pass exactly one of engine_args or engine")
        self.engine_args = engine_args if engine_args is not None else engine.args
        self.engine = engine
        self.warmup = warmup
        self.max_waiting_requests = max_waiting_requests
        self.on_output = on_output
        # builds and frees the engine off the event loop
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-engine")
        self._streams: dict[str, RequestStream] = {}        # event loop side
        self._arrivals: dict[str, float] = {}               # event loop side: accepted requests
        self._num_queued_adds = 0                           # adds not yet taken by the core
        # To the core thread: _Add items and abort ids (str), applied between steps.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._work = threading.Event()          # set when the inbox has something, or to stop
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = True
        self.errored = False
        self.error: BaseException | None = None
        self.stats = None               # EngineStats after the last step (for /metrics)

    # -- lifetime ---------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self.is_running and not self.errored

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    async def start(self) -> None:
        """Build the engine (if needed) without blocking the loop, then start the loop task."""
        loop = asyncio.get_running_loop()
        if self.engine is None:
            from jaxserve.engine.llm_engine import LLMEngine
            try:
                self.engine = await loop.run_in_executor(
                    self._executor, lambda: LLMEngine(self.engine_args, warmup=self.warmup))
            except BaseException as e:
                self.errored, self.error = True, e
                raise
        self.stats = self.engine.stats()
        self._loop = loop
        self._thread = threading.Thread(target=self._core, name="jaxserve-engine-core", daemon=True)
        self._thread.start()
        group = getattr(self.engine, "group", None)
        if group is not None and group.is_leader:
            # A lost follower leaves the step waiting in a collective forever: report the engine
            # dead now (503s, failed streams) rather than when the step returns.
            group.on_lost(lambda e: loop.call_soon_threadsafe(self._die, e))

    async def shutdown(self, graceful: bool = True, timeout: float | None = 30.0) -> None:
        """Stop accepting requests; with graceful, let in-flight ones finish (up to timeout
        seconds), then abort the rest, stop the loop and free the engine."""
        self._accepting = False
        if graceful and self.is_running:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._streams and (deadline is None or time.monotonic() < deadline):
                await asyncio.sleep(0.05)
        if self._streams:
            for rid in list(self._streams):
                self.abort(rid)
            for _ in range(100):
                if not self._streams or not self.is_running:
                    break
                await asyncio.sleep(0.02)
        if self._thread is not None:
            self._stop = True
            self._work.set()
            if not self._stuck():
                await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError("the server is shutting down"))
        self._streams.clear()
        if self.engine is not None and not self._stuck():
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self.engine.shutdown)
        self._executor.shutdown(wait=False)

    def _stuck(self) -> bool:
        """A lost peer process can leave the engine thread inside a step that never returns."""
        group = getattr(self.engine, "group", None)
        return group is not None and group.lost is not None

    # -- requests ---------------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return (self.stats.num_waiting if self.stats else 0) + self._num_queued_adds

    def num_requests(self) -> int:
        """Requests this engine holds (queued, waiting or running; event-loop side)."""
        return len(self._streams)

    def holds(self, request_id: str) -> bool:
        return request_id in self._streams

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          priority: int = 0, lora_request=None) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it. Raises
        ValueError (the engine's validation, an invalid structured-output grammar),
        EngineOverloadedError or EngineDeadError."""
        self._check_alive()
        if getattr(params, "structured_outputs", None) is not None:   # PoolingParams: none
            # Grammars compile in the default thread pool (llguidance drops the GIL), never on
            # the loop; the engine's add then finds the compiled grammar in its cache.
            await asyncio.get_running_loop().run_in_executor(
                None, self.engine.compile_structured, params)
        if lora_request is not None:        # the adapter is read off the loop and off the step
            await asyncio.get_running_loop().run_in_executor(None, self.engine.load_lora, lora_request)
        self._check_alive()
        if self.max_waiting_requests is not None and \
                self.num_waiting() >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"The server is overloaded: {self.num_waiting()} requests are waiting "
                f"(--max-waiting-requests {self.max_waiting_requests}); retry later.")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, params.output_kind)
        self._streams[request_id] = stream
        accepted = asyncio.get_running_loop().create_future()
        self._num_queued_adds += 1
        self._inbox.put(_Add(request_id, prompt, params, priority, time.time(), accepted, lora_request))
        self._work.set()
        try:
            await accepted
        except BaseException:
            if accepted.done() and not accepted.cancelled() and accepted.exception() is None:
                self.abort(request_id)      # accepted, then cancelled before we resumed
            else:
                self._streams.pop(request_id, None)   # rejected, or cancelled while queued
            raise
        return stream

    def load_lora(self, lora_request) -> None:
        """Read and check an adapter's host copy (thread-safe; InvalidRequestError naming the
        field when it cannot be served)."""
        self.engine.load_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Drop an adapter's host copy (False: none was loaded)."""
        return self.engine.remove_lora(lora_name)

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request (DELTA, CUMULATIVE or FINAL_ONLY as params.output_kind says).
        Leaving the loop early or cancelling the consuming task aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def encode(self, prompt, pooling_params, request_id: str,
               priority: int = 0) -> AsyncIterator:
        """A pooling model's output for one prompt (vLLM's `AsyncLLM.encode`): one
        PoolingRequestOutput, as `generate` yields for a PoolingParams."""
        return self.generate(prompt, pooling_params, request_id, priority)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it has finished). Applied before the next step."""
        if self._thread is None:
            return
        self._inbox.put(request_id)
        self._work.set()

    def _check_alive(self) -> None:
        if self.errored:
            raise EngineDeadError(f"The engine is dead: {self.error!r}")
        if not self._accepting or not self.is_running:
            raise EngineDeadError("The server is not accepting requests (starting up or "
                                  "shutting down).")

    # -- the engine core thread -------------------------------------------------------------------
    def _core(self) -> None:
        """The engine core loop (its own thread): inbox, step, outputs to the event loop."""
        engine, call = self.engine, self._loop.call_soon_threadsafe
        live: set[str] = set()          # accepted and not finished (this thread's view)
        try:
            while not self._stop:
                self._work.clear()
                self._apply_inbox(live)
                if not engine.has_unfinished_requests():
                    call(self._publish, [], engine.stats())
                    if self._inbox.empty():
                        self._work.wait()
                    continue
                outputs = engine.step()
                for out in outputs:
                    if out.finished:
                        live.discard(out.request_id)
                call(self._publish, outputs, engine.stats())
        except BaseException as e:
            logger.exception("engine loop failed; the server answers 503 from now on")
            call(self._die, e)

    def _apply_inbox(self, live: set[str]) -> None:
        """On the core thread, between steps: the queued adds (each accepted or refused on the
        event loop), then the aborts."""
        aborts, call = [], self._loop.call_soon_threadsafe
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, str):
                aborts.append(item)
                continue
            add = item
            if add.accepted.done():             # the caller gave up while it was queued
                call(self._settled, add, None, False)
                continue
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params,
                                        arrival_time=add.arrival_time, priority=add.priority,
                                        **({"lora_request": add.lora_request} if add.lora_request else {}))
            except Exception as e:
                call(self._settled, add, e, False)
                continue
            live.add(add.request_id)
            call(self._settled, add, None, True)
        known = [rid for rid in dict.fromkeys(aborts) if rid in live]
        if known:
            self.engine.abort_request(known)    # its final output comes with the next step's
        unknown = [rid for rid in aborts if rid not in live]
        if unknown:
            call(self._forget, unknown)

    # -- the event loop side ------------------------------------------------------------------------
    def _settled(self, add: _Add, error: Exception | None, added: bool) -> None:
        """An add the core took: added to the engine, refused (error), or skipped (its caller
        gave up while it was queued)."""
        self._num_queued_adds -= 1
        rid = add.request_id
        if added:
            self._arrivals[rid] = add.arrival_time
            if add.accepted.done():     # the caller gave up while the core added it
                self._streams.pop(rid, None)
                self.abort(rid)
            else:
                add.accepted.set_result(None)
        elif error is not None and not add.accepted.done():
            self._streams.pop(rid, None)
            add.accepted.set_exception(error)

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid not in self._arrivals:
                self._streams.pop(rid, None)

    def _publish(self, outputs: list[RequestOutput], stats) -> None:
        self.stats = stats
        for out in outputs:
            deliver(self, out)

    def _die(self, e: BaseException) -> None:
        """The engine cannot serve again: fail what waits on it; /health answers 503."""
        if self.errored:
            return
        self.errored, self.error = True, e
        dead = EngineDeadError(f"The engine is dead: {e!r}")
        while True:                     # adds the core never took
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, str) and not item.accepted.done():
                item.accepted.set_exception(dead)
        for stream in self._streams.values():
            stream.put(dead)
        self._streams.clear()

    # -- engine facts the server needs --------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def default_sampling_params(self) -> dict:
        """The model's generation-config defaults for unset request fields."""
        return self.engine.default_sampling_params

    @property
    def pooler(self):
        """The PoolerConfig of a pooling model (runner "pooling"); None for a generating one."""
        return getattr(self.engine, "pooler", None)

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_logprobs(self) -> int:
        return self.engine_args.max_logprobs
