"""Training an EAGLE-3 head with optax (jaxserve/training/eagle3.py, `jaxserve train-eagle3`): on the
shared default-model engine, a few prompts: the loss falls, the head is written in the published
format with its training log, and it loads as a head of the target."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def test_a_few_steps_lower_the_loss_and_write_a_loadable_head(llm, tmp_path):
    from jaxserve.models import eagle3
    from jaxserve.training.eagle3 import default_prompts, train_head
    out = tmp_path / "head"
    report = train_head(str(out), prompts=default_prompts()[:6], max_tokens=16, max_len=64, draft_vocab_size=512,
                        epochs=4, batch_size=2, learning_rate=3e-3, llm=llm)
    log = report["log"]
    # the shared engine is intact: training donates the head's arrays, none of the target's
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(llm.llm_engine.runner.weights))
    assert report["sequences"] == 6 and report["answer_tokens"] > 40
    # padded to the longest sequence (in 16s), within max_len
    assert report["padded_len"] % 16 == 0 and report["padded_len"] <= 64
    assert len(log) >= 4 and log[-1]["loss"] < log[0]["loss"] - 0.5, log
    assert json.loads((out / "train_log.json").read_text())["log"] == log
    cfg = llm.llm_engine.runner.cfg
    ecfg = eagle3.read_config(out, cfg)
    assert ecfg.draft_vocab_size == 512 and ecfg.aux_layer_ids == eagle3.default_aux_layers(cfg.num_layers)
    head = eagle3.load(out, ecfg, jnp.float32)
    targets = np.arange(512) + np.asarray(head.d2t)
    assert (np.diff(targets) > 0).all() and targets[-1] < cfg.vocab_size


def test_cli_refuses_bad_arguments(tmp_path, capsys):
    from jaxserve.server.cli.main import main
    with pytest.raises(SystemExit):
        main(["train-eagle3", "--out", str(tmp_path / "h"), "--max-tokens", "0"])
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    with pytest.raises(SystemExit):
        main(["train-eagle3", "--out", str(tmp_path / "h"), "--prompts", str(empty)])
    assert "holds no prompt" in capsys.readouterr().err
    for flag, value, message in (("--num-prompts", "0", "--num-prompts must be >= 1"),
                                 ("--time-limit", "-1", "--time-limit must be >= 0"),
                                 ("--distill-top-k", "-1", "--distill-top-k must be >= 0")):
        with pytest.raises(SystemExit):
            main(["train-eagle3", "--out", str(tmp_path / "h"), flag, value])
        assert message in capsys.readouterr().err


def test_built_in_prompts_are_distinct_and_spare_the_held_out_ones():
    import sys
    from pathlib import Path

    from jaxserve.training.eagle3 import DEFAULT_NUM_PROMPTS, default_prompts
    prompts = default_prompts()
    assert len(prompts) == len(set(prompts)) == 2748 and default_prompts(DEFAULT_NUM_PROMPTS) == prompts[:1200]
    # the first 240 as before (the notebook trains on the first topics and holds out later ones)
    assert prompts[:2] == ["Explain the ocean in simple terms.", "Write a short paragraph about the ocean."]
    assert prompts[239] == "Describe the brain to a child."
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_eagle3 import HELD_OUT
    from bench_eagle3_labels import HELD_OUT as MORE_HELD_OUT
    assert not set(HELD_OUT) & set(prompts)
    assert len(set(MORE_HELD_OUT)) == 40 and set(HELD_OUT) < set(MORE_HELD_OUT)
    assert not set(MORE_HELD_OUT) & set(prompts)


def test_distillation_labels_and_the_acceptance_they_train_for(llm):
    """generate_data's soft labels are the target's own top-k next tokens (their first is the
    greedy answer's next token); with all the mass on the token that followed, the distillation
    loss is the hard one; `acceptance` counts leading correct drafts at every answer position
    and rises with training."""
    import dataclasses

    from jaxserve.models import eagle3, get_model
    from jaxserve.training.eagle3 import (
        acceptance,
        answer_window,
        default_prompts,
        draft_vocabulary,
        generate_data,
        new_head,
        target_to_draft,
        train,
        ttt_loss,
    )
    cfg, weights = llm.llm_engine.runner.cfg, llm.llm_engine.runner.weights
    ecfg = eagle3.config_for(cfg, draft_vocab_size=512)
    data = generate_data(llm, default_prompts()[:4], ecfg.aux_layer_ids, max_tokens=12, max_len=64, soft_top_k=4)
    assert data.soft_ids.shape == data.tokens.shape + (4,)
    agree = []
    for s in range(len(data)):
        ans = np.flatnonzero(data.answer[s])
        # the target answered greedily: its top-1 before each answer token is that token (the
        # answer came from decode steps, the labels from one prefill: a near tie may differ)
        agree += list(data.soft_ids[s, ans - 1, 0] == data.tokens[s, ans])
        assert (np.diff(data.soft_logp[s, ans], axis=-1) <= 0).all()
    assert np.mean(agree) >= 0.9, np.mean(agree)
    ids = draft_vocabulary(data, 512, cfg.vocab_size)
    head = new_head(ecfg, weights, get_model(cfg.architecture), ids, jax.random.key(0))
    t2d = jnp.asarray(target_to_draft(head, cfg.vocab_size))
    one_hot_ids = np.zeros_like(data.soft_ids)
    one_hot_ids[:, :-1, 0] = data.tokens[:, 1:]
    one_hot_lp = np.full(data.soft_logp.shape, -1e9, np.float32)
    one_hot_lp[..., 0] = 0.0
    row = (data.tokens[0], data.features[0], data.embeds[0], data.answer[0], t2d)
    hard = ttt_loss(head, *row, ecfg=ecfg, steps=3)
    soft = ttt_loss(head, *row, one_hot_ids[0], one_hot_lp[0], ecfg=ecfg, steps=3)
    np.testing.assert_allclose(np.asarray(soft[:2]), np.asarray(hard[:2]), rtol=1e-5)
    # only the anchors near the answer (what training computes): the same sums and gradients
    width = answer_window(data.answer, 3)
    assert width < data.tokens.shape[1]
    for s in range(len(data)):
        row = (data.tokens[s], data.features[s], data.embeds[s], data.answer[s], t2d)
        for extra in ((), (data.soft_ids[s], data.soft_logp[s])):
            full = ttt_loss(head, *row, *extra, ecfg=ecfg, steps=3)
            window = ttt_loss(head, *row, *extra, ecfg=ecfg, steps=3, width=width)
            np.testing.assert_allclose(np.asarray(window), np.asarray(full), rtol=1e-5)
    params = dataclasses.replace(head, d2t=None)        # the integer d2t is not trained
    grads = [jax.grad(lambda p, width=width: ttt_loss(dataclasses.replace(p, d2t=head.d2t), *row, ecfg=ecfg,
                                                      steps=3, width=width)[0])(params)
             for width in (None, width)]
    for g_full, g_window in zip(*(jax.tree_util.tree_leaves(g) for g in grads)):
        g_full = np.asarray(g_full)        # summed in another order: float rounding apart
        np.testing.assert_allclose(np.asarray(g_window), g_full, rtol=1e-3, atol=1e-3 * np.abs(g_full).max())
    before = acceptance(head, data, t2d, ecfg=ecfg)
    answers = int(sum(max(0, int(a.sum()) - 1) for a in data.answer))
    assert before["anchors"] == answers     # the anchors whose next two tokens are answer tokens
    head, _ = train(ecfg, head, dataclasses.replace(data), epochs=15, batch_size=4, learning_rate=3e-3)
    after = acceptance(head, data, t2d, ecfg=ecfg)
    per = after["per_position"]
    assert per[0] >= per[1] >= per[2] and after["mean_acceptance_length"] == pytest.approx(1 + sum(per))
    assert after["mean_acceptance_length"] > before["mean_acceptance_length"] + 0.2, (before, after)


def test_features_are_packed_densely_and_equal_one_sequence_a_pass(llm):
    """generate_data's features pass packs the sequences longest first into passes of a fixed
    token count: each sequence's features, embeddings and answer mask are those of a pass that
    holds it alone (batch_size 1: one sequence's worth of tokens a pass)."""
    from jaxserve.models import eagle3
    from jaxserve.training.batch import make_batch, packed_chunks
    from jaxserve.training.eagle3 import default_prompts, generate_data
    chunks = packed_chunks([5, 9, 3, 9, 2, 7], num_tokens=12, max_seqs=3)
    assert chunks == [[1, 2], [3, 4], [5, 0]]       # longest first, each in the first pass it fits
    assert packed_chunks([4] * 5, num_tokens=100, max_seqs=2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="num_tokens=8 is less than the examples' 9 tokens"):
        make_batch([([1, 2, 3], [4, 5]), ([1, 2], [3, 4])], num_seqs=2, max_len=8, num_tokens=8)
    cfg = llm.llm_engine.runner.cfg
    aux = eagle3.default_aux_layers(cfg.num_layers)
    prompts = default_prompts()[:5]
    packed = generate_data(llm, prompts, aux, max_tokens=10, max_len=64, batch_size=4)
    alone = generate_data(llm, prompts, aux, max_tokens=10, max_len=64, batch_size=1)
    np.testing.assert_array_equal(packed.tokens, alone.tokens)
    np.testing.assert_array_equal(packed.answer, alone.answer)
    np.testing.assert_allclose(packed.embeds, alone.embeds)
    np.testing.assert_allclose(packed.features, alone.features, rtol=1e-4, atol=1e-4 * np.abs(alone.features).max())
