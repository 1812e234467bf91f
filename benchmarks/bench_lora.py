"""Multi-LoRA throughput on this CPU: tokens/s of one batch with 0 (base), 1, 4 and 8 distinct
adapters, side by side in one run.

    python benchmarks/bench_lora.py [--batch 32] [--max-tokens 64] [--rank 8] [--repeats 3]
        [--adapters 1,4,8] [--plain]

One engine (default model as served: its GGUF kept Q4_1; greedy, `enable_lora=True`, max_loras =
the largest count, prefix caching off so repeats do the same work) serves every configuration: the batch's prompts
are spread round-robin over the first N of 8 random rank-`--rank` adapters (PEFT checkpoints on
q/k/v/o/gate/up/down written to a temporary folder with numpy + safetensors), or run without an
adapter ("base"). Each configuration runs once to warm up (adapters into their device slots),
then the configurations alternate, best of `--repeats`; tokens/s = generated tokens / wall time
of `LLM.generate`. `--plain` adds an engine built without `enable_lora` (the base model with no
LoRA weights at all). Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve import LLM, LoRARequest, SamplingParams

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain why the sky is blue to a child.",
           "What are three good habits for staying healthy?", "Describe your ideal weekend.",
           "List five fruits and their colours.", "How does a bicycle work?",
           "Give me a recipe for pancakes.", "What is the capital of Japan and why is it famous?"]


def write_adapter(path: Path, cfg, rank: int, seed: int) -> Path:
    """A random PEFT LoRA checkpoint for the model config `cfg` (a jaxserve ModelConfig)."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    E, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"q_proj": (E, cfg.num_heads * D), "k_proj": (E, cfg.num_kv_heads * D),
              "v_proj": (E, cfg.num_kv_heads * D), "o_proj": (cfg.num_heads * D, E),
              "gate_proj": (E, F), "up_proj": (E, F), "down_proj": (F, E)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, kind in TARGETS.items():
            n_in, n_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{kind}.{name}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (n_out, rank)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
         "bias": "none", "use_dora": False, "use_rslora": False}))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--adapters", default="1,4,8", help="distinct adapter counts to run")
    ap.add_argument("--plain", action="store_true", help="also an engine without enable_lora")
    args = ap.parse_args()
    counts = [int(c) for c in args.adapters.split(",")]
    engine = dict(dtype="float32", max_model_len=512, max_num_seqs=args.batch, enable_prefix_caching=False,
                  compilation_cache_dir="")
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.batch)]
    best: dict[str, float] = {}

    def run(llm, name, loras):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
        rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
        best[name] = max(best.get(name, 0.0), rate)

    with tempfile.TemporaryDirectory() as tmp:
        with LLM(enable_lora=True, max_loras=max(counts), max_lora_rank=args.rank, **engine) as llm:
            cfg = llm.llm_engine.model_config
            adapters = [LoRARequest(f"bench{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, i)))
                        for i in range(max(counts))]
            configs = {"base": None} | {f"{n} adapter{'s' if n > 1 else ''}":
                                        [adapters[i % n] for i in range(args.batch)] for n in counts}
            for name, loras in configs.items():       # warm-up: programs, adapters into slots
                run(llm, name, loras)
            best.clear()
            for _ in range(args.repeats):
                for name, loras in configs.items():
                    run(llm, name, loras)
        if args.plain:
            with LLM(**engine) as plain:
                run(plain, "warm-up", None)
                for _ in range(args.repeats):
                    run(plain, "no LoRA engine", None)
                best.pop("warm-up")
    base = best["base"]
    print(f"\nbatch {args.batch} x {args.max_tokens} new tokens, rank {args.rank}, all 7 projections, "
          f"{platform.processor() or platform.machine()}, best of {args.repeats}\n")
    print("| configuration | tok/s | vs base |\n| --- | --- | --- |")
    for name, rate in best.items():
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |")
    print(json.dumps({"bench": "lora", "batch": args.batch, "max_tokens": args.max_tokens, "rank": args.rank,
                      "tok_s": {k: round(v, 2) for k, v in best.items()}}))


if __name__ == "__main__":
    main()
