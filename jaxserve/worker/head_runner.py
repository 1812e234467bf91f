"""The drafters that are one layer over the target's own features: the EAGLE-3 head
(`speculative_config={"method": "eagle3", "model": DIR}`, `models/eagle3.py`) and DeepSeek's
multi-token prediction layer (`{"method": "mtp"}`, `models/mtp.py`). Each has its own paged KV
pool of one layer indexed by the target's block tables and slot mappings (the draft-model
runner's design: the scheduler and the KV cache manager know nothing of it). The head's module
gives `project`, `forward`, `draft_logits` and `to_target_ids`; its config `model` (the layer as a
one-layer model), `aux_layer_ids` / `final_hidden` (which features the target's step returns)
and `feature_width`.

The target's step returns its features for every token, left on the device: EAGLE-3's are the
residual stream at the head's aux layers (`StepContext.aux_layers`), MTP's the final hidden
states (`StepContext.final_hidden`). After the step's samples are known, one program per token
bucket:

1. catch-up: the head runs the step's tokens with the step's attention metadata, each position p
   fed the target's feature at p and the token at p + 1 (EAGLE's shift: the tokens of the row,
   then the tokens the step emitted; the next prompt token for a prompt chunk that does not
   sample), writing its K/V wherever the target wrote its own. Past the accepted tokens the
   inputs are garbage and the K/V lies past `num_computed_tokens`: overwritten before anything
   reads it, as in the target's pool.
2. drafting: for each row that sampled, the head's output at its last accepted position gives
   the first draft (argmax, mapped to a target id: EAGLE-3's reduced vocabulary by `d2t`), and
   k - 1 single-token steps follow, each fed the last draft and the layer's own pre-norm output.
   Argmax drafts are point masses, so the rejection sampler keeps the target's distribution exact.

Under tensor parallelism an EAGLE-3 head and its pool are replicated (one small layer: every
device runs it whole; `head_plan` None), the MTP layer is split as the target's layers are
(`head_plan`: its plan); the target's vocabulary-split embedding is read where it lies.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sample.sampler import argmax_last
from jaxserve.sharding.plan import ShardingPlan, embed_lookup
from jaxserve.worker.compile_cache import compile_noting_cache_hit, how_obtained, step_compiler_options
from jaxserve.worker.draft_runner import lookahead_meta, row_tables
from jaxserve.worker.kv_sizing import allocate_kv_cache, allocate_sharded_kv_cache

logger = logging.getLogger(__name__)


class HeadRunner:
    """`catch_up(inputs, aux)` after the target's step (keeps them), then
    `propose(scheduled, sampled, lengths, batch)` -> request id -> draft ids. `head`: the head's
    module (`models.eagle3` or `models.mtp`), `hcfg` its config; `head_plan`: None to run the
    head whole on every device (its weights are replicated here), else the plan its weights
    were placed with."""

    def __init__(self, head, hcfg, weights, target_embed, *, target_plan: ShardingPlan,
                 num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 num_speculative_tokens: int, dtype, backend: str, kv_quantize=None, kv_dtype=None,
                 head_plan: ShardingPlan | None = None):
        self.head, self.hcfg = head, hcfg
        self.aux_layers = hcfg.aux_layer_ids
        self.final_hidden = hcfg.final_hidden
        self.plan = target_plan
        rep = target_plan.replicated
        self.weights = jax.device_put(weights, rep) if head_plan is None else weights
        self.target_embed = target_embed
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_rows = max_num_seqs
        self.k = k = num_speculative_tokens
        if head_plan is None:
            self.cache = jax.device_put(allocate_kv_cache(
                hcfg.model, num_blocks, block_size, kv_dtype or dtype, kv_quantize is not None,
                platform=target_plan.mesh.devices.flat[0].platform), rep)
        else:
            self.cache = allocate_sharded_kv_cache(hcfg.model, head_plan, num_blocks, block_size,
                                                   kv_dtype or dtype, kv_quantize is not None)
        self._pending = None        # (StepInputs, aux) of the step in flight
        fwd = partial(head.forward, hcfg, backend=backend, kv_quantize=kv_quantize, plan=head_plan)
        plan = target_plan

        def drafts_of(w, normed):
            logits = jax.lax.with_sharding_constraint(head.draft_logits(w, normed), rep)
            return head.to_target_ids(w, argmax_last(logits))

        def program(w, embed, cache, tokens, positions, meta, aux, starts, tables, limits,
                    num_rows, num_steps):
            table = embed if w.embed is None else w.embed
            emb = lambda t: embed_lookup(plan, table, t).astype(w.final_norm.dtype)   # noqa: E731
            normed, pre, cache = fwd(w, cache, emb(tokens), head.project(w, aux), positions, meta)
            first = drafts_of(w, normed[starts])
            out = jnp.zeros((starts.shape[0], k), jnp.int32).at[:, 0].set(first)

            def body(j, carry):
                cache, tok, hid, pos, out = carry
                m = lookahead_meta(tables, pos, limits, num_rows, block_size, num_blocks)
                normed, hid, cache = fwd(w, cache, emb(tok), hid, pos, m)
                nxt = drafts_of(w, normed)
                return cache, nxt, hid, pos + 1, out.at[:, j].set(nxt)

            init = (cache, first, pre[starts], positions[starts] + 1, out)
            cache, *_, out = jax.lax.fori_loop(1, jnp.maximum(num_steps[0], 1), body, init)
            return out, cache

        self._program = jax.jit(program, donate_argnames=("cache",),
                                out_shardings=(rep, jax.tree.map(lambda a: a.sharding, self.cache)))
        self._executables: dict[int, jax.stages.Compiled] = {}

    # -- programs --------------------------------------------------------------------------------
    def rows(self, num_tokens: int) -> int:
        """Drafting rows of a token bucket's program (a step has at most this many sequences)."""
        return min(num_tokens, self.max_rows)

    def _executable(self, T: int, args):
        exe = self._executables.get(T)
        if exe is None:
            t0 = time.perf_counter()
            rep = self.plan.replicated
            spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=rep), args)
            options = step_compiler_options(self.plan.mesh.devices.flat, self.weights)
            exe, from_cache = compile_noting_cache_hit(lambda: self._program.lower(
                self.weights, self.target_embed, self.cache, *spec).compile(options))
            self._executables[T] = exe
            logger.info("%s program: %d tokens, %s (%.1f s)", self.head.NAME, T, how_obtained(from_cache),
                        time.perf_counter() - t0)
        return exe

    @property
    def compiled_programs(self) -> list[int]:
        return sorted(self._executables)

    def _inputs(self, inputs, aux, rows, shifted, num_steps: int):
        """rows: (start index, position, block ids) of each drafting row -> the program's args."""
        T = len(inputs.tokens)
        G = self.rows(T)
        starts = np.zeros(G, np.int32)
        starts[:len(rows)] = [start for start, _ in rows]
        tables, limits = row_tables([b for _, b in rows], G, self.max_blocks_per_seq, self.block_size,
                                    self.max_model_len)
        return (shifted, inputs.positions, inputs.meta, aux, starts, tables, limits,
                np.array([len(rows)], np.int32), np.array([num_steps], np.int32))

    # -- the step --------------------------------------------------------------------------------
    def catch_up(self, inputs, aux=None) -> None:
        """Keep the target step's inputs and features: the head's catch-up needs the tokens the
        step samples, so it runs in `propose`."""
        self._pending = (inputs, aux)

    def propose(self, scheduled, sampled: dict[str, list[int]],
                lengths: dict[str, int] | None = None, batch=None) -> dict[str, list[int]]:
        """The catch-up of the last step and drafts after the tokens it emitted, for each
        sampling row, as many as `lengths` asks (None: k; a row asking 0 gets none). `batch`:
        the runner's InputBatch (the next prompt token of a chunk that does not sample)."""
        if self._pending is None:
            return {}
        inputs, aux = self._pending
        self._pending = None
        shifted = np.zeros(len(inputs.tokens), np.int32)
        ids, rows, steps, off = [], [], 0, 0
        for s in scheduled:
            n, m = len(s.token_ids), len(s.spec_token_ids)
            shifted[off:off + n - 1] = s.token_ids[1:]
            new = sampled.get(s.request_id)
            if s.sample and new:
                known = off + n - m - 1                  # the last known token's index
                emitted = new[:m + 1]
                shifted[known:known + len(emitted)] = emitted
                want = self.k if lengths is None else min(self.k, lengths.get(s.request_id, 0))
                if want > 0:
                    steps = max(steps, want)
                    ids.append(s.request_id)
                    rows.append((known + len(emitted) - 1, s.block_ids))
            elif not s.sample and batch is not None and s.request_id in batch.requests:
                req = batch.requests[s.request_id]
                at = s.num_computed_tokens + n
                seq = req.prompt_token_ids
                if at >= len(seq):
                    seq, at = req.output_token_ids, at - len(seq)
                shifted[off + n - 1] = seq[at] if at < len(seq) else 0
            off += n
        args = self._inputs(inputs, aux, rows, shifted, steps)
        exe = self._executable(len(inputs.tokens), args)
        drafts, self.cache = exe(self.weights, self.target_embed, self.cache, *args)
        if not rows:
            return {}
        drafts = np.asarray(jax.device_get(drafts))
        return {rid: drafts[i, :steps].tolist() for i, rid in enumerate(ids)}

    def warmup(self, step_inputs_of, token_buckets) -> None:
        """Compile the program of every token bucket (`step_inputs_of(T)`: the target's
        StepInputs of bucket T, shapes only)."""
        width = self.hcfg.feature_width
        dtype = self.weights.final_norm.dtype
        for T in token_buckets:
            x = step_inputs_of(T)
            aux = jax.ShapeDtypeStruct((T, width), dtype)
            self._executable(T, self._inputs(x, aux, [], np.zeros(T, np.int32), 0))

    def release(self) -> None:
        for x in jax.tree_util.tree_leaves((self.cache, self.weights)):
            x.delete()
        self.cache = self.weights = None
        self._executables.clear()
