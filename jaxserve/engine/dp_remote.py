"""Data-parallel replicas on other hosts (vLLM's `--headless` engines with one API server).

The server's host runs ranks 0 .. L-1 (`--data-parallel-size-local L`) and listens on
`--data-parallel-rpc-port`; each other host runs `jaxserve serve MODEL --headless
--data-parallel-start-rank S -dpl L' ...` with the head's `--data-parallel-address`: it builds
ranks S .. S+L'-1 on its own devices, with no HTTP server, and every one of them dials the head.
The head's balancer sees a `RemoteReplica` for each as it sees a local `AsyncLLM`: the same
calls, the request's outputs streamed back, the replica's `EngineStats` (waiting, running, KV
usage: the load it balances on and the `/metrics` series of its `engine` label).

Wire: one ZeroMQ ROUTER on the head, one DEALER per remote replica (identity: its rank),
pickled tuples. Pickle runs code on load: the RPC port is for the replicas of one deployment on
a private network, never for the public (vLLM's DP RPC channel is the same).

head -> replica: ("add", id, prompt, params, priority, lora_request, arrival), ("abort", id),
                 ("load_lora", call, lora_request), ("remove_lora", name), ("shutdown",),
                 ("ping",) every HEARTBEAT seconds
replica -> head: ("ready",), ("accepted", id, error | None), ("out", RequestOutput, EngineStats),
                 ("stats", EngineStats) every HEARTBEAT seconds, ("reply", call, error | None),
                 ("dead", message)

A replica that sends nothing for DEAD_AFTER seconds is dead (its host or process went away): its
requests fail, the others keep serving, `/health` names its rank, as for a local replica. A head
that sends nothing for DEAD_AFTER seconds (it crashed: a shutdown would have said so) leaves its
requests with no one to read them: the headless rank aborts them and keeps serving, so a restarted
head finds it ready (its heartbeat) with no orphaned work in its batch.
The prefix-aware part of the balancer needs the replica's cache: remote replicas count as
holding none of a prompt (load alone places requests on them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import pickle
import signal
import time

from jaxserve.config import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream, deliver

logger = logging.getLogger("jaxserve")

HEARTBEAT = 0.5             # seconds between a replica's stats messages
DEAD_AFTER = 15.0           # seconds of silence after which the head counts a replica dead
DEFAULT_RPC_PORT = 29550    # vLLM's default --data-parallel-rpc-port
CALL_TIMEOUT = 300.0        # a remote adapter load


def _wire_error(e: BaseException) -> BaseException:
    """`e` if it survives pickling (the head re-raises it: a ValueError is the client's 400),
    else a plain ValueError (for a ValueError) or RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return (ValueError if isinstance(e, ValueError) else RuntimeError)(str(e))


class RemoteHub:
    """The head's ROUTER socket: routes each remote replica's messages to its `RemoteReplica`
    and watches their heartbeats."""

    def __init__(self, port: int):
        import zmq
        import zmq.asyncio
        self.port = port
        self.replicas: dict[bytes, RemoteReplica] = {}
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://*:{port}")
        except zmq.ZMQError as e:
            self._ctx.destroy()
            raise ValueError(f"data_parallel_rpc_port {port}: cannot listen there ({e})") from None
        self._tasks: list[asyncio.Task] = []

    def add(self, replica: RemoteReplica) -> None:
        self.replicas[str(replica.rank).encode()] = replica

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch())]

    def send(self, rank: int, message: tuple) -> None:
        self._sock.send_multipart([str(rank).encode(), pickle.dumps(message)])

    async def _receive(self) -> None:
        while True:
            identity, payload = await self._sock.recv_multipart()
            replica = self.replicas.get(identity)
            if replica is None:
                logger.warning("data-parallel RPC: a message from unknown rank %r ignored", identity)
                continue
            try:
                replica.receive(pickle.loads(payload))
            except Exception:
                logger.exception("data-parallel RPC: rank %s sent a message that failed", replica.rank)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            now = time.monotonic()
            for r in self.replicas.values():
                self.send(r.rank, ("ping",))        # the head is alive (a headless host's watch)
                if r.is_running and now - r.last_seen > DEAD_AFTER:
                    r.die(TimeoutError(f"data-parallel rank {r.rank} sent nothing for {DEAD_AFTER:.0f} s"))

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._ctx.destroy(linger=1000)      # up to 1 s to deliver the "shutdown" messages


class RemoteReplica:
    """A replica on another host, with the AsyncLLM calls DataParallelLLM makes."""

    engine = None                   # no engine here: its cache and adapters are not looked at

    def __init__(self, hub: RemoteHub, rank: int, on_output=None, ready_timeout: float | None = None):
        self.hub, self.rank, self.on_output = hub, rank, on_output
        self.ready_timeout = ready_timeout
        self.stats = None
        self.errored, self.error = False, None
        self.last_seen = time.monotonic()
        self._ready: asyncio.Future | None = None
        self._running = False
        self._streams: dict[str, RequestStream] = {}
        self._arrivals: dict[str, float] = {}
        self._adds: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        hub.add(self)

    # -- lifetime ---------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def is_ready(self) -> bool:
        return self._running and not self.errored

    async def start(self) -> None:
        """Wait until the replica has built its engine and said so."""
        self._loop = asyncio.get_running_loop()
        if self._ready is None:
            self._ready = self._loop.create_future()
        self.hub.start()
        logger.info("data-parallel rank %d: waiting for its headless host to dial port %d",
                    self.rank, self.hub.port)
        await asyncio.wait_for(asyncio.shield(self._ready), self.ready_timeout)
        self.last_seen = time.monotonic()
        self._running = True

    async def shutdown(self, graceful: bool = True, timeout: float | None = 30.0) -> None:
        if graceful and self._running:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._streams and not self.errored and (deadline is None or time.monotonic() < deadline):
                await asyncio.sleep(0.05)
        if self._running:
            self.hub.send(self.rank, ("shutdown",))
        self._running = False
        self._fail(EngineDeadError("the server is shutting down"))

    def die(self, error: BaseException) -> None:
        if self.errored:
            return
        logger.error("data-parallel rank %d is dead: %s", self.rank, error)
        self.errored, self.error = True, error
        self._fail(EngineDeadError(f"The engine is dead: {error!r}"))

    def _fail(self, error: BaseException) -> None:
        for fut in [*self._adds.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(error)
        for stream in self._streams.values():
            stream.put(error)
        self._adds.clear()
        self._calls.clear()
        self._streams.clear()

    # -- requests ---------------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return (self.stats.num_waiting if self.stats else 0) + len(self._adds)

    def num_requests(self) -> int:
        return len(self._streams)

    def holds(self, request_id: str) -> bool:
        return request_id in self._streams

    def _check_alive(self) -> None:
        if self.errored:
            raise EngineDeadError(f"The engine is dead: {self.error!r}")
        if not self._running:
            raise EngineDeadError("The server is not accepting requests (starting up or shutting down).")

    async def add_request(self, request_id: str, prompt, params, priority: int = 0,
                          lora_request=None) -> RequestStream:
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, params.output_kind)
        accepted = asyncio.get_running_loop().create_future()
        self._streams[request_id], self._adds[request_id] = stream, accepted
        arrival = time.time()
        self.hub.send(self.rank, ("add", request_id, prompt, params, priority, lora_request, arrival))
        try:
            await accepted
        except BaseException:
            self._adds.pop(request_id, None)
            if accepted.done() and not accepted.cancelled() and accepted.exception() is None:
                self.abort(request_id)
            else:
                self._streams.pop(request_id, None)
            raise
        self._arrivals[request_id] = arrival
        return stream

    def abort(self, request_id: str) -> None:
        if self._running and not self.errored:
            self.hub.send(self.rank, ("abort", request_id))

    def load_lora(self, lora_request) -> None:
        """Read the adapter on the replica's host (called from a worker thread: it waits for
        the answer; the adapter's path must exist there too)."""
        self._check_alive()

        async def call():
            fut, n = self._loop.create_future(), next(self._ids)
            self._calls[n] = fut
            self.hub.send(self.rank, ("load_lora", n, lora_request))
            return await asyncio.wait_for(fut, CALL_TIMEOUT)
        asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def remove_lora(self, lora_name: str) -> bool:
        """Drop the adapter there (not waited for: False, the local replicas answer)."""
        if self._running and not self.errored:
            self.hub.send(self.rank, ("remove_lora", lora_name))
        return False

    # -- messages from the replica (on the event loop) --------------------------------------------
    def receive(self, message: tuple) -> None:
        self.last_seen = time.monotonic()
        kind = message[0]
        if kind in ("ready", "stats"):
            # a heartbeat counts as ready too: a host that was up before this server started
            # (a restarted server) said "ready" to its predecessor
            if self._ready is None:
                self._ready = asyncio.get_running_loop().create_future()
            if not self._ready.done():
                self._ready.set_result(None)
            if kind == "stats":
                self.stats = message[1]
        elif kind == "accepted":
            _, rid, error = message
            fut = self._adds.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None) if error is None else fut.set_exception(error)
            elif fut is None and error is None:     # the caller gave up: free it there
                self.abort(rid)
        elif kind == "out":
            self.stats = message[2]
            deliver(self, message[1])
        elif kind == "reply":
            _, n, error = message
            fut = self._calls.pop(n, None)
            if fut is not None and not fut.done():
                fut.set_result(None) if error is None else fut.set_exception(error)
        elif kind == "dead":
            self.die(RuntimeError(message[1]))


class ReplicaLink:
    """A headless host's side of one replica: its AsyncLLM and its DEALER socket to the head."""

    def __init__(self, ctx, llm: AsyncLLM, rank: int, address: str, port: int):
        import zmq
        self.rank = rank
        self.llm = llm
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, str(rank).encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{address}:{port}"
        self._serving: dict[str, asyncio.Task] = {}
        self.done = asyncio.Event()
        self.last_head = time.monotonic()     # when the head last sent anything

    def send(self, message: tuple) -> None:
        self.sock.send(pickle.dumps(message))

    async def start(self) -> None:
        await self.llm.start()
        self.sock.connect(self.endpoint)
        self.send(("ready",))
        logger.info("data-parallel rank %d ready; serving the head at %s", self.rank, self.endpoint)

    async def run(self) -> None:
        beat = asyncio.ensure_future(self._heartbeat())
        try:
            while not self.done.is_set():
                message = pickle.loads(await self.sock.recv())
                self.last_head = time.monotonic()
                self._handle(message)
        finally:
            beat.cancel()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, rid, prompt, params, priority, lora, _arrival = message
            self._serving[rid] = asyncio.ensure_future(self._serve(rid, prompt, params, priority, lora))
        elif kind == "abort":
            self.llm.abort(message[1])
        elif kind == "load_lora":
            asyncio.ensure_future(self._load_lora(message[1], message[2]))
        elif kind == "remove_lora":
            self.llm.remove_lora(message[1])
        elif kind == "shutdown":
            logger.info("data-parallel rank %d: the head shut down", self.rank)
            self.done.set()

    async def _serve(self, rid, prompt, params, priority, lora) -> None:
        try:
            try:
                stream = await self.llm.add_request(rid, prompt, params, priority, lora)
            except Exception as e:
                self.send(("accepted", rid, _wire_error(e)))
                return
            self.send(("accepted", rid, None))
            try:
                async for out in stream:
                    self.send(("out", out, self.llm.stats))   # the stats of its step
            except EngineDeadError:
                pass                            # the heartbeat reports the engine dead
            finally:
                stream.close()
        finally:
            self._serving.pop(rid, None)

    async def _load_lora(self, n: int, lora_request) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.llm.load_lora, lora_request)
            self.send(("reply", n, None))
        except Exception as e:
            self.send(("reply", n, _wire_error(e)))

    async def _heartbeat(self) -> None:
        while True:
            if self.llm.errored:
                self.send(("dead", f"data-parallel rank {self.rank}: {self.llm.error!r}"))
                return
            self.send(("stats", self.llm.stats))
            if self._serving and time.monotonic() - self.last_head > DEAD_AFTER:
                logger.warning("data-parallel rank %d: the head sent nothing for %.0f s; aborting its %d "
                               "request(s)", self.rank, DEAD_AFTER, len(self._serving))
                for rid in list(self._serving):
                    self.llm.abort(rid)
            await asyncio.sleep(HEARTBEAT)

    async def shutdown(self) -> None:
        await self.llm.shutdown(graceful=False)


async def serve_headless(engine_args: EngineArgs, warmup: bool | str = True) -> int:
    """Run ranks start .. start + size_local - 1 of the data-parallel group for the head at
    data_parallel_address:data_parallel_rpc_port, until the head shuts down or a signal."""
    import zmq.asyncio
    p = engine_args.parallel_config()
    start, local = p.data_parallel_start_rank or 0, p.data_parallel_size_local
    ranks = range(start, start + local)
    address = engine_args.data_parallel_address or "127.0.0.1"
    port = engine_args.data_parallel_rpc_port or DEFAULT_RPC_PORT
    ctx = zmq.asyncio.Context()
    links = [ReplicaLink(ctx, AsyncLLM(dataclasses.replace(engine_args, data_parallel_rank=r),
                                       warmup=warmup), r, address, port) for r in ranks]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(*(link.start() for link in links))
        runs = [asyncio.ensure_future(link.run()) for link in links]
        waiters = [asyncio.ensure_future(stop.wait())] + [asyncio.ensure_future(link.done.wait())
                                                         for link in links]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for t in runs + waiters:
            t.cancel()
    finally:
        await asyncio.gather(*(link.shutdown() for link in links), return_exceptions=True)
        ctx.destroy(linger=0)
    return 0
