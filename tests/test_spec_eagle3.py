"""EAGLE-3 speculative decoding (`speculative_config={"method": "eagle3", "model": DIR}`): the head
format (models/eagle3.py), the drafter (worker/head_runner.py) on the default model with a
random head written in the published format and loaded by path: greedy and seeded outputs equal
decoding without drafts, and the engine's drafts equal a reference that runs the head over the
whole sequence in one prefill (the feature/token shift, the catch-up over chunks and verified
drafts, the head's own KV)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_spec_draft_model import _run

from jaxserve.config import SpeculativeConfig
from jaxserve.sampling_params import SamplingParams

K = 3
DRAFT_VOCAB = 8192
COPY = ["Repeat exactly: the quick brown fox jumps over the lazy dog, twice.",
        "Rewrite this code with the variable x renamed to y:\n\ndef f(x):\n    x = x + 1\n"
        "    return x * 2\n"]
OPEN = ["Tell me about snow.", "Write a haiku about the sea."]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _target_config():
    from jaxserve.default_model import default_model_path
    from jaxserve.loader.gguf import read_gguf
    from jaxserve.loader.loader import gguf_config_of
    path = default_model_path()
    return gguf_config_of(path, read_gguf(path))


def _random_head(tmp_path, cfg, seed=0):
    """A random head with a draft vocabulary of DRAFT_VOCAB target ids (sorted, d2t offsets)."""
    from jaxserve.models import eagle3
    ecfg = eagle3.config_for(cfg, draft_vocab_size=DRAFT_VOCAB)
    ids = np.sort(np.random.default_rng(seed).choice(cfg.vocab_size, DRAFT_VOCAB, replace=False))
    w = eagle3.init(ecfg, jax.random.key(seed), draft_to_target=ids)
    # The target's features are large next to the embeddings: scaled down, the drafts turn on
    # the tokens and the head's attention over its KV too (what the engine tests check).
    w.fc.w = w.fc.w * 0.05
    eagle3.save(tmp_path, ecfg, w)
    return ecfg, ids


def test_config_takes_vllms_eagle3_line():
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                                        "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1})
    assert spec.method == "eagle3" and spec.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig(method="eagle3")
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        SpeculativeConfig(method="eagle3", model="x", draft_tensor_parallel_size=0)
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match="'eagle3' with nnodes > 1"):
        EngineArgs(nnodes=2, speculative_config={"method": "eagle3", "model": "x"})


def test_head_round_trips_in_the_published_format_and_bad_heads_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxserve.models import eagle3
    cfg = _target_config()
    ecfg, ids = _random_head(tmp_path / "h", cfg)
    hf = json.loads((tmp_path / "h" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["draft_vocab_size"] == DRAFT_VOCAB
    tensors = load_file(tmp_path / "h" / "model.safetensors")
    assert tensors["fc.weight"].shape == (cfg.hidden_size, 3 * cfg.hidden_size)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * cfg.hidden_size
    assert tensors["t2d"].sum() == DRAFT_VOCAB and (np.flatnonzero(tensors["t2d"]) == ids).all()
    loaded = eagle3.load(tmp_path / "h", eagle3.read_config(tmp_path / "h", cfg), jnp.float32)
    assert (np.arange(DRAFT_VOCAB) + np.asarray(loaded.d2t) == ids).all()
    # The other published spelling: `model.layers.0.` for `midlayer.`.
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "config.json").write_text(json.dumps(hf))
    save_file({k.replace("midlayer.", "model.layers.0."): v for k, v in tensors.items()},
              tmp_path / "v" / "model.safetensors")
    again = eagle3.load(tmp_path / "v", ecfg, jnp.float32)
    assert np.array_equal(np.asarray(again.layer.wq.w), np.asarray(loaded.layer.wq.w))
    # Refused, naming the field.
    bad = dict(tensors, **{"fc.weight": tensors["fc.weight"][:, :10]})
    save_file(bad, tmp_path / "v" / "model.safetensors")
    with pytest.raises(ValueError, match=r"speculative_config.model: fc.weight has shape"):
        eagle3.load(tmp_path / "v", ecfg, jnp.float32)
    with pytest.raises(ValueError, match="differs from the target"):
        eagle3.config_of(dict(hf, hidden_size=64), cfg)
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        eagle3.config_of(dict(hf, architectures=["LlamaForCausalLM"]), cfg)
    with pytest.raises(ValueError, match="must name layers"):
        eagle3.config_of(dict(hf, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 99]}), cfg)
    with pytest.raises(ValueError, match="not an EAGLE-3 head directory"):
        eagle3.read_config(tmp_path / "nowhere", cfg)


# -- the engine on the default model --------------------------------------------------------


@pytest.fixture(scope="module")
def eagle_llm(tmp_path_factory):
    from jaxserve import LLM
    head = tmp_path_factory.mktemp("eagle3")
    _random_head(head, _target_config())
    llm = LLM(warmup=False, max_model_len=512, max_num_batched_tokens=128, max_num_seqs=16,
              num_gpu_blocks_override=256, seed=0, dtype="float32",
              speculative_config={"method": "eagle3", "model": str(head),
                                  "num_speculative_tokens": K, "min_expected_accepted": 0})
    # Drafts run whenever offered (whether they pay is the proposer's business, measured).
    llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
    yield llm
    llm.shutdown()


def test_greedy_identical_alone_mixed_chunked_preempted_and_on_prefix_hits(eagle_llm, variant):
    engine = eagle_llm.llm_engine
    prompts = COPY + OPEN
    base = [o.token_ids for o in _run(eagle_llm, prompts, GREEDY, drafts=False)]
    before = engine.stats()
    assert [o.token_ids for o in _run(eagle_llm, prompts, GREEDY, drafts=True)] == base
    assert _run(eagle_llm, COPY[:1], GREEDY, drafts=True)[0].token_ids == base[0]
    assert engine.stats().spec_num_draft_tokens > before.spec_num_draft_tokens
    with variant(eagle_llm, num_blocks=9, max_num_batched_tokens=32) as sched:   # chunks, preempts
        tight = _run(eagle_llm, prompts, GREEDY, drafts=True)
        assert sched.num_preemptions_total > 0
    assert [o.token_ids for o in tight] == base
    with variant(eagle_llm, enable_prefix_caching=True) as sched:
        _run(eagle_llm, COPY, GREEDY, drafts=True)
        again = _run(eagle_llm, COPY, GREEDY, drafts=True)
        assert sched.prefix_cache_stats.hits > 0
    assert [o.token_ids for o in again] == base[:2]
    assert not engine.scheduler.kv_cache_manager.req_to_blocks


def test_seeded_sampling_identical_with_eagle3(eagle_llm):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, n=2),
              SamplingParams(temperature=0.8, min_p=0.05, seed=8, max_tokens=24, logprobs=2)]
    base = _run(eagle_llm, COPY, params, drafts=False)
    spec = _run(eagle_llm, COPY, params, drafts=True)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]


def test_structured_output_greedy_identical_with_eagle3(eagle_llm):
    from jaxserve.sampling_params import StructuredOutputsParams
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=32,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["Give me a person as JSON: Ada, 36."]
    base = _run(eagle_llm, prompts, params, drafts=False)[0]
    spec = _run(eagle_llm, prompts, params, drafts=True)[0]
    assert spec.token_ids == base.token_ids and json.loads(spec.text)["age"] == json.loads(base.text)["age"]


def test_warmup_compiles_the_heads_program_per_bucket_and_serving_compiles_nothing(eagle_llm):
    """The head's warm-up compiles one program per token bucket; with them (and the target's
    programs of a first identical run) serving with drafts compiles nothing."""
    from test_spec_draft_model import warmup_then_no_compile
    warmup_then_no_compile(eagle_llm, lambda runner, drafter: sorted(runner.buckets))


def test_drafts_equal_the_head_run_over_the_whole_sequence(eagle_llm, variant, monkeypatch):
    """Each step's drafts (after chunked prompts and verified drafts, most of them accepted)
    equal those proposed after one prefill of the same tokens: the head's KV, features and
    shifted tokens were right. The steps verify oracle drafts (the greedy continuation), so
    rows emit several tokens; the head's own drafts are what is compared."""
    engine = eagle_llm.llm_engine
    drafter = engine.runner.drafter
    batch = engine.runner.input_batch
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = eagle_llm.chat([[{"role": "user", "content": p}] for p in COPY], params, use_tqdm=False)
    full = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]

    def oracle(request_id, tokens):
        return next((f[len(tokens):len(tokens) + K] for f in full if f[:len(tokens)] == tokens), [])

    seen, propose = [], drafter.propose

    def recording(scheduled, sampled, lengths=None, batch_=None):
        out = propose(scheduled, sampled, lengths, batch_)
        for rid, d in out.items():
            r = batch.requests[rid]
            seen.append((tuple(r.prompt_token_ids + r.output_token_ids), tuple(d)))
        return out

    monkeypatch.setattr(drafter, "propose", recording)
    with variant(eagle_llm, max_num_batched_tokens=16, enable_prefix_caching=False):
        monkeypatch.setattr(engine.proposer, "propose", oracle)
        eagle_llm.chat([[{"role": "user", "content": p}] for p in COPY], params, use_tqdm=False)
        monkeypatch.undo()
        monkeypatch.setattr(drafter, "propose", recording)
        assert engine.stats().spec_num_accepted_tokens >= 10      # rows emitted several tokens
    steps = seen[:]
    seen.clear()
    # the same tokens in one prefill: the drafts after its first sampled token
    refs = eagle_llm.generate([{"prompt_token_ids": list(t[:-1])} for t, _ in steps],
                              SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert all(o.outputs[0].token_ids[0] == t[-1] for o, (t, _) in zip(refs, steps))
    reference = dict(seen)
    assert len(steps) >= 4
    # (a new request's first drafts may be shorter: the proposer's caution)
    agree = [reference[t][:len(d)] == d[:len(reference[t])] for t, d in steps]
    # f32 throughout; a chunked run and one prefill differ in the order of a few sums, so a
    # near-tie of the random head's logits may flip: nearly all must agree
    assert sum(agree) >= len(agree) - 1, (steps, reference)
    assert agree[0]


def test_with_dtype_auto_the_heads_matrices_take_the_fused_kernel_in_int8(tmp_path):
    """`--dtype auto` on one CPU device: the target's matmuls of a few rows take the fused CPU
    kernel, and the head's matrices, rounded to int8, take it too (a quarter of the bytes a draft
    reads); greedy output is still the target's."""
    from jaxserve import LLM
    from jaxserve.layers import int4_cpu
    from jaxserve.layers.int4 import Int4Weight
    if int4_cpu.load() is not None:
        pytest.skip(f"the fused CPU kernel does not build here: {int4_cpu.load()}")
    _random_head(tmp_path, _target_config())
    with LLM(warmup=False, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4,
             num_gpu_blocks_override=64, seed=0,
             speculative_config={"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": K,
                                 "min_expected_accepted": 0}) as llm:
        llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
        w = llm.llm_engine.runner.drafter.weights
        for m in (w.fc, w.lm_head, w.layer.wq, w.layer.wk, w.layer.wv, w.layer.wo, w.layer.w_gate,
                  w.layer.w_up, w.layer.w_down):
            assert isinstance(m, Int4Weight) and m.bits == 8 and m.fused_max_rows and m.col_block
        params = SamplingParams(temperature=0, max_tokens=16)
        # both runs with the prompts cached (test_spec_draft_model.py's random-draft test says why)
        _run(llm, COPY, params, drafts=False)
        base = [o.token_ids for o in _run(llm, COPY, params, drafts=False)]
        before = llm.llm_engine.stats().spec_num_draft_tokens
        assert [o.token_ids for o in _run(llm, COPY, params, drafts=True)] == base
        assert llm.llm_engine.stats().spec_num_draft_tokens > before


def test_eagle3_is_refused_for_a_family_without_features():
    import dataclasses

    from jaxserve.config import EngineArgs
    from jaxserve.engine.builder import load_eagle3_head
    cfg = dataclasses.replace(_target_config(), architecture="Gemma2ForCausalLM")
    spec = SpeculativeConfig(method="eagle3", model="x")
    with pytest.raises(ValueError, match="EAGLE-3 runs on the Llama family"):
        load_eagle3_head(EngineArgs(), spec, cfg, jnp.float32, 1)


# Runs in a process with 8 simulated devices: the tiny Llama (dummy weights) with a random head,
# greedy tokens without drafts and with EAGLE-3 at TP 1 and 2.
_TP_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    from jaxserve import LLM, SamplingParams
    from jaxserve.loader.loader import load_hf_config
    from jaxserve.models import eagle3
    from pathlib import Path
    tiny, head = sys.argv[1], sys.argv[2]
    ecfg = eagle3.config_for(load_hf_config(Path(tiny)), draft_vocab_size=512)
    w = eagle3.init(ecfg, jax.random.key(1))
    w.fc.w = w.fc.w * 0.05
    eagle3.save(head, ecfg, w)
    result = []
    for tp, spec in ((1, None), (1, head), (2, head)):
        cfg = spec and {"method": "eagle3", "model": spec, "num_speculative_tokens": 3,
                        "min_expected_accepted": 0, "draft_tensor_parallel_size": 1}
        with LLM(model=tiny, load_format="dummy", tensor_parallel_size=tp, max_model_len=128,
                 max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=32, seed=0,
                 warmup=False, compilation_cache_dir="", program_cache_dir="",
                 speculative_config=cfg) as llm:
            llm.llm_engine.runner.step_cost = lambda n: 1.0
            outs = llm.generate([{"prompt_token_ids": list(range(5, 30))}, {"prompt_token_ids": [7, 8, 9]}],
                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
            st = llm.llm_engine.stats()
            result.append(dict(tokens=[o.outputs[0].token_ids for o in outs],
                               drafted=st.spec_num_draft_tokens))
    print("RESULT" + json.dumps(result))
""")


def test_tensor_parallel_2_tokens_equal_one_device(tmp_path):
    tiny = Path(__file__).parent / "data" / "tiny-llama"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _TP_CHILD, str(tiny), str(tmp_path / "head")],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    plain, tp1, tp2 = json.loads(lines[0][len("RESULT"):])
    assert tp1["tokens"] == plain["tokens"] and tp2["tokens"] == plain["tokens"]
    assert tp1["drafted"] > 0 and tp2["drafted"] > 0
