"""The offline `LLM`'s program cache (`program_cache_dir`, default ~/.cache/jaxserve/programs): a
second `LLM()` of the same model and flags loads its step programs instead of compiling them, with
the same tokens, and leaves jax.config alone; other flags get their own directory; a damaged
program is compiled again, never fatal. Each start runs in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = str(Path(__file__).resolve().parent / "data" / "tiny-llama")
TINY_FLAGS = dict(model=TINY, load_format="dummy", max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=64, num_gpu_blocks_override=64)

CHILD = r"""
import io, json, logging, sys
log = io.StringIO()
logging.getLogger("jaxserve").addHandler(logging.StreamHandler(log))
logging.getLogger("jaxserve").setLevel(logging.INFO)
import jax
from jaxserve import LLM, SamplingParams
llm = LLM(**json.loads(sys.argv[1]))
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "log": log.getvalue(),
                  "programs": llm.llm_engine.runner.programs_obtained(),
                  "jax_cache": jax.config.jax_compilation_cache_dir}))
"""


def _start(prompts, env=None, **kwargs) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs), json.dumps(prompts)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_llm_loads_its_programs_and_leaves_jax_config_alone(tmp_path):
    prompts = ["t5 t6 t7 t8", "t1 t2"]
    cold = _start(prompts, program_cache_dir=str(tmp_path), **TINY_FLAGS)
    assert cold["programs"] == "0 loaded from the program cache, 0 loaded from the compilation cache, 8 compiled"
    warm = _start(prompts, program_cache_dir=str(tmp_path), **TINY_FLAGS)
    assert warm["programs"] == "8 loaded from the program cache, 0 loaded from the compilation cache, 0 compiled"
    assert warm["tokens"] == cold["tokens"]
    assert not cold["jax_cache"] and not warm["jax_cache"]       # jax's process-wide cache untouched
    (key_dir,) = tmp_path.iterdir()
    assert sorted(p.name for p in key_dir.glob("*.exe"))[:2] == ["penalty_write.exe", "step_1.exe"]
    # other shape-changing flags: another key, another directory, compiled
    other = _start(prompts, program_cache_dir=str(tmp_path), **{**TINY_FLAGS, "max_num_seqs": 16})
    assert other["programs"].endswith(" 0 loaded from the compilation cache, 8 compiled")
    assert len(list(tmp_path.iterdir())) == 2
    # a damaged program is compiled again (and a warning says so), never fatal
    (key_dir / "step_16.exe").write_bytes(b"not a program")
    again = _start(prompts, program_cache_dir=str(tmp_path), **TINY_FLAGS)
    assert again["programs"] == "7 loaded from the program cache, 0 loaded from the compilation cache, 1 compiled"
    assert "could not load program step_16" in again["log"] and again["tokens"] == cold["tokens"]


@pytest.mark.parametrize("tp", [1, 2])
def test_programs_load_onto_the_engines_devices_when_the_host_has_more(tmp_path, tp):
    """On a host of 8 devices an engine of 1 or 2 runs its cached programs on its own devices (a
    program deserialized onto all 8 failed: "Expected args ... to have 8 shards")."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    flags = dict(program_cache_dir=str(tmp_path), tensor_parallel_size=tp, **TINY_FLAGS)
    cold = _start(["t5 t6 t7 t8", "t1 t2"], env=env, **flags)
    warm = _start(["t5 t6 t7 t8", "t1 t2"], env=env, **flags)
    assert warm["programs"].startswith("8 loaded from the program cache") and warm["programs"].endswith(" 0 compiled")
    assert warm["tokens"] == cold["tokens"] and all(len(t) == 8 for t in warm["tokens"])


@pytest.mark.slow
def test_the_default_model_starts_warm_from_the_program_cache(tmp_path):
    """The default model's programs call the C++ CPU kernels (XLA FFI custom calls): they load too."""
    from jaxserve.default_model import default_model_path
    default_model_path()            # the installed default model (the README's test command installs it)
    flags = dict(program_cache_dir=str(tmp_path), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64)
    cold = _start(["Bees make"], **flags)
    warm = _start(["Bees make"], **flags)
    # buckets 1, 2, 4, 8, 16, 32, 64 (4 and 8: the fused int4 kernel's), the prompt-logprobs
    # variants that differ, the penalty-row write
    assert warm["programs"].startswith("12 loaded from the program cache") and warm["programs"].endswith(" 0 compiled")
    assert warm["tokens"] == cold["tokens"]
