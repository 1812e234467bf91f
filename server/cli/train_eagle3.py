"""`jaxserve train-eagle3 [MODEL] --out DIR`: train an EAGLE-3 head for MODEL (default: the embedded
one) from the model's own answers to a prompt set, with optax (jaxserve/training/eagle3.py), and
write it in the published format: `serve MODEL --speculative-config '{"method": "eagle3",
"model": "DIR"}'` loads it like a downloaded head. The defaults finish within 10 minutes on a
2-core CPU (`--time-limit`: training stops where the budget ends, the head so far written)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="the target model (default: the embedded one)")
    p.add_argument("--out", required=True, help="the head's directory (config.json, model.safetensors)")
    p.add_argument("--prompts", default=None,
                   help="a text file of chat prompts, one per line (default: the built-in ones)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="train on the first N prompts (default: all of --prompts, or 1200 of the 2748 "
                        "built-in ones)")
    p.add_argument("--max-tokens", type=int, default=96, help="answer tokens per prompt (default 96)")
    p.add_argument("--max-len", type=int, default=256, help="tokens per training sequence (default 256)")
    p.add_argument("--draft-vocab-size", type=int, default=4096,
                   help="the head's vocabulary: the answers' most frequent tokens (default 4096)")
    p.add_argument("--epochs", type=int, default=3,
                   help="passes over the answers: the cosine schedule's length (default 3; --time-limit "
                        "may end it sooner)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per optimizer step (default 4)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="chained drafts trained per position (training-time test; default 3)")
    p.add_argument("--time-limit", type=float, default=570,
                   help="stop training once this many seconds have passed in all, data included (the "
                        "head so far is written; default 570, 0: no limit)")
    p.add_argument("--distill-top-k", type=int, default=0,
                   help="label each draft with the target's top-k next-token distribution instead of its "
                        "token (distillation; 0, the default: its tokens)")
    p.add_argument("--seed", type=int, default=0)


def run(ns: argparse.Namespace) -> int:
    from jaxserve.training.eagle3 import train_head
    prompts = None
    if ns.prompts is not None:
        prompts = [line.strip() for line in Path(ns.prompts).read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts: {ns.prompts} holds no prompt")
    for name in ("max_tokens", "max_len", "epochs", "batch_size", "ttt_steps", "num_prompts"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.distill_top_k < 0:
        raise ValueError(f"--distill-top-k must be >= 0 (0: the target's tokens as labels), got {ns.distill_top_k}")
    if ns.time_limit < 0:
        raise ValueError(f"--time-limit must be >= 0 (0: no limit), got {ns.time_limit}")
    if ns.num_prompts is not None:
        from jaxserve.training.eagle3 import default_prompts
        prompts = (default_prompts() if prompts is None else prompts)[:ns.num_prompts]
    report = train_head(ns.out, ns.model, prompts=prompts, max_tokens=ns.max_tokens, max_len=ns.max_len,
                        draft_vocab_size=ns.draft_vocab_size, epochs=ns.epochs, batch_size=ns.batch_size,
                        learning_rate=ns.learning_rate, steps=ns.ttt_steps, time_limit_s=ns.time_limit or None,
                        seed=ns.seed, distill_top_k=ns.distill_top_k)
    last = report["log"][-1] if report["log"] else {}
    print(json.dumps(dict(out=ns.out, seconds=report["total_seconds"], sequences=report["sequences"],
                          loss=last.get("loss"), first_draft_accuracy=last.get("accuracy"))))
    return 0
