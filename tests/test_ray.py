"""`--distributed-executor-backend ray` on one machine: a Ray cluster of two simulated nodes
(`ray.cluster_utils.Cluster`, one raylet each), one simulated CPU device per process, a TP 2
engine over 2 hosts. `jaxserve serve` started once places the second host itself (its own
placement group) and serves the single-process tokens; a host whose actor is killed turns
/health to 503. An `LLM` inside a Ray actor that runs in a placement group (as Ray Serve LLM
starts a replica) reuses that group. The placement rules are checked on their own."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from server_fixtures import ServerProcess, free_port, greedy_texts, http_status, post_json

from jaxserve.engine import ray_hosts

TINY = str(Path(__file__).parent / "data" / "tiny-llama")
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
ENGINE = dict(load_format="dummy", max_model_len=512, max_num_batched_tokens=16, max_num_seqs=8,
              num_gpu_blocks_override=512)
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
MB = 2**20


@pytest.fixture(scope="module")
def expected():
    from jaxserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=TINY, warmup=False, **ENGINE) as one:
        return [o.outputs[0].text for o in
                one.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                      "object_store_memory": 80 * MB})
    c.add_node(num_cpus=1, object_store_memory=80 * MB)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="jaxserve-test", log_to_driver=True)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.mark.slow
def test_serve_places_the_second_host_and_serves_the_single_process_tokens(
        cluster, expected, monkeypatch, tmp_path):
    for k, v in ONE_DEVICE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    leader = ServerProcess(TINY, "--load-format", "dummy", "-tp", "2", "--nnodes", "2",
                           "--distributed-executor-backend", "ray",
                           "--master-port", str(free_port()), "--max-num-batched-tokens", "16",
                           "--max-num-seqs", "8", log_path=tmp_path / "leader.log")
    try:
        leader.start(timeout=400)
        assert greedy_texts(leader.base_url, PROMPTS, 8) == expected
        log = leader.log()
        assert "Ray: host 1 of 2 in bundle" in log and "a new placement group" in log, log
        assert "following process 0" in log, log     # the host's log, forwarded by Ray
        # The two processes run on the two Ray nodes.
        nodes = {line.rsplit("on node ", 1)[1].split()[0].rstrip(",")
                 for line in log.splitlines() if "Ray: " in line and "on node " in line}
        assert len(nodes) == 2, log

        host = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("jaxserve-host-1-")]
        assert len(host) == 1, host
        ray.kill(ray.get_actor(host[0]["name"], namespace=host[0]["namespace"]))
        deadline = time.monotonic() + 40
        while http_status(leader.base_url + "/health") != 503:
            assert time.monotonic() < deadline, "/health still not 503 40 s after the host died"
            time.sleep(0.2)
        status, body = post_json(leader.base_url + "/v1/completions",
                                 {"prompt": PROMPTS[0], "max_tokens": 4}, timeout=30)
        assert status == 503, (status, body)
    finally:
        assert leader.stop(timeout=60) is not None, leader.log()


class _Replica:
    """What Ray Serve LLM runs: an engine built inside an actor of a placement group."""

    def generate(self, port: int) -> list[str]:
        from jaxserve import LLM, SamplingParams
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        with LLM(model=TINY, warmup=False, tensor_parallel_size=2, nnodes=2,
                 distributed_executor_backend="ray", master_port=port, **ENGINE) as llm:
            return [o.outputs[0].text for o in
                    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                 use_tqdm=False)]


@pytest.mark.slow
def test_an_engine_in_a_placement_group_reuses_it(cluster, expected):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    try:
        replica = ray.remote(_Replica).options(
            num_cpus=1, runtime_env={"env_vars": ONE_DEVICE},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True)).remote()
        assert ray.get(replica.generate.remote(free_port()), timeout=400) == expected
        ray.kill(replica)
    finally:
        remove_placement_group(pg)


def test_placement_rules():
    table = {0: "node-b", 1: "node-a"}
    hosts = ray_hosts.host_nodes(table, 2)
    assert ray_hosts.assign_ranks(hosts, "node-a") == [(0, 1, "node-a"), (1, 0, "node-b")]
    assert ray_hosts.assign_ranks(hosts, "node-b") == [(0, 0, "node-b"), (1, 1, "node-a")]
    with pytest.raises(ValueError, match="no bundle of the placement group is on this node"):
        ray_hosts.assign_ranks(hosts, "node-c")
    with pytest.raises(ValueError, match="1 bundle\\(s\\), nnodes is 2"):
        ray_hosts.host_nodes({0: "node-a"}, 2)
    with pytest.raises(ValueError, match="several bundles on one node"):
        ray_hosts.host_nodes({0: "node-a", 1: "node-a"}, 2)
    assert ray_hosts.bundle_resources(8, gpus=True) == {"CPU": 1.0, "GPU": 8.0}
    assert ray_hosts.bundle_resources(4, gpus=False) == {"CPU": 1.0}
    env = ray_hosts.host_environment({"XLA_FLAGS": "x", "JAX_PLATFORMS": "cpu", "HOME": "/root",
                                      "NCCL_DEBUG": "INFO"})
    assert env == {"XLA_FLAGS": "x", "JAX_PLATFORMS": "cpu", "NCCL_DEBUG": "INFO"}


def test_a_cluster_short_of_nodes_is_a_clear_error(cluster, monkeypatch):
    from jaxserve.config import EngineArgs
    monkeypatch.setattr(ray_hosts, "PLACEMENT_TIMEOUT_S", 3.0)
    args = EngineArgs(model=TINY, tensor_parallel_size=3, nnodes=3,
                      distributed_executor_backend="ray")
    with pytest.raises(RuntimeError, match="could not place 3 hosts .* the cluster has 2 node"):
        ray_hosts.start(args)


@pytest.mark.parametrize("kwargs, field", [
    (dict(distributed_executor_backend="dask"), "distributed_executor_backend"),
    (dict(distributed_executor_backend="ray", nnodes=2, node_rank=1), "node_rank")])
def test_bad_executor_flags_are_value_errors_naming_the_field(kwargs, field):
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)
