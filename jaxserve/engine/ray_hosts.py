"""`--distributed-executor-backend ray`: Ray places the processes of a multi-node engine.

The engine over several hosts is the one of `engine/multihost.py` (one JAX process per host, a
multi-controller job; process 0 schedules and serves, the others follow its steps). With Ray the
user starts one command, on a node of a Ray cluster; this module then

1. reserves one placement-group bundle per host (`STRICT_SPREAD`: each on its own node; a GPU
   node's bundle holds that host's GPUs) — or reuses the placement group the calling process
   already runs in, as Ray Serve LLM makes one for each replica;
2. keeps for itself (process 0, the leader) the bundle on its own node, and starts in every other
   bundle one actor (`HostWorker`) that, in a fresh worker process with the leader's JAX/XLA
   environment, builds the same engine as process k — `jax.distributed.initialize` first, before
   JAX starts its backends — and follows the leader's steps until told to stop.

The leader then joins the job itself and drives the steps exactly as a `--node-rank 0` process
does; the multi-host watchdog notices a host that dies (its actor killed, its node lost). The
actors are owned by the leader: they end when it closes the engine or exits.

vLLM's Ray executor starts one actor per GPU and drives them by RPC; JAX drives every device of
a host from one process, so jaxserve starts one actor per host and sends each step once per host.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from typing import Any

logger = logging.getLogger(__name__)

# How long the leader waits for Ray to place the bundles (a cluster short of nodes never does).
PLACEMENT_TIMEOUT_S = 120.0
# The leader's environment variables the hosts inherit (set before JAX starts there).
ENV_PREFIXES = ("JAX_", "XLA_", "JAXSERVE_", "NCCL_", "HF_", "TF_CPP_")
NAMESPACE = "jaxserve"


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend 'ray' needs Ray: pip install 'jaxserve[ray]' "
                          "(or pip install ray)") from None
    return ray


def host_nodes(bundles_to_node: dict[int, str], nnodes: int) -> list[tuple[int, str]]:
    """(bundle index, node id) of each host, in bundle order; a placement group for `nnodes`
    hosts has `nnodes` bundles, each on its own node."""
    if len(bundles_to_node) != nnodes:
        raise ValueError(f"the placement group has {len(bundles_to_node)} bundle(s), nnodes is "
                         f"{nnodes}: a multi-node engine on Ray takes one bundle per host (e.g. "
                         f"[{{'GPU': 8}}] * {nnodes}, strategy STRICT_SPREAD)")
    hosts = sorted(bundles_to_node.items())
    nodes = [node for _, node in hosts]
    if len(set(nodes)) != len(nodes):
        raise ValueError("the placement group has several bundles on one node: a multi-node engine "
                         "on Ray takes one bundle per host, each on its own node (STRICT_SPREAD)")
    return hosts


def assign_ranks(hosts: list[tuple[int, str]], leader_node: str) -> list[tuple[int, int, str]]:
    """(rank, bundle index, node id) for every host: rank 0 is the bundle on the leader's node
    (the calling process is process 0), the others follow in bundle order."""
    mine = [h for h in hosts if h[1] == leader_node]
    if not mine:
        raise ValueError(f"no bundle of the placement group is on this node ({leader_node[:12]}), "
                         "where process 0 runs: start jaxserve on a node the group holds")
    rest = [h for h in hosts if h[1] != leader_node]
    return [(rank, bundle, node) for rank, (bundle, node) in enumerate([mine[0], *rest])]


def bundle_resources(devices_per_host: int, gpus: bool) -> dict[str, float]:
    """One host's bundle: a CPU for its process, and its GPUs on a GPU cluster."""
    return {"CPU": 1.0, **({"GPU": float(devices_per_host)} if gpus else {})}


def host_environment(environ=os.environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES)}


class HostWorker:
    """One host's process (a Ray actor): builds the engine as process `rank` and follows."""

    def run(self, args, rank: int, master_addr: str, warmup: bool) -> int:
        from jaxserve.engine.llm_engine import LLMEngine
        from jaxserve.logger import configure_default_logging
        configure_default_logging()
        args = dataclasses.replace(args, node_rank=rank, master_addr=master_addr,
                                   distributed_executor_backend=None)
        engine = LLMEngine(args, warmup=warmup)
        try:
            return engine.follow()
        finally:
            engine.shutdown()


@dataclasses.dataclass
class RayHosts:
    """The leader's handle on the hosts Ray placed: keeps the actors alive, logs a host's
    failure as it happens, and ends them on `close`."""
    master_addr: str
    actors: list
    placement_group: Any
    owns_placement_group: bool
    refs: list = dataclasses.field(default_factory=list)
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def watch(self, refs: list) -> None:
        ray = _ray()
        self.refs = list(refs)

        def loop():
            pending = list(refs)
            while pending and not self._stop.is_set():
                done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
                for ref in done:
                    try:
                        code = ray.get(ref)
                        if code:
                            logger.error("a Ray host's process ended with code %s", code)
                    except Exception as e:          # noqa: BLE001 - reported, the watchdog acts
                        if not self._stop.is_set():
                            logger.error("a Ray host's process failed: %s", e)
        threading.Thread(target=loop, name="jaxserve-ray-hosts", daemon=True).start()

    def close(self, grace_s: float = 10.0) -> None:
        """After the leader sent its stop message: let the hosts end, then free their actors
        and the placement group this engine made."""
        if self._stop.is_set():
            return
        self._stop.set()
        ray = _ray()
        if not ray.is_initialized():
            return
        if self.refs:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=grace_s)
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:                       # noqa: BLE001 - already gone
                pass
        if self.owns_placement_group:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self.placement_group)
            except Exception:                       # noqa: BLE001 - shutting down anyway
                pass


def start(args, warmup: bool = True) -> RayHosts:
    """Leader (node_rank 0): place the other `args.nnodes - 1` hosts and start their processes
    (compiling their step programs up front when the leader does: `warmup`); returns their
    handle, with the address process 0's coordinator listens on."""
    ray = _ray()
    from ray.util.placement_group import (
        get_current_placement_group,
        placement_group,
        placement_group_table,
        remove_placement_group,
    )
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS", "auto")
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        except ConnectionError as e:
            raise RuntimeError(f"distributed_executor_backend 'ray' with nnodes={args.nnodes} "
                               f"needs a running Ray cluster (ray start --head on this node, "
                               f"ray start --address=... on the others, or RAY_ADDRESS): {e}") from None
    nnodes = args.nnodes
    per_host = args.tensor_parallel_size // nnodes
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    pg = get_current_placement_group()
    owns = pg is None
    if owns:
        pg = placement_group([bundle_resources(per_host, gpus)] * nnodes, strategy="STRICT_SPREAD",
                             name=f"jaxserve-{uuid.uuid4().hex[:8]}")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        if owns:
            remove_placement_group(pg)
        raise RuntimeError(f"Ray could not place {nnodes} hosts in {PLACEMENT_TIMEOUT_S:.0f} s: "
                           f"nnodes={nnodes} needs {nnodes} nodes with "
                           f"{bundle_resources(per_host, gpus)} free each, the cluster has {alive} "
                           "node(s) alive")
    try:
        hosts = host_nodes(placement_group_table(pg)["bundles_to_node_id"], nnodes)
        ranks = assign_ranks(hosts, ray.get_runtime_context().get_node_id())
    except ValueError:
        if owns:
            remove_placement_group(pg)
        raise
    master_addr = ray.util.get_node_ip_address()
    worker = ray.remote(HostWorker)
    env = host_environment()
    actors, refs = [], []
    tag = uuid.uuid4().hex[:8]
    for rank, bundle, node in ranks[1:]:
        actor = worker.options(
            name=f"jaxserve-host-{rank}-{tag}", namespace=NAMESPACE,
            num_cpus=1, num_gpus=per_host if gpus else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=bundle),
            runtime_env={"env_vars": env}).remote()
        actors.append(actor)
        refs.append(actor.run.remote(args, rank, master_addr, bool(warmup)))
        logger.info("Ray: host %d of %d in bundle %d on node %s", rank, nnodes, bundle, node[:12])
    logger.info("Ray: process 0 (this one) in bundle %d on node %s, coordinator %s:%d; %s "
                "placement group", ranks[0][1], ranks[0][2][:12], master_addr, args.master_port,
                "a new" if owns else "the caller's")
    hosts_handle = RayHosts(master_addr, actors, pg, owns)
    hosts_handle.watch(refs)
    return hosts_handle
