"""A tiny model quantized by llama.cpp's own quantizer to each of its presets (the files in
tests/data/gguf_presets, made by make.py there): kept quantized, it computes what the same file
read into f32 (`--quantization none`) computes, to f32 rounding, through the engine's matmul paths,
and every quantized tensor stays quantized (a preset's mixed stacks as `LayerMixWeight`s)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.layers.int4 import Int4Weight, with_fused_kernel, with_q8_rows
from jaxserve.layers.int4_layout import with_cpu_layout
from jaxserve.layers.layer_mix import LayerMixWeight
from jaxserve.layers.linear import DenseWeight
from jaxserve.loader.loader import load_model

sys.path.insert(0, str(Path(__file__).parent))
from helpers_paged import PagedRunner  # noqa: E402

gguf = pytest.importorskip("gguf")
FILES = sorted((Path(__file__).parent / "data" / "gguf_presets").glob("tiny-*.gguf"))
LAYER = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _logits(cfg, weights, ids):
    return PagedRunner(cfg, weights, block_size=4, num_blocks=32, max_blocks_per_seq=16).prefill_logits(ids)


def test_every_preset_file_is_here():
    assert {f.stem.removeprefix("tiny-") for f in FILES} == {"Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "IQ4_XS"}


@pytest.mark.parametrize("path", FILES, ids=lambda f: f.stem.removeprefix("tiny-"))
def test_preset_kept_quantized_computes_the_dequantized_model(path):
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    cfg, dense = load_model(path, "float32", quantization="none")
    _, kept = load_model(path, "float32", quantization="gguf")
    for name in LAYER:     # every matrix of the file stays quantized, mixed stacks too
        w = getattr(kept.layers, name)
        assert isinstance(w, (Int4Weight, LayerMixWeight)), (name, type(w))
        assert isinstance(getattr(dense.layers, name), DenseWeight)
    assert isinstance(kept.embed, Int4Weight)
    per_weight = sum(a.nbytes for a in jax.tree.leaves(kept)) / sum(a.nbytes for a in jax.tree.leaves(dense))
    assert per_weight < 0.36, per_weight         # at most ~1.25 bytes a weight (plus f32 norms) of f32's 4
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=21).tolist()
    want = _logits(cfg, dense, ids)
    scale = np.abs(want).max()
    np.testing.assert_allclose(_logits(cfg, kept, ids), want, rtol=0, atol=2e-5 * scale)
    from jaxserve.layers import int4_cpu
    if int4_cpu.load() is not None:
        return
    # the fused CPU kernel, f32 activations: the same numbers to f32 rounding
    fused = with_cpu_layout(with_fused_kernel(kept, max_rows=1 << 30))
    np.testing.assert_allclose(_logits(cfg, fused, ids), want, rtol=0, atol=2e-5 * scale)
    if int4_cpu.int8_dot() is None:
        return
    # --q8-activations: int8 activations (two parts a block to 16 rows, one from 17: llama.cpp's
    # Q8): the logits within the activations' rounding, greedy picks the same where the top two
    # are not near a tie
    q8 = with_q8_rows(with_cpu_layout(with_fused_kernel(kept, int8_x=True)))
    got = _logits(cfg, q8, ids)
    err = np.abs(got - want)
    assert err.max() <= 0.05 * scale and err.mean() <= 0.005 * scale, (err.max(), err.mean(), scale, sorted(types))
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * scale
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_q8_activations_by_default_from_a_billion_parameters(monkeypatch):
    """`--q8-activations` unset: llama.cpp's one-part int8 activations at every row count for a
    GGUF model of `Q8_AUTO_PARAMS` parameters or more, two parts (or bf16 tiles) below; an explicit
    on or off wins either way."""
    from jaxserve.layers import int4_cpu
    from jaxserve.loader import loader
    if int4_cpu.load() is not None or int4_cpu.int8_dot() is None or int4_cpu.amx():
        pytest.skip("needs the fused kernel with an integer dot product and no AMX kernel")
    path = FILES[0]

    def q8_rows(q8):
        _, w = load_model(path, "float32", quantization="gguf")
        leaves = jax.tree.leaves(loader.cpu_matmuls_for(w, "auto", q8=q8),
                                 is_leaf=lambda x: isinstance(x, Int4Weight))
        return {x.q8_min_rows for x in leaves if isinstance(x, Int4Weight)}
    _, w = load_model(path, "float32", quantization="gguf")
    params = loader.parameter_count(w)
    assert 100_000 < params < loader.Q8_AUTO_PARAMS
    assert q8_rows(None) == {None} and q8_rows(True) == {1}
    monkeypatch.setattr(loader, "Q8_AUTO_PARAMS", params)          # as if the model were that large
    assert q8_rows(None) == {1} and q8_rows(False) == {None}


def test_a_billion_parameter_gguf_on_the_cpu_gets_llama_cpps_16_bit_kv_cache(monkeypatch):
    """`--kv-cache-dtype auto` with a GGUF model of `Q8_AUTO_PARAMS` parameters or more on the CPU:
    bf16 pages (llama.cpp's f16 KV size), the same greedy tokens here as f32 pages; an explicit
    dtype wins; below the size, f32 pages."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.default_model import default_model_path
    from jaxserve.loader import loader
    path = str(FILES[0])
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(**kw):
        llm = LLM(model=path, tokenizer=str(default_model_path()), max_num_seqs=2, max_model_len=64, warmup=False,
                  **kw)                                             # (the tiny files carry no tokenizer)
        try:
            out = llm.generate([{"prompt_token_ids": [5, 9, 17, 3]}], sp, use_tqdm=False)[0].outputs[0].token_ids
            return llm.llm_engine.config_info()["cache"]["cache_dtype"], out
        finally:
            llm.llm_engine.shutdown()
    small = run()
    assert small[0] == "auto"
    monkeypatch.setattr(loader, "Q8_AUTO_PARAMS", 1000)                 # as if the model were that large
    large = run(q8_activations=False)
    assert large == ("bfloat16", small[1])
    assert run(q8_activations=False, kv_cache_dtype="int8")[0] == "int8"
