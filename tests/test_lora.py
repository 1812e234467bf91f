"""Multi-LoRA: PEFT adapters served through the whole offline path (`LLM(enable_lora=True)`,
scheduler, runner, sampler) against transformers + peft (CPU torch, f32): tiny random Llama and
Qwen3 checkpoints and the default model, one adapter, and a mixed batch of three adapters and the
base model in one step. Bad adapters are refused with the field named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from lora_helpers import ALL_TARGETS, hf_logprobs, hf_model, write_adapter, write_tiny  # noqa: E402

from jaxserve import LLM, LoRARequest, SamplingParams  # noqa: E402

ATOL = 1e-3
PROMPTS = [[3, 17, 42, 99, 5, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [200, 1, 2, 3], [9, 9, 9, 9, 9, 30, 31], [77, 66, 55, 44, 33, 22, 11, 100, 101]]


def _llm(model, **kw):
    return LLM(model=str(model), dtype="float32", enable_lora=True, max_model_len=128, max_num_seqs=8,
               warmup=False, compilation_cache_dir="",
               **({"max_loras": 4, "max_lora_rank": 8, "num_gpu_blocks_override": 64} | kw))


def _check(model, out, adapter):
    """Every prompt logprob and every sampled token's logprob equal transformers + peft's."""
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    ref = hf_logprobs(model, ids, adapter)
    got, want = [], []
    for j in range(1, len(out.prompt_token_ids)):
        got.append(out.prompt_logprobs[j][ids[j]].logprob)
        want.append(ref[j - 1, ids[j]])
    for k, lp in enumerate(out.outputs[0].logprobs):
        j = len(out.prompt_token_ids) + k
        got.append(lp[ids[j]].logprob)
        want.append(ref[j - 1, ids[j]])
    err = np.abs(np.array(got) - np.array(want)).max()
    assert err < ATOL, (adapter, err)
    return err


def _adapters(model, tmp_path):
    return [write_adapter(model, tmp_path / "a0", r=8, alpha=16, targets=("q_proj", "v_proj"), seed=1),
            write_adapter(model, tmp_path / "a1", r=4, alpha=8, targets=ALL_TARGETS, rslora=True, seed=2),
            write_adapter(model, tmp_path / "a2", r=2, alpha=4, targets=("o_proj", "gate_proj", "down_proj"),
                          seed=3)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_batch_of_three_adapters_and_base_matches_peft(tmp_path, family):
    base = write_tiny(tmp_path / "base", family)
    model = hf_model(base)
    paths = _adapters(model, tmp_path)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with _llm(base) as llm:
        # one adapter for every prompt
        for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False,
                                lora_request=loras[1]):
            _check(model, out, paths[1])
        # three adapters and the base model in the same steps
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False,
                            lora_request=[loras[0], None, loras[2], loras[1]])
        for out, adapter in zip(outs, [paths[0], None, paths[2], paths[1]]):
            _check(model, out, adapter)
        # the adapter changes the answer: the base model's logprobs differ
        base_out = llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, use_tqdm=False)[0]
        assert base_out.prompt_logprobs[5] != outs[0].prompt_logprobs[5]


def test_default_model_with_adapter_matches_peft(tmp_path):
    from jaxserve.default_model import default_model_path
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model = hf_model(path.parent, path.name)
    a = write_adapter(model, tmp_path / "smol", r=8, alpha=16, targets=ALL_TARGETS, seed=5)
    smol = LoRARequest("smol", 1, str(a))
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with LLM(dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2, max_model_len=256,
             num_gpu_blocks_override=64, warmup=False, compilation_cache_dir="") as llm:
        outs = llm.generate(["The capital of France is", "def add(a, b):"], sp, use_tqdm=False,
                            lora_request=[smol, None])
        _check(model, outs[0], a)
        _check(model, outs[1], None)
        # structured output under the adapter: the grammar holds, the chat path takes it too
        from jaxserve.sampling_params import StructuredOutputsParams
        so = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["Paris", "Lyon"]))
        got = llm.chat([{"role": "user", "content": "Capital of France?"}], so, use_tqdm=False,
                       lora_request=smol)[0].outputs[0].text
        assert got in ("Paris", "Lyon")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    base = write_tiny(tmp / "base")
    model = hf_model(base)
    good = write_adapter(model, tmp / "good", r=8, targets=("q_proj",))
    with _llm(base, max_lora_rank=4) as llm:
        yield llm, model, tmp, good


def _edit(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text()) | changes
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change,field", [
    ({}, "r"),                                        # rank 8 above max_lora_rank 4
    ({"r": 4, "use_dora": True}, "use_dora"),
    ({"r": 4, "target_modules": ["embed_tokens"]}, "target_modules"),
    ({"r": 4, "target_modules": ["lm_head", "q_proj"]}, "target_modules"),
    ({"r": 4, "bias": "all"}, "bias"),
])
def test_bad_adapter_config_is_refused_naming_the_field(served, change, field, tmp_path):
    llm, model, tmp, good = served
    bad = _edit(good, tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=field):
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("bad", 9, str(bad)))
    # the engine keeps serving
    assert llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_adapter_of_another_model_or_module_is_refused(served, tmp_path):
    import transformers
    llm, model, tmp, good = served
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    other = transformers.AutoModelForCausalLM.from_config(cfg)
    a = write_adapter(other, tmp_path / "other", r=4, targets=("q_proj",))
    with pytest.raises(ValueError, match="base_model_name_or_path"):
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("other", 10, str(a)))
    # a module the model has no LoRA-servable projection for (renamed tensors)
    from safetensors.numpy import load_file, save_file
    c = _edit(good, tmp_path / "renamed", r=8)
    t = load_file(str(c / "adapter_model.safetensors"))
    save_file({k.replace("q_proj", "qq_proj"): v[:4] if "lora_A" in k else v[:, :4] for k, v in t.items()},
              str(c / "adapter_model.safetensors"))
    _edit(c, tmp_path / "renamed4", r=4)
    with pytest.raises(ValueError, match="target_modules"):
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("renamed", 11, str(tmp_path / "renamed4")))
    with pytest.raises(ValueError, match="lora_path"):
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("missing", 12, str(tmp_path / "nowhere")))


def test_lora_request_fields_are_checked_and_need_enable_lora(llm, tmp_path):
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, str(tmp_path))
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, str(tmp_path))
    assert LoRARequest("x", 1, str(tmp_path)) == LoRARequest("x", 1, str(tmp_path))
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("x", 1, str(tmp_path)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    base = write_tiny(tmp / "base")
    model = hf_model(base)
    paths = _adapters(model, tmp)
    return base, model, paths, [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]


def test_chunked_prefill_and_preemption_under_adapters_match_peft(tiny):
    """16-token steps cut the 20-token prompt into chunks; 10 blocks of 4 tokens cannot hold all
    four requests' outputs, so some are preempted and recomputed, under their own adapter."""
    base, model, paths, loras = tiny
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    with _llm(base, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=10) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False,
                            lora_request=[loras[0], loras[1], None, loras[2]])
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for out, adapter in zip(outs, [paths[0], paths[1], None, paths[2]]):
        _check(model, out, adapter)


def test_ngram_drafts_are_verified_under_the_request_adapter(tiny):
    """Speculative decoding (n-gram drafts) gives the same greedy tokens as plain decoding under
    each request's adapter, and the logprobs of transformers + peft."""
    base, model, paths, loras = tiny
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 5}, {"prompt_token_ids": [9, 10, 11] * 6}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    which = [loras[1], loras[0]]
    with _llm(base) as llm:
        plain = llm.generate(prompts, sp, use_tqdm=False, lora_request=which)
    with _llm(base, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1}) as llm:
        spec = llm.generate(prompts, sp, use_tqdm=False, lora_request=which)
        assert llm.llm_engine.stats().spec_num_draft_tokens > 0
    for p, s, adapter in zip(plain, spec, [paths[1], paths[0]]):
        assert p.outputs[0].token_ids == s.outputs[0].token_ids
        _check(model, s, adapter)


def test_draft_model_drafts_are_verified_under_the_request_adapter(tiny):
    """A draft model proposes without any adapter (it is the base model here, so its drafts are
    the base model's greedy tokens); the target verifies them under each request's adapter: the
    greedy tokens are those of plain decoding under the adapter, the logprobs those of peft."""
    base, model, paths, loras = tiny
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[3]}, {"prompt_token_ids": PROMPTS[1]}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    which = [loras[1], loras[0], None]
    with _llm(base) as llm:
        plain = llm.generate(prompts, sp, use_tqdm=False, lora_request=which)
    with _llm(base, speculative_config={"model": str(base), "num_speculative_tokens": 3}) as llm:
        spec = llm.generate(prompts, sp, use_tqdm=False, lora_request=which)
        stats = llm.llm_engine.stats()
    # some drafts rejected (the adapters change the greedy tokens), the base request's all accepted
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    for p, s, adapter in zip(plain, spec, [paths[1], paths[0], None]):
        assert p.outputs[0].token_ids == s.outputs[0].token_ids
        _check(model, s, adapter)


def test_eagle3_drafts_are_verified_under_the_request_adapter(tiny, tmp_path):
    """An EAGLE-3 head drafts from the target's features without the adapter's own view of
    the draft tokens; the target verifies under each request's adapter: greedy tokens equal
    plain decoding under the adapter, the logprobs those of peft."""
    import jax

    from jaxserve.models import eagle3
    base, model, paths, loras = tiny
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": PROMPTS[1]}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    which = [loras[0], None, loras[2]]
    with _llm(base) as llm:
        plain = llm.generate(prompts, sp, use_tqdm=False, lora_request=which)
        cfg = llm.llm_engine.model_config
    ecfg = eagle3.config_for(cfg, draft_vocab_size=128)
    ids = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, 128, replace=False))
    eagle3.save(tmp_path / "head", ecfg, eagle3.init(ecfg, jax.random.key(0), draft_to_target=ids))
    with _llm(base, speculative_config={"method": "eagle3", "model": str(tmp_path / "head"),
                                        "num_speculative_tokens": 3, "min_expected_accepted": 0}) as llm:
        llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
        spec = llm.generate(prompts, sp, use_tqdm=False, lora_request=which)
        assert llm.llm_engine.stats().spec_num_draft_tokens > 0
    for p, s, adapter in zip(plain, spec, [paths[0], None, paths[2]]):
        assert p.outputs[0].token_ids == s.outputs[0].token_ids
        _check(model, s, adapter)
