"""Sharded training checkpoints in one process: keep-last, asynchronous save, the export tool.

* ``prune_steps`` removes only complete step directories older than ``latest`` beyond the newest
  K -- never the one ``latest`` names, a newer one, or a save in progress; a run with
  ``keep_last=2`` keeps its two newest steps.  Control: without ``keep_last`` every step stays.
* ``async_save=True`` writes the same tensors as a blocking save (read back whole, compared
  bit for bit) and the run resumed from it ends with the uninterrupted run's weights; control:
  the checkpoint of another step differs.
* ``tools/export_checkpoint.py`` writes a model directory with the trained weights.
"""
from __future__ import annotations

import io
import json
import os

import pytest

from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads
from tpinv.training import TrainConfig, Trainer
from tpinv.training.export import read_full_tensors
from tpinv.testing.scripts import load_script
from tpinv.training.ckpt_files import STATE_FILE, prune_steps, step_dir_name

TINY = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=8, micro_batch=4, eval_every=0, warmup=1, lr=1e-2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with num_threads(1):
        yield


def _run(**kw):
    return Trainer(TrainConfig(**dict(TINY, **kw)), stream=io.StringIO()).run()


def test_prune_steps_removes_only_older_complete_steps(tmp_path):
    for step in range(1, 6):
        os.makedirs(tmp_path / step_dir_name(step))
        (tmp_path / step_dir_name(step) / STATE_FILE).write_text("{}")
    os.makedirs(tmp_path / "step_00000002.tmp-abc")      # a save in progress
    os.makedirs(tmp_path / "step_00000001x")             # not a step directory
    os.makedirs(tmp_path / step_dir_name(0))             # incomplete (no train_state.json)
    (tmp_path / "latest").write_text(step_dir_name(3) + "\n")  # resumed from an older step
    assert prune_steps(str(tmp_path), 1) == [step_dir_name(1), step_dir_name(2)]
    assert sorted(os.listdir(tmp_path)) == ["latest", step_dir_name(0), "step_00000001x", "step_00000002.tmp-abc",
                                            step_dir_name(3), step_dir_name(4), step_dir_name(5)]
    assert prune_steps(str(tmp_path), 1) == []  # nothing older than latest is left


def test_keep_last_keeps_the_newest_steps(tmp_path):
    _run(steps=4, save=str(tmp_path / "k"), save_every=1, keep_last=2, async_save=True)
    assert sorted(os.listdir(tmp_path / "k")) == ["latest", step_dir_name(3), step_dir_name(4)]
    _run(steps=3, save=str(tmp_path / "all"), save_every=1)  # control: without keep_last every step stays
    assert sorted(os.listdir(tmp_path / "all")) == ["latest"] + [step_dir_name(s) for s in (1, 2, 3)]
    for bad in (dict(keep_last=0, save=str(tmp_path / "x")), dict(keep_last=2), dict(async_save=True),
                dict(exit_signal_handler=True)):
        with pytest.raises(ValueError, match="keep_last|needs a directory to save to"):
            TrainConfig(**dict(TINY, **bad)).check(1)


def test_async_save_writes_what_a_blocking_save_writes(tmp_path):
    full = _run(steps=4)
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    _run(steps=4, save=str(sync_dir), save_every=1, stop_after=2)
    log = tmp_path / "log"
    stopped = _run(steps=4, save=str(async_dir), save_every=1, stop_after=2, async_save=True, log_dir=str(log))
    events = [json.loads(line)["event"] for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert events.count("checkpoint_started") == 2 and events.count("checkpoint") == 2, events  # ran async
    assert stopped["step"] == 2
    for step in (1, 2):  # step 1 was written while step 2 trained: its shards were copies
        a = read_full_tensors(str(async_dir / step_dir_name(step)), "")
        b = read_full_tensors(str(sync_dir / step_dir_name(step)), "")
        assert sorted(a) == sorted(b) and len(a) > 4
        for key in a:
            assert_same_bits(a[key], b[key], f"async vs blocking save of step {step}: {key}")
    step1 = read_full_tensors(str(async_dir / step_dir_name(1)), "exp_avg/")
    name = next(iter(step1))
    assert_bits_differ(step1[name], b["exp_avg/" + name], "control: the moments of step 1 vs step 2")
    resumed = _run(steps=4, load=str(async_dir))
    assert resumed["weights_sha256"] == full["weights_sha256"] and resumed["master_sha256"] == full["master_sha256"]


def test_export_tool_writes_the_trained_weights(tmp_path, capsys):
    tool = load_script("tools/export_checkpoint.py")
    trained = Trainer(TrainConfig(**dict(TINY, steps=2, save=str(tmp_path / "ck"))), stream=io.StringIO())
    trained.run()
    out = tmp_path / "model"
    assert tool.main([str(tmp_path / "ck"), str(out)]) == 0
    again = Trainer(TrainConfig(**dict(TINY, model=str(out))), stream=io.StringIO())
    assert again.weights_sha256() == trained.weights_sha256()
    assert again.weights_sha256() != Trainer(TrainConfig(**TINY), stream=io.StringIO()).weights_sha256()  # control
    capsys.readouterr()
    assert tool.main([str(tmp_path / "no"), str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and "not found" in err and not (tmp_path / "other").exists()


def test_incomplete_or_mislabelled_checkpoints_are_refused(tmp_path):
    from tpinv.training import CheckpointError
    ck = tmp_path / "ck"
    _run(steps=1, save=str(ck))
    step = ck / step_dir_name(1)
    shard = next(n for n in os.listdir(step) if n.endswith(".distcp"))
    data = (step / shard).read_bytes()
    (step / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{shard} is missing: the checkpoint is incomplete"):
        _run(steps=2, load=str(ck))
    (step / shard).write_bytes(data)
    _run(steps=2, load=str(ck))  # control: restored, it loads
    state = json.loads((step / STATE_FILE).read_text())
    (step / STATE_FILE).write_text(json.dumps(dict(state, files={})))
    with pytest.raises(CheckpointError, match="no file checksums"):
        _run(steps=2, load=str(ck))


def test_an_async_save_is_published_at_close(tmp_path):
    ck = tmp_path / "ck"
    trainer = Trainer(TrainConfig(**dict(TINY, steps=2, save=str(ck), async_save=True)), stream=io.StringIO())
    trainer.train_step()
    trainer.save()
    assert not (ck / step_dir_name(1)).exists() and not (ck / "latest").exists()  # in flight: a temp dir only
    trainer.close()
    assert (ck / "latest").read_text().strip() == step_dir_name(1) and (ck / step_dir_name(1) / STATE_FILE).is_file()


def test_one_process_keyword_only_where_the_dcp_call_has_it():
    """torch 2.7's ``dcp.save`` takes ``no_dist`` and its ``dcp.async_save`` does not: each call gets
    the keyword only if its own signature has it (torch 2.6 has it nowhere)."""
    from tpinv.training.dcp_shards import one_process

    def with_it(state_dict, *, storage_writer=None, no_dist=False):
        pass

    def without_it(state_dict, *, storage_writer=None, process_group=None):
        pass

    assert one_process(with_it) == {"no_dist": True}
    assert one_process(without_it) == {}
