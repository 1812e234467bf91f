"""DeepSeek multi-token prediction (`speculative_config={"method": "mtp"}`, models/mtp.py): the
checkpoint's next-token layer drafts, run by the EAGLE-3 runner (worker/head_runner.py).

A tiny random DeepSeek V3 checkpoint (test_deepseek's "v3": q_lora, sigmoid routing with the
correction bias, YaRN) written with transformers, plus the MTP layer as V3 ships it
(`model.layers.{N}.` with enorm, hnorm, eh_proj, an MoE decoder layer, shared_head, a copy of the
embedding) and `num_nextn_predict_layers: 1`. Target and layer both score against the embedding
(lm_head = 3 x embed, eh_proj passing the token's embedding), so the target often repeats a
token and the drafts are accepted and rejected alike. Checked:
  - greedy tokens equal decoding without drafts, alone, mixed, chunked and preempted, on prefix
    hits; seeded sampling unchanged; TP 2 (and TP 2 with expert parallelism) tokens equal TP 1;
  - the acceptance counters (drafts, accepted, per position) equal what the verified drafts and
    the final tokens imply;
  - the engine's drafts equal a torch reference of vLLM's DeepSeekMTP (transformers'
    DeepseekV3DecoderLayer with enorm / hnorm / eh_proj / shared_head) run over the whole sequence;
  - the warm-up compiles the layer's program per token bucket and serving compiles nothing;
  - under a LoRA adapter the target verifies the (unadapted) drafts: greedy tokens unchanged;
  - a block-FP8 checkpoint (V3's format) loads the layer's projections as FP8;
  - configs: "deepseek_mtp" is "mtp", `model` defaults to the target, refusals name the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_deepseek import FAMILIES, VOCAB  # noqa: E402
from test_spec_draft_model import _run  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.config import SpeculativeConfig  # noqa: E402

pytestmark = pytest.mark.slow

K = 3
PROMPTS = [np.random.default_rng(s).integers(3, VOCAB, size=n).tolist() for s, n in enumerate((7, 40, 130))] \
    + [[5] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def write_checkpoint(path, seed: int = 0, copying: bool = True):
    """The tiny V3 checkpoint with its MTP layer; returns (torch model, torch MTP modules).
    `copying`: the MTP layer leans towards its input token as the target does (drafts accepted
    and rejected alike); else it is random throughout (its drafts turn on every part of it)."""
    from safetensors.torch import save_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    from jaxserve.tokenizer.tokenizer import Tokenizer
    path = Path(path)
    config = transformers.DeepseekV3Config(**FAMILIES["v3"][2], num_nextn_predict_layers=1)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    N, E, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
    mtp = torch.nn.ModuleDict(dict(
        enorm=m.DeepseekV3RMSNorm(E, eps), hnorm=m.DeepseekV3RMSNorm(E, eps),
        eh_proj=torch.nn.Linear(2 * E, E, bias=False), block=m.DeepseekV3DecoderLayer(config, N),
        norm=m.DeepseekV3RMSNorm(E, eps), head=torch.nn.Linear(E, VOCAB, bias=False))).float().eval()
    with torch.no_grad():
        for module in (model, mtp):
            for name, p in module.named_parameters():
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            for name, b in module.named_buffers():
                if "e_score_correction_bias" in name:
                    b.copy_(0.1 * torch.randn_like(b))
        emb = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(3 * emb)
        if copying:
            mtp["head"].weight.copy_(3 * emb)
            mtp["eh_proj"].weight[:, :E].copy_(torch.eye(E))
    model.save_pretrained(path, safe_serialization=True)
    Tokenizer.synthetic(VOCAB, config.eos_token_id).backend.save(str(path / "tokenizer.json"))
    pre = f"model.layers.{N}."
    tensors = {}
    for k, v in mtp["block"].state_dict().items():
        if k == "mlp.experts.gate_up_proj":      # transformers' fused experts -> the per-expert names
            F = v.shape[1] // 2
            for x in range(v.shape[0]):
                tensors[pre + f"mlp.experts.{x}.gate_proj.weight"] = v[x, :F]
                tensors[pre + f"mlp.experts.{x}.up_proj.weight"] = v[x, F:]
        elif k == "mlp.experts.down_proj":
            for x in range(v.shape[0]):
                tensors[pre + f"mlp.experts.{x}.down_proj.weight"] = v[x]
        else:
            tensors[pre + k] = v
    for k in ("enorm", "hnorm", "eh_proj"):
        tensors[pre + k + ".weight"] = mtp[k].weight.detach()
    tensors[pre + "shared_head.norm.weight"] = mtp["norm"].weight.detach()
    tensors[pre + "shared_head.head.weight"] = mtp["head"].weight.detach()
    tensors[pre + "embed_tokens.weight"] = emb.detach().clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model-mtp.safetensors"))
    return model, mtp


def _llm(path, **kw):
    spec = {"method": "mtp", "num_speculative_tokens": K, "min_expected_accepted": 0}
    kw = dict(dict(max_num_batched_tokens=512, enable_prefix_caching=True), **kw)
    return LLM(model=str(path), dtype="float32", max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=128,
               block_size=16, warmup=False, compilation_cache_dir="", seed=0, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def mtp_case(tmp_path_factory):
    """(checkpoint dir, torch model, torch MTP modules, LLM with MTP drafts)."""
    path = tmp_path_factory.mktemp("v3-mtp")
    model, mtp = write_checkpoint(path)
    llm = _llm(path)
    # Drafts run whenever offered (whether they pay is the proposer's business, measured).
    llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
    yield path, model, mtp, llm
    llm.shutdown()


def _gen(llm, prompts, params, *, drafts: bool, **kw):
    return [c.token_ids for c in _run(llm, prompts, params, drafts=drafts, **kw)]


def test_config_names_and_refusals(tmp_path):
    from jaxserve.config import EngineArgs
    from jaxserve.models import mtp
    spec = SpeculativeConfig.from_dict({"method": "deepseek_mtp", "num_speculative_tokens": 1})
    assert spec.method == "mtp" and spec.model is None
    assert SpeculativeConfig(method="deepseek_mtp").method == "mtp"
    assert SpeculativeConfig.from_dict({"method": "mtp"}).num_speculative_tokens == 1     # vLLM's default
    assert SpeculativeConfig.from_dict({"method": "mtp", "model": "deepseek-ai/DeepSeek-V3"}).model
    with pytest.raises(ValueError, match="'mtp' with nnodes > 1"):
        EngineArgs(nnodes=2, speculative_config={"method": "mtp"})
    path = tmp_path / "ck"
    write_checkpoint(path)
    from jaxserve.loader.loader import load_hf_config
    target = load_hf_config(path)
    hf = json.loads((path / "config.json").read_text())
    mcfg = mtp.config_of(hf, target)
    assert mcfg.layer_index == 3 and mcfg.model.num_layers == 1
    assert mcfg.model.moe.sparse_layers(1) == (0,)      # layer 3 of a first_k_dense_replace=1 model
    with pytest.raises(ValueError, match="no multi-token prediction layer"):
        mtp.config_of(dict(hf, num_nextn_predict_layers=0), target)
    with pytest.raises(ValueError, match="hidden_size / num_hidden_layers"):
        mtp.config_of(dict(hf, num_hidden_layers=61), target)
    with pytest.raises(ValueError, match="runs on DeepSeek V3"):
        LLM(speculative_config={"method": "mtp"}, warmup=False)      # the default model: Llama
    with pytest.raises(ValueError, match="load_format 'dummy' has none"):
        _llm(path, load_format="dummy")


def test_greedy_identical_alone_mixed_chunked_preempted_and_on_prefix_hits(mtp_case, variant):
    _, _, _, llm = mtp_case
    engine = llm.llm_engine
    base = _gen(llm, PROMPTS, GREEDY, drafts=False)
    before = engine.stats()
    assert _gen(llm, PROMPTS, GREEDY, drafts=True) == base
    assert _gen(llm, PROMPTS[3:], GREEDY, drafts=True) == base[3:]
    after = engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted      # accepted and rejected drafts alike
    with variant(llm, num_blocks=14, max_num_batched_tokens=32) as sched:   # chunks, preempts
        tight = _gen(llm, PROMPTS, GREEDY, drafts=True)
        assert sched.num_preemptions_total > 0
    assert tight == base
    with variant(llm, enable_prefix_caching=True) as sched:
        _gen(llm, PROMPTS, GREEDY, drafts=True)
        again = _gen(llm, PROMPTS, GREEDY, drafts=True)
        assert sched.prefix_cache_stats.hits > 0
    assert again == base
    assert not engine.scheduler.kv_cache_manager.req_to_blocks


def test_seeded_sampling_identical_with_mtp(mtp_case):
    _, _, _, llm = mtp_case
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, n=2, ignore_eos=True),
              SamplingParams(temperature=0.8, min_p=0.05, seed=8, max_tokens=16, logprobs=2, ignore_eos=True)]
    assert _gen(llm, PROMPTS[:2], params, drafts=True) == _gen(llm, PROMPTS[:2], params, drafts=False)


def test_acceptance_counters_equal_the_verified_drafts(mtp_case, monkeypatch):
    """Every verification's accepted count is the longest prefix of its drafts that the final
    tokens continue with: the counters (drafts, draft tokens, accepted, per position) add up."""
    _, _, _, llm = mtp_case
    engine = llm.llm_engine
    verified, schedule = [], engine.scheduler.schedule

    def recording(*args, **kw):
        out = schedule(*args, **kw)
        for row in out.scheduled:
            if row.spec_token_ids:
                at = row.num_computed_tokens + len(row.token_ids) - len(row.spec_token_ids)
                verified.append((row.request_id, at, list(row.spec_token_ids)))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    before = engine.stats()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    after = engine.stats()
    full = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    per_pos = [0] * K
    accepted = 0
    for rid, at, drafts in verified:
        n = 0
        while n < len(drafts) and at + n < len(full[rid]) and full[rid][at + n] == drafts[n]:
            n += 1
        accepted += n
        for i in range(n):
            per_pos[i] += 1
    assert after.spec_num_drafts - before.spec_num_drafts == len(verified) > 0
    assert after.spec_num_draft_tokens - before.spec_num_draft_tokens == sum(len(d) for _, _, d in verified)
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == accepted > 0
    pos = [a - b for a, b in zip(after.spec_num_accepted_tokens_per_pos,
                                 list(before.spec_num_accepted_tokens_per_pos) + [0] * K)]
    assert pos[:K] == per_pos and per_pos[0] >= per_pos[1] >= per_pos[2]


def _reference_drafts(model, mtp, tokens: list[int], k: int) -> list[int]:
    """vLLM's DeepSeekMTP over the whole sequence in torch: position p reads the target's final
    hidden state at p and the embedding of token p + 1 (zeroed at position 0); chained drafts
    feed the layer's output back."""
    n = len(tokens)
    with torch.no_grad():
        ids = torch.tensor([tokens[:n - 1]])
        hidden = model.model(input_ids=ids).last_hidden_state[0]          # after the final norm
        features, inputs, drafts = list(hidden), list(tokens[1:]), []
        for _ in range(k):
            T = len(inputs)
            pos = torch.arange(T)[None]
            emb = model.model.embed_tokens(torch.tensor([inputs]))[0]
            emb[0] = 0
            x = mtp["eh_proj"](torch.cat([mtp["enorm"](emb), mtp["hnorm"](torch.stack(features))], -1))[None]
            cos_sin = model.model.rotary_emb(x, pos)
            mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
            out = mtp["block"](x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            out = out[0] if isinstance(out, tuple) else out
            last = out[0, -1]
            drafts.append(int(mtp["head"](mtp["norm"](last)).argmax()))
            features.append(last)
            inputs.append(drafts[-1])
    return drafts


def test_drafts_equal_a_torch_reference_of_vllms_mtp(tmp_path, monkeypatch):
    """Each step's drafts (after chunked prompts and verified drafts) of a random MTP layer
    equal the torch reference run over the whole sequence: features, the token shift, the
    latent KV of the layer and the chained drafts were right."""
    model, mtp = write_checkpoint(tmp_path, copying=False)
    llm = _llm(tmp_path, max_num_batched_tokens=32, enable_prefix_caching=False)
    llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
    engine = llm.llm_engine
    drafter, batch = engine.runner.drafter, engine.runner.input_batch
    seen, propose = [], drafter.propose

    def recording(scheduled, sampled, lengths=None, batch_=None):
        out = propose(scheduled, sampled, lengths, batch_)
        for rid, d in out.items():
            r = batch.requests[rid]
            seen.append((list(r.prompt_token_ids) + list(r.output_token_ids), d))
        return out

    monkeypatch.setattr(drafter, "propose", recording)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:3]], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert len(seen) >= 10 and len({tuple(d) for _, d in seen}) >= 5
    agree = [_reference_drafts(model, mtp, t, len(d)) == d for t, d in seen]
    # f32 throughout; the engine's chunks and the one-pass reference differ in the order of a
    # few sums, so a near-tie of the random layer's logits may flip: nearly all must agree
    assert sum(agree) >= len(agree) - 1, [(t[-4:], d) for (t, d), a in zip(seen, agree) if not a]


def test_warmup_compiles_the_layers_program_per_bucket_and_serving_compiles_nothing(mtp_case):
    from test_no_compile_while_serving import count_compilations
    _, _, _, llm = mtp_case
    engine = llm.llm_engine
    runner, drafter = engine.runner, engine.runner.drafter
    _gen(llm, PROMPTS, GREEDY, drafts=True)     # the target's programs for this batch
    drafter._executables.clear()
    drafter.warmup(lambda T: runner._build([], T, False)[0], runner.buckets)
    assert drafter.compiled_programs == sorted(runner.buckets)
    with count_compilations() as seen:
        _gen(llm, PROMPTS, GREEDY, drafts=True)
    assert not seen


# Runs in a process with 8 simulated devices: greedy tokens without drafts, and with MTP at TP 1,
# TP 2 and TP 2 with expert parallelism.
_TP_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from test_spec_mtp import PROMPTS, GREEDY, write_checkpoint
    from jaxserve import LLM
    path = sys.argv[1]
    write_checkpoint(path)
    result = []
    for tp, ep, spec in ((1, False, None), (1, False, "mtp"), (2, False, "mtp"), (2, True, "mtp")):
        cfg = spec and {"method": spec, "num_speculative_tokens": 3, "min_expected_accepted": 0}
        with LLM(model=path, dtype="float32", tensor_parallel_size=tp, enable_expert_parallel=ep,
                 max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks_override=64,
                 block_size=16, seed=0, warmup=False, compilation_cache_dir="", program_cache_dir="",
                 speculative_config=cfg) as llm:
            llm.llm_engine.runner.step_cost = lambda n: 1.0
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
            st = llm.llm_engine.stats()
            result.append(dict(tokens=[o.outputs[0].token_ids for o in outs],
                               accepted=st.spec_num_accepted_tokens))
    print("RESULT" + json.dumps(result))
""")


def test_tensor_parallel_2_tokens_equal_one_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _TP_CHILD, str(tmp_path / "ck"), str(Path(__file__).parent)],
                         capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    plain, *spec = json.loads(lines[0][len("RESULT"):])
    for r in spec:
        assert r["tokens"] == plain["tokens"] and r["accepted"] > 0


def test_mtp_drafts_are_verified_under_the_request_adapter(tmp_path):
    """The MTP layer drafts without the request's adapter; the target verifies under it: greedy
    tokens with drafts equal those without, adapter by adapter, and differ from the base's."""
    from lora_helpers import write_adapter

    from jaxserve import LoRARequest
    model, _ = write_checkpoint(tmp_path / "ck")
    adapter = write_adapter(model, tmp_path / "a", targets=("o_proj",))
    loras = [LoRARequest("a", 1, str(adapter)), None]
    llm = _llm(tmp_path / "ck", enable_lora=True, max_lora_rank=8)
    llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
    try:
        runs = {drafts: _gen(llm, PROMPTS[:2] * 2, GREEDY, drafts=drafts, lora_request=[loras[0]] * 2 + [None] * 2)
                for drafts in (False, True)}
        assert runs[True] == runs[False] and runs[True][:2] != runs[True][2:]
        assert llm.llm_engine.stats().spec_num_accepted_tokens > 0
    finally:
        llm.shutdown()



def test_fp8_block_checkpoint_loads_the_mtp_layer_as_fp8(tmp_path):
    """DeepSeek V3 ships 128x128 block FP8: the MTP layer's projections load as the target's do
    (Fp8Weight; eh_proj, no matmul of the layer stack, dequantised), and greedy tokens with its
    drafts equal those without."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    from test_deepseek import _block_fp8

    from jaxserve.layers.fp8 import Fp8Weight
    write_checkpoint(tmp_path)
    B = 16
    for file in ("model.safetensors", "model-mtp.safetensors"):
        with safe_open(str(tmp_path / file), "np") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for name in list(tensors):
            w = tensors[name]
            if w.ndim == 2 and (name.endswith("proj.weight") or "proj_with_mqa" in name):
                tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = _block_fp8(w, B)
        save_file(tensors, str(tmp_path / file))
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [B, B]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    llm = _llm(tmp_path)
    llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
    try:
        w = llm.llm_engine.runner.drafter.weights
        assert isinstance(w.layer.wq_b, Fp8Weight) and isinstance(w.layer.we_gate.w, Fp8Weight)
        assert w.eh_proj.w.dtype == np.float32
        assert _gen(llm, PROMPTS, GREEDY, drafts=True) == _gen(llm, PROMPTS, GREEDY, drafts=False)
        assert llm.llm_engine.stats().spec_num_accepted_tokens > 0
    finally:
        llm.shutdown()
