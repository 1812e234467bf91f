"""The loss and the optax train step of a LoRA adapter over a frozen model.

The model's own `forward` runs the batch (a fresh KV cache, the differentiable `dense` attention
path: the serving reference path loops with dynamic trip counts, which autodiff cannot reverse);
only the adapter is a differentiated argument, so the base weights get no gradient.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax

from jaxserve.attention import kv_cache as kvc
from jaxserve.config import ModelConfig
from jaxserve.models import get_model
from jaxserve.training.batch import TrainBatch
from jaxserve.training.lora import LoraAB, LoraSpec, apply_adapter


def adapter_logits(adapter: dict[str, LoraAB], weights, batch: TrainBatch, *, cfg: ModelConfig,
                   spec: LoraSpec, rows: jax.Array | None = None) -> jax.Array:
    """Logits [R, V] (f32) of the tokens `rows` [R] (None: all T tokens) under the adapted model."""
    model = get_model(cfg.architecture)
    w = apply_adapter(weights, cfg, spec, adapter)
    cache = kvc.allocate(cfg.num_layers, batch.num_blocks, batch.block_size, cfg.num_kv_heads,
                         cfg.head_dim, weights.final_norm.dtype)
    hidden, _ = model.forward(w, cache, batch.tokens, batch.positions, batch.meta, cfg=cfg,
                              backend="dense")
    return model.compute_logits(w, hidden if rows is None else hidden[rows])


def completion_loss(adapter: dict[str, LoraAB], weights, batch: TrainBatch, *, cfg: ModelConfig,
                    spec: LoraSpec) -> jax.Array:
    """Mean cross-entropy of the completion tokens (the prompts are context, not targets)."""
    logits = adapter_logits(adapter, weights, batch, cfg=cfg, spec=spec, rows=batch.rows)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.targets[:, None], axis=-1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def train_state(adapter: dict[str, LoraAB], optimizer: optax.GradientTransformation, weights):
    """(adapter, optimizer.init(adapter)) placed where the train step's outputs land: replicated
    on the mesh the loaded weights live on. Placed otherwise, the step's second call would see
    inputs that differ from its first call's in placement and compile again."""
    opt_state = optimizer.init(adapter)
    sharding = getattr(weights.final_norm, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        adapter, opt_state = jax.device_put((adapter, opt_state), replicated)
    return adapter, opt_state


def make_train_step(cfg: ModelConfig, spec: LoraSpec, optimizer: optax.GradientTransformation):
    """A jitted `step(adapter, opt_state, weights, batch) -> (adapter, opt_state, loss)`: one
    optax update of the adapter (adapter and optimizer state donated). The weights are an
    argument, not a closed-over constant, so they are not baked into the compiled program."""
    loss_fn = partial(completion_loss, cfg=cfg, spec=spec)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(adapter, opt_state, weights, batch):
        loss, grads = jax.value_and_grad(loss_fn)(adapter, weights, batch)
        updates, opt_state = optimizer.update(grads, opt_state, adapter)
        return optax.apply_updates(adapter, updates), opt_state, loss

    return step
