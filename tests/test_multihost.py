"""Multi-host: two local processes with 4 simulated CPU devices each run one engine (TP 8 over
both, JAX's multi-controller runtime with gloo collectives). Process 0 serves /v1/completions
with the same tokens as one process; killing process 1 turns /health to 503 within seconds and
requests fail fast instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_fixtures import SMALL_ENGINE, ServerProcess, free_port, greedy_texts, http_status, post_json

TINY = str(Path(__file__).parent / "data" / "tiny-llama")
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
# After SMALL_ENGINE on the command line, so these win: one token bucket (two programs to build).
ENGINE = ["--load-format", "dummy", "-tp", "8", "--nnodes", "2", "--max-num-batched-tokens", "16",
          "--max-num-seqs", "8"]


@pytest.mark.slow
def test_two_processes_serve_like_one_and_a_lost_follower_is_a_503(monkeypatch, tmp_path):
    from jaxserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=TINY, load_format="dummy", warmup=False, max_model_len=512,
             max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=512) as one:
        expected = [o.outputs[0].text for o in
                    one.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    master_port = str(free_port())
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    follower_log = open(tmp_path / "follower.log", "w")
    follower = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.server.cli", "serve", TINY, *SMALL_ENGINE, *ENGINE,
         "--node-rank", "1", "--master-port", master_port],
        stdout=follower_log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    leader = ServerProcess(TINY, *ENGINE, "--node-rank", "0", "--master-port", master_port,
                           log_path=tmp_path / "leader.log")
    try:
        leader.start(timeout=400)
        assert greedy_texts(leader.base_url, PROMPTS, 8) == expected

        follower.send_signal(signal.SIGKILL)
        follower.wait(30)
        killed = time.monotonic()
        deadline = time.monotonic() + 30
        while http_status(leader.base_url + "/health") != 503:
            assert time.monotonic() < deadline, "/health still not 503 30 s after the follower died"
            time.sleep(0.2)
        t0 = time.monotonic()
        status, body = post_json(leader.base_url + "/v1/completions",
                                 {"prompt": PROMPTS[0], "max_tokens": 4}, timeout=30)
        assert status == 503 and time.monotonic() - t0 < 10, (status, body)
        print(f"lost follower -> 503 in {t0 - killed:.1f} s")
        assert "stopped" in body["error"]["message"], body
    finally:
        if follower.poll() is None:
            follower.kill()
        follower_log.close()
        assert leader.stop(timeout=60) is not None, leader.log()
    assert "following process 0" in (tmp_path / "follower.log").read_text()


@pytest.mark.parametrize("kwargs, field", [(dict(nnodes=0), "nnodes"),
                                           (dict(nnodes=2, node_rank=2), "node_rank"),
                                           (dict(node_rank=-1), "node_rank"),
                                           (dict(master_port=70000), "master_port")])
def test_bad_multihost_flags_are_value_errors_naming_the_field(kwargs, field):
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)


class _FakeCoordinator:
    """The coordination service's live-task query as ProcessGroup uses it: a barrier over the
    live 'processes' (threads here) that returns the live set; a dead one is dropped."""

    def __init__(self):
        self.live, self.arrived, self.cond = {0, 1}, set(), threading.Condition()

    def get_live_nodes(self, ranks):
        with self.cond:
            self.arrived.add(threading_rank())
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.live <= self.arrived, 30)
            return {r: 1 for r in ranks if r in self.live}


def threading_rank() -> int:
    return int(threading.current_thread().name.rsplit("-", 1)[1])


def test_the_built_barrier_waits_for_a_slow_process_and_fails_on_a_dead_one():
    """Process 0 (its programs came from a cache, say) waits at the barrier until process 1 (still
    compiling) arrives, instead of starting a step whose collectives would time out; a process
    that died instead makes it a PeerLostError."""
    from jaxserve.engine.multihost import PeerLostError, ProcessGroup
    coord = _FakeCoordinator()
    passed = []
    leader = threading.Thread(name="rank-0", target=lambda: (
        ProcessGroup(coord, 0, 2).barrier("built"), passed.append(time.monotonic())))
    leader.start()
    time.sleep(2)
    assert not passed                           # still waiting for process 1
    arrived = time.monotonic()
    follower = threading.Thread(name="rank-1", target=lambda: ProcessGroup(coord, 1, 2).barrier("built"))
    follower.start()
    leader.join(5), follower.join(5)
    assert passed and passed[0] >= arrived

    coord = _FakeCoordinator()
    coord.live.discard(1)                       # process 1 died while building
    errors = []

    def lone_leader():
        try:
            ProcessGroup(coord, 0, 2).barrier("built")
        except PeerLostError as e:
            errors.append(str(e))
    t = threading.Thread(name="rank-0", target=lone_leader)
    t.start()
    t.join(5)
    assert errors == ["process(es) [1] of 2 stopped before reaching 'built'"]
