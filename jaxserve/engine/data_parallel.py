"""Data parallelism with internal load balancing (vLLM's `--data-parallel-size N`): N engine
replicas in this process, each an `AsyncLLM` over its own `tensor_parallel_size` devices
(`ParallelConfig.replica_devices`), behind one front the server uses as it uses an AsyncLLM.

Each request goes to one replica (`choose_replica`): the least loaded, counting a waiting request
as vLLM's balancer does (4 x waiting + running), unless a replica within a small margin of that
load holds more of the prompt's prefix in its prefix cache, which then wins, so repeated system
prompts, multi-turn chats and lm-eval's choices come back to the KV they left. Every replica keeps
its own scheduler, KV pool, prefix cache and step thread; outputs, aborts and streams stay with
the replica that took the request. A replica whose engine dies fails only its own requests; the
others go on serving, and `dead_ranks` says which died (the server's /health reports them).

External load balancing (`--data-parallel-rank R`: one replica per process, one endpoint per
rank for the user's router) needs nothing here: that process is a plain engine on its rank's
devices, tagging its KV-cache events and metrics with the rank.

Several hosts behind this one server (`--data-parallel-size-local L` below the size): ranks
0..L-1 run here, the others on `--headless` hosts that dial `--data-parallel-rpc-port`; each is
a `dp_remote.RemoteReplica` to the balancer (`engine/dp_remote.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from jaxserve.config import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from jaxserve.engine.llm_engine import EngineStats
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")

# A replica holding more of a prompt's prefix takes it while its load is within this much of the
# least loaded one's (in load units: a running request is 1, a waiting one 4), plus this share.
PREFIX_LOAD_MARGIN = 4
PREFIX_LOAD_SHARE = 0.25


def choose_replica(loads: Sequence[float], cached_blocks: Sequence[int], alive: Sequence[bool],
                   start: int = 0, adapter_on_device: Sequence[bool] | None = None) -> int:
    """The replica for a request: among live replicas whose load is within PREFIX_LOAD_MARGIN
    (+ PREFIX_LOAD_SHARE of it) of the least, the one with the most cached prefix blocks; then
    one whose device slots already hold the request's LoRA adapter (no slot write); then by
    load, then round robin from `start`. Raises EngineDeadError when none is alive."""
    live = [i for i, ok in enumerate(alive) if ok]
    if not live:
        raise EngineDeadError("every data-parallel replica is dead")
    least = min(loads[i] for i in live)
    near = [i for i in live if loads[i] <= least + PREFIX_LOAD_MARGIN + PREFIX_LOAD_SHARE * least]
    n = len(loads)
    slot = adapter_on_device or [False] * n
    return min(near, key=lambda i: (-cached_blocks[i], not slot[i], loads[i], (i - start) % n))


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts summed, KV usage averaged (each replica has
    a pool of the same size), accepted-per-position summed by position, adapters merged."""
    out = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if f.name in ("kv_cache_usage", "kv_offload_host_usage"):
            out[f.name] = sum(values) / len(values)
        elif f.name == "spec_num_accepted_tokens_per_pos":
            width = max(map(len, values), default=0)
            out[f.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        elif f.name.endswith("lora_adapters"):
            out[f.name] = tuple(dict.fromkeys(a for v in values for a in v))
        else:
            out[f.name] = sum(values)
    return EngineStats(**out)


class DataParallelLLM:
    """`data_parallel_size` AsyncLLM replicas behind one AsyncLLM-shaped front (module doc)."""

    def __init__(self, engine_args: EngineArgs, *, warmup: bool | str = True,
                 max_waiting_requests: int | None = None,
                 on_output: Callable[[RequestOutput, float, int], None] | None = None,
                 replicas: list[AsyncLLM] | None = None):
        """replicas: prebuilt AsyncLLMs (tests); default: one per rank of engine_args.
        on_output(output, arrival time, rank of the replica that ran it): AsyncLLM's hook, with
        the rank (the server labels its per-request metrics by it)."""
        n = engine_args.data_parallel_size
        if n < 2 or engine_args.data_parallel_rank is not None:
            raise ValueError("DataParallelLLM runs data_parallel_size >= 2 replicas with no "
                             "data_parallel_rank (internal load balancing)")
        parallel = engine_args.parallel_config()
        if parallel.data_parallel_start_rank:
            raise ValueError("data_parallel_start_rank is a headless host's first rank (serve "
                             "--headless); the server runs ranks from 0")
        local = parallel.local_ranks
        self.hub = None
        if replicas is None:
            import jax
            need, have = len(local) * engine_args.tensor_parallel_size, len(jax.local_devices())
            if need > have:
                raise ValueError(
                    f"data_parallel_size {len(local)} x tensor_parallel_size "
                    f"{engine_args.tensor_parallel_size} needs {need} devices, but this host has "
                    f"{have} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={need})")
        self.engine_args = engine_args
        self.on_output = on_output
        # max_waiting_requests bounds each replica's queue (as vLLM's engines each have one)
        if replicas is None:
            replicas = [AsyncLLM(dataclasses.replace(engine_args, data_parallel_rank=r),
                                 warmup=warmup, max_waiting_requests=max_waiting_requests,
                                 on_output=self._hook(r)) for r in local]
            if len(local) < n:          # the other ranks: headless hosts dial in
                from jaxserve.engine.dp_remote import DEFAULT_RPC_PORT, RemoteHub, RemoteReplica
                self.hub = RemoteHub(engine_args.data_parallel_rpc_port or DEFAULT_RPC_PORT)
                replicas += [RemoteReplica(self.hub, r, self._hook(r)) for r in range(len(local), n)]
        self.replicas = replicas
        self._owner: dict[str, int] = {}        # request id -> replica, until its final output
        self._next = 0                          # round robin among equals
        self.routed = [0] * len(self.replicas)  # requests each replica took (for tests, logs)

    def _hook(self, rank: int):
        def on_output(out: RequestOutput, arrival: float) -> None:
            if out.finished:
                self._owner.pop(out.request_id, None)
            if self.on_output is not None:
                self.on_output(out, arrival, rank)
        return on_output

    # -- lifetime ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Build and start every replica (concurrently: each builds on its own thread)."""
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failed = [(rank, e) for rank, e in enumerate(results) if isinstance(e, BaseException)]
        if failed:
            await self.shutdown(graceful=False)
            rank, error = failed[0]
            raise RuntimeError(f"data-parallel replica {rank} failed to start: {error!r}") from error
        for rank, r in enumerate(self.replicas):
            devices = getattr(getattr(r.engine, "runner", None), "plan", None)
            logger.info("data-parallel replica %d of %d ready%s", rank, len(self.replicas),
                        f" on {list(devices.mesh.devices.flat)}" if devices is not None else "")

    async def shutdown(self, graceful: bool = True, timeout: float | None = 30.0) -> None:
        await asyncio.gather(*(r.shutdown(graceful=graceful, timeout=timeout)
                               for r in self.replicas), return_exceptions=True)
        if self.hub is not None:
            self.hub.close()

    @property
    def is_ready(self) -> bool:
        """Serving while any replica is (the dead ones: `dead_ranks`)."""
        return any(r.is_ready for r in self.replicas)

    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def errored(self) -> bool:
        return all(r.errored for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def dead_ranks(self) -> list[int]:
        return [rank for rank, r in enumerate(self.replicas) if r.errored]

    # -- requests ---------------------------------------------------------------------------------
    def loads(self) -> list[float]:
        """Each replica's load: 4 x waiting + running (vLLM's DP balancer), from the requests it
        holds (streams open, adds queued) and its last step's waiting count."""
        return [r.num_requests() + 3 * r.num_waiting() for r in self.replicas]

    def cached_blocks(self, prompt, lora_request=None) -> list[int]:
        """How many full blocks of the prompt's prefix each replica's prefix cache holds (0 for
        all when caching is off, for a pooling model, or when the prompt cannot be read: the
        engine's add reports that)."""
        none = [0] * len(self.replicas)
        if not self.engine_args.enable_prefix_caching or self.engine is None:
            return none
        try:
            _, token_ids = self.engine.tokenize_prompt(prompt)
            lora = None if lora_request is None else lora_request.lora_name
            return [0 if r.errored or r.engine is None else
                    r.engine.scheduler.kv_cache_manager.cached_prefix_blocks(token_ids, lora)
                    for r in self.replicas]
        except (AttributeError, TypeError, ValueError):
            return none

    def adapter_on_device(self, lora_request) -> list[bool] | None:
        """Whether each replica's device slots hold the request's adapter (None: no adapter)."""
        if lora_request is None:
            return None
        name = lora_request.lora_name
        return [not r.errored and r.engine is not None and getattr(r.engine, "lora", None) is not None
                and name in r.engine.lora.device_loaded for r in self.replicas]

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.replicas)

    # -- LoRA adapters: every replica serves the same set ------------------------------------------
    def load_lora(self, lora_request) -> None:
        """Read and check the adapter on every live replica (each keeps its own host copy, as
        each vLLM engine core does when the API server broadcasts a load)."""
        for r in self.replicas:
            if not r.errored:
                r.load_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Drop the adapter's host copy on every replica; True when any held one."""
        return any([r.remove_lora(lora_name) for r in self.replicas if not r.errored])

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          priority: int = 0, lora_request=None) -> RequestStream:
        """Queue a request on the replica `choose_replica` picks; returns its stream."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        rank = choose_replica(self.loads(), self.cached_blocks(prompt, lora_request),
                              [r.is_ready for r in self.replicas], self._next,
                              self.adapter_on_device(lora_request))
        self._next = (rank + 1) % len(self.replicas)
        self._owner[request_id] = rank
        try:
            stream = await self.replicas[rank].add_request(request_id, prompt, params, priority,
                                                           lora_request)
        except BaseException:
            if not self.replicas[rank].holds(request_id):
                self._owner.pop(request_id, None)
            raise
        self.routed[rank] += 1
        return stream

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def encode(self, prompt, pooling_params, request_id: str, priority: int = 0) -> AsyncIterator:
        return self.generate(prompt, pooling_params, request_id, priority)

    def abort(self, request_id: str) -> None:
        rank = self._owner.get(request_id)
        if rank is not None:
            self.replicas[rank].abort(request_id)

    # -- engine facts the server needs (the replicas are built alike: replica 0's) ----------------
    @property
    def engine(self):
        """Replica 0's LLMEngine, for the facts every replica shares (model, tokenizer, config)."""
        return self.replicas[0].engine

    @property
    def stats(self) -> EngineStats | None:
        stats = self.replica_stats
        return None if any(s is None for s in stats) else sum_stats(stats)

    @property
    def replica_stats(self) -> list[EngineStats | None]:
        """Each replica's EngineStats after its last step (/metrics labels them `engine`)."""
        return [r.stats for r in self.replicas]

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def default_sampling_params(self) -> dict:
        return self.replicas[0].default_sampling_params

    @property
    def pooler(self):
        return self.replicas[0].pooler

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    @property
    def max_logprobs(self) -> int:
        return self.replicas[0].max_logprobs
