"""Prefix-cache block hashes (`--prefix-caching-hash-algo`): a hash names a full block and, chained
through its parent's, the whole prefix up to it.

- "builtin" (the default): xxh3-128 over fixed-width bytes (the parent's 16 bytes, then each token
  id as 8 bytes), a LoRA adapter's name keying the chain's root: deterministic across processes
  and the fastest.
- vLLM's algorithms, with vLLM's definitions, so an external indexer that computes block keys from
  token ids as vLLM does (llm-d's, with the engines' PYTHONHASHSEED) finds jaxserve's:
  `hash_fn((parent, tuple(token_ids), extra_keys))` where `hash_fn` is sha256 over the pickle of
  the tuple ("sha256", vLLM's default), over its canonical CBOR ("sha256_cbor"), or xxh3-128 over
  either ("xxhash", "xxhash_cbor"); the parent of a sequence's first block is NONE_HASH,
  `hash_fn(PYTHONHASHSEED)` when that variable is set and 32 random bytes otherwise (as in vLLM:
  then no other process shares the chain); `extra_keys` is `(lora_name,)` under a LoRA adapter,
  else None.

Hashes are kept as ints everywhere (the digest read big-endian); `BlockHasher` turns a parent back
into its digest bytes.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct

import xxhash

from jaxserve.config import PREFIX_CACHING_HASH_ALGOS as HASH_ALGOS

ROOT_HASH = 0x6A6178736572766500000000000000   # "builtin": the parent of the first block ("jaxserve")


def builtin_hash(parent_hash: int, block_token_ids) -> int:
    """"builtin": the chained hash of one full block, H(parent_hash, tuple(block_token_ids))."""
    data = parent_hash.to_bytes(16, "little") + struct.pack(f"<{len(block_token_ids)}q", *block_token_ids)
    return xxhash.xxh3_128_intdigest(data)


def builtin_root(lora_name: str | None) -> int:
    """"builtin": the chain's parent of a request's first block, keyed on its LoRA adapter."""
    if lora_name is None:
        return ROOT_HASH
    return xxhash.xxh3_128_intdigest(ROOT_HASH.to_bytes(16, "little") + b"lora:" + lora_name.encode())


def _cbor(value) -> bytes:
    import cbor2
    return cbor2.dumps(value, canonical=True)


def _pickle(value) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


# vLLM's hash functions (vllm/utils/hashing.py): name -> (serialise, digest, digest bytes)
_VLLM = {
    "sha256": (_pickle, lambda b: hashlib.sha256(b).digest(), 32),
    "sha256_cbor": (_cbor, lambda b: hashlib.sha256(b).digest(), 32),
    "xxhash": (_pickle, xxhash.xxh3_128_digest, 16),
    "xxhash_cbor": (_cbor, xxhash.xxh3_128_digest, 16),
}


def vllm_hash_fn(algo: str):
    """vLLM's `get_hash_fn_by_name(algo)`: object -> digest bytes."""
    serialise, digest, _ = _VLLM[algo]
    return lambda value: digest(serialise(value))


class BlockHasher:
    """`hasher(parent, token_ids, lora_name)` -> the block's hash (an int); parent None for a
    sequence's first block."""

    def __init__(self, algo: str = "builtin"):
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")
        self.algo = algo
        self.digest_bytes = 16          # of a block's hash (the int's width in bytes)
        if algo == "builtin":
            return
        self._fn = vllm_hash_fn(algo)
        self.digest_bytes = _VLLM[algo][2]
        seed = os.environ.get("PYTHONHASHSEED")
        self.none_hash = os.urandom(32) if seed is None else self._fn(seed)

    def __call__(self, parent: int | None, token_ids, lora_name: str | None = None) -> int:
        if self.algo == "builtin":
            return builtin_hash(builtin_root(lora_name) if parent is None else parent, token_ids)
        parent_bytes = self.none_hash if parent is None else parent.to_bytes(self.digest_bytes, "big")
        extra = None if lora_name is None else (lora_name,)
        return int.from_bytes(self._fn((parent_bytes, tuple(token_ids), extra)), "big")
