"""KV-cache events (`--kv-events-config`): the block pool's stores, removals and clears published
over ZeroMQ in vLLM's wire format, decoded here with msgspec structs written from vLLM's schema
(`vllm/distributed/kv_events.py`), as llm-d's indexer decodes them. A subscriber that replays the
events rebuilds exactly the engine's set of cached block hashes, through evictions, preemption and
`reset_prefix_cache`; one that joined late catches up through the replay socket; every stored
block's hash can be recomputed from the event's token ids and parent."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from jaxserve.config import EngineArgs, KVEventsConfig
from jaxserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from jaxserve.engine.kv_event_publisher import END_OF_REPLAY, encode_batch

TINY = str(Path(__file__).resolve().parent / "data" / "tiny-llama")
Hash = bytes | int


# -- vLLM's schema (newer vLLM: events as maps tagged "type"; older: tagged arrays) -----------
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ABlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None


class ABlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None


class AAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[ABlockStored | ABlockRemoved | AAllBlocksCleared]
    data_parallel_rank: int | None = None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _apply(cached: set, batch) -> None:
    for e in batch.events:
        if isinstance(e, VBlockStored | ABlockStored):
            cached.update(e.block_hashes)
        elif isinstance(e, VBlockRemoved | ABlockRemoved):
            cached.difference_update(e.block_hashes)
        else:
            cached.clear()


# -- the wire ---------------------------------------------------------------------------------
@pytest.mark.parametrize("form, decoder", [("map", KVEventBatch), ("array", ArrayBatch)])
def test_both_wire_forms_decode_with_vllms_structs(form, decoder):
    events = [BlockStored([5, 6], None, list(range(8)), 4, lora_id=3, lora_name="a"),
              BlockRemoved([5]), AllBlocksCleared()]
    batch = msgspec.msgpack.decode(encode_batch(events, 12.5, 1, form, as_int=False), type=decoder)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 1
    stored, removed, cleared = batch.events
    assert stored.block_hashes == [(5).to_bytes(16, "big"), (6).to_bytes(16, "big")]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8))
    assert (stored.block_size, stored.lora_id, stored.lora_name, stored.medium) == (4, 3, "a", "GPU")
    assert removed.block_hashes == [(5).to_bytes(16, "big")] and removed.medium == "GPU"
    assert type(cleared).__name__.endswith("AllBlocksCleared")
    # without a data-parallel rank the batch is [ts, events]
    assert len(msgspec.msgpack.decode(encode_batch(events, 1.0))) == 2
    # vLLM's default: the low 64 bits of the hash as an unsigned int
    big = (7 << 100) | (2 ** 64 - 1)
    ints = msgspec.msgpack.decode(encode_batch([BlockRemoved([big])], 1.0, form=form), type=decoder)
    assert ints.events[0].block_hashes == [2 ** 64 - 1]
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the digest's bytes (sha256: 32)
    sha = (1 << 255) | 3
    raw = msgspec.msgpack.decode(encode_batch([BlockRemoved([sha])], 1.0, form=form, as_int=False,
                                              hash_bytes=32), type=decoder)
    assert raw.events[0].block_hashes == [sha.to_bytes(32, "big")]


@pytest.mark.parametrize("bad, field", [
    ({"publisher": "kafka"}, "publisher"), ({"buffer_steps": 0}, "buffer_steps"),
    ({"wire": "json"}, "wire"), ({"bogus": 1}, "bogus"), ({"enable_kv_cache_events": "yes"}, "enable"),
])
def test_bad_kv_events_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(kv_events_config=bad)


def test_an_endpoint_in_use_is_a_clear_error():
    from jaxserve.engine.kv_event_publisher import ZmqEventPublisher
    port = _port()
    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    try:
        with pytest.raises(ValueError, match="kv_events_config.endpoint"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
        with pytest.raises(ValueError, match="kv_events_config.replay_endpoint"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{_port()}",
                                             replay_endpoint=f"tcp://*:{port}"))
    finally:
        first.shutdown()


def test_defaults_follow_vllm():
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().publishes
    on = KVEventsConfig(enable_kv_cache_events=True)
    assert on.publisher == "zmq" and on.publishes and on.endpoint == "tcp://*:5557"


# -- end to end -------------------------------------------------------------------------------
def _reference_hasher(algo: str):
    """(parent digest or None, token ids) -> digest, written from each algorithm's definition
    here, not through jaxserve's code: "builtin" (xxh3-128 over the parent's 16 little-endian
    bytes and 8 bytes a token, the root a constant) and vLLM's sha256_cbor under
    PYTHONHASHSEED=0 (sha256 of the canonical CBOR of (parent, tokens, None), the root
    sha256(cbor("0")))."""
    import hashlib
    import struct

    import cbor2
    import xxhash
    if algo == "builtin":
        root = (0x6A6178736572766500000000000000).to_bytes(16, "big")

        def h(parent, tokens):
            p = int.from_bytes(parent or root, "big").to_bytes(16, "little")
            return xxhash.xxh3_128_digest(p + struct.pack(f"<{len(tokens)}q", *tokens))
        return h
    none = hashlib.sha256(cbor2.dumps("0", canonical=True)).digest()
    return lambda parent, tokens: hashlib.sha256(
        cbor2.dumps((parent or none, tuple(tokens), None), canonical=True)).digest()


@pytest.mark.parametrize("algo", ["builtin", "sha256_cbor"])
def test_a_subscriber_rebuilds_the_engines_cached_blocks_and_catches_up_by_replay(algo, monkeypatch):
    from jaxserve import LLM, SamplingParams
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    reference = _reference_hasher(algo)
    pub, replay = _port(), _port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    llm = LLM(model=TINY, load_format="dummy", max_model_len=128, block_size=4,
              num_gpu_blocks_override=40, max_num_seqs=4, max_num_batched_tokens=64, warmup=False,
              prefix_caching_hash_algo=algo,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                                "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"})
    engine = llm.llm_engine
    pool = engine.scheduler.kv_cache_manager.block_pool
    live: dict[int, bytes] = {}
    req = ctx.socket(zmq.DEALER)

    def drain(wait: float = 0.3) -> None:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if sub.poll(50):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                live[int.from_bytes(seq, "big")] = payload

    def engine_hashes() -> set:
        return {h & (2 ** 64 - 1) for h in pool.cached_block_hash_to_block}

    try:
        rng = random.Random(0)
        shared = [rng.randrange(3, 1000) for _ in range(24)]     # a 6-block common prefix
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for round_ in range(3):
            prompts = [{"prompt_token_ids": shared[:rng.randrange(8, 24)]
                        + [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 40))]}
                       for _ in range(8)]
            llm.generate(prompts, params, use_tqdm=False)
            drain()
            if round_ == 1:
                assert engine.reset_prefix_cache()
                drain()
        assert engine.stats().num_preemptions_total > 0, "the pool was meant to force preemption"
        # the live subscriber missed the first batches (it joined as the engine started): it
        # asks the replay socket for everything from 0, then applies all in order
        req.connect(f"tcp://127.0.0.1:{replay}")
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = {}
        while True:
            assert req.poll(5000), "no answer from the replay socket"
            _, seq, payload = req.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            replayed[int.from_bytes(seq, "big")] = payload
        assert sorted(replayed) == list(range(len(replayed))) and live
        assert all(replayed[s] == p for s, p in live.items())
        cached, stored, cleared, removed = set(), 0, 0, 0
        full = {}       # the 64-bit hash on the wire -> the chain's full digest, as recomputed
        for seq in sorted(replayed):
            batch = msgspec.msgpack.decode(replayed[seq], type=KVEventBatch)
            for e in batch.events:
                stored += isinstance(e, VBlockStored)
                removed += isinstance(e, VBlockRemoved)
                cleared += isinstance(e, VAllBlocksCleared)
                if isinstance(e, VBlockStored):
                    # an indexer recomputes each block's key from the token ids and the parent
                    parent = None if e.parent_block_hash is None else full[e.parent_block_hash]
                    for j, h in enumerate(e.block_hashes):
                        parent = reference(parent, e.token_ids[j * e.block_size:(j + 1) * e.block_size])
                        assert int.from_bytes(parent, "big") & (2 ** 64 - 1) == h
                        full[h] = parent
            _apply(cached, batch)
        assert stored and removed and cleared == 1
        assert cached == engine_hashes() and cached
    finally:
        llm.shutdown()
        sub.close(0)
        req.close(0)
        ctx.term()


# -- --prefix-caching-hash-algo ---------------------------------------------------------------
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_vllm_hash_algorithms_follow_vllms_definitions(algo, monkeypatch):
    """vLLM's `hash_block_tokens(hash_fn, parent, tokens, extra_keys)` = hash_fn((parent or
    NONE_HASH, tuple(tokens), extra_keys)), NONE_HASH = hash_fn(PYTHONHASHSEED), hash_fn sha256 /
    xxh3-128 over pickle (protocol HIGHEST) or canonical CBOR; LoRA adds (lora_name,)."""
    import hashlib
    import pickle

    import cbor2
    import xxhash

    from jaxserve.core.block_hash import BlockHasher
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    serialise = ((lambda v: cbor2.dumps(v, canonical=True)) if algo.endswith("cbor")
                 else (lambda v: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)))
    digest = (lambda b: hashlib.sha256(b).digest()) if algo.startswith("sha") else xxhash.xxh3_128_digest
    fn = lambda v: digest(serialise(v))       # noqa: E731
    none = fn("0")
    first = fn((none, (1, 2, 3, 4), None))
    second = fn((first, (5, 6, 7, 8), ("adapter",)))
    hasher = BlockHasher(algo)
    h1 = hasher(None, [1, 2, 3, 4])
    assert h1 == int.from_bytes(first, "big")
    assert hasher(h1, [5, 6, 7, 8], "adapter") == int.from_bytes(second, "big")
    if algo == "sha256_cbor":         # fixed vectors
        assert none.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        assert first.hex() == "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb"


def test_without_pythonhashseed_vllms_chains_start_from_a_random_root(monkeypatch):
    from jaxserve.core.block_hash import BlockHasher
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert BlockHasher("sha256")(None, [1, 2]) != BlockHasher("sha256")(None, [1, 2])
    assert BlockHasher("builtin")(None, [1, 2]) == BlockHasher("builtin")(None, [1, 2])


def test_the_hash_algo_flag_parses_and_bad_names_are_refused():
    from jaxserve.server.cli import main as cli
    ns = cli.build_parser().parse_args(["serve", "--prefix-caching-hash-algo", "sha256_cbor"])
    assert ns.prefix_caching_hash_algo == "sha256_cbor"
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineArgs(prefix_caching_hash_algo="md5")
