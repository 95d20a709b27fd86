"""Sharded training checkpoints (torch.distributed.checkpoint) on 4 gloo ranks.

* Saved at TP2 x DP2 after step 1 (``qwen3-kv2-tiny``), resumed at TP4 x DP1 (each KV head then
  replicated on 2 ranks) and at TP1 x DP4: both end with the final weights and fp32 masters of an
  uninterrupted TP1 run; the TP4 resume saves again (``async_save``, with replicated KV chunks)
  and TP1 x DP4 resumes from that too.  Control: the resume with another learning rate ends elsewhere.
* DP replicas are written once: the shard files of the TP2 x DP2 save hold about the bytes of a
  one-process save (twice as many if each DP replica wrote its copy).
* A flipped byte in one shard file (verified by rank 3) is refused on every rank, naming the file.
* A save never materializes a full (unsharded) tensor: a dispatch-mode detector watching for
  tensors of a sharded parameter's full size sees none during ``Trainer.save``; control: the
  same detector fires on :func:`tpinv.distributed.reduce.gather_shards`.
"""
from __future__ import annotations

import io
import math
import os

import pytest
import torch

from tpinv.testing import num_threads, run_ranks
from tpinv.training import TrainConfig, Trainer

BASE = dict(model="qwen3-kv2-tiny", digits=1, seq_len=6, global_batch=8, micro_batch=2, steps=3, lr=1e-2, warmup=1,
            eval_every=0)


class FullTensorDetector(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op output whose (local) element count is a sharded parameter's full count."""

    def __init__(self, layout):
        super().__init__()
        local = {s.numel for s in layout.slots}
        self.watch = {math.prod(s.full_shape) for s in layout.slots
                      if s.partition_dim is not None and math.prod(s.full_shape) != s.numel} - local
        self.hits, self.ops = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard
                if t.numel() in self.watch:
                    self.hits.append((str(func), tuple(t.shape)))
        return out


def _summary(result):
    return {"sha": result["weights_sha256"], "master": result["master_sha256"], "step": result["step"]}


def _save_and_resume(rank, world_size, ckpt, ckpt4):
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.distributed.reduce import gather_shards
    out = {}
    # TP2 x DP2: one step, then a watched save
    par = ParallelDims(tp=2).build()
    trainer = Trainer(TrainConfig(**dict(BASE, save=ckpt)), par, stream=io.StringIO())
    trainer.train_step()
    with FullTensorDetector(trainer.layout) as save_watch:
        trainer.save()
    sharded = next(s for s in trainer.layout.slots if s.partition_dim is not None and s.numel < math.prod(s.full_shape))
    with FullTensorDetector(trainer.layout) as control_watch:
        gather_shards(trainer.layout.params[sharded.name], trainer.tp_group, sharded.partition_dim, sharded.replicas)
    trainer.close()
    out["save_watch"] = (sorted(save_watch.watch), save_watch.hits, save_watch.ops)
    out["control_watch"] = control_watch.hits
    # resume at TP4 x DP1 (saving again after step 2, KV heads replicated), at TP1 x DP4, and the control
    from tpinv.training import train
    out["tp4"] = _summary(train(TrainConfig(**dict(BASE, load=ckpt, save=ckpt4, save_every=2, async_save=True)),
                                ParallelDims(tp=4).build(), stream=io.StringIO()))
    dp4 = ParallelDims(tp=1).build()
    out["dp4"] = _summary(train(TrainConfig(**dict(BASE, load=ckpt)), dp4, stream=io.StringIO()))
    out["dp4_from_tp4"] = _summary(train(TrainConfig(**dict(BASE, load=os.path.join(ckpt4, "step_00000002"))), dp4,
                                         stream=io.StringIO()))
    out["control_lr"] = _summary(train(TrainConfig(**dict(BASE, load=ckpt, lr=2e-2)), ParallelDims(tp=4).build(),
                                       stream=io.StringIO()))
    # a flipped byte in the file rank 3 verifies (files are checked round-robin): every rank refuses it
    import torch.distributed as dist
    from tpinv.training import CheckpointError
    corrupt = os.path.join(ckpt, "step_00000001", "__2_0.distcp")
    if rank == 0:
        data = bytearray(open(corrupt, "rb").read())
        data[-9] ^= 0x10
        open(corrupt, "wb").write(bytes(data))
    dist.barrier()
    try:
        Trainer(TrainConfig(**dict(BASE, load=ckpt)), ParallelDims(tp=2).build(), stream=io.StringIO())
        out["corrupt"] = None
    except CheckpointError as e:
        out["corrupt"] = str(e)
    return out


def _shard_bytes(step_dir):
    return sum(os.path.getsize(os.path.join(step_dir, n)) for n in os.listdir(step_dir) if n.endswith(".distcp"))


@pytest.mark.slow
def test_sharded_save_at_tp2_dp2_resumes_at_tp4_and_dp4_bitwise(tmp_path):
    ckpt, ckpt4, one = str(tmp_path / "ck"), str(tmp_path / "ck4"), str(tmp_path / "one")
    with num_threads(1):
        full = Trainer(TrainConfig(**BASE), stream=io.StringIO()).run()
        Trainer(TrainConfig(**dict(BASE, save=one, stop_after=1)), stream=io.StringIO()).run()
    outs = run_ranks(_save_and_resume, 4, ckpt, ckpt4, timeout=600)
    out = outs[0]
    errors = {o["corrupt"] for o in outs}
    assert len(errors) == 1 and errors.pop().endswith("__2_0.distcp: sha256 mismatch with train_state.json; the "
                                                      "file is corrupt"), [o["corrupt"] for o in outs]

    for name in ("tp4", "dp4", "dp4_from_tp4"):
        assert out[name]["step"] == BASE["steps"], name
        assert out[name]["sha"] == full["weights_sha256"], f"{name}: final weights differ from the TP1 run"
        assert out[name]["master"] == full["master_sha256"], f"{name}: final fp32 masters differ from the TP1 run"
    # negative control: a resume that changes the learning rate ends elsewhere
    assert out["control_lr"]["sha"] != full["weights_sha256"] and out["control_lr"]["master"] != full["master_sha256"]

    step1 = os.path.join(ckpt, "step_00000001")
    assert sorted(n for n in os.listdir(step1) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    ratio = _shard_bytes(step1) / _shard_bytes(os.path.join(one, "step_00000001"))
    assert 0.9 < ratio < 1.25, f"TP2xDP2 shard files hold {ratio:.2f}x the bytes of a one-process save"

    watch, hits, ops = out["save_watch"]
    assert watch and ops > 100, "the detector watched nothing or saw no work"
    assert hits == [], f"the save materialized full tensors: {hits[:5]}"
    assert out["control_watch"], "control: the detector missed a gather of full tensors"
