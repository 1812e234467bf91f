"""Shared fixtures. Everything runs by default (no --runslow); `gpu`-marked tests are skipped when
JAX sees no GPU.

`llm` is ONE small engine on the default model (SmolLM2-135M, f32) shared by the whole session:
loading it costs ~20 s and every new step shape costs a compile, so tests share it. Tests that
need another scheduler setting (no prefix caching, a tiny KV pool, a small token budget) swap the
engine's scheduler with `engine_variant(...)` instead of loading a second model; the runner (and
its compiled programs) stays the same, and the swapped scheduler only ever hands out block ids
below the runner's pool size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import pytest

# The offline `LLM` keeps its compiled programs in ~/.cache/jaxserve/programs by default; tests
# build many engines and assert how their programs came to be (compiled, in the background, from
# the compilation cache), so engines here, in this process and the subprocesses and notebook
# kernels it starts, run without it unless a test asks (tests/test_program_cache.py).
os.environ["JAXSERVE_PROGRAM_CACHE"] = ""

# Sized for the e2e tests: 64 concurrent requests of up to ~250 tokens fit without preemption.
# dtype float32: f32 matmul tiles at every batch size (the CPU default, "auto", takes batches of 16
# rows or more through bf16 tiles), so tests can compare a request run alone with it in a batch.
SHARED_LLM_KWARGS = dict(max_model_len=512, max_num_batched_tokens=128, max_num_seqs=64,
                         num_gpu_blocks_override=1024, seed=0, dtype="float32")


@pytest.fixture(scope="module")
def server():
    """A real `jaxserve serve` of the default model with small engine settings
    (server_fixtures.ServerProcess), one per module that asks; a module that needs other flags
    defines its own `server`."""
    from server_fixtures import ServerProcess
    srv = ServerProcess().start()
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on `server`."""
    import openai
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import jax
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() is not 'gpu')")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true, as .ci/run runs), a skip is a failure unless it is a GPU test on a machine
    without one, a test for the other jax version (reason "needs jax ..."; .ci/run runs both) or
    a test of a CPU feature this machine lacks (reason "needs a CPU with ...": CI machines differ,
    AMX on one, not on another): a missing oracle (torch, transformers), default model, kernel
    build or notebook runner must not turn the parity and end-to-end checks silently into nothing."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI", "").lower() in ("1", "true") \
            and not item.get_closest_marker("gpu"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        if re.search(r"\bneeds? jax\b|\bneeds a CPU with\b", str(reason)):
            return
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run every non-GPU test: {reason}"


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache():
    """The test process uses JAX's persistent compilation cache, as the CLI does (an engine no
    longer turns it on by itself), so warm reruns load programs instead of compiling them."""
    from jaxserve.engine.llm_engine import enable_compilation_cache
    enable_compilation_cache(None)


@pytest.fixture(scope="session")
def llm():
    from jaxserve import LLM
    engine = LLM(warmup=False, **SHARED_LLM_KWARGS)
    yield engine
    engine.shutdown()


@contextlib.contextmanager
def engine_variant(llm, *, enable_prefix_caching: bool | None = None,
                   num_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                   async_scheduling: bool | None = None):
    """Run the shared engine with a fresh scheduler (empty prefix cache, zeroed counters) built
    from changed configs; the original scheduler is restored afterwards. Yields the scheduler."""
    from jaxserve.core.scheduler import Scheduler
    engine = llm.llm_engine
    # hands the finished ids to the worker, which drops them from its batch, and reads a step an
    # async engine launched for a request that finished in the step before (its token dropped)
    engine.step()
    assert not engine.has_unfinished_requests()
    cache_cfg, sched_cfg = engine.cache_config, engine.scheduler_config
    if enable_prefix_caching is not None:
        cache_cfg = dataclasses.replace(cache_cfg, enable_prefix_caching=enable_prefix_caching)
    if num_blocks is not None:
        assert num_blocks <= engine.cache_config.num_blocks
        cache_cfg = dataclasses.replace(cache_cfg, num_blocks=num_blocks)
    if max_num_batched_tokens is not None:
        assert max_num_batched_tokens <= sched_cfg.max_num_batched_tokens   # within the buckets
        sched_cfg = dataclasses.replace(sched_cfg, max_num_batched_tokens=max_num_batched_tokens)
    if async_scheduling is not None:
        sched_cfg = dataclasses.replace(sched_cfg, async_scheduling=async_scheduling)
    original = engine.scheduler
    engine.scheduler = Scheduler(sched_cfg, cache_cfg)
    try:
        yield engine.scheduler
    finally:
        engine.step()
        engine.scheduler = original
        # The variant wrote K/V into blocks the original scheduler may still hold as cached-free
        # prefix blocks; forget those hashes so no later hit reads overwritten K/V.
        assert original.kv_cache_manager.reset_prefix_cache()


@pytest.fixture
def variant():
    return engine_variant


# The flags of the tool calling tests: one server for test_server_tools.py and
# test_tool_choice_constrained.py (a start costs ~15 s on 2 cores).
TOOLS_SERVER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      "--reasoning-parser", "qwen3")


@pytest.fixture(scope="session")
def tools_server():
    from server_fixtures import ServerProcess
    srv = ServerProcess(*TOOLS_SERVER_FLAGS).start()
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]
