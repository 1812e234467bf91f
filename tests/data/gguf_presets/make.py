"""Regenerate the small GGUF files beside this script: one tiny random-weight Llama (hidden 256,
3 layers, ffn 256, 128-token vocabulary, no tokenizer; 256 inputs: the K-quants' super-block)
quantized by llama.cpp's own quantizer to each preset in PRESETS, as a user's downloaded file
would be. A preset mixes types (Q4_K_M keeps some layers' attn_v and ffn_down in Q6_K, Q2_K some
in Q3_K/Q4_K, ...); three layers, so that llama.cpp's "more bits" layers are some and not all of
them. The other types (Q5_0, Q5_1, Q6_K, Q8_0, IQ4_NL, MXFP4) are checked block by block in
tests/test_gguf_quant.py; ~3.6 MB in all. Read by tests/test_gguf_presets.py; the quantizer is a
tool here, never a dependency.

    PEER_PYTHON=/tmp/peer/venv/bin/python python tests/data/gguf_presets/make.py

(the peer venv of ../shared/peers/README.md: llama-cpp-python 0.3.36 and gguf).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
PRESETS = ("Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "IQ4_XS")
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 3, 4, 1, 256, 128

_QUANTIZE = r"""
import sys, llama_cpp as L
src, dst, name = sys.argv[1:4]
p = L.llama_model_quantize_default_params(); p.ftype = getattr(L, "LLAMA_FTYPE_MOSTLY_" + name); p.nthread = 2
sys.exit(L.llama_model_quantize(src.encode(), dst.encode(), p))
"""


def write_f16(path: Path) -> None:
    import gguf
    rng = np.random.default_rng(0)
    D = HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(D)

    def t(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float16)
    w.add_tensor("token_embd.weight", t(VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + name + ".weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(p + "attn_q.weight", t(HEADS * D, HIDDEN))
        w.add_tensor(p + "attn_k.weight", t(KV_HEADS * D, HIDDEN))
        w.add_tensor(p + "attn_v.weight", t(KV_HEADS * D, HIDDEN))
        w.add_tensor(p + "attn_output.weight", t(HIDDEN, HEADS * D))
        w.add_tensor(p + "ffn_gate.weight", t(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", t(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", t(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    peer = os.environ.get("PEER_PYTHON")
    if not peer:
        sys.exit("set PEER_PYTHON to a Python with llama-cpp-python (the quantizer)")
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "tiny-f16.gguf"
        write_f16(f16)
        for preset in PRESETS:
            out = HERE / f"tiny-{preset}.gguf"
            done = subprocess.run([peer, "-c", _QUANTIZE, str(f16), str(out), preset], capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{preset}: {(done.stderr or done.stdout)[-1500:]}")
            print(f"{out.name}: {out.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
