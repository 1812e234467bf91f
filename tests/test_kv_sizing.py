"""KV pool sizing: the profile-run arithmetic with injected device statistics, the fallbacks, and
the probe step itself on CPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jaxserve.config import EngineArgs
from jaxserve.worker import kv_sizing
from jaxserve.worker.kv_sizing import MemoryProfile, num_kv_blocks

GiB = 1 << 30
H100 = {"bytes_limit": 80 * GiB, "bytes_in_use": 16 * GiB, "peak_bytes_in_use": 16 * GiB}
BLOCK = 2 * GiB // 1024          # 2 MiB per block


def test_profiled_budget_is_utilization_of_the_limit_minus_the_measured_peak():
    calls = []

    def profile(n):
        calls.append(n)
        return 16 * GiB + 3 * GiB + n * BLOCK        # weights + activations + probe pool

    blocks = num_kv_blocks(EngineArgs(gpu_memory_utilization=0.9), BLOCK, 16 * GiB, profile=profile,
                           probe_num_blocks=128, stats=H100)
    assert calls == [128]
    assert blocks == (int(80 * GiB * 0.9) - 19 * GiB) // BLOCK          # 53 GiB of 2 MiB blocks
    p = MemoryProfile(80 * GiB, 0.9, 16 * GiB, 19 * GiB + 128 * BLOCK, 128 * BLOCK)
    assert p.activations == 3 * GiB and p.kv_budget == int(72 * GiB) - 19 * GiB


def test_lower_utilization_leaves_the_rest_of_the_device_free():
    def profile(n):
        return 20 * GiB

    full = num_kv_blocks(EngineArgs(gpu_memory_utilization=0.9), BLOCK, 16 * GiB, profile=profile, stats=H100)
    half = num_kv_blocks(EngineArgs(gpu_memory_utilization=0.5), BLOCK, 16 * GiB, profile=profile, stats=H100)
    assert (full - half) * BLOCK == pytest.approx(0.4 * 80 * GiB, abs=BLOCK)


def test_a_peak_over_the_budget_is_a_value_error_naming_the_knobs():
    with pytest.raises(ValueError, match="gpu_memory_utilization or set kv_cache_memory_bytes"):
        num_kv_blocks(EngineArgs(gpu_memory_utilization=0.3), BLOCK, 16 * GiB,
                      profile=lambda n: 30 * GiB, stats=H100)


def test_no_peak_reported_falls_back_to_a_fixed_headroom():
    blocks = num_kv_blocks(EngineArgs(), BLOCK, 16 * GiB, profile=lambda n: None, stats=H100)
    assert blocks == (int(80 * GiB * 0.9) - 16 * GiB - kv_sizing.UNMEASURED_HEADROOM) // BLOCK


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": 5}])
def test_without_a_device_limit_the_cpu_budget_holds_and_nothing_is_profiled(stats):
    def profile(n):
        raise AssertionError("no profile run without memory statistics")

    blocks = num_kv_blocks(EngineArgs(gpu_memory_utilization=0.45), BLOCK, 0, profile=profile, stats=stats)
    assert blocks == int(kv_sizing.CPU_KV_BUDGET_BYTES * 0.5) // BLOCK


@pytest.mark.parametrize("args, want", [(EngineArgs(num_gpu_blocks_override=40), 40),
                                        (EngineArgs(kv_cache_memory_bytes=100 * BLOCK), 100)])
def test_explicit_sizes_skip_the_profile_run(args, want):
    def profile(n):
        raise AssertionError("explicit sizes are not profiled")

    assert num_kv_blocks(args, BLOCK, 16 * GiB, profile=profile, stats=H100) == want


def test_profile_peak_bytes_runs_the_probe_and_frees_it():
    class Probe:
        ran = released = False

        def profile_run(self):
            self.ran = True

        def release(self):
            self.released = True

    probe = Probe()
    peak = kv_sizing.profile_peak_bytes(probe)
    assert probe.ran and probe.released
    assert peak is None or peak > 0         # None on CPU: XLA:CPU reports no memory statistics


def test_profile_run_on_cpu_changes_no_tokens():
    """The probe step (largest bucket, both variants, an all-padding batch) runs on the real
    runner and writes nothing: greedy tokens afterwards are the same."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import make_cpu_tokens as m

    from jaxserve import LLM
    with LLM(model=m.TINY, warmup=False, **m.SETTINGS) as llm:
        before = m.greedy(llm)
        llm.llm_engine.runner.profile_run()
        assert (m.SETTINGS["max_num_batched_tokens"], True) in llm.llm_engine.runner.compiled_programs
        assert m.greedy(llm) == before
