"""The training loop: the same loss curve and final weights, bit for bit, at every TP size.

Per step, the order of every sum is fixed and independent of the TP size:

* the global batch is a function of (seed, samples consumed); DP rank ``d`` takes rows
  ``[d*G/D, (d+1)*G/D)`` and cuts them into micro-batches in order (:mod:`tpinv.training.data`);
* per micro-batch, the summed loss (the per-token losses of the model's invariant
  cross-entropy, times the loss mask, summed over the flattened tokens by ``tree_sum(.., 1)``)
  is back-propagated; each parameter's gradient (rounded once by the layers to the parameter
  dtype) is widened into an fp32 buffer, together with the loss sum;
* the micro-batch buffers are combined by the adjacent-pair tree in micro-batch order, then
  across DP ranks by the tree reducer -- one tree over the ``M = global_batch / micro_batch``
  micro-batch leaves of the global batch.  ``M`` must be a power of two (checked), so every
  DP size ``D`` (a power of two dividing ``M``) gives each rank ``M / D`` whole, contiguous
  sub-trees, and how micro-batches map to ranks and accumulation steps never changes the
  tree: TP x DP layouts of any world (TP2xDP2, TP4xDP1, TP1xDP4, TP1xDP1) agree bitwise;
* the sum is divided (elementwise) by the number of loss tokens in the global batch, the
  gradient norm is taken by :func:`~tpinv.training.optim.global_grad_norm`, clipped, and
  :class:`~tpinv.training.optim.InvariantAdamW` updates the fp32 masters and the model.

``vanilla=True`` is the control: the plain torch/BLAS model path, ``torch.sum``, plain
``all_reduce`` and ``torch.optim.AdamW`` on the same data and weights.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import torch
import torch.distributed as dist

from tpinv.core.contract import InvarianceError, TreeAccumulator
from tpinv.io.checkpoint import param_meta_from_module
from tpinv.io.run_dir import new_run_id
from tpinv.ops import tree_sum
from tpinv.distributed.reduce import gather_shards, tree_all_reduce
from tpinv.training.preemption import ExitSignalHandler
from tpinv.training.ckpt_files import check_compatible
from tpinv.training.train_state import Checkpointer
from tpinv.training.config import TrainConfig
from tpinv.training.guards import (NonFiniteError, changed_on_resume, check_finite, claim_save_dir, config_sha256,
                                   watchdog)
from tpinv.training.data import dp_slice, make_dataset, micro_batches
from tpinv.training.logs import configure_logging
from tpinv.training.metrics import PLOT_FILE, MetricsLogger, plot_loss_curve, read_metrics
from tpinv.training.sinks import open_sinks
from tpinv.training.model import build_model
from tpinv.training.optim import (InvariantAdamW, ParamLayout, TorchAdamW, clip_coefficient, global_grad_norm,
                                  lr_at, vanilla_grad_norm)

__all__ = ["NonFiniteError", "TrainConfig", "Trainer", "TreeAccumulator", "train"]

#: Rows per forward when measuring held-out accuracy (the model is batch-invariant).
EVAL_CHUNK = 64


def fp32_hex(x: float) -> str:
    """``float.hex()`` without the trailing zeros an fp32 value leaves: ``0x1.6314cp+2``."""
    if x != x or x in (float("inf"), float("-inf")):
        return x.hex()  # "nan", "inf", "-inf"
    mantissa, exponent = x.hex().split("p")
    return (mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa) + "p" + exponent


class Trainer:
    """One rank's view of a run; ``parallel=None`` is a single process without torch.distributed."""

    def __init__(self, config: TrainConfig, parallel=None, *, stream=None):
        self.cfg, self.par = config, parallel
        self.tp, self.dp = (parallel.tp_size, parallel.dp_size) if parallel else (1, 1)
        self.tp_rank, self.dp_rank = (parallel.tp_rank, parallel.dp_rank) if parallel else (0, 0)
        self.rank = parallel.rank if parallel else 0
        # groups are passed even of size 1 (tpinv.distributed.groups: None is a single-process run)
        self.tp_group = parallel.tp_group if parallel else None
        self.dp_group = parallel.dp_group if parallel else None
        self.log = configure_logging(config.log_level, rank=self.rank, world=parallel.world_size if parallel else 1,
                                     tp_rank=self.tp_rank, tp=self.tp, dp_rank=self.dp_rank,
                                     dp=self.dp).getChild("training")
        self.logger = None
        config.check(self.dp)
        if not config.vanilla and self.dp & (self.dp - 1):
            raise InvarianceError(f"dp={self.dp}: the tree reducer needs a power-of-two data-parallel size")
        self.run_id, self.lock = new_run_id(), None
        if config.save:  # before any model work: a bad or busy --save fails now, not after the steps
            self.lock = claim_save_dir(config.save, rank=self.rank, distributed=parallel is not None,
                                       run_id=self.run_id, resume=bool(config.load), overwrite=config.overwrite)
        try:
            self._build(config, stream)
        except BaseException:
            self.close(publish=False)
            raise

    def close(self, publish: bool = True) -> None:
        """The end of the run: publish an asynchronous save still in flight (collective; not when
        ``publish=False``, after an error), close the metrics, release the ``save`` directory's lock."""
        if publish and getattr(self, "checkpointer", None) is not None and self.logger is not None:
            self.finalize_save()
        if self.logger is not None:
            self.logger.close()  # the sinks too (a W&B run is finished)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _build(self, config: TrainConfig, stream) -> None:
        parallel = self.par
        self.dataset = make_dataset(config.data, config.seq_len, config.seed, tokenizer=config.tokenizer,
                                    digits=config.digits, heldout_size=config.heldout_size,
                                    data_path=config.data_path, data_cache_path=config.data_cache_path,
                                    num_samples=config.steps * config.global_batch)
        # the model takes the TP group even of size 1: tpinv layers never guess a group
        model_group = parallel.tp_group if parallel else None
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if parallel is not None and dist.get_backend() == "nccl" else torch.device("cpu")
        self.model_args, self.model = build_model(config, model_group, self.tp, self.tp_rank)
        self.model.to(self.device)  # built on the CPU from the seed, moved exactly
        if self.dataset.vocab_size > self.model_args.vocab_size:
            raise ValueError(f"the data's vocabulary ({self.dataset.vocab_size} ids) exceeds the model's "
                             f"vocab_size={self.model_args.vocab_size}; use a model with a larger vocabulary")
        self.layout = ParamLayout(self.model, self.tp)
        opt = TorchAdamW if config.vanilla else InvariantAdamW
        self.optimizer = opt(self.layout, betas=(config.beta1, config.beta2), eps=config.eps,
                             weight_decay=config.weight_decay)
        self.step, self.consumed, self.history, self.resumed_from, self.resume_changes = 0, 0, [], None, []
        self.checkpointer = Checkpointer(config.save, tp=self.tp, dp=self.dp, rank=self.rank,
                                         distributed=parallel is not None, async_save=config.async_save,
                                         keep_last=config.keep_last)
        if config.load:
            args = _args_dict(self.model_args)
            st = self.checkpointer.load(config.load, layout=self.layout, optimizer=self.optimizer,
                                        check=lambda state, where: check_compatible(state, args, config.leaves, where))
            self.step, self.consumed, self.resumed_from = st["step"], st["consumed_samples"], st["path"]
            self.run_id = st.get("run_id", self.run_id)
            self.resume_changes = changed_on_resume(st.get("config", {}), dataclasses.asdict(config))
        sinks = open_sinks(config, rank=self.rank, distributed=parallel is not None, run_id=self.run_id,
                           config=dataclasses.asdict(config), start_step=self.step)
        self.logger = MetricsLogger(config.steps, log_dir=config.log_dir, enabled=self.rank == 0,
                                    progress=config.progress, stream=stream, start_step=self.step, sinks=sinks)
        for sink in sinks:
            self.log.info("metrics sink %s: %s", sink.name, sink.where)
        self.log.debug("built %s on %s: %d parameter elements on this rank, step %d", config.model, self.device,
                       sum(p.numel() for p in self.model.parameters()), self.step)

    # -- one step -------------------------------------------------------------------------
    def _micro_loss(self, mb, sample_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.vanilla:
            from tpinv.models.vanilla import vanilla_loss
            return (vanilla_loss(self.model, mb.tokens, mb.targets) * mb.loss_mask).sum()
        per_token = self.model.loss(mb.tokens, mb.targets, sample_ids=sample_ids,
                                    chunk_tokens=self.cfg.cross_entropy_chunk_tokens)
        return tree_sum((per_token * mb.loss_mask).reshape(-1), 1)

    def _dp_sum(self, total: torch.Tensor) -> torch.Tensor:
        if self.dp == 1:
            return total
        if self.cfg.vanilla:
            dist.all_reduce(total, group=self.dp_group)
            return total
        return tree_all_reduce(total, self.dp_group, leaves=max(self.cfg.leaves, self.dp))

    def train_step(self) -> dict:
        watchdog(self.step + 1, self.cfg.dist_timeout)  # gloo: names a rank that stopped answering
        cfg, start = self.cfg, time.perf_counter()
        lr = lr_at(self.step, lr=cfg.lr, min_lr=cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr,
                   warmup=cfg.warmup, total=cfg.steps)
        batch = self.dataset.batch(self.consumed, cfg.global_batch).to(self.device)
        loss_tokens = batch.num_loss_tokens
        acc, chain = TreeAccumulator(), None
        # each row's global sample index in the run (its dropout masks key on it, never on the split)
        first = self.consumed + self.dp_rank * (cfg.global_batch // self.dp)
        for k, mb in enumerate(micro_batches(dp_slice(batch, self.dp_rank, self.dp), cfg.micro_batch)):
            ids = torch.arange(first + k * cfg.micro_batch, first + (k + 1) * cfg.micro_batch, device=self.device)
            loss_sum = self._micro_loss(mb, ids)
            loss_sum.backward()
            buf = self.layout.flatten_grads(torch.empty(self.layout.numel + 1, dtype=torch.float32,
                                                        device=self.device))
            buf[-1] = loss_sum.detach()
            self.model.zero_grad(set_to_none=True)
            if cfg.vanilla:
                chain = buf if chain is None else chain + buf
            else:
                acc.push(buf)
        total = self._dp_sum(chain if cfg.vanilla else acc.result())
        grads, loss = total[:-1] / loss_tokens, total[-1] / loss_tokens
        norm = vanilla_grad_norm(grads, self.layout, self.tp_group) if cfg.vanilla else \
            global_grad_norm(grads, self.layout, self.tp_group, cfg.leaves)
        check_finite(self.step + 1, loss, norm, cfg.save)  # before the update: nothing non-finite is applied
        coef = clip_coefficient(norm, cfg.clip_grad)
        if coef is not None:
            grads.mul_(coef)
        self.optimizer.step(grads, lr)
        self.step, self.consumed = self.step + 1, self.consumed + cfg.global_batch
        elapsed = time.perf_counter() - start
        loss_f, norm_f = float(loss), float(norm)
        return {"step": self.step, "loss": loss_f, "loss_hex": fp32_hex(loss_f), "grad_norm": norm_f,
                "grad_norm_hex": fp32_hex(norm_f), "lr": lr, "clipped": coef is not None,
                "tokens_per_s": cfg.global_batch * cfg.seq_len / elapsed, "loss_tokens": loss_tokens,
                "consumed_samples": self.consumed, "time_s": elapsed}

    # -- evaluation, weights, checkpoints ------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Teacher-forced greedy accuracy on the held-out set: argmax of the full logits per answer token."""
        held = self.dataset.heldout()
        if held is None:
            return {}
        held = held.to(self.device)
        self.model.eval()  # no dropout
        try:
            return self._heldout_accuracy(held)
        finally:
            self.model.train()

    def _heldout_accuracy(self, held) -> dict:
        n = len(held)
        lo, hi = self.dp_rank * n // self.dp, (self.dp_rank + 1) * n // self.dp
        counts = torch.zeros(4, dtype=torch.int64, device=self.device)  # exact, rows, right, answer tokens
        for start in range(lo, hi, EVAL_CHUNK):
            b = held.rows(start, min(hi, start + EVAL_CHUNK))
            if self.cfg.vanilla:
                from tpinv.models.vanilla import vanilla_forward
                logits = vanilla_forward(self.model, b.tokens, gather_logits=True)
            else:
                logits = self.model(b.tokens, gather_logits=True)
            need = b.loss_mask > 0
            right = (logits.argmax(-1) == b.targets) & need
            counts += torch.stack([(right == need).all(-1).sum(), need.new_tensor(len(b), dtype=torch.int64),
                                   right.sum(), need.sum()])
        if self.dp > 1:
            dist.all_reduce(counts, group=self.dp_group)  # integer sums are exact in any order
        c = counts.tolist()
        return {"heldout_exact": c[0] / c[1], "heldout_token_acc": c[2] / c[3]}

    def _full(self, t: torch.Tensor, dim, replicas: int = 1) -> torch.Tensor:
        return t.detach() if dim is None or self.tp == 1 else gather_shards(t, self.tp_group, dim, replicas)

    def weights_sha256(self, which: str = "model") -> str:
        """sha256 of the full tensors (names, dtypes, shapes, bytes) of the model or the fp32 masters."""
        h = hashlib.sha256()
        for s in self.layout.slots:
            t = self.layout.params[s.name] if which == "model" else self.optimizer.tensors(s.name)["master"]
            full = self._full(t, s.partition_dim, s.replicas).cpu().contiguous()
            h.update(f"{s.name}|{full.dtype}|{tuple(full.shape)}|".encode())
            h.update(full.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def save(self) -> str:
        cfg = self.cfg
        state = {"consumed_samples": self.consumed, "leaves": cfg.leaves, "row_strategy": cfg.row_strategy,
                 "run_id": self.run_id, "config_sha256": config_sha256(dataclasses.asdict(cfg)),
                 "data": self.dataset.describe(), "tp_size": self.tp, "dp_size": self.dp, "vanilla": cfg.vanilla,
                 "config": dataclasses.asdict(cfg)}
        state.update(model_args=_args_dict(self.model_args), param_meta=param_meta_from_module(self.model))
        self.finalize_save()  # the save in flight first (its own event)
        path = self.checkpointer.save(step=self.step, layout=self.layout, optimizer=self.optimizer, state=state)
        if cfg.async_save:
            self.logger.event("checkpoint_started", {"step": self.step, "path": path},
                              f"saving checkpoint {path} in the background")
        else:
            self.logger.event("checkpoint", {"step": self.step, "path": path}, f"saved checkpoint {path}")
        return path

    def finalize_save(self) -> None:
        """Wait for an asynchronous save in flight and publish it (collective)."""
        path = self.checkpointer.finalize()
        if path is not None:
            self.logger.event("checkpoint", {"step": int(path[-8:]), "path": path}, f"saved checkpoint {path}")

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            result = self._run()
        except BaseException:
            self.close(publish=False)  # the other ranks may be gone: no collective
            raise
        self.close()
        return result

    def _run(self) -> dict:
        cfg = self.cfg
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
        self.logger.event("start", self.describe(), self.describe()["line"])
        if self.resume_changes:
            self.logger.event("warning", {"resume_changes": self.resume_changes})
            if self.rank == 0:
                self.log.warning("resuming %s with other settings than it was saved with: %s (the curve will "
                                 "differ from an uninterrupted run)", self.resumed_from,
                                 "; ".join(self.resume_changes))
        saved_at = start = self.step
        signals = ExitSignalHandler(distributed=self.par is not None, device=self.device) \
            if cfg.exit_signal_handler else None
        stopped_by_signal = False
        try:
            while self.step < end:
                rec = self.train_step()
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps:
                    rec.update(self.evaluate())
                self.history.append(rec)
                self.logger.step(rec)
                if cfg.save and cfg.save_every and self.step % cfg.save_every == 0:
                    self.save()
                    saved_at = self.step
                if signals is not None and signals.stop_requested():  # the same step on every rank
                    stopped_by_signal = True
                    self.logger.event("exit_signal", {"step": self.step},
                                      f"SIGTERM received: saving at step {self.step} and exiting")
                    break
            if cfg.save and saved_at != self.step:  # the end of a session that took steps
                self.save()
            self.finalize_save()
        finally:
            if signals is not None:
                signals.close()
        result = {"step": self.step, "weights_sha256": self.weights_sha256("model"),
                  "master_sha256": self.weights_sha256("master"), "history": self.history,
                  "exit_signal": stopped_by_signal}
        self.logger.event("final", {k: v for k, v in result.items() if k != "history"},
                          f"final weights sha256 {result['weights_sha256']} (step {self.step})")
        if self.rank == 0 and cfg.log_dir and self.step > start:
            steps = {r["step"]: r for r in read_metrics(cfg.log_dir) if r["event"] == "step"}  # resumed: all
            try:
                path = plot_loss_curve([steps[k] for k in sorted(steps)], os.path.join(cfg.log_dir, PLOT_FILE),
                                       title=self._title())
                self.logger.event("plot", {"path": path}, f"loss curve {path}")
            except ImportError:
                self.logger.event("plot", {"path": None})
                self.log.warning("loss-curve PNG skipped: matplotlib is not installed")
        self.logger.close()
        return result

    def _title(self) -> str:
        return f"{self.cfg.model} TP={self.tp} DP={self.dp}" + (" (vanilla)" if self.cfg.vanilla else "")

    def describe(self) -> dict:
        cfg, a = self.cfg, self.model_args
        n_micro = cfg.global_batch // (cfg.micro_batch * self.dp)
        line = (f"tpinv pretrain: {cfg.model} ({a.num_layers} layers, hidden {a.hidden_size}, {cfg.dtype}) | "
                f"TP={self.tp} DP={self.dp} | {'vanilla control' if cfg.vanilla else 'invariant'} | "
                f"data {self.dataset.describe()['kind']} | global batch {cfg.global_batch} = {self.dp} x "
                f"{n_micro} micro-batches x {cfg.micro_batch} | seq {cfg.seq_len} | steps {self.step + 1}..{cfg.steps}"
                + (f" | resumed from {self.resumed_from}" if self.resumed_from else ""))
        return {"tp": self.tp, "dp": self.dp, "vanilla": cfg.vanilla, "start_step": self.step,
                "config": dataclasses.asdict(cfg), "line": line}


def _args_dict(model_args) -> dict:
    from tpinv.io.hf_keys import args_to_dict
    return args_to_dict(model_args)


def train(config: TrainConfig, parallel=None, *, stream=None) -> dict:
    """Build a :class:`Trainer` and run it; returns ``{"step", "weights_sha256", "master_sha256", "history"}``."""
    return Trainer(config, parallel, stream=stream).run()
