"""The subcommands that load a model in this process, no server: `generate` (a quick offline
check), `export-model` (a model as a Hugging Face directory) and `quantize` (a calibrated FP8
checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from jaxserve.config import EngineArgs
from jaxserve.server.cli.flags import add_engine_args, engine_args_from


# -- generate (quick offline check) -----------------------------------------------------------
def generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+", metavar="PROMPT",
                   help="Prompt text; several prompts (each quoted) are generated together. "
                        "The model is --model, never a positional.")
    p.add_argument("--chat", action="store_true", help="Wrap each prompt in the chat template.")
    p.add_argument("--max-tokens", type=int, default=64, help="(default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="(default: 0, off)")
    p.add_argument("--config", default=None, help="YAML file of flag values.")
    add_engine_args(p, model_positional=False)


def _looks_like_a_model(text: str) -> bool:
    path = os.path.expanduser(text)
    return (path.endswith(".gguf") and os.path.isfile(path)) or \
        os.path.isfile(os.path.join(path, "config.json"))


def generate_inputs(ns: argparse.Namespace) -> tuple[EngineArgs, list[str]]:
    """`generate [--model MODEL] PROMPT...`: every positional is a prompt. A first positional
    that names a model on disk (the old `generate MODEL PROMPT` form) is refused, not generated
    from as text."""
    if not ns.model and _looks_like_a_model(ns.prompts[0]):
        ns._subparser.error(f"{ns.prompts[0]!r} is a model: pass it as --model, e.g. jaxserve generate "
                            f"--model {ns.prompts[0]} \"Once upon a time\"")
    return engine_args_from(ns), list(ns.prompts)


def generate(ns: argparse.Namespace) -> int:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    args, prompts = generate_inputs(ns)
    # warmup=False: a one-shot run compiles the step shapes its prompts meet, not every bucket
    llm = LLM(**dataclasses.asdict(args), warmup=False)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, top_k=ns.top_k)
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    if len(prompts) == 1:
        print(outs[0].outputs[0].text)
    else:                   # vLLM's offline examples print the same
        for prompt, out in zip(prompts, outs):
            print(f"Prompt: {prompt!r}, Generated text: {out.outputs[0].text!r}")
    llm.shutdown()
    return 0


# -- export-model -------------------------------------------------------------------------------
def export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="Where to write the Hugging Face files.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="HF directory, .gguf file or Hub name org/name (default: the embedded "
                        "SmolLM2-135M-Instruct).")
    p.add_argument("--no-weights", action="store_true",
                   help="Write config, generation config and tokenizer files only.")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of model.safetensors (default: float32, exact for GGUF).")


def export(ns: argparse.Namespace) -> int:
    from jaxserve.default_model import default_model_path
    from jaxserve.loader.export import export_model
    from jaxserve.loader.gguf import read_gguf
    from jaxserve.loader.loader import load_model
    from jaxserve.tokenizer.tokenizer import Tokenizer
    path = ns.model_tag or str(default_model_path())
    reader = read_gguf(path) if path.endswith(".gguf") else None
    tokenizer = Tokenizer.from_gguf(reader) if reader is not None else Tokenizer.from_model(path)
    cfg, weights = load_model(path, "float32", gguf_reader=reader)
    files = export_model(ns.directory, cfg, tokenizer, None if ns.no_weights else weights,
                         dtype=ns.dtype)
    print(f"wrote {', '.join(files)} to {ns.directory}")
    return 0


# -- quantize ---------------------------------------------------------------------------------
def quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="Where to write the FP8 checkpoint.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
    p.add_argument("--calibration-samples", type=int, default=64,
                   help="Sequences to calibrate on (default: 64).")
    p.add_argument("--calibration-tokens", type=int, default=256,
                   help="Tokens per calibration sequence (default: 256).")
    p.add_argument("--calibration-file", default=None,
                   help="Calibration text: .jsonl with a \"text\" field per line, or plain text with samples "
                        "separated by blank lines (default: the model's own samples from its BOS token).")
    p.add_argument("--activations", choices=["dynamic", "none"], default="dynamic",
                   help="dynamic: W8A8 with per-token e4m3 activations (FP8 GPUs); none: W8A16, weights "
                        "only (default: dynamic).")
    p.add_argument("--damp", type=float, default=0.01,
                   help="GPTQ dampening, a fraction of the Hessian's mean diagonal (default: 0.01).")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the tensors left unquantised: embeddings, norms, lm_head.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")


def quantize(ns: argparse.Namespace) -> int:
    from jaxserve.quantize import quantize_model, read_calibration_file
    try:
        texts = read_calibration_file(ns.calibration_file) if ns.calibration_file else None
        files = quantize_model(ns.directory, ns.model_tag, num_samples=ns.calibration_samples,
                               num_tokens=ns.calibration_tokens, texts=texts, activations=ns.activations,
                               damp=ns.damp, seed=ns.seed, dtype=ns.dtype, load_format=ns.load_format)
    except (OSError, ValueError) as e:
        print(f"jaxserve quantize: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(files)} to {ns.directory}; serve it with: jaxserve serve {ns.directory}")
    return 0
