"""A run's settings: two dataclasses, and the command line and YAML files generated from them.

Every setting is declared once, as a dataclass field whose metadata carries its help text and
flag group; :func:`build_parser` turns the fields into ``launch/pretrain.py``'s flags
(``--global-batch`` for ``global_batch``), and :func:`load_yaml_config` reads the same names from a
YAML file (``global_batch: 64`` or ``global-batch: 64``).  Precedence: a flag given on the
command line, then the ``--config`` file, then the field's default.

* :class:`TrainConfig` -- what a run computes and where it saves; :func:`tpinv.training.train`
  takes it.  Its settings are recorded in checkpoints (a resume with a changed setting that
  alters the curve is reported).
* :class:`LaunchConfig` -- how the processes are laid out (TP, DP, backend, threads); the curve
  does not depend on them, so they are not part of a run's identity.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Optional

from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError
from tpinv.layers.linear_cross_entropy import check_chunk_tokens
from tpinv.training.guards import check_optimizer_numbers
from tpinv.training.sinks import check_sink_packages

__all__ = ["LaunchConfig", "TrainConfig", "build_parser", "configs_from_namespace", "load_yaml_config",
           "parse_configs"]


def setting(default: Any, help: str, group: str, **flag: Any) -> Any:
    """A dataclass field with its flag's help text and group (``choices=``, ``flag=False`` for no flag)."""
    return dataclasses.field(default=default, metadata={"help": help, "group": group, **flag})


MODEL = LAYOUT = "model and parallelism"
OPTIM, DATA, SAVE = "optimization", "data", "checkpoints and logs"
LOGS = "metrics sinks and logging"


@dataclasses.dataclass
class TrainConfig:
    """Every setting of a run that the curve or its outputs depend on (the ``launch/pretrain.py`` flags)."""

    model: str = setting("qwen3-tiny", "named config (qwen3-tiny, llama-tiny, mistral-tiny, ...), a HF model "
                         "directory or a tpinv checkpoint", MODEL)
    dtype: str = setting("bf16", "model parameter dtype (the master weights and gradients are always fp32)", MODEL,
                         choices=("bf16", "fp32", "fp16"))
    leaves: int = setting(DEFAULT_LEAVES, "leaf count of the contract (the largest TP size)", MODEL)
    row_strategy: str = setting("tree", "how a row-parallel layer combines partial sums", MODEL,
                                choices=("tree", "column_only"))
    sequence_parallel: bool = setting(False, "Megatron's sequence parallelism: norms and residuals on sequence "
                                      "chunks (the same bits as without it)", MODEL)
    recompute_granularity: Optional[str] = setting(
        None, "Megatron's activation recompute (the same bits as without): 'selective' recomputes the attention "
        "core of every layer, 'full' whole layers (with --recompute-method)", MODEL, choices=("full", "selective"))
    recompute_method: Optional[str] = setting(
        None, "with --recompute-granularity full: 'uniform' checkpoints consecutive groups of "
        "--recompute-num-layers layers, 'block' checkpoints the first --recompute-num-layers layers one by one",
        MODEL, choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = setting(
        None, "with --recompute-granularity full: layers per group (uniform) or layers recomputed (block)", MODEL)
    vanilla: bool = setting(False, "the control: plain torch/BLAS/all_reduce path", MODEL)
    hidden_dropout: float = setting(0.0, "Megatron's hidden_dropout: dropout of the attention and MLP outputs "
                                    "before each residual add, masks keyed by (seed, layer, sample, token, "
                                    "feature): the same at every TP/SP/DP layout", MODEL)
    attention_dropout: float = setting(0.0, "Megatron's attention_dropout on the attention probabilities: not "
                                       "supported by tpinv's fused attention (> 0 is refused)", MODEL)
    cross_entropy_chunk_tokens: Optional[int] = setting(
        None, "run the output layer and the cross-entropy this many tokens at a time, forward and backward "
        "(at most N x vocab/TP logits at once; the same loss and gradient bits as unchunked; default: all tokens "
        "at once)", MODEL)
    dist_timeout: float = setting(600.0, "seconds a rank waits for the others before the run stops with an "
                                  "error naming the ranks that did not answer", MODEL)
    steps: int = setting(100, "optimizer steps of the run (the LR schedule's length)", OPTIM)
    global_batch: int = setting(32, "sequences per step", OPTIM)
    micro_batch: int = setting(8, "sequences per forward/backward", OPTIM)
    seq_len: int = setting(16, "tokens per sequence", OPTIM)
    lr: float = setting(3e-3, "peak learning rate", OPTIM)
    min_lr: Optional[float] = setting(None, "end of the cosine decay (default lr / 10)", OPTIM)
    warmup: int = setting(10, "linear warmup steps", OPTIM)
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay", OPTIM)
    clip_grad: float = setting(1.0, "max global grad norm (0: off)", OPTIM)
    beta1: float = setting(0.9, "AdamW beta1", OPTIM)
    beta2: float = setting(0.95, "AdamW beta2", OPTIM)
    eps: float = setting(1e-8, "AdamW epsilon", OPTIM)
    seed: int = setting(1234, "seed of the weights and the data order", OPTIM)
    data: str = setting("arithmetic", "'arithmetic' (built in) or a .txt / .jsonl file (preprocessed once into "
                        "--data-cache-path, then read as --data-path)", DATA)
    data_path: Optional[list[str]] = setting(None, "Megatron's indexed datasets (tools/preprocess_data.py): a prefix "
                                             "(PREFIX.bin/.idx) or a blend 'W1 PREFIX1 W2 PREFIX2 ...'", DATA)
    data_cache_path: Optional[str] = setting(None, "directory of megatron's dataset index caches and preprocessed "
                                             "--data files, seen by every rank (default: 'cache' beside the data)",
                                             DATA)
    tokenizer: Optional[str] = setting(None, "tokenizer.json / tokenizer.model of the data (needed with "
                                       "--data-path; --data files default to UTF-8 bytes)", DATA)
    digits: int = setting(2, "arithmetic: digits per operand", DATA)
    heldout_size: Optional[int] = setting(None, "arithmetic: held-out problems (default: a fifth, at most 256)", DATA)
    eval_every: int = setting(25, "held-out accuracy every N steps (0: at the end only)", DATA)
    save: Optional[str] = setting(None, "checkpoint directory", SAVE)
    save_every: int = setting(0, "save every K steps (and at the end)", SAVE)
    load: Optional[str] = setting(None, "resume from a checkpoint directory (its 'latest') or a step dir", SAVE)
    overwrite: bool = setting(False, "a fresh run may replace the checkpoints another run left in --save "
                              "(without it, and without --load, such a directory is refused)", SAVE)
    stop_after: Optional[int] = setting(None, "stop after this step (the schedule still follows --steps); resume "
                                        "later with --load", SAVE)
    async_save: bool = setting(False, "write checkpoints in a background thread while training goes on (each "
                               "rank's shards are first copied to host memory); 'latest' moves when the save is "
                               "finalized, at the next save or the end of the run", SAVE)
    keep_last: Optional[int] = setting(None, "keep only the newest N complete step directories (older complete "
                                       "ones are removed after each save; default: keep all)", SAVE)
    exit_signal_handler: bool = setting(False, "on SIGTERM every rank finishes the current step, the run saves "
                                        "a checkpoint and exits with status 0 (resume with --load)", SAVE)
    log_dir: Optional[str] = setting(None, "metrics.jsonl and loss_curve.png go here", SAVE)
    progress: Optional[bool] = setting(None, "tqdm progress bar (default: when stdout is a terminal)", SAVE)
    tensorboard_dir: Optional[str] = setting(None, "write the step scalars as TensorBoard event files here (needs "
                                             "pip install 'tpinv[logging]')", LOGS)
    wandb_project: Optional[str] = setting(None, "log the step scalars to this Weights & Biases project (needs "
                                           "pip install 'tpinv[logging]'; WANDB_MODE=offline: no network)", LOGS)
    wandb_exp_name: Optional[str] = setting(None, "W&B run name (default: the run id)", LOGS)
    wandb_save_dir: Optional[str] = setting(None, "W&B's local files (default: SAVE/wandb, else LOG_DIR/wandb, "
                                            "else ./wandb)", LOGS)
    log_level: str = setting("info", "level of the trainer's rank-prefixed messages on stderr (the step lines on "
                             "stdout do not depend on it)", LOGS, choices=("debug", "info", "warning", "error"))

    def check_numbers(self) -> None:
        """Refuse optimizer settings that are not finite or out of range (before any work is done)."""
        check_optimizer_numbers(self)

    def check(self, dp: int) -> None:
        for name in ("steps", "global_batch", "micro_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: expected a positive int")
        if not self.vanilla and dp & (dp - 1):
            raise InvarianceError(
                f"{dp} data-parallel ranks: the gradient tree over data-parallel ranks needs a power of two "
                f"(1, 2, 4, ...); launch tp * 2**k ranks")
        if self.global_batch % (self.micro_batch * dp):
            raise ValueError(f"global_batch={self.global_batch} must be a multiple of micro_batch * dp = "
                             f"{self.micro_batch} * {dp} = {self.micro_batch * dp}")
        leaves = self.global_batch // self.micro_batch
        if not self.vanilla and leaves & (leaves - 1):
            raise InvarianceError(
                f"global_batch / micro_batch = {self.global_batch} / {self.micro_batch} = {leaves} micro-batches: "
                f"the gradient tree over micro-batches needs a power of two so every data-parallel size (a power "
                f"of two dividing it) holds whole sub-trees; e.g. global_batch={self.micro_batch * (1 << leaves.bit_length())}")
        check_chunk_tokens(self.cross_entropy_chunk_tokens, "cross_entropy_chunk_tokens")
        if self.vanilla and self.cross_entropy_chunk_tokens is not None:
            raise NotImplementedError("cross_entropy_chunk_tokens is not supported by the vanilla control (--vanilla)")
        if self.vanilla and self.sequence_parallel:
            raise NotImplementedError("sequence_parallel=True is not supported by the vanilla control (--vanilla)")
        if self.sequence_parallel and self.row_strategy != "tree":
            raise NotImplementedError(f"--sequence-parallel needs --row-strategy tree (the row-parallel layers "
                                      f"reduce-scatter the sequence), got --row-strategy {self.row_strategy}")
        if self.vanilla and (self.hidden_dropout or self.attention_dropout):
            raise NotImplementedError("hidden_dropout / attention_dropout > 0 are not supported by the vanilla "
                                      "control (--vanilla)")
        if self.vanilla and self.recompute_granularity is not None:
            raise NotImplementedError(f"recompute_granularity={self.recompute_granularity!r} is not supported by the "
                                      f"vanilla control (--vanilla)")
        if self.warmup < 0 or self.save_every < 0 or self.eval_every < 0:
            raise ValueError("warmup, save_every and eval_every must be >= 0")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout={self.dist_timeout}: expected a number of seconds > 0")
        self.check_numbers()
        check_sink_packages(self)
        for name in ("save_every", "async_save", "keep_last", "exit_signal_handler"):
            if getattr(self, name) and not self.save:
                raise ValueError(f"{name}={getattr(self, name)} needs a directory to save to (--save DIR)")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last={self.keep_last}: expected at least 1 step directory to keep")


@dataclasses.dataclass
class LaunchConfig:
    """How the run's processes are laid out; the loss curve and the weights do not depend on these."""

    tp: int = setting(1, "tensor-parallel size (a power of two dividing --leaves)", LAYOUT)
    dp: Optional[int] = setting(None, "data-parallel size (default world / tp)", LAYOUT)
    backend: Optional[str] = setting(None, "default: nccl with GPUs, else gloo", LAYOUT, choices=("gloo", "nccl"))
    threads: Optional[int] = setting(None, "torch CPU threads per rank (results do not depend on it; 1 is fastest "
                                     "for the tiny models on a small machine)", LAYOUT)


_CLASSES = (TrainConfig, LaunchConfig)


def _fields() -> list[tuple[type, dataclasses.Field, Any]]:
    out = []
    for cls in _CLASSES:
        hints = typing.get_type_hints(cls)
        out += [(cls, f, hints[f.name]) for f in dataclasses.fields(cls)]
    return out


def _scalar_type(hint: Any) -> type:
    """``int`` for ``Optional[int]``; ``str`` for ``list[str]`` (the item type of a list field)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if args else hint
    return typing.get_args(hint)[0] if _is_list(hint) else hint


def _is_list(hint: Any) -> bool:
    """A ``list[...]`` or ``Optional[list[...]]`` field (flag with ``nargs="+"``, a YAML list)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is typing.Union \
        else [hint]
    return len(args) == 1 and typing.get_origin(args[0]) is list


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """The flags of :class:`TrainConfig` and :class:`LaunchConfig`, plus ``--config FILE.yaml``."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, help="YAML file of settings (the names of these flags, with _ or -); "
                   "flags given on the command line override it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for _, f, hint in _fields():
        meta = f.metadata
        if meta.get("flag", True) is False:
            continue
        g = groups.get(meta["group"]) or groups.setdefault(meta["group"], p.add_argument_group(meta["group"]))
        kind = _scalar_type(hint)
        if kind is bool:
            action = argparse.BooleanOptionalAction if f.default is None else "store_true"
            g.add_argument(_flag(f.name), dest=f.name, action=action, default=f.default, help=meta["help"])
        else:
            g.add_argument(_flag(f.name), dest=f.name, type=kind, default=f.default, choices=meta.get("choices"),
                           help=meta["help"], **({"nargs": "+"} if _is_list(hint) else {}))
    return p


def load_yaml_config(path: str) -> dict:
    """The settings of a YAML file as ``{field_name: value}``, checked against the two dataclasses."""
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - PyYAML is a dependency
        raise ImportError("--config needs PyYAML: pip install pyyaml") from exc
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file")
    with open(path, encoding="utf-8") as fh:
        try:
            raw = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ValueError(f"--config {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a mapping of setting names to values, got {type(raw).__name__}")
    known = {f.name: (f, hint) for _, f, hint in _fields()}
    out = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(f"--config {path}: unknown setting {key!r}; known: {', '.join(sorted(known))}")
        f, hint = known[name]
        kind = _scalar_type(hint)
        if _is_list(hint) and value is not None:
            out[name] = _yaml_list(path, key, value, kind)
            continue
        if value is not None and not isinstance(value, kind) and not (kind is float and isinstance(value, int)
                                                                       and not isinstance(value, bool)):
            raise ValueError(f"--config {path}: {key}={value!r} is a {type(value).__name__}, expected "
                             f"{kind.__name__}")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"--config {path}: {key}={value!r}; choose from {', '.join(map(str, choices))}")
        out[name] = float(value) if kind is float and value is not None else value
    return out


def _yaml_list(path: str, key: str, value: Any, kind: type) -> list:
    """A YAML list (or one scalar) of a list field; numbers in a ``list[str]`` become their text (weights)."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError(f"--config {path}: {key} is an empty list")
    out = []
    for item in items:
        if kind is str and isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, kind) or isinstance(item, bool) and kind is not bool:
            raise ValueError(f"--config {path}: {key} item {item!r} is a {type(item).__name__}, expected "
                             f"{kind.__name__}")
        out.append(item)
    return out


def parse_configs(argv=None, description: Optional[str] = None) -> tuple[TrainConfig, LaunchConfig]:
    """Parse ``argv`` (flags over ``--config`` over defaults) into the two dataclasses."""
    parser = build_parser(description)
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**load_yaml_config(first.config))
    return configs_from_namespace(parser.parse_args(argv))


def configs_from_namespace(ns: argparse.Namespace) -> tuple[TrainConfig, LaunchConfig]:
    values = vars(ns)
    return tuple(cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
                 for cls in _CLASSES)
