"""One engine over several processes (one per node), with JAX's own multi-controller runtime.

Every process builds the same engine from the same flags (weights are placed shard by shard, so
each process reads only the slices its devices hold) and runs the same jitted step: JAX programs
over a mesh that spans processes are executed by every process at once (NCCL across GPU nodes,
gloo across CPU processes). Process 0 is the leader: it runs the API server and the scheduler,
and before each step sends the step's `SchedulerOutput` to the others through the JAX
coordination service's key-value store (the service process 0 hosts for
`jax.distributed.initialize`); the followers feed it to their own runner. Nothing else crosses
processes: host bookkeeping lives on the leader only.

    leader:   schedule -> send(sched) -> runner.execute(sched) -> update, outputs
    follower: recv() -> runner.execute(sched)     (until the leader sends the stop message)

A follower that dies is noticed by the leader's watchdog (the coordination service's live
nodes, polled every `WATCH_INTERVAL_S`; a process silent for `HEARTBEAT_TIMEOUT_S` is gone): the
leader reports the engine dead (the server's /health turns 503 and requests fail fast) instead
of waiting forever in the step's collectives. A leader that dies makes each follower exit. The
job runs with `jax_enable_recoverability`, so the loss of one process does not terminate the
others from inside the runtime.

The messages are pickles: every process of the job must be trusted (as in vLLM's multi-node
setup); the coordinator port must not be reachable from outside the cluster.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable

import jax

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
# A process silent this long is dead for the coordination service (JAX's default is 100 s).
HEARTBEAT_TIMEOUT_S = 10
_STOP = b"stop"


class PeerLostError(RuntimeError):
    """A process of the job stopped (crashed, killed, or its node went away)."""


def _runtime():
    from jax._src import distributed
    return distributed.global_state


def initialize(nnodes: int, node_rank: int, master_addr: str, master_port: int,
               hosts=None) -> ProcessGroup:
    """Join the job (`jax.distributed.initialize`) unless this process already has, and return
    its process group. Must run before JAX starts its backends (before any array exists).
    `hosts`: what started the other processes (engine/ray_hosts.RayHosts), closed with the group."""
    state = _runtime()
    if state.client is None:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            raise RuntimeError("nnodes > 1 needs jax.distributed.initialize before JAX starts its "
                               "backends: build the engine (or call jaxserve.engine.multihost."
                               "initialize) before creating any JAX array")
        # Keep the survivors running when a process dies (they report it instead), and give XLA
        # collectives across CPU processes (harmless on GPUs, which use NCCL).
        jax.config.update("jax_enable_recoverability", True)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's preemption notifier would take SIGTERM, which drains the server here.
        jax.config.update("jax_enable_preemption_service", False)
        logger.info("joining the job as process %d of %d (coordinator %s:%d)", node_rank, nnodes,
                    master_addr, master_port)
        jax.distributed.initialize(f"{master_addr}:{master_port}", num_processes=nnodes,
                                   process_id=node_rank,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    elif (state.num_processes, state.process_id) != (nnodes, node_rank):
        raise ValueError(f"this process already joined a job as process {state.process_id} of "
                         f"{state.num_processes}, not {node_rank} of {nnodes}")
    return ProcessGroup(state.client, node_rank, nnodes, hosts)


class ProcessGroup:
    """The leader's and the followers' side of the step channel, and the leader's watchdog."""

    def __init__(self, client, rank: int, size: int, hosts=None):
        self.client, self.rank, self.size = client, rank, size
        self.hosts = hosts
        self._seq = 0
        self._lost: PeerLostError | None = None
        self._listeners: list[Callable[[PeerLostError], None]] = []
        self._watchdog: threading.Thread | None = None
        self._stopped = threading.Event()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- the step channel -------------------------------------------------------------------------
    def send(self, message) -> None:
        """Leader: hand `message` (a SchedulerOutput, or None to stop) to every follower."""
        if self._lost is not None:
            raise self._lost
        data = _STOP if message is None else pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.size):
            self.client.key_value_set_bytes(f"jaxserve/step/{rank}/{self._seq}", data)
        self._seq += 1

    def recv(self, poll_ms: int = 1000):
        """Follower: the next message from the leader (None: stop). Raises PeerLostError when
        the leader is gone."""
        key = f"jaxserve/step/{self.rank}/{self._seq}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, poll_ms)
                break
            except Exception as e:          # the runtime raises its own error type on timeout
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise PeerLostError(f"lost the coordinator (process 0): {e}") from e
                if 0 not in self._live([0]):
                    raise PeerLostError("process 0 (the leader) stopped") from None
        self.client.key_value_delete(key)
        self._seq += 1
        return None if data == _STOP else pickle.loads(data)

    def agree_min(self, name: str, value: int) -> int:
        """Every process's `value` -> the smallest (e.g. KV blocks sized per process)."""
        self.client.key_value_set(f"jaxserve/agree/{name}/{self.rank}", str(int(value)))
        return min(int(self.client.blocking_key_value_get(f"jaxserve/agree/{name}/{r}", 300_000))
                   for r in range(self.size))

    def barrier(self, name: str) -> None:
        """Every process: return once all have reached `name` — however long the slowest takes
        (compiling, say). The coordination service's live-task query is itself a barrier over
        the live processes (a dead one is dropped once its heartbeat lapses, ~HEARTBEAT_TIMEOUT_S),
        so a process that stops first makes it a PeerLostError, not a hang."""
        missing = sorted(set(range(self.size)) - self._live(range(self.size)))
        if missing:
            raise PeerLostError(f"process(es) {missing} of {self.size} stopped before reaching "
                                f"{name!r}")

    # -- liveness ---------------------------------------------------------------------------------
    def _live(self, ranks) -> set[int]:
        try:
            return set(self.client.get_live_nodes(list(ranks)))
        except Exception:                   # noqa: BLE001 - the coordinator itself is gone
            return set()

    def on_lost(self, listener: Callable[[PeerLostError], None]) -> None:
        """Leader: call `listener(error)` (from the watchdog thread) once a follower is gone."""
        self._listeners.append(listener)
        if self._lost is not None:
            listener(self._lost)
        elif self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="jaxserve-peers",
                                              daemon=True)
            self._watchdog.start()

    @property
    def lost(self) -> PeerLostError | None:
        return self._lost

    def _watch(self) -> None:
        ranks = range(self.size)
        while not self._stopped.wait(WATCH_INTERVAL_S):
            missing = sorted(set(ranks) - self._live(ranks))
            if missing:
                self._lost = PeerLostError(f"process(es) {missing} of {self.size} stopped; the "
                                           "engine cannot run its steps without them")
                logger.error("%s", self._lost)
                for listener in self._listeners:
                    listener(self._lost)
                return

    def close(self) -> None:
        """Leader: tell the followers to stop (best effort), and stop watching."""
        self._stopped.set()
        if self.is_leader and self._lost is None:
            try:
                self.send(None)
            except Exception:               # noqa: BLE001 - shutting down anyway
                logger.warning("could not send the stop message to the followers")
        if self.hosts is not None:
            self.hosts.close()


def follow(group: ProcessGroup, execute: Callable) -> int:
    """A follower's life: run each step the leader sends until it says stop (0) or is gone (1)."""
    logger.info("process %d of %d: following process 0's steps", group.rank, group.size)
    steps, t0 = 0, time.monotonic()
    while True:
        try:
            message = group.recv()
        except PeerLostError as e:
            logger.error("%s; exiting", e)
            return 1
        if message is None:
            logger.info("process %d: stop after %d steps in %.0f s", group.rank, steps,
                        time.monotonic() - t0)
            return 0
        try:
            execute(message)
        except Exception:                   # noqa: BLE001 - the leader fails the same step
            logger.exception("step %d failed on process %d", steps, group.rank)
        steps += 1
