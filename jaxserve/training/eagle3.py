"""Training an EAGLE-3 head (`models/eagle3.py`) for a target with optax, from the target's own data.

1. `generate_data`: the target answers a prompt set greedily (the engine, batched); forward
   passes with the head's aux layers over the (prompt, answer) sequences, packed longest first,
   give the features, and the token embeddings are taken from the target's table.
2. `new_head`: the draft vocabulary is the answers' most frequent tokens; the head starts from
   the target where it can: `lm_head` rows and `norm` from the target's head and final norm, `fc`
   selecting the highest aux layer (its residual stream is nearly the final one), `wo` and
   `w_down` zero (the layer starts as the identity on the feature).
3. `train`: training-time test as EAGLE-3 trains: step 1 at anchor p is the head's catch-up
   (feature of the target at p, token p + 1, predicts token p + 2); step j > 1 feeds step j - 1's
   pre-norm output with token p + j at position p + j - 1 and attends to step 1's keys at
   positions <= p plus its own earlier steps' keys of the same anchor — exactly what the chained
   drafts see at inference. Cross-entropy over the draft vocabulary on answer tokens (against
   the token that followed, or with `soft_top_k` data the target's own top-k distribution there:
   distillation), step j weighted 0.8^(j-1), AdamW with warm-up and cosine decay. Only the
   anchors around each answer are computed past step 1's keys and values (`answer_window`:
   prompt and padding anchors have no label; 1.43x faster a step on the default data, the same
   loss and gradients).
4. `eagle3.save`: the published format, which `serve` loads like a downloaded head.
5. `acceptance`: a head judged without an engine, on data of held-out prompts: its chained
   drafts at every answer position, accepted up to the first that differs from the target's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve.layers.embedding import embed_rows
from jaxserve.layers.linear import DenseWeight, linear
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import apply_rope
from jaxserve.models import eagle3
from jaxserve.models.llama import mlp, rope_tables

logger = logging.getLogger(__name__)

_TOPICS = ["the ocean", "volcanoes", "the moon", "bread baking", "honey bees", "the internet", "chess",
           "rainbows", "electric cars", "the Roman empire", "photosynthesis", "coffee", "gravity",
           "music theory", "the human heart", "recycling", "mountains", "penguins", "solar panels",
           "the printing press", "friendship", "sleep", "clouds", "trains", "vaccines", "deserts",
           "libraries", "earthquakes", "the piano", "tea", "robots", "rivers", "forests", "bicycles",
           "the stock market", "dinosaurs", "snow", "airplanes", "cheese", "the brain"]
_TEMPLATES = ["Explain {} in simple terms.", "Write a short paragraph about {}.",
              "Give three facts about {}.", "How does {} work?", "Why is {} important?",
              "Describe {} to a child."]
_MORE_TOPICS = (
    "tigers, elephants, whales, owls, spiders, ants, butterflies, wolves, dolphins, sharks, frogs, horses, cats, "
    "dogs, rabbits, eagles, octopuses, jellyfish, coral reefs, rainforests, glaciers, tornadoes, hurricanes, "
    "lightning, the sun, Mars, Jupiter, black holes, comets, stars, the Milky Way, telescopes, microscopes, "
    "batteries, magnets, electricity, computers, smartphones, video games, social media, email, passwords, "
    "cloud computing, artificial intelligence, databases, programming, the Python language, spreadsheets, "
    "3D printing, drones, satellites, GPS, radio, television, cameras, movies, theater, painting, sculpture, "
    "poetry, novels, jazz, rock music, the guitar, the violin, drums, opera, dance, photography, architecture, "
    "bridges, skyscrapers, castles, pyramids, ancient Egypt, ancient Greece, the Vikings, the Middle Ages, "
    "the Renaissance, the Industrial Revolution, democracy, elections, taxes, banks, money, inflation, "
    "budgeting, saving money, credit cards, shopping, advertising, small businesses, job interviews, teamwork, "
    "leadership, public speaking, time management, studying, exams, learning a language, reading, "
    "writing essays, mathematics, fractions, geometry, algebra, statistics, probability, physics, chemistry, "
    "biology, DNA, cells, bacteria, viruses, the immune system, nutrition, vitamins, exercise, running, "
    "swimming, yoga, meditation, stress, happiness, gardening, houseplants, composting, farming, wheat, rice, "
    "potatoes, apples, chocolate, pizza, soup, salad, cooking pasta, baking cookies, breakfast, camping, hiking, "
    "fishing, sailing, travel, maps, hotels, airports, city life, village life, neighbors, parks, museums, zoos, "
    "birthdays, holidays, weddings, grandparents, babies, teenagers, pets, kindness, honesty, patience, courage, "
    "curiosity, habits, goals, weather, seasons, autumn, winter, spring, summer, water, air pollution, "
    "climate change, wind power, nuclear power, oil, plastic, glass, paper, wood, steel, gold, diamonds, salt, "
    "sugar").split(", ")
_MORE_TEMPLATES = ["What are the pros and cons of {}?", "Tell me something surprising about {}.",
                   "Write a short poem about {}.", "What should a beginner know about {}?",
                   "Summarize the history of {}.", "Give me some tips related to {}."]
# The prompts `jaxserve train-eagle3` trains on by default: 1,200 answers fill its ~10 minutes on
# a 2-core CPU (5x the first 240 raised held-out acceptance 1.26 -> 1.41, benchmarks/RESULTS.md).
DEFAULT_NUM_PROMPTS = 1200


def default_prompts(n: int | None = None) -> list[str]:
    """The built-in chat prompts (the first `n`; None: all 2,748): first the 240 of 6 templates x
    40 topics, topic by topic, then every other pairing of 12 templates with 229 topics in a
    fixed shuffled order (so any prefix spreads over them)."""
    first = [t.format(topic) for topic in _TOPICS for t in _TEMPLATES]
    rest = [t.format(topic) for topic in _TOPICS + _MORE_TOPICS for t in _TEMPLATES + _MORE_TEMPLATES]
    seen = set(first)
    rest = [p for p in rest if p not in seen]
    np.random.default_rng(0).shuffle(rest)
    prompts = first + rest
    return prompts if n is None else prompts[:n]


@dataclasses.dataclass
class Eagle3Data:
    """N sequences padded to L: tokens [N, L], features [N, L, n_aux * E] (f32), embeddings
    [N, L, E] (f32), answer [N, L] (1 where the token is the target's own, 0 prompt or pad)."""
    tokens: np.ndarray
    features: np.ndarray
    embeds: np.ndarray
    answer: np.ndarray
    soft_ids: np.ndarray | None = None      # [N, L, k] the target's top-k next tokens at each position
    soft_logp: np.ndarray | None = None     # [N, L, k] their log-probabilities

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, sel) -> tuple:
        """The arrays the train step takes, for sequences `sel`."""
        soft = () if self.soft_ids is None else (self.soft_ids[sel], self.soft_logp[sel])
        return (self.tokens[sel], self.features[sel], self.embeds[sel], self.answer[sel], *soft)


def generate_data(llm, prompts: list[str], aux_layer_ids: tuple[int, ...], *, max_tokens: int = 96,
                  max_len: int = 256, batch_size: int = 8, soft_top_k: int = 0) -> Eagle3Data:
    """The target (`llm`, an LLM) answers each chat prompt greedily; its features at
    `aux_layer_ids` and token embeddings for every (prompt, answer) token, cut to `max_len`;
    with `soft_top_k`, also its top-k next tokens and their log-probabilities (the labels of
    distillation). The features pass packs the sequences longest first, as many as fit `batch_size`
    * max_len tokens a pass (at most 2 * batch_size), so it computes little padding."""
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.training.batch import make_batch, packed_chunks
    engine = llm.llm_engine
    cfg, weights = engine.runner.cfg, engine.runner.weights
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    t_answers = time.perf_counter() - t0
    pairs = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs if o.outputs[0].token_ids]
    from jaxserve.attention import kv_cache as kvc
    from jaxserve.models import get_model
    model = get_model(cfg.architecture)
    backend = engine.attention_backend      # no gradient here: the serving kernels

    @jax.jit
    def features(weights, batch):
        cache = kvc.allocate(cfg.num_layers, batch.num_blocks, batch.block_size, cfg.num_kv_heads,
                             cfg.head_dim, jnp.float32)
        hidden, _, aux = model.forward(weights, cache, batch.tokens, batch.positions, batch.meta, cfg=cfg,
                                       backend=backend, aux_layers=aux_layer_ids)
        soft = ()
        if soft_top_k:
            logp, ids = jax.lax.top_k(jax.nn.log_softmax(model.compute_logits(weights, hidden)), soft_top_k)
            soft = (ids, logp)
        return aux.astype(jnp.float32), embed_rows(weights.embed, batch.tokens).astype(jnp.float32), *soft

    # Sequences padded only to the longest (rounded up to 16), not to max_len: training's cost
    # grows with the padded length (its attention with its square).
    N, E = len(pairs), cfg.hidden_size
    L = min(max_len, -(-max(len(p) + len(a) for p, a in pairs) // 16) * 16)
    data = Eagle3Data(np.zeros((N, L), np.int32), np.zeros((N, L, len(aux_layer_ids) * E), np.float32),
                      np.zeros((N, L, E), np.float32), np.zeros((N, L), np.float32))
    if soft_top_k:
        data.soft_ids = np.zeros((N, L, soft_top_k), np.int32)
        data.soft_logp = np.full((N, L, soft_top_k), -1e9, np.float32)
    lengths = [min(L, len(p) + len(a)) for p, a in pairs]
    T = batch_size * L
    for chunk in packed_chunks(lengths, T, 2 * batch_size):
        batch = make_batch([pairs[i] for i in chunk], num_seqs=2 * batch_size, max_len=L, max_targets=T,
                           num_tokens=T)
        aux, emb, *soft = jax.device_get(features(weights, batch))
        cu = batch.meta.cu_q_lens
        for j, i in enumerate(chunk):
            a, b = int(cu[j]), int(cu[j + 1])
            n = b - a
            data.tokens[i, :n] = batch.tokens[a:b]
            data.features[i, :n] = aux[a:b]
            data.embeds[i, :n] = emb[a:b]
            data.answer[i, len(pairs[i][0]):n] = 1.0
            if soft:
                data.soft_ids[i, :n] = soft[0][a:b]
                data.soft_logp[i, :n] = soft[1][a:b]
    logger.info("eagle3 data: %d answers in %.0f s, their features in %.0f s", N, t_answers,
                time.perf_counter() - t0 - t_answers)
    return data


def draft_vocabulary(data: Eagle3Data, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent answer tokens, sorted (the head's draft ids -> target ids)."""
    counts = np.bincount(data.tokens[data.answer > 0], minlength=vocab_size).astype(np.float64)
    counts += 1e-6 * np.bincount(data.tokens.ravel(), minlength=vocab_size)    # ties: any token seen
    return np.sort(np.argsort(-counts, kind="stable")[:size])


def new_head(ecfg: eagle3.Eagle3Config, target_weights, model, draft_ids: np.ndarray, key) -> eagle3.Eagle3Weights:
    """A head started from the target (module docstring, 2.)."""
    w = eagle3.init(ecfg, key, draft_to_target=draft_ids)
    E = ecfg.model.hidden_size
    eye = jnp.eye(E, dtype=jnp.float32)
    head = np.asarray(model.compute_logits(target_weights, eye))[:, draft_ids]       # [E, Vd]
    fc = np.zeros((ecfg.fc_in, E), np.float32)
    fc[-ecfg.target_hidden_size:] = np.eye(E)       # the last aux layer (the highest by default)
    layer = dataclasses.replace(w.layer, wo=DenseWeight(jnp.zeros_like(w.layer.wo.w)),
                                w_down=DenseWeight(jnp.zeros_like(w.layer.w_down.w)))
    return dataclasses.replace(w, fc=DenseWeight(jnp.asarray(fc)), layer=layer,
                               lm_head=DenseWeight(jnp.asarray(head)),
                               # a copy: training donates the head, never the target's arrays
                               final_norm=jnp.array(target_weights.final_norm, jnp.float32, copy=True))


def _attention(cfg, q, k_ctx, v_ctx, k_own, v_own, anchors):
    """q [W, H, D] of one step at `anchors` [W]; k_ctx/v_ctx [L, K, D] step 1's keys at every
    position (anchor p sees those at <= p); k_own/v_own [m, W, K, D] the same anchor's earlier
    steps' and its own."""
    W, H, D = q.shape
    L, K = k_ctx.shape[:2]
    g = H // K
    qg = q.reshape(W, K, g, D).astype(jnp.float32)
    scale = D ** -0.5
    s_ctx = jnp.einsum("pkgd,ckd->kgpc", qg, k_ctx.astype(jnp.float32)) * scale        # [K, g, W, L]
    causal = anchors[:, None] >= jnp.arange(L)[None, :]
    s_ctx = jnp.where(causal, s_ctx, -1e30)
    s_own = jnp.einsum("pkgd,mpkd->kgpm", qg, k_own.astype(jnp.float32)) * scale       # [K, g, W, m]
    p = jax.nn.softmax(jnp.concatenate([s_ctx, s_own], axis=-1), axis=-1)
    out = (jnp.einsum("kgpc,ckd->pkgd", p[..., :L], v_ctx.astype(jnp.float32))
           + jnp.einsum("kgpm,mpkd->pkgd", p[..., L:], v_own.astype(jnp.float32)))
    return out.reshape(W, H * D).astype(q.dtype)


def _chained_logits(w: eagle3.Eagle3Weights, features, embeds, *, ecfg: eagle3.Eagle3Config, steps: int,
                    anchors=None):
    """The head's draft logits [W, Vd] at `anchors` ([W] positions; None: all L) of one sequence
    ([L, n*E] features, [L, E] embeddings), for each of `steps` chained drafts (module docstring,
    3.): step j at anchor p is fed token p + j and predicts token p + j + 1. Step 1's keys and
    values are computed at every position (later anchors attend to them); the rest of the layer,
    the norm and lm_head only at `anchors`."""
    cfg = ecfg.model
    L = features.shape[0]
    H, K, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    every = jnp.arange(L)
    anchors = every if anchors is None else anchors
    W = anchors.shape[0]
    feat_all = eagle3.project(w, features)
    feat = feat_all[anchors]

    def step_input(emb, feat):      # the layer's input: the fed token's embedding beside the feature
        return jnp.concatenate([rms_norm(emb, w.layer.attn_norm, eps), rms_norm(feat, w.hidden_norm, eps)], -1)

    k_ctx = v_ctx = None
    own_k, own_v, out = [], [], []
    for j in range(1, steps + 1):
        if j == 1:      # step 1 at every position: its keys and values are the context's
            cos, sin = rope_tables(cfg, every)
            h_all = step_input(embeds[jnp.minimum(every + 1, L - 1)], feat_all)
            k_ctx = apply_rope(linear(h_all, w.layer.wk).reshape(L, K, D), cos, sin)
            v_ctx = linear(h_all, w.layer.wv).reshape(L, K, D)
            q = apply_rope(linear(h_all[anchors], w.layer.wq).reshape(W, H, D), cos[anchors], sin[anchors])
            none = jnp.zeros((0, W, K, D), k_ctx.dtype)
            o = _attention(cfg, q, k_ctx, v_ctx, none, none, anchors)
        else:
            cos, sin = rope_tables(cfg, anchors + j - 1)
            h = step_input(embeds[jnp.minimum(anchors + j, L - 1)], feat)      # fed token p + j
            q = apply_rope(linear(h, w.layer.wq).reshape(W, H, D), cos, sin)
            own_k.append(apply_rope(linear(h, w.layer.wk).reshape(W, K, D), cos, sin))
            own_v.append(linear(h, w.layer.wv).reshape(W, K, D))
            o = _attention(cfg, q, k_ctx, v_ctx, jnp.stack(own_k), jnp.stack(own_v), anchors)
        residual = feat + linear(o, w.layer.wo)
        residual = residual + mlp(cfg, None, w.layer, rms_norm(residual, w.layer.mlp_norm, eps))
        out.append(eagle3.draft_logits(w, rms_norm(residual, w.final_norm, eps)))
        feat = residual
    return out


def _draft_labels(tokens, answer, t2d, j: int, anchors=None):
    """Draft j at every anchor p (`anchors`; None: every position) of one sequence predicts
    token p + j + 1: -> (its index, clipped into the sequence; its draft id, -1 outside the
    draft vocabulary; whether it is one, i.e. in the sequence, the target's own and in the
    draft vocabulary)."""
    L = tokens.shape[0]
    tgt_at = (jnp.arange(L) if anchors is None else anchors) + j + 1
    at = jnp.minimum(tgt_at, L - 1)
    draft = t2d[tokens[at]]
    return at, draft, (tgt_at < L) & (answer[at] > 0) & (draft >= 0)


def answer_window(answer: np.ndarray, steps: int) -> int:
    """The fewest anchors per sequence that hold every labelled draft of `answer` ([N, L] masks,
    each one run of answer positions): from `steps` + 1 before the first answer position to 3
    before the end of the sequence (`window_anchors`)."""
    L = answer.shape[1]
    has = answer > 0
    first = np.argmax(has, 1)
    end = L - np.argmax(has[:, ::-1], 1)
    width = np.where(has.any(1), end - np.maximum(first - steps - 1, 0) - 2, 1)
    return int(min(L, max(1, width.max())))


def window_anchors(answer, width: int, steps: int):
    """[width] anchors of one sequence ([L] answer mask) where a draft has a label: those whose
    step-j target p + j + 1 (j <= steps) is an answer position (`answer_window`)."""
    L = answer.shape[0]
    start = jnp.clip(jnp.argmax(answer > 0) - steps - 1, 0, L - width)
    return start + jnp.arange(width)


def ttt_loss(w: eagle3.Eagle3Weights, tokens, features, embeds, answer, t2d, soft_ids=None, soft_logp=None, *,
             ecfg: eagle3.Eagle3Config, steps: int, width: int | None = None):
    """Mean weighted cross-entropy of one sequence ([L] tokens, [L, n*E] features, [L, E]
    embeddings, [L] answer mask; t2d [V] the draft id of each target id, -1 none) over `steps`
    chained drafts. With `soft_ids` / `soft_logp` ([L, k]: the target's own top-k next tokens and
    log-probabilities at each position) the label of a draft is the target's distribution there
    (distillation: the mass outside the draft vocabulary is dropped), else the token that
    followed. With `width` (`answer_window` of the data), only the `width` anchors around the
    answer where drafts have labels are computed (the same sums, less work: the prompt's and
    padding's anchors have none). Returns (loss sum, weight sum, correct first-step predictions,
    their count)."""
    total = weight = correct = counted = 0.0
    anchors = None if width is None else window_anchors(answer, width, steps)
    for j, logits in enumerate(_chained_logits(w, features, embeds, ecfg=ecfg, steps=steps, anchors=anchors), 1):
        at, draft, valid = _draft_labels(tokens, answer, t2d, j, anchors)
        logq = jax.nn.log_softmax(logits)
        if soft_ids is None:
            nll = -jnp.take_along_axis(logq, jnp.maximum(draft, 0)[:, None], 1)[:, 0]
        else:       # the target's distribution for the token at `at` is its output at at - 1
            sd = t2d[soft_ids[at - 1]]                                               # [W, k]
            p = jnp.where(sd >= 0, jnp.exp(soft_logp[at - 1]), 0.0)
            p = p / jnp.maximum(jnp.sum(p, -1, keepdims=True), 1e-9)
            nll = -jnp.sum(p * jnp.take_along_axis(logq, jnp.maximum(sd, 0), 1), -1)
        wj = 0.8 ** (j - 1)
        total += wj * jnp.sum(jnp.where(valid, nll, 0.0))
        weight += wj * jnp.sum(valid)
        if j == 1:
            correct = jnp.sum(valid & (jnp.argmax(logits, -1) == draft))
            counted = jnp.sum(valid)
    return total, weight, correct, counted


def acceptance(w: eagle3.Eagle3Weights, data: Eagle3Data, t2d, *, ecfg: eagle3.Eagle3Config, steps: int = 3,
               batch_size: int = 8) -> dict:
    """Greedy acceptance of `steps` chained drafts at every answer position of `data`, as a
    verification step would count it: at anchor p (token p + 1 the target's own), the drafts are
    accepted up to the first that differs from the target's token. -> {mean_acceptance_length,
    per_position (accepted fraction at draft 1..steps), anchors}."""
    @jax.jit
    def leading(w, tokens, features, embeds, answer):
        def one(tokens, features, embeds, answer):
            L = tokens.shape[0]
            anchors = jnp.arange(L)
            ok = jnp.ones(L, bool)
            run = []
            for j, logits in enumerate(_chained_logits(w, features, embeds, ecfg=ecfg, steps=steps), 1):
                _, draft, valid = _draft_labels(tokens, answer, t2d, j)
                ok = ok & valid & (jnp.argmax(logits, -1) == draft)
                run.append(ok)
            # an anchor counts if the token it is fed first and the next are the target's
            real = (anchors + 2 < L) & (answer[jnp.minimum(anchors + 1, L - 1)] > 0) & (
                answer[jnp.minimum(anchors + 2, L - 1)] > 0)
            return jnp.stack(run, -1) & real[:, None], real
        return jax.vmap(one)(tokens, features, embeds, answer)

    t2d = jnp.asarray(t2d)
    hits, n = np.zeros(steps), 0
    for s in range(0, len(data), batch_size):
        sel = slice(s, s + batch_size)
        run, real = jax.device_get(leading(w, data.tokens[sel], data.features[sel], data.embeds[sel], data.answer[sel]))
        hits += run.reshape(-1, steps).sum(0)
        n += int(real.sum())
    per = hits / max(n, 1)
    return dict(mean_acceptance_length=float(1 + per.sum()), per_position=[float(x) for x in per], anchors=n)


def make_optimizer(learning_rate: float, total_steps: int):
    """`train`'s optimizer: AdamW, gradients clipped to norm 1, warm-up over the first 5% of
    `total_steps`, then cosine decay to 5% of `learning_rate`."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, total_steps // 20), total_steps,
                                                  learning_rate * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))


def make_train_step(ecfg: eagle3.Eagle3Config, optimizer, steps: int, width: int | None = None):
    """step(params, opt_state, d2t, t2d, *Eagle3Data.rows(batch)) -> (params, opt_state, loss,
    first-step accuracy); params: the head without its d2t; `width`: as `ttt_loss`'s."""
    per_seq = partial(ttt_loss, ecfg=ecfg, steps=steps, width=width)

    def loss_fn(w, t2d, tokens, features, embeds, answer, *soft):
        total, weight, correct, counted = jax.vmap(per_seq, in_axes=(None, 0, 0, 0, 0, None) + (0,) * len(soft))(
            w, tokens, features, embeds, answer, t2d, *soft)
        return jnp.sum(total) / jnp.maximum(jnp.sum(weight), 1.0), jnp.sum(correct) / jnp.maximum(jnp.sum(counted), 1.0)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, d2t, t2d, *rows):
        # params: the head without its (integer) d2t, which is not trained; rows: Eagle3Data.rows
        def of(p):
            return loss_fn(dataclasses.replace(p, d2t=d2t), t2d, *rows)
        (loss, acc), grads = jax.value_and_grad(of, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    return step


def target_to_draft(head: eagle3.Eagle3Weights, vocab_size: int) -> np.ndarray:
    """[V] the draft id of each target id (-1: not in the draft vocabulary)."""
    d2t = np.asarray(head.d2t)
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[np.arange(len(d2t)) + d2t] = np.arange(len(d2t))
    return t2d


def train(ecfg: eagle3.Eagle3Config, head: eagle3.Eagle3Weights, data: Eagle3Data, *, epochs: int = 3,
          batch_size: int = 4, learning_rate: float = 1e-3, steps: int = 3, seed: int = 0,
          log_every: int | None = None, time_limit_s: float | None = None,
          on_step=None) -> tuple[eagle3.Eagle3Weights, list[dict]]:
    """Train `head` on `data` -> (trained head, a log of {step, loss, accuracy, seconds}).
    `on_step(n, head)`, if given, is called after every step with the head so far; its arrays are
    donated to the next step, so use them (e.g. `acceptance`) before returning."""
    t2d = target_to_draft(head, ecfg.model.vocab_size)
    n_batches = max(1, len(data) // batch_size)
    total_steps = epochs * n_batches
    log_every = log_every or max(1, total_steps // 20)
    optimizer = make_optimizer(learning_rate, total_steps)
    d2t_dev = head.d2t
    params = dataclasses.replace(head, d2t=None)
    opt_state = optimizer.init(params)
    # only the anchors near each answer: 1.43x fewer FLOPs a step on the default data (module docstring, 3.)
    step_fn = make_train_step(ecfg, optimizer, steps, answer_window(data.answer, steps))
    rng = np.random.default_rng(seed)
    log, t0, n = [], time.perf_counter(), 0
    for _ in range(epochs):
        order = rng.permutation(len(data))
        for b in range(n_batches):
            sel = order[b * batch_size:(b + 1) * batch_size]
            params, opt_state, loss, acc = step_fn(params, opt_state, d2t_dev, t2d, *data.rows(sel))
            n += 1
            if on_step is not None:
                on_step(n, dataclasses.replace(params, d2t=d2t_dev))
            if n % log_every == 0 or n == total_steps:
                log.append(dict(step=n, loss=float(loss), accuracy=float(acc),
                                seconds=round(time.perf_counter() - t0, 1)))
                logger.info("eagle3 step %d/%d: loss %.3f, first-draft accuracy %.2f (%.0f s)", n, total_steps,
                            log[-1]["loss"], log[-1]["accuracy"], log[-1]["seconds"])
            if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                logger.info("eagle3: time limit %.0f s reached after %d steps", time_limit_s, n)
                return dataclasses.replace(params, d2t=d2t_dev), log
    return dataclasses.replace(params, d2t=d2t_dev), log


def train_head(out: str, model: str | None = None, *, prompts: list[str] | None = None, max_tokens: int = 96,
               max_len: int = 256, draft_vocab_size: int = 4096, epochs: int = 3, batch_size: int = 4,
               learning_rate: float = 1e-3, steps: int = 3, time_limit_s: float | None = None, seed: int = 0,
               distill_top_k: int = 0, llm=None) -> dict:
    """The whole recipe (module docstring): load `model` (None: the default one) or use `llm`,
    make the data, train, write the head to `out` with `train_log.json` beside it. Returns that
    log: timings, data size, the loss and first-draft accuracy curve. `distill_top_k` > 0: the
    labels are the target's top-k distributions (`ttt_loss`), not its tokens."""
    import json
    import os
    import platform
    from pathlib import Path

    from jaxserve.models import get_model
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    if distill_top_k < 0:
        raise ValueError(f"distill_top_k must be >= 0 (0: the target's tokens as labels), got {distill_top_k}")
    t0 = time.perf_counter()
    if llm is None:
        from jaxserve import LLM
        # 256 sequences at a time: the answers 1.27x faster than 64 on a 2-core CPU
        llm = LLM(model=model, warmup=False, max_model_len=max(512, max_len), max_num_seqs=256, seed=seed)
    engine = llm.llm_engine
    cfg, weights = engine.runner.cfg, engine.runner.weights
    ecfg = eagle3.config_for(cfg, draft_vocab_size=min(draft_vocab_size, cfg.vocab_size))
    prompts = default_prompts(DEFAULT_NUM_PROMPTS) if prompts is None else prompts
    data = generate_data(llm, prompts, ecfg.aux_layer_ids, max_tokens=max_tokens, max_len=max_len,
                         soft_top_k=min(distill_top_k, cfg.vocab_size))
    t_data = time.perf_counter() - t0
    draft_ids = draft_vocabulary(data, ecfg.draft_vocab_size, cfg.vocab_size)
    head = new_head(ecfg, weights, get_model(cfg.architecture), draft_ids, jax.random.key(seed))
    remaining = None if time_limit_s is None else max(1.0, time_limit_s - t_data)
    head, log = train(ecfg, head, data, epochs=epochs, batch_size=batch_size, learning_rate=learning_rate,
                      steps=steps, seed=seed, time_limit_s=remaining)
    eagle3.save(out, ecfg, head)
    report = dict(model=model or "default", sequences=len(data), answer_tokens=int(data.answer.sum()),
                  padded_len=int(data.tokens.shape[1]),
                  draft_vocab_size=ecfg.draft_vocab_size, aux_layer_ids=list(ecfg.aux_layer_ids),
                  distill_top_k=distill_top_k,
                  data_seconds=round(t_data, 1), total_seconds=round(time.perf_counter() - t0, 1),
                  machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {jax.default_backend()}",
                  log=log)
    (Path(out) / "train_log.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
