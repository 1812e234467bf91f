"""`jaxserve quantize`: a calibrated FP8 checkpoint from a full-precision model.

`--quantization fp8` rounds each weight to its nearest e4m3 value at load time, as vLLM does.
This runs GPTQ instead (`loader/fp8_calibrate.py`): the roundings are chosen on calibration
tokens, once, offline. The result is written as a compressed-tensors "float-quantized" checkpoint,
the format llm-compressor's FP8 schemes write, with e4m3 weights and per-output-channel scales.
`jaxserve serve DIR` detects it from config.json, and other engines that read compressed-tensors
can load it too.

    jaxserve quantize OUT_DIR [MODEL] [--calibration-samples 64 --calibration-tokens 256]
        [--calibration-file corpus.txt|.jsonl] [--activations dynamic|none]

Calibration text: by default the model's own samples, drawn from its BOS token at temperature 1
(data-free, as LLM-QAT calibrates). Or a file: .jsonl lines with a "text" field, or plain text
with samples separated by blank lines. Samples are cut to `--calibration-tokens`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from jaxserve.llm import LLM
from jaxserve.loader.export import export_model
from jaxserve.loader.fp8_calibrate import calibrate_fp8
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ACTIVATIONS = ("dynamic", "none")


def read_calibration_file(path: str | os.PathLike) -> list[str]:
    """Texts of a calibration file: .jsonl ({"text": ...} per line) or plain text (blank-line
    separated samples). Raises ValueError naming the line that is not usable."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: expected a JSON object with a \"text\" field") from None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: \"text\" must be a string")
            texts.append(text)
    else:
        texts = [t.strip() for t in raw.split("\n\n") if t.strip()]
    if not texts:
        raise ValueError(f"{path}: no calibration text found")
    return texts


def calibration_sequences(llm: LLM, num_samples: int, num_tokens: int, *, texts=None,
                          seed: int = 0) -> list[list[int]]:
    """Token sequences to calibrate on: the first `num_samples` of `texts` encoded and cut to
    `num_tokens` (single-token ones dropped), or `num_samples` of the model's own samples of
    `num_tokens` tokens from its BOS token (temperature 1, one seed each)."""
    if num_samples < 1 or num_tokens < 2:
        raise ValueError(f"calibration needs num_samples >= 1 and num_tokens >= 2, got {num_samples} and "
                         f"{num_tokens}")
    tokenizer = llm.get_tokenizer()
    if texts is not None:
        seqs = [ids[:num_tokens] for ids in (tokenizer.encode(t) for t in texts)]
        seqs = [s for s in seqs if len(s) >= 2][:num_samples]
        if not seqs:
            raise ValueError("no calibration text is at least 2 tokens long")
        return seqs
    bos = llm.model_config.bos_token_id
    if bos is None:
        raise ValueError("the model has no BOS token to sample calibration text from: give --calibration-file")
    params = [SamplingParams(temperature=1.0, max_tokens=num_tokens - 1, ignore_eos=True, seed=seed + i)
              for i in range(num_samples)]
    outs = llm.generate([{"prompt_token_ids": [bos]}] * num_samples, params, use_tqdm=False)
    return [[bos, *o.outputs[0].token_ids] for o in outs]


def quantize_model(output_dir: str | os.PathLike, model: str | None = None, *, num_samples: int = 64,
                   num_tokens: int = 256, texts=None, activations: str = "dynamic", damp: float = 0.01,
                   seed: int = 0, dtype: str = "float32", load_format: str = "auto") -> list[str]:
    """Calibrate FP8 weights for `model` (default: the embedded one) and write the checkpoint
    to `output_dir`. `activations`: "dynamic" (W8A8 with per-token e4m3 activations, what FP8
    GPUs run) or "none" (W8A16, weights only: the most accurate). `dtype`: of the tensors that
    stay unquantised (embeddings, norms). Returns the file names written."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    llm = LLM(model, dtype="float32", max_model_len=max(num_tokens, 16), max_num_seqs=min(num_samples, 64),
              enable_prefix_caching=False, load_format=load_format, seed=seed, warmup=False,
              quantization="none")     # calibration reads full-precision matrices (a GGUF's dequantised)
    try:
        seqs = calibration_sequences(llm, num_samples, num_tokens, texts=texts, seed=seed)
        engine = llm.llm_engine
        logger.info("calibrating fp8 weights on %d sequences (%d tokens)", len(seqs), sum(map(len, seqs)))
        weights = calibrate_fp8(engine.model_config, engine.runner.weights, seqs, damp=damp,
                                activations=activations, kernel="xla")
        return export_model(output_dir, engine.model_config, engine.tokenizer, weights, dtype=dtype)
    finally:
        llm.shutdown()
