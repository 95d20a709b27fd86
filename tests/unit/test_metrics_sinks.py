"""Metrics sinks and rank-prefixed logging of the trainer.

* TensorBoard: the event files of a run, read back with tensorboard's EventAccumulator, hold
  every step scalar of :data:`SCALAR_TAGS` at the record's step with the record's value, equal as
  Python floats (control: the learning rates of the run are not fp32 numbers, so a sink that
  rounded to fp32 -- TensorBoard's default ``simple_value`` -- would fail the check).
* W&B offline (``WANDB_MODE=offline``, no network): the offline run directory is written and
  the history records of its ``.wandb`` log hold the same values at the same steps.
* A sink asked for whose package is missing raises ImportError naming the flag and the pip
  extra; ranks other than 0 open nothing.
* Logging: messages carry ``[rank R/W tp t/T dp d/D]``, follow ``--log-level``, and the stdout
  step lines are the same text at every level.
"""
from __future__ import annotations

import glob
import io
import logging
import os
import struct
import time

import numpy as np
import pytest
import torch

from tpinv.training import TrainConfig, Trainer
from tpinv.training import sinks as sinks_mod
from tpinv.training.logs import configure_logging, rank_prefix
from tpinv.training.sinks import SCALAR_TAGS, step_scalars

TINY = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=8, micro_batch=4, eval_every=2, warmup=1, lr=1e-2,
            steps=3)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _expected(history) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for rec in history:
        for tag, value in step_scalars(rec).items():
            out.setdefault(tag, {})[rec["step"]] = value
    return out


def _not_fp32(history) -> None:
    """The control: some record values change when rounded to fp32, so an fp32 sink would not match."""
    lrs = [r["lr"] for r in history]
    assert any(float(np.float32(v)) != v for v in lrs), "control: every lr is an fp32 number"


def test_tensorboard_events_hold_the_step_records(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    tb = tmp_path / "tb"
    result = Trainer(TrainConfig(**dict(TINY, tensorboard_dir=str(tb))), stream=io.StringIO()).run()
    history = result["history"]
    assert len(history) == 3 and "heldout_exact" in history[1] and "heldout_exact" not in history[0]
    acc = EventAccumulator(str(tb), size_guidance={"tensors": 0})
    acc.Reload()
    got = {tag: {e.step: float(make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
           for tag in acc.Tags()["tensors"] if tag in SCALAR_TAGS.values()}
    want = _expected(history)
    assert set(want) >= {"train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s", "heldout/exact_match"}
    assert got == want
    assert got["heldout/exact_match"].keys() == {2, 3}
    _not_fp32(history)


def _wandb_records(data: bytes):
    """The records of a ``.wandb`` log (W&B's record log: 32 KiB blocks of CRC/length/type-framed protobufs), or
    None while its writer has not yet put down every byte of the last record."""
    from wandb.proto import wandb_internal_pb2 as pb
    assert data[:4] == b":W&B", "not a W&B log"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        if pos + 7 + length > len(data):
            return None
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            records.append(rec)
    return records


def _wandb_history(run_file: str, wait_s: float = 60.0) -> list[dict]:
    """The history rows of a finished run's log. W&B's service process writes the log; ``finish()`` can return
    before its last bytes reach the file, so this reads again until the run's closing ``exit`` record is there."""
    deadline = time.monotonic() + wait_s
    while True:
        data = open(run_file, "rb").read()
        try:
            records = _wandb_records(data)
        except Exception:  # a record whose bytes are not all written yet
            records = None
            if time.monotonic() > deadline:
                raise
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        assert time.monotonic() < deadline, f"the W&B log {run_file} never got its exit record"
        time.sleep(0.2)
    return [{item.key or "/".join(item.nested_key): item.value_json for item in rec.history.item}
            for rec in records if rec.WhichOneof("record_type") == "history"]


def test_wandb_offline_run_holds_the_step_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save_dir = tmp_path / "wb"
    trainer = Trainer(TrainConfig(**dict(TINY, wandb_project="tpinv-test", wandb_exp_name="tiny",
                                         wandb_save_dir=str(save_dir))), stream=io.StringIO())
    result = trainer.run()
    runs = glob.glob(str(save_dir / "wandb" / f"offline-run-*-{trainer.run_id}"))
    assert len(runs) == 1, os.listdir(save_dir / "wandb")
    log_file = os.path.join(runs[0], f"run-{trainer.run_id}.wandb")
    assert os.path.getsize(log_file) > 0
    got: dict[str, dict[int, float]] = {}
    for row in _wandb_history(log_file):
        for tag, value in row.items():
            if tag in SCALAR_TAGS.values():
                got.setdefault(tag, {})[int(row["_step"])] = float(value)
    assert got == _expected(result["history"])
    _not_fp32(result["history"])


def test_missing_package_names_the_flag_and_the_extra(monkeypatch):
    real = sinks_mod.importlib.util.find_spec
    monkeypatch.setattr(sinks_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    with pytest.raises(ImportError, match=r"--wandb-project needs the 'wandb' package.*tpinv\[logging\]"):
        TrainConfig(**dict(TINY, wandb_project="p")).check(1)
    with pytest.raises(ImportError, match=r"--tensorboard-dir needs the 'tensorboard' package.*tpinv\[logging\]"):
        Trainer(TrainConfig(**dict(TINY, tensorboard_dir="unused")), stream=io.StringIO())
    TrainConfig(**TINY).check(1)  # no sink asked for: nothing needed


def test_wandb_name_without_project_is_refused():
    with pytest.raises(ValueError, match="--wandb-exp-name / --wandb-save-dir need --wandb-project"):
        TrainConfig(**dict(TINY, wandb_exp_name="x")).check(1)


def test_only_rank_zero_opens_sinks(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = TrainConfig(**dict(TINY, tensorboard_dir=str(tmp_path / "tb")))
    assert sinks_mod.open_sinks(cfg, rank=1, distributed=False, run_id="r", config={}) == []
    assert not (tmp_path / "tb").exists()
    opened = sinks_mod.open_sinks(cfg, rank=0, distributed=False, run_id="r", config={})
    assert [s.name for s in opened] == ["tensorboard"] and (tmp_path / "tb").is_dir()  # the control
    opened[0].close()


def test_log_lines_carry_the_rank_and_follow_the_level():
    out = io.StringIO()
    log = configure_logging("info", rank=3, world=4, tp_rank=1, tp=2, dp_rank=1, dp=2, stream=out)
    log.getChild("training").info("hello %d", 7)
    log.getChild("training").debug("hidden")
    assert rank_prefix(3, 4, 1, 2, 1, 2) == "[rank 3/4 tp 1/2 dp 1/2]"
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith("[rank 3/4 tp 1/2 dp 1/2] INFO tpinv.training: hello 7")
    configure_logging("debug", stream=out)  # replaces the handler (no doubled lines)
    logging.getLogger("tpinv.x").debug("shown")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].endswith("[rank 0/1 tp 0/1 dp 0/1] DEBUG tpinv.x: shown")
    with pytest.raises(ValueError, match="log_level='loud'"):
        configure_logging("loud")


def test_trainer_messages_and_unchanged_step_lines(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    lines = {}
    for level in ("debug", "error"):
        out = io.StringIO()
        Trainer(TrainConfig(**dict(TINY, steps=1, log_level=level, tensorboard_dir=str(tmp_path / level))),
                stream=out).run()
        lines[level] = [ln for ln in out.getvalue().splitlines() if ln.startswith("step ")]
        err = capsys.readouterr().err
        if level == "debug":
            assert "[rank 0/1 tp 0/1 dp 0/1] INFO tpinv.training: metrics sink tensorboard:" in err
            assert "[rank 0/1 tp 0/1 dp 0/1] DEBUG tpinv.training: built qwen3-tiny" in err
        else:
            assert "tpinv.training" not in err  # the control: the level filters
    assert len(lines["debug"]) == 1
    assert [ln.split(" tok/s")[0].rsplit("|", 1)[0] for ln in lines["debug"]] == \
        [ln.split(" tok/s")[0].rsplit("|", 1)[0] for ln in lines["error"]]


def test_resumed_tensorboard_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    # the accumulator TensorBoard's own loading uses (the legacy one does not purge tensor events)
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    tb, ck = str(tmp_path / "tb"), str(tmp_path / "ck")
    first = Trainer(TrainConfig(**dict(TINY, tensorboard_dir=tb, save=ck, save_every=1)), stream=io.StringIO()).run()
    again = Trainer(TrainConfig(**dict(TINY, tensorboard_dir=tb, save=ck, load=os.path.join(ck, "step_00000001"))),
                    stream=io.StringIO()).run()
    assert [r["step"] for r in again["history"]] == [2, 3]
    acc = EventAccumulator(tb, size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("train/loss")] == [1, 2, 3]  # the first session's 2 and 3 are hidden
    # the control: the two sessions' files hold 3 + 2 loss events; the restart marker is what hides two
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    written = [e.step for f in sorted(glob.glob(os.path.join(tb, "events.out.tfevents.*")))
               for e in EventFileLoader(f).Load() if e.HasField("summary") and e.summary.value[0].tag == "train/loss"]
    assert written == [1, 2, 3, 2, 3] and len(first["history"]) == 3


def test_resumed_run_rewrites_the_metrics_file_after_its_checkpoint(tmp_path):
    from tpinv.training.metrics import read_metrics
    log, ck = str(tmp_path / "log"), str(tmp_path / "ck")
    Trainer(TrainConfig(**dict(TINY, log_dir=log, save=ck, save_every=1)), stream=io.StringIO()).run()
    first = read_metrics(log)
    assert [r["step"] for r in first if r["event"] == "step"] == [1, 2, 3]
    with open(os.path.join(log, "metrics.jsonl"), "a", encoding="utf-8") as f:
        f.write('{"event": "step", "step": 4, "lo')          # a killed run's torn last line
    Trainer(TrainConfig(**dict(TINY, log_dir=log, save=ck, load=os.path.join(ck, "step_00000001"))),
            stream=io.StringIO()).run()
    records = read_metrics(log)
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]                 # one record a step
    assert steps[0] == [r for r in first if r["event"] == "step"][0]   # the first session's step 1 kept
    assert [r["event"] for r in records].count("start") == 2       # both sessions' starts
    # the control: the same resume without the checkpoint's step to cut at appends (start_step 0
    # means a fresh run, which writes the file anew)
    from tpinv.training.metrics import drop_records_after
    drop_records_after(os.path.join(log, "metrics.jsonl"), 3)
    assert read_metrics(log) == records


def test_a_resume_with_other_settings_warns_naming_each(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    Trainer(TrainConfig(**dict(TINY, save=ck, save_every=1)), stream=io.StringIO()).run()
    step = os.path.join(ck, "step_00000001")
    same = Trainer(TrainConfig(**dict(TINY, save=ck, load=step)), stream=io.StringIO())
    assert same.resume_changes == []                                  # the control: nothing changed
    other = Trainer(TrainConfig(**dict(TINY, save=ck, load=step, seed=7, vanilla=True, lr=1e-3)),
                    stream=io.StringIO())
    assert other.resume_changes == [f"seed (checkpoint {TrainConfig().seed!r}, this run 7)",
                                    f"lr (checkpoint {TINY['lr']!r}, this run 0.001)",
                                    "vanilla (checkpoint False, this run True)"]
    capsys.readouterr()
    other.run()
    err = capsys.readouterr().err
    assert "WARNING tpinv.training: resuming" in err and "with other settings than it was saved with: seed" in err


def test_an_unwritable_log_dir_is_refused_before_training(tmp_path):
    (tmp_path / "afile").write_text("")
    cfg = TrainConfig(**dict(TINY, log_dir=str(tmp_path / "afile" / "logs")))
    with pytest.raises(sinks_mod.SinkError, match=r"--log-dir .*afile/logs is not writable"):
        sinks_mod.open_sinks(cfg, rank=0, distributed=False, run_id="r", config={})
    assert sinks_mod.open_sinks(cfg, rank=1, distributed=False, run_id="r", config={}) == []  # rank 0 checks
    cfg = TrainConfig(**dict(TINY, log_dir=str(tmp_path / "logs")))   # the control: a directory it can make
    assert sinks_mod.open_sinks(cfg, rank=0, distributed=False, run_id="r", config={}) == []
    assert (tmp_path / "logs").is_dir() and not os.listdir(tmp_path / "logs")


def test_flags_reach_the_settings_and_a_missing_package_is_one_error_line(monkeypatch, capsys):
    import importlib.util
    import sys
    from tpinv.training.config import parse_configs
    cfg, _ = parse_configs(["--tensorboard-dir", "tb", "--wandb-project", "p", "--wandb-exp-name", "n",
                            "--wandb-save-dir", "w", "--log-level", "debug"])
    assert (cfg.tensorboard_dir, cfg.wandb_project, cfg.wandb_exp_name, cfg.wandb_save_dir, cfg.log_level) == \
        ("tb", "p", "n", "w", "debug")
    assert parse_configs([])[0].log_level == "info"
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "launch"))
    try:
        import pretrain
    finally:
        sys.path.pop(0)
    real = importlib.util.find_spec
    monkeypatch.setattr(sinks_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert pretrain.main(["--tensorboard-dir", "tb"]) == 1  # before any process group: no torchrun needed
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --tensorboard-dir needs the 'tensorboard' package, which is not installed: "
                   "pip install 'tpinv[logging]' (or pip install tensorboard)"]
