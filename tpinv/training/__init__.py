"""Pretraining whose loss curve and final weights are the same bits at every TP size.

``train(TrainConfig(...), parallel)`` runs the loop of :mod:`tpinv.training.loop`;
``launch/pretrain.py`` is its command line.  Every reduction of a step -- the loss and
gradient sums over tokens and micro-batches, the data-parallel gradient reduction, the global
gradient norm -- follows the invariance contract, and the optimizer is elementwise, so the
per-step losses and the final weights do not depend on the TP size.
"""
from tpinv.training.ckpt_files import CheckpointError, resolve_checkpoint
from tpinv.training.train_state import Checkpointer
from tpinv.training.data import ArithmeticTask, Batch, dp_slice, make_dataset, micro_batches
from tpinv.training.data_megatron import IndexedCorpus
from tpinv.training.config import LaunchConfig, TrainConfig
from tpinv.training.loop import NonFiniteError, Trainer, TreeAccumulator, train
from tpinv.training.metrics import MetricsLogger, plot_loss_curve, read_metrics
from tpinv.training.optim import (InvariantAdamW, ParamLayout, TorchAdamW, adamw_update, clip_coefficient,
                                  global_grad_norm, lr_at, vanilla_grad_norm)

__all__ = ["ArithmeticTask", "Batch", "CheckpointError", "Checkpointer", "IndexedCorpus", "NonFiniteError",
           "InvariantAdamW", "LaunchConfig", "MetricsLogger", "ParamLayout",
           "TorchAdamW", "TrainConfig", "Trainer", "TreeAccumulator", "adamw_update",
           "clip_coefficient", "dp_slice", "global_grad_norm", "lr_at", "make_dataset",
           "micro_batches", "plot_loss_curve", "read_metrics", "resolve_checkpoint", "train",
           "vanilla_grad_norm"]
