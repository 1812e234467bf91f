"""LoRA fine-tuning (jaxserve/training): the differentiable attention path equals the serving one,
optax steps lower the loss, and the saved PEFT adapter, read by transformers + peft, gives the
logits our forward with the adapter gives (f32, < 1e-3): on tiny random Llama / Qwen2 checkpoints
and on the default model (SmolLM2-135M-Instruct GGUF)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxserve.attention import AttentionMetadata, ragged_paged_attention_ref
from jaxserve.attention.dense import dense_paged_attention
from jaxserve.loader.loader import load_model
from jaxserve.training import (
    LoraSpec,
    adapter_logits,
    apply_adapter,
    init_adapter,
    make_batch,
    make_train_step,
    save_peft,
    train_state,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from helpers_paged import PagedRunner  # noqa: E402

LOGIT_ATOL = 1e-3
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- the differentiable attention path ------------------------------------------------------------

def _ragged_case(window, soft_cap):
    """3 sequences (one with 7 tokens already cached, one whole prefill, one padding) over 8
    blocks of 4, GQA 4 query heads on 2 kv heads; T padded past the real tokens."""
    rng = np.random.default_rng(0)
    N, B, K, H, D, M = 8, 4, 2, 4, 16, 4
    k_pages = jnp.asarray(rng.normal(size=(N, B, K, D)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(N, B, K, D)), jnp.float32)
    tables = np.array([[0, 1, 2, 0], [3, 4, 0, 0], [0, 0, 0, 0]], np.int32)
    q_lens, kv_lens = [3, 6, 0], [10, 6, 0]
    T = 12
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata(slot_mapping=jnp.full(T, N * B, jnp.int32), block_tables=jnp.asarray(tables),
                             kv_lens=jnp.asarray(kv_lens, jnp.int32), cu_q_lens=jnp.asarray(cu),
                             num_seqs=jnp.asarray([2], jnp.int32))
    q = jnp.asarray(rng.normal(size=(T, H, D)), jnp.float32)
    assert M == tables.shape[1]
    return q, k_pages, v_pages, meta, dict(sm_scale=D ** -0.5, sliding_window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("window,soft_cap", [(None, None), (4, None), (None, 5.0)])
def test_dense_attention_equals_the_reference_and_has_gradients(window, soft_cap):
    q, k, v, meta, opts = _ragged_case(window, soft_cap)
    want = np.asarray(ragged_paged_attention_ref(q, k, v, meta, **opts))
    got = np.asarray(dense_paged_attention(q, k, v, meta, **opts))
    real = int(meta.cu_q_lens[-1])
    np.testing.assert_allclose(got[:real], want[:real], atol=1e-5)
    assert not got[real:].any()          # padding tokens attend to nothing
    grads = jax.grad(lambda q, k, v: dense_paged_attention(q, k, v, meta, **opts).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert float(jnp.abs(grads[1]).sum()) > 0


# --- tiny random checkpoints ----------------------------------------------------------------------

TINY = {
    "llama-gqa2-untied": ("LlamaConfig", "LlamaForCausalLM",
                          dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2-bias-mqa-tied": ("Qwen2Config", "Qwen2ForCausalLM",
                            dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
}


def _tiny_checkpoint(path, name):
    """A random 2-layer model (every parameter randomised, so a misplaced norm or bias shows),
    saved with save_pretrained; returns the torch model (f32, eval)."""
    config_class, model_class, kwargs = TINY[name]
    config = getattr(transformers, config_class)(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, **kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def _train(cfg, weights, spec, examples, steps, lr, max_len):
    optimizer = optax.adamw(lr, weight_decay=0.0)
    adapter, opt_state = train_state(init_adapter(cfg, spec, jax.random.key(1)), optimizer, weights)
    step = make_train_step(cfg, spec, optimizer)
    losses = []
    for i in range(steps):
        batch = make_batch([examples[(i + j) % len(examples)] for j in range(2)], num_seqs=2, max_len=max_len)
        adapter, opt_state, loss = step(adapter, opt_state, weights, batch)
        losses.append(float(loss))
    assert step._cache_size() == 1      # every step reused the first one's program
    return adapter, losses


def _peft_logits(hf_model, adapter_dir, ids):
    model = peft.PeftModel.from_pretrained(hf_model, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    return model, logits


def _check_against_peft(cfg, weights, spec, adapter, hf_model, adapter_dir, ids, atol):
    """peft's logits equal ours, from the training forward and from the serving reference path
    (PagedRunner over the adapted weights, chunked); the adapter visibly moves them."""
    batch = make_batch([(ids[:1], ids[1:])], num_seqs=1, max_len=len(ids))
    ours = np.asarray(adapter_logits(adapter, weights, batch, cfg=cfg, spec=spec))
    base = np.asarray(adapter_logits(jax.tree.map(jnp.zeros_like, adapter), weights, batch, cfg=cfg, spec=spec))
    with torch.no_grad():
        hf_base = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    peft_model, theirs = _peft_logits(hf_model, adapter_dir, ids)

    assert float(np.abs(base - hf_base).max()) < atol        # the base model agrees first
    assert float(np.abs(theirs - hf_base).max()) > 50 * atol  # the adapter changes the logits
    diff = float(np.abs(ours - theirs).max())
    print(f"max |logit diff| vs peft: {diff:.2e}")
    assert diff < atol
    runner = PagedRunner(cfg, apply_adapter(weights, cfg, spec, adapter), block_size=4, num_blocks=32,
                         max_blocks_per_seq=16)
    served = runner.prefill_logits(ids, chunk_sizes=(5, 3))
    assert float(np.abs(served - theirs).max()) < atol

    # every tensor we wrote is one peft expects, and none is missing
    from peft.utils import get_peft_model_state_dict
    from safetensors.numpy import load_file
    written = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert set(written) == set(get_peft_model_state_dict(peft_model))


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_model_learns_and_peft_reads_the_adapter(tmp_path, name):
    hf_model = _tiny_checkpoint(tmp_path / "base", name)
    cfg, weights = load_model(tmp_path / "base", "float32")
    spec = LoraSpec(r=4, lora_alpha=8, target_modules=ALL_TARGETS)
    rng = np.random.default_rng(2)
    # the task: after any prompt, answer 5 6 7 8 9
    examples = [(rng.integers(10, 96, size=int(n)).tolist(), [5, 6, 7, 8, 9]) for n in rng.integers(3, 9, 8)]
    adapter, losses = _train(cfg, weights, spec, examples, steps=30, lr=1e-2, max_len=16)
    assert losses[-1] < 0.3 * losses[0], losses

    save_peft(tmp_path / "adapter", cfg, spec, adapter, str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    ids = rng.integers(0, 96, size=20).tolist()
    _check_against_peft(cfg, weights, spec, adapter, hf_model, tmp_path / "adapter", ids, 1e-4)


# --- the default model ----------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_adapter_matches_peft(tmp_path):
    """Two optax steps on the default model lower the loss; the saved adapter, applied by peft to
    transformers' reading of the same GGUF, gives our logits."""
    from jaxserve.default_model import default_model_path
    from jaxserve.tokenizer.tokenizer import Tokenizer
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg, weights = load_model(path, "float32")
    tok = Tokenizer.from_gguf(path)
    spec = LoraSpec(r=8, lora_alpha=16, target_modules=ALL_TARGETS)
    examples = [(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True),
                 tok.encode("Arr, matey! Yo-ho-ho!<|im_end|>", add_special_tokens=False))
                for q in ("Hi!", "What is 2 plus 2?", "Name a colour.", "Who are you?")]
    adapter, losses = _train(cfg, weights, spec, examples, steps=3, lr=3e-3, max_len=48)
    assert losses[-1] < losses[0], losses

    save_peft(tmp_path / "adapter", cfg, spec, adapter, str(path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=True)
    _check_against_peft(cfg, weights, spec, adapter, hf_model, tmp_path / "adapter", ids, LOGIT_ATOL)


# --- bad input ------------------------------------------------------------------------------------

def test_bad_spec_and_batches_name_the_field(tmp_path):
    _tiny_checkpoint(tmp_path, "llama-gqa2-untied")
    cfg, _ = load_model(tmp_path, "float32")
    with pytest.raises(ValueError, match="target_modules.*lm_head"):
        init_adapter(cfg, LoraSpec(target_modules=("q_proj", "lm_head")), jax.random.key(0))
    with pytest.raises(ValueError, match="target_modules"):
        LoraSpec(target_modules="q_proj")
    with pytest.raises(ValueError, match="^r must"):
        LoraSpec(r=0)
    with pytest.raises(ValueError, match="max_targets"):
        make_batch([([1, 2], [3, 4, 5])], num_seqs=1, max_len=8, max_targets=2)
    with pytest.raises(ValueError, match=r"examples\[1\]"):
        make_batch([([1, 2], [3]), ([1], [])], num_seqs=2, max_len=8)
    with pytest.raises(ValueError, match="examples"):
        make_batch([([1], [2])] * 3, num_seqs=2, max_len=8)
