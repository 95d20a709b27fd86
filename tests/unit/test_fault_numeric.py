"""Numeric guards of training: optimizer flags out of range are refused before any work, and a
step whose loss or gradient norm is not finite stops the run naming the step, before the
update, so nothing non-finite is saved or made ``latest``."""
from __future__ import annotations

import io
import os

import pytest
import torch

from tpinv.testing import assert_same_bits

from tpinv.training import NonFiniteError, TrainConfig, Trainer
from tpinv.training.ckpt_files import LATEST_FILE
from tpinv.testing.scripts import load_script

TINY = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=4, micro_batch=4, steps=3, lr=1e-2, warmup=1,
            eval_every=0)


@pytest.mark.parametrize("field,value,words", [
    ("lr", float("nan"), "lr=nan"), ("lr", float("inf"), "lr=inf"), ("lr", 0.0, "lr=0.0"),
    ("min_lr", -1.0, "min_lr=-1.0"), ("min_lr", 1.0, "<= lr"), ("clip_grad", -1.0, "clip_grad=-1.0"),
    ("clip_grad", float("nan"), "clip_grad=nan"), ("beta1", 2.0, "beta1=2.0"), ("beta2", 1.0, "beta2=1.0"),
    ("weight_decay", -10.0, "weight_decay=-10.0"), ("eps", 0.0, "eps=0.0")])
def test_bad_optimizer_numbers_are_refused(field, value, words):
    cfg = TrainConfig(**dict(TINY, **{field: value}))
    with pytest.raises(ValueError, match="bad optimizer setting") as e:
        cfg.check_numbers()
    assert words in str(e.value)
    TrainConfig(**TINY).check_numbers()  # control: the defaults pass


def test_cli_refuses_nan_lr_before_building_anything(capsys):
    module = load_script("launch/pretrain.py")
    assert module.main(["--lr", "nan", "--steps", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: bad optimizer setting: lr=nan (must be finite and > 0)"]


def test_non_finite_loss_stops_the_step_and_saves_nothing(tmp_path):
    save = str(tmp_path / "ck")
    Trainer(TrainConfig(**dict(TINY, steps=1, save=save)), stream=io.StringIO()).run()
    latest = open(os.path.join(save, LATEST_FILE)).read()
    before = sorted(os.listdir(save))
    tr = Trainer(TrainConfig(**dict(TINY, save=save, save_every=1, load=save)), stream=io.StringIO())
    name = tr.layout.slots[0].name
    with torch.no_grad():
        tr.layout.params[name].view(-1)[0] = float("nan")
    masters = {s.name: tr.optimizer.tensors(s.name)["master"].clone() for s in tr.layout.slots}
    with pytest.raises(NonFiniteError, match=r"step 2: the loss is nan .* the step was not applied"):
        tr.run()
    assert tr.step == 1 and sorted(os.listdir(save)) == before
    assert open(os.path.join(save, LATEST_FILE)).read() == latest
    for s in tr.layout.slots:  # the update did not run
        assert_same_bits(tr.optimizer.tensors(s.name)["master"], masters[s.name], s.name)


def test_cli_run_flags_reach_the_config(capsys):
    module = load_script("launch/pretrain.py")
    cfg, _ = module.parse_args(["--dist-timeout", "5", "--overwrite"])
    assert cfg.dist_timeout == 5.0 and cfg.overwrite
    assert module.main(["--dist-timeout", "0"]) == 1
    assert capsys.readouterr().err.strip() == "error: --dist-timeout 0.0: expected a number of seconds > 0"
