"""Greedy tokens of the seeded dummy tiny Llama (`tests/data/tiny-llama`, f32) computed on CPU,
written to `tests/data/tiny-llama/cpu_greedy.json`; the GPU suite carries the file and checks that
the engine on the GPU (XLA reference and Pallas backends) produces the same tokens.

    python benchmarks/make_cpu_tokens.py
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                    "tiny-llama")
SETTINGS = dict(load_format="dummy", seed=0, dtype="float32", max_model_len=256,
                kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=64)
NEW_TOKENS = 16


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 1000, n).tolist() for n in (5, 17, 40, 70)]


def greedy(llm) -> list[list[int]]:
    from jaxserve import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def main() -> int:
    from jaxserve import LLM
    with LLM(model=TINY, attention_backend="reference", **SETTINGS) as llm:
        tokens = greedy(llm)
    path = os.path.join(TINY, "cpu_greedy.json")
    with open(path, "w") as f:
        json.dump({"settings": SETTINGS, "new_tokens": NEW_TOKENS, "prompts": prompts(),
                   "tokens": tokens}, f)
        f.write("\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
