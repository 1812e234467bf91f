"""Safe GPU defaults (issue 25): `auto` picks only kernels with a recorded GPU measurement, and a
kernel that fails to compile at warm-up falls back to the next choice with a warning, never a crash.
The failures are injected into the real kernels' entry points; the engine runs the seeded dummy
tiny Llama on CPU."""
from __future__ import annotations

import logging
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxserve.attention.backend import AttentionCase, Platform, select_backend
from jaxserve.engine.fallback import Choice, build_with_fallback, fallback_plan
from jaxserve.pallas import measured

TINY = str(Path(__file__).parent / "data" / "tiny-llama")
H100 = Platform("gpu", "9.0", (0, 11))
H200 = Platform("gpu", "9.0", (0, 11))
A100 = Platform("gpu", "8.0", (0, 11))
BF16 = AttentionCase(jnp.bfloat16, jnp.bfloat16, 32, 8, 128, 16)
MOSAIC_MEASURED = measured.MEASURED + (measured.Measurement("attention/mosaic", "sm90", None, None, "test"),)


def test_hopper_without_a_mosaic_measurement_gets_the_measured_triton_kernel(caplog):
    caplog.set_level(logging.INFO, "jaxserve.attention.backend")
    assert select_backend("auto", BF16, H100) == "pallas"
    assert "attention/mosaic has no GPU measurement on sm90" in caplog.text


def test_a_mosaic_measurement_in_the_table_makes_it_the_hopper_default():
    assert select_backend("auto", BF16, H200, measured=MOSAIC_MEASURED) == "mosaic"


@pytest.mark.parametrize("platform, case_kw", [
    (A100, {}),                                           # no measurement on sm80 at all
    (H100, dict(q_dtype=jnp.float32)),                    # measured in bf16; f32 dots run as TF32
    (H100, dict(head_dim=64)),                            # measured at head_dim 128 only
])
def test_no_measured_kernel_for_the_case_means_the_xla_reference_path(platform, case_kw, caplog):
    case = AttentionCase(**{**BF16.__dict__, **case_kw})
    assert select_backend("auto", case, platform) == "reference"
    assert "XLA reference path" in caplog.text


def test_explicit_names_are_honoured_whatever_the_table_says():
    assert select_backend("mosaic", BF16, H100) == "mosaic"
    assert select_backend("pallas", BF16, A100) == "pallas"


def test_fp8_auto_takes_the_mosaic_kernel_only_where_measured(monkeypatch):
    from jaxserve.layers import fp8

    class Hopper:
        platform, compute_capability = "gpu", "9.0"

    monkeypatch.setattr(fp8, "_kernel_available", lambda: True)
    assert fp8.resolve_kernel("auto", Hopper()) == "xla"
    table = (measured.Measurement("fp8/pallas", "sm90", None, None, "test"),)
    assert fp8.resolve_kernel("auto", Hopper(), measured=table) == "pallas"
    assert fp8.resolve_kernel("mosaic", Hopper()) == "pallas"          # the flag's alias
    with pytest.raises(ValueError, match="fp8 kernel must be one of"):
        fp8.resolve_kernel("cutlass", Hopper())


def test_fallback_plan_drops_the_fp8_kernel_first_then_attention():
    assert fallback_plan("mosaic", "pallas") == [Choice("mosaic", "pallas"), Choice("mosaic", "xla"),
                                                 Choice("pallas", "xla"), Choice("reference", "xla")]
    assert fallback_plan("reference", None) == [Choice("reference", None)]


def test_the_last_choice_failing_raises_its_own_error():
    def build(choice):
        raise RuntimeError(f"broken {choice.attention}")
    with pytest.raises(RuntimeError, match="broken reference"):
        build_with_fallback(fallback_plan("pallas", None), build)


def _generate(**kw):
    from jaxserve import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=TINY, load_format="dummy", seed=0, max_model_len=64, max_num_seqs=4,
             max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20, **kw) as llm:
        from jaxserve.loader.fp8 import kernels_in
        outs = llm.generate([{"prompt_token_ids": [5, 17, 300, 42]}], sp, use_tqdm=False)
        engine = llm.llm_engine
        return outs[0].outputs[0].token_ids, engine.attention_backend, kernels_in(engine.runner.weights)


def test_an_attention_kernel_that_fails_to_compile_falls_back_to_the_reference(monkeypatch, caplog):
    from jaxserve.pallas import paged_attention

    def broken(*args, **kwargs):
        raise RuntimeError("injected: ptxas fatal error")

    want, backend, _ = _generate(attention_backend="reference")
    assert backend == "reference"
    monkeypatch.setattr(paged_attention, "ragged_paged_attention", broken)
    caplog.set_level(logging.WARNING, "jaxserve.engine.fallback")
    got, backend, _ = _generate(attention_backend="pallas")
    assert backend == "reference" and got == want
    assert "attention pallas failed to compile" in caplog.text and "injected: ptxas" in caplog.text


def test_an_fp8_kernel_that_fails_to_compile_falls_back_to_the_xla_matmul(monkeypatch, caplog):
    from jaxserve.pallas import fp8_matmul

    want, attention, kernels = _generate(quantization="fp8", fp8_kernel="xla")
    assert kernels == {"xla"} and attention == "cpu"      # the CPU kernel: --dtype auto, one device

    def broken(*args, **kwargs):
        raise RuntimeError("injected: Mosaic GPU lowering failed")

    monkeypatch.setattr(fp8_matmul, "fp8_matmul_mgpu", broken)
    caplog.set_level(logging.WARNING, "jaxserve.engine.fallback")
    got, backend, kernels = _generate(quantization="fp8", fp8_kernel="mosaic")
    assert got == want and backend == attention and kernels == {"xla"}
    assert "fp8 matmul pallas failed" in caplog.text


def test_fp8_kernel_is_a_flag_with_its_choices():
    from jaxserve.config import EngineArgs
    from jaxserve.server.cli.main import build_parser
    with pytest.raises(ValueError, match="fp8_kernel must be one of"):
        EngineArgs(fp8_kernel="cutlass")
    args = build_parser().parse_args(["serve", "--fp8-kernel", "xla"])
    assert args.fp8_kernel == "xla"
