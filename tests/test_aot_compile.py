"""`jaxserve compile` and `--compiled-dir`: programs compiled in one process start an engine in
another with no compilation and the same tokens; a directory compiled for other settings is
refused by name and the engine compiles; for an H100 (compile-only devices, jax 0.11.2 with the
CUDA plugin wheels: the Python 3.12 CI step) the step programs hold the kernels' custom calls,
never their interpreters."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "tests" / "data" / "tiny-llama")
FLAGS = dict(load_format="dummy", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
             num_gpu_blocks_override=64)

ENGINE = r"""
import io, json, logging, sys
log = io.StringIO()
handler = logging.StreamHandler(log)
logging.getLogger("jaxserve").addHandler(handler)
logging.getLogger("jaxserve").setLevel(logging.INFO)
from jaxserve import LLM, SamplingParams
llm = LLM(**json.loads(sys.argv[1]))
outs = llm.generate(["t5 t6 t7 t8", "t1 t2", "t9 t9 t9"], SamplingParams(max_tokens=8, temperature=0),
                    use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "log": log.getvalue()}))
"""


def _flags(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


def _compile(out: Path, target: str = "cpu", extra: list[str] = (), python: str = sys.executable, **flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [python, "-m", "jaxserve.server.cli", "compile", TINY, "--target", target, "--out", str(out),
           *_flags(**{**FLAGS, **flags}), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _engine(**kwargs) -> dict:
    args = {"model": TINY, "program_cache_dir": "", **FLAGS, **kwargs}
    done = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(args)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cpu_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled-cpu")
    report = _compile(out)
    return out, report


def test_a_compiled_directory_starts_an_engine_with_no_compilation_and_the_same_tokens(cpu_dir):
    out, report = cpu_dir
    assert report["programs"] and all(p["compiled"] for p in report["programs"])
    assert (out / "manifest.json").is_file() and (out / "report.md").is_file()
    assert all((out / f"{p['name']}.hlo.txt").is_file() for p in report["programs"])
    loaded = _engine(compiled_dir=str(out))
    fresh = _engine()
    assert loaded["tokens"] == fresh["tokens"]
    ready = [line for line in loaded["log"].splitlines() if "warm-up:" in line]
    assert ready and f"{len(report['programs'])} loaded from the compiled directory" in ready[0], ready
    assert ", 0 compiled)" in ready[0], ready
    assert "compiled (" not in loaded["log"]          # no step program line says "compiled"
    assert "compiled (" in fresh["log"]


def test_a_directory_compiled_for_other_settings_is_refused_by_name_and_the_engine_compiles(cpu_dir):
    out, _ = cpu_dir
    other = _engine(compiled_dir=str(out), max_num_seqs=16)
    assert "compiled for another engine" in other["log"]
    assert "max_num_seqs: compiled 8, this engine 16" in other["log"]
    assert "loaded from the compiled directory" not in other["log"]
    assert " compiled)" in other["log"]
    assert other["tokens"] == _engine(max_num_seqs=16)["tokens"]


def test_key_mismatch_names_each_field():
    from jaxserve.aot.store import mismatch
    assert mismatch({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == ["b: compiled 2, this engine 3",
                                                                    "c: compiled None, this engine 4"]
    assert mismatch({"a": 1}, {"a": 1}) == []


def _h100_or_skip():
    try:
        from jaxserve.aot.targets import get_target
        return get_target("h100")
    except (ValueError, ImportError) as e:
        pytest.skip(f"needs jax 0.11.2 with the CUDA plugin wheels for a compile-only H100 (the py312 CI step): {e}")


@pytest.mark.parametrize("backend,custom_call", [("pallas", "__gpu$xla.gpu.triton"), ("mosaic", "mosaic_gpu")])
def test_h100_programs_hold_the_kernel_not_its_interpreter(tmp_path, backend, custom_call):
    _h100_or_skip()
    report = _compile(tmp_path, "h100", ["--programs", "ci"], attention_backend=backend)
    assert report["target"]["compute_capability"] == "9.0"
    assert report["attention_backend"] == backend
    for p in report["programs"]:
        assert p["compiled"], p["error"]
        text = (tmp_path / f"{p['name']}.hlo.txt").read_text()
        assert custom_call in text
        # the interpreter would show as ops named after it, or as host callbacks (Mosaic's barriers)
        assert not re.search(r'op_name="[^"]*interpret', text) and "callback" not in text
        assert p["memory"]["argument"] > 0 and p["modeled_bytes"] > 0 and p["min_bytes"] > 0
        assert isinstance(p["host_syncs"], int)
        # no loop inside the layer scan: the kernels' tile planning (a binary search, a `while`
        # of tiny kernels, once per layer) compares all pairs on a GPU instead
        from jaxserve.aot.hlo_analysis import parse_hlo, while_loops
        entry = parse_hlo(text).entry
        nested = [w for w in while_loops(text) if w["computation"] != entry]
        assert not nested, nested
    assert report["memory_check"]["fits"]


def test_h100_tensor_parallel_all_reduces_move_the_activation_dtype(tmp_path):
    """Row-parallel partial sums are all-reduced in bf16 on a GPU (vLLM's choice), not in f32."""
    _h100_or_skip()
    report = _compile(tmp_path, "h100", ["--programs", "ci"], tensor_parallel_size=2)
    ops = {(c["op"], c["dtype"]) for p in report["programs"] for c in p["collectives"]}
    assert ("all-reduce", "bf16") in ops and ("all-reduce", "f32") not in ops, ops


@pytest.mark.parametrize("method,group,sym,act_order", [("awq", 32, False, False), ("gptq", 64, True, True)])
def test_abstract_int4_weights_have_the_layout_the_loader_makes(tmp_path, method, group, sym, act_order):
    """A config-only int4 compile (no checkpoint files read) must compile the programs an engine on
    the real checkpoint runs: every array of every Int4Weight the same shape, dtype and placement."""
    pytest.importorskip("transformers")
    import jax
    import jax.numpy as jnp
    from test_int4 import write_int4_checkpoint

    from jaxserve.aot.store import _spec_signature
    from jaxserve.loader.dummy import abstract_weights
    from jaxserve.loader.int4 import scheme_of
    from jaxserve.loader.loader import _hf_json, load_model
    from jaxserve.sharding.mesh import make_mesh
    write_int4_checkpoint(tmp_path / "q", method, group, sym, act_order)
    mesh = make_mesh(1)
    cfg, loaded = load_model(tmp_path / "q", "float32", mesh=mesh)
    shapes = abstract_weights(cfg, jnp.float32, mesh, int4_scheme=scheme_of(_hf_json(tmp_path / "q")))
    assert jax.tree.structure(shapes) == jax.tree.structure(loaded)
    assert _spec_signature(shapes) == _spec_signature(loaded)


def test_step_compiler_options_read_gemm_weights_in_place_on_a_gpu_only():
    """On a GPU the layer scan's GEMMs take cuBLAS with dynamic-slice fusion (each layer read in
    place in its stack) and no dot merger; FP8 weights keep Triton's GEMMs (XLA's cuBLAS FP8 GEMM
    takes per-tensor scales only); the CPU keeps XLA's defaults."""
    import types

    import jax.numpy as jnp
    import numpy as np

    from jaxserve.worker.compile_cache import step_compiler_options
    gpu, cpu = [types.SimpleNamespace(platform="gpu")], [types.SimpleNamespace(platform="cpu")]
    bf16 = {"w": jnp.zeros((2, 4, 4), jnp.bfloat16)}
    fp8 = {"w": np.zeros((2, 4, 4), jnp.float8_e4m3fn), "s": np.ones((2, 1, 4), np.float32)}
    assert step_compiler_options(cpu, bf16) is None
    assert step_compiler_options(gpu, bf16) == {"xla_gpu_enable_dynamic_slice_fusion": True,
                                                "xla_gpu_enable_triton_gemm": False,
                                                "xla_gpu_dot_merger_threshold_mb": 0}
    assert step_compiler_options(gpu, fp8) == {"xla_gpu_dot_merger_threshold_mb": 0}



def test_the_compile_gate_fails_on_a_host_sync_or_bytes_over_target():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from gpu_compile_gate import check_targets
    finally:
        sys.path.pop(0)

    def report(syncs, ratio, collectives=None):
        return {"programs": [{"name": "step_1", "compiled": True, "host_syncs": syncs, "host_sync_points": [],
                              "bytes_ratio": ratio, "top": [], "collective_ratio": collectives,
                              "collectives": []}]}
    assert check_targets({"llama-3.1-8b-bf16": report(0, 1.07)}) == []
    assert check_targets({"llama-3.1-70b-tp8": report(0, 3.0, 1.09)}) == []     # no bytes target there
    assert len(check_targets({"llama-3.1-8b-bf16": report(0, 1.2)})) == 1
    assert len(check_targets({"qwen3-30b-a3b-ep2": report(2, 1.0)})) == 1
    assert len(check_targets({"llama-3.1-70b-tp8": report(0, 1.0, 1.2)})) == 1


@pytest.mark.parametrize("backend", ["pallas", "reference"])
def test_h100_every_program_prompt_logprobs_variants_included_has_no_host_sync(tmp_path, backend):
    """0 host synchronisation points in every step program for an H100, on the kernel path and on
    the reference path (its GPU form: loops of static trip count), the prompt-logprobs variants too
    (their chunk loop has a static trip count on a GPU)."""
    _h100_or_skip()
    # the reference path at max_model_len 2048: its steps compiled for block tables 512 and 2048
    # tokens wide (KV width buckets, worker/buckets.kv_widths)
    extra = {"max_model_len": 2048} if backend == "reference" else {}
    report = _compile(tmp_path, "h100", ["--programs", "all"], attention_backend=backend, **extra)
    assert any(p["prompt_logprobs"] for p in report["programs"])
    if backend == "reference":
        widths = {p["kv_width_tokens"] for p in report["programs"]}
        assert widths == {512, 2048} and any(p["name"].endswith("_kv32blocks") for p in report["programs"])
    for p in report["programs"]:
        assert p["compiled"], p["error"]
        assert p["host_syncs"] == 0, (p["name"], p["host_sync_points"])
