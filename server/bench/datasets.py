"""Benchmark prompts, as vLLM's `--dataset-name random|sharegpt` make them.

`random`: prompts of exactly the requested token count (random token ids decoded, re-encoded and
trimmed until the round trip is stable), each asking for a fixed number of output tokens; lengths
vary by `--random-range-ratio` and a shared `--random-prefix-len` prefix leads every prompt.
`sharegpt`: the first human turn of each ShareGPT conversation as the prompt, the first answer's
token count as the output length (vLLM's filters: both at least 4 tokens, prompt at most 1024,
prompt + output at most 2048), sampled with the seed, repeated when the file has too few.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random

logger = logging.getLogger("jaxserve.bench")

DATASETS = ("random", "sharegpt")
# vLLM's ShareGPT filters (benchmarks/datasets.py: is_valid_sequence)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int              # tokens, by the benchmark's tokenizer (no special tokens)
    expected_output_len: int


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, *,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """`num_prompts` prompts of `prefix_len` + input tokens each: the input length is drawn from
    [input_len * (1 - range_ratio), input_len * (1 + range_ratio)], the output length likewise."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    prefix = [rng.choice(ids) for _ in range(prefix_len)]

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    out = []
    for _ in range(num_prompts):
        n_in, n_out = prefix_len + length(input_len), length(output_len)
        text = _exact_length_text(tokenizer, prefix + [rng.choice(ids) for _ in range(n_in - prefix_len)],
                                  n_in, ids, rng)
        out.append(SampleRequest(text, n_in, n_out))
    return out


def _exact_length_text(tokenizer, toks: list[int], n: int, ids: list[int], rng: random.Random) -> str:
    """A text that encodes to exactly n tokens, made from `toks` (decoding can merge or split
    tokens, so the ids are re-encoded, topped up and trimmed at the end until stable)."""
    for _ in range(10):
        text = tokenizer.decode(toks, skip_special_tokens=True)
        toks = tokenizer.encode(text, add_special_tokens=False)
        toks = (toks + [rng.choice(ids) for _ in range(n - len(toks))])[:n]
        text = tokenizer.decode(toks, skip_special_tokens=True)
        if len(tokenizer.encode(text, add_special_tokens=False)) == n:
            return text
    raise ValueError(f"--random-input-len: could not build a prompt of exactly {n} tokens with this tokenizer")


def sharegpt_requests(path: str, tokenizer, num_prompts: int, *, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """`num_prompts` requests from a ShareGPT-format JSON file; `output_len` overrides each
    conversation's answer length (then only the prompt's length is filtered)."""
    entries = read_sharegpt(path)
    rng = random.Random(seed)
    rng.shuffle(entries)
    out: list[SampleRequest] = []
    for prompt, answer in entries:
        if len(out) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_out = output_len if output_len is not None else len(tokenizer.encode(answer, add_special_tokens=False))
        if prompt_len < MIN_LEN or (output_len is None and n_out < MIN_LEN) or prompt_len > MAX_PROMPT_LEN \
                or prompt_len + n_out > MAX_TOTAL_LEN:
            continue
        out.append(SampleRequest(prompt, prompt_len, n_out))
    if not out:
        raise ValueError(f"--dataset-path {path}: no conversation fits vLLM's ShareGPT limits (prompt and answer "
                         f"of at least {MIN_LEN} tokens, prompt at most {MAX_PROMPT_LEN}, both at most "
                         f"{MAX_TOTAL_LEN})")
    if len(out) < num_prompts:      # vLLM's oversampling: repeat random picks to reach the count
        logger.info("--dataset-path %s has %d usable conversations; repeating some to make %d requests",
                    path, len(out), num_prompts)
        out += [rng.choice(out) for _ in range(num_prompts - len(out))]
    return out


def read_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, first answer) of each conversation with at least two turns; a clear
    ValueError naming --dataset-path when the file is missing or not ShareGPT-shaped."""
    if not os.path.isfile(path):
        raise ValueError(f"--dataset-path {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: not a readable JSON file: {e}") from None
    shape = ('a JSON list of {"conversations": [{"from": "human", "value": ...}, '
             '{"from": "gpt", "value": ...}]}')
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected ShareGPT's format, {shape}")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        values = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
        if all(isinstance(v, str) for v in values):
            pairs.append((values[0], values[1]))
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no conversation with two turns; expected {shape}")
    return pairs


def check_dataset_flags(ns) -> None:
    """Refuse dataset flags that cannot work before anything slow starts (a model load, a run)."""
    if ns.dataset_name == "sharegpt":
        if not ns.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file, e.g. "
                             "ShareGPT_V3_unfiltered_cleaned_split.json)")
        if not os.path.isfile(ns.dataset_path):
            raise ValueError(f"--dataset-path {ns.dataset_path}: no such file")
    elif ns.dataset_path:
        raise ValueError("--dataset-path is read with --dataset-name sharegpt only (--dataset-name is "
                         f"{ns.dataset_name!r})")


def sample_requests(ns, tokenizer) -> list[SampleRequest]:
    """The requests --dataset-name and its flags ask for (vLLM's flag names)."""
    check_dataset_flags(ns)
    if ns.dataset_name == "sharegpt":
        return sharegpt_requests(ns.dataset_path, tokenizer, ns.num_prompts,
                                 output_len=ns.sharegpt_output_len, seed=ns.seed or 0)
    return random_requests(tokenizer, ns.num_prompts, ns.random_input_len, ns.random_output_len,
                           range_ratio=ns.random_range_ratio, prefix_len=ns.random_prefix_len,
                           seed=ns.seed or 0)
