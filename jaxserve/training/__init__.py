"""Fine-tuning LoRA adapters with optax on a loaded model, saved in PEFT's format for serving; EAGLE-3
heads (`jaxserve.training.eagle3`, imported on its own), saved in the published format."""

from jaxserve.training.batch import TrainBatch, make_batch
from jaxserve.training.lora import (
    LoraAB,
    LoraSpec,
    TrainLoraWeight,
    apply_adapter,
    init_adapter,
    lora_targets,
    save_peft,
)
from jaxserve.training.step import adapter_logits, completion_loss, make_train_step, train_state

__all__ = ["LoraAB", "LoraSpec", "TrainBatch", "TrainLoraWeight", "adapter_logits", "apply_adapter",
           "completion_loss", "init_adapter", "lora_targets", "make_batch", "make_train_step", "save_peft",
           "train_state"]
