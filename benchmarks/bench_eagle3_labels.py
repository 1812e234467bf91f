"""EAGLE-3 training choices on the default model, judged by held-out acceptance without an engine
(`jaxserve.training.eagle3.acceptance`): token labels vs the target's top-k distributions
(`--distill-top-k`), the draft vocabulary's size, the learning rate, at the same training time.

    python benchmarks/bench_eagle3_labels.py [--cache DIR] [--seconds 290]
        [--variants tokens,distill,distill-8192,tokens-lr2e-3]
    python benchmarks/bench_eagle3_labels.py --variants tokens --epochs 6 --seconds 0 \
        --eval-at 300,600,900,1200,1500,1800      # held-out acceptance as training goes on

The data is made once and kept in DIR (default /tmp/jaxserve-eagle3-labels): the first 1,200
built-in prompts' greedy answers (96 tokens) with the target's top-16 at every position, and the
same for HELD_OUT, 40 hand-written chat prompts unlike the built-in templates (none of them
among the training prompts; `bench_eagle3.HELD_OUT` among them). Each variant then starts a head
from the target and trains it for `--seconds` (batch 4, 2 epochs' cosine schedule), and its mean
acceptance length with 3 chained drafts is measured on the held-out data and on 48 training
sequences. Prints a Markdown table and one JSON line per variant (and one per `--eval-at` step:
the held-out acceptance of the head so far; `--seconds 0`: no time limit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_eagle3 import HELD_OUT as BENCH_HELD_OUT  # noqa: E402

HELD_OUT = BENCH_HELD_OUT + [
    "How can I improve my handwriting?", "Write a letter to a friend who moved away.",
    "What is the difference between weather and climate?", "List five ways to save water at home.",
    "Why do leaves change color in the fall?", "Can you help me plan a birthday party for my sister?",
    "What makes a good teacher?", "Tell me a fun fact about octopuses and explain it.",
    "How do I start learning to draw?", "What happens when we dream?",
    "Write a haiku about the morning.", "Compare cats and dogs as pets.",
    "How should I prepare for a long hike?", "What is the water cycle?",
    "Give me advice for my first day at a new job.", "Why is reading books good for you?",
    "How do vaccines train the immune system?", "What is a healthy breakfast?",
    "Write a product description for a reusable water bottle.", "How do I make friends in a new city?",
    "Explain how a refrigerator keeps food cold.", "What are the planets in our solar system?",
    "Describe a busy market in the morning.", "How can students manage their time better?",
    "What is the best way to learn math?", "Write a thank-you note to a neighbor.",
    "Why do people celebrate new year?", "How does a seed grow into a plant?",
    "What should I pack for a beach vacation?", "Explain what a computer virus is.",
    "Tell me about the life of a honeybee colony.", "How do I stay calm before an exam?",
    "What are some fun things to do on a rainy day?", "Summarize the story of Cinderella.",
]
# name -> (distillation labels, draft vocabulary, learning rate)
VARIANTS = {"tokens": (False, 4096, 1e-3), "distill": (True, 4096, 1e-3),
            "distill-8192": (True, 8192, 1e-3), "tokens-lr2e-3": (False, 4096, 2e-3)}
TOP_K = 16


def _data(llm, prompts, path, aux_layer_ids):
    from jaxserve.training.eagle3 import Eagle3Data, generate_data
    if not os.path.exists(path):
        t0 = time.perf_counter()
        d = generate_data(llm, prompts, aux_layer_ids, soft_top_k=TOP_K)
        np.savez(path, **{k: v for k, v in dataclasses.asdict(d).items() if v is not None})
        print(f"{os.path.basename(path)}: {len(d)} sequences in {time.perf_counter() - t0:.0f} s", flush=True)
    z = np.load(path)
    return Eagle3Data(**{k: z[k] for k in z.files})


def _first(d, n: int):
    """The first n sequences of Eagle3Data d."""
    return dataclasses.replace(d, **{f.name: None if getattr(d, f.name) is None else getattr(d, f.name)[:n]
                                     for f in dataclasses.fields(d)})


def _concatenate(a, b):
    """Two Eagle3Data as one, each padded to the longer's length (pad: no answer, no label)."""
    L = max(a.tokens.shape[1], b.tokens.shape[1])

    def pad(x, fill):
        if x is None or x.shape[1] == L:
            return x
        width = [(0, 0), (0, L - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
        return np.pad(x, width, constant_values=fill)
    fills = dict(soft_logp=-1e9)
    return dataclasses.replace(a, **{
        f.name: None if getattr(a, f.name) is None else np.concatenate(
            [pad(getattr(a, f.name), fills.get(f.name, 0)), pad(getattr(b, f.name), fills.get(f.name, 0))])
        for f in dataclasses.fields(a)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default="/tmp/jaxserve-eagle3-labels")
    ap.add_argument("--seconds", type=float, default=290)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--epochs", type=int, default=2, help="the cosine schedule's length (default 2)")
    ap.add_argument("--eval-at", default="", help="steps (comma-separated) at which to measure held-out acceptance")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="train on the first N built-in prompts (default: train-eagle3's 1,200; those past "
                         "1,200 are cached in a file of their own)")
    a = ap.parse_args()
    names = a.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"--variants: {n!r} is not one of {', '.join(VARIANTS)}")
    import jax

    from jaxserve import LLM
    from jaxserve.models import eagle3, get_model
    from jaxserve.training import eagle3 as T
    os.makedirs(a.cache, exist_ok=True)
    llm = LLM(warmup=False, max_model_len=512, max_num_seqs=64, seed=0)
    cfg, weights = llm.llm_engine.runner.cfg, llm.llm_engine.runner.weights
    aux = eagle3.config_for(cfg).aux_layer_ids
    held = _data(llm, HELD_OUT, os.path.join(a.cache, "held_out.npz"), aux)
    train = _data(llm, T.default_prompts(T.DEFAULT_NUM_PROMPTS), os.path.join(a.cache, "train.npz"), aux)
    n = a.num_prompts or T.DEFAULT_NUM_PROMPTS
    if n < T.DEFAULT_NUM_PROMPTS:
        train = _first(train, n)
    elif n > T.DEFAULT_NUM_PROMPTS:
        more = _data(llm, T.default_prompts(n)[T.DEFAULT_NUM_PROMPTS:],
                     os.path.join(a.cache, f"train_{T.DEFAULT_NUM_PROMPTS}_{n}.npz"), aux)
        train = _concatenate(train, more)
    sample = _first(train, 48)
    print("| labels | draft vocabulary (held-out coverage) | lr | steps | held-out MAL | per position | "
          "training-sample MAL |\n| --- | --- | ---: | ---: | ---: | --- | ---: |")
    for name in names:
        distill, vocab, lr = VARIANTS[name]
        data = train if distill else dataclasses.replace(train, soft_ids=None, soft_logp=None)
        ecfg = eagle3.config_for(cfg, draft_vocab_size=vocab)
        head = T.new_head(ecfg, weights, get_model(cfg.architecture),
                          T.draft_vocabulary(data, vocab, cfg.vocab_size), jax.random.key(0))
        t2d = T.target_to_draft(head, cfg.vocab_size)
        coverage = float((t2d[held.tokens[held.answer > 0]] >= 0).mean())
        eval_at = {int(x) for x in a.eval_at.split(",") if x}

        def on_step(n, h, name=name, ecfg=ecfg, t2d=t2d, eval_at=eval_at):
            if n in eval_at:
                m = T.acceptance(h, held, t2d, ecfg=ecfg)
                print(json.dumps(dict(variant=name, step=n, held_out_mal=round(m["mean_acceptance_length"], 3),
                                      per_position=[round(x, 3) for x in m["per_position"]])), flush=True)
        head, log = T.train(ecfg, head, data, epochs=a.epochs, batch_size=4, learning_rate=lr,
                            time_limit_s=a.seconds or None, on_step=on_step if eval_at else None)
        h, s = T.acceptance(head, held, t2d, ecfg=ecfg), T.acceptance(head, sample, t2d, ecfg=ecfg)
        per = " / ".join(f"{x:.3f}" for x in h["per_position"])
        labels = f"top-{TOP_K} distillation" if distill else "tokens"
        print(f"| {labels} | {vocab} ({coverage:.3f}) | {lr:g} | "
              f"{log[-1]['step']} | {h['mean_acceptance_length']:.2f} | {per} | {s['mean_acceptance_length']:.2f} |")
        print(json.dumps(dict(variant=name, steps=log[-1]["step"], coverage=coverage, held_out=h, training=s)),
              flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
