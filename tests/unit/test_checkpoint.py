"""tpinv checkpoints: streaming safetensors IO, atomic writes, shard / reshard / unshard bit for bit."""
from __future__ import annotations

import json
import os
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

import tpinv.io.checkpoint as ckpt
from tpinv.io.checkpoint import (CheckpointError, CheckpointReader, TensorSource, iter_full_tensors, load_full,
                              load_shard, read_info, save_checkpoint, shard_index, write_checkpoint)
from tpinv.core.contract import InvarianceError
from tpinv.io.safetensors_stream import SafetensorsReader, SafetensorsStreamWriter, TensorSpec, read_header
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits

ARGS = {"family": "llama", "hidden_size": 24, "dtype": torch.bfloat16}


def _state(seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "embed.weight": torch.randn(40, 24, generator=g).to(torch.bfloat16),   # column / vocab: dim 0
        "proj.weight": torch.randn(24, 56, generator=g),                       # row (tree): dim 1
        "proj.bias": torch.randn(24, generator=g).to(torch.float16),           # replicated
        "norm.weight": torch.randn(24, generator=g).to(torch.bfloat16),        # replicated
        "scale": torch.tensor(1.5),                                            # 0-dim, replicated
    }
    return sd, {"embed.weight": 0, "proj.weight": 1, "proj.bias": None, "norm.weight": None, "scale": None}


def _listing(path) -> list[str]:
    return sorted(os.listdir(path))


# ---- streaming safetensors IO --------------------------------------------------------------------

def test_stream_writer_matches_safetensors_bit_for_bit(tmp_path):
    tensors = {"a": torch.randn(3, 7).to(torch.bfloat16), "b": torch.randn(5), "c": torch.randn(2, 3).half(),
               "i": torch.randint(-9, 9, (4,)), "m": torch.rand(6) > 0.5, "s": torch.tensor(2.5),
               "e": torch.zeros(0, 3), "t": torch.randn(6, 4)[:, 1:3]}  # a strided view
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    with SafetensorsStreamWriter(str(tmp_path / "x.safetensors"), specs, {"format": "pt"}) as w:
        for n, t in tensors.items():
            w.write(n, t)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    for n, t in tensors.items():
        assert back[n].dtype == t.dtype, n
        assert_same_bits(back[n], t, str(n))
    r = SafetensorsReader(str(tmp_path / "x.safetensors"))
    assert_same_bits(r.get("a", (slice(1, 3), slice(2, 5))), tensors["a"][1:3, 2:5],
                     "r.get('a', (slice(1, 3), slice(2, 5)))")
    assert r.metadata() == {"format": "pt"}
    # the reader also accepts files written by safetensors itself
    save_file({"a": tensors["a"]}, str(tmp_path / "y.safetensors"))
    assert_same_bits(SafetensorsReader(str(tmp_path / "y.safetensors")).get("a"), tensors["a"],
                     "SafetensorsReader(str(tmp_path / 'y.safetensors...")


def test_stream_writer_checks_order_shape_and_completeness(tmp_path):
    specs = [TensorSpec("a", torch.float32, (2, 3)), TensorSpec("b", torch.bfloat16, (4,))]
    path = str(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="expected tensor a next, got b"):
        with SafetensorsStreamWriter(path, specs) as w:
            w.write("b", torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"expected shape \(2, 3\) torch.float32"):
        with SafetensorsStreamWriter(path, specs) as w:
            w.write("a", torch.zeros(3, 2))
    w = SafetensorsStreamWriter(path, specs)
    w.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="closed before writing"):
        w.close()
    with pytest.raises(CheckpointError, match="x.safetensors is truncated or corrupt"):
        read_header(path)  # an unfinished file is never taken for a complete one


def test_reader_rejects_truncated_and_corrupt_files(tmp_path):
    save_file({"a": torch.randn(8, 8)}, str(tmp_path / "ok.safetensors"))
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="cut.safetensors is truncated or corrupt"):
        SafetensorsReader(str(tmp_path / "cut.safetensors"))
    (tmp_path / "hdr.safetensors").write_bytes(data[:8] + b"{" * (len(data) - 8))
    with pytest.raises(CheckpointError, match="hdr.safetensors has a corrupt safetensors header"):
        SafetensorsReader(str(tmp_path / "hdr.safetensors"))
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="tiny.safetensors is truncated"):
        SafetensorsReader(str(tmp_path / "tiny.safetensors"))


# ---- format, sharding, resharding ---------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_and_metadata(tmp_path, tp):
    sd, meta = _state()
    out = save_checkpoint(sd, str(tmp_path / "ck"), model_args=ARGS, param_meta=meta, tp=tp, progress=True)
    files = ["model.safetensors"] if tp == 1 else [f"model-tp{tp}-rank{r:02d}.safetensors" for r in range(tp)]
    assert _listing(out) == sorted(files + ["tpinv.json"])
    info = read_info(out)
    assert (info.tp_size, info.leaves, info.row_strategy) == (tp, 8, "tree")
    assert info.model_args == {"family": "llama", "hidden_size": 24, "dtype": "bfloat16"}
    assert info.tensors["proj.weight"] == {"shape": [24, 56], "dtype": "float32", "partition_dim": 1}
    for r, f in enumerate(files):  # each rank file holds exactly rank r's piece
        piece = load_file(os.path.join(out, f))
        for name, t in sd.items():
            assert_same_bits(piece[name], t[shard_index(t.shape, meta[name], tp, r)], str((f, name)))


@pytest.mark.parametrize("file_tp", [1, 2, 4])
@pytest.mark.parametrize("load_tp", [1, 2, 4, 8])
def test_load_at_any_tp_is_the_slice_of_the_full_tensor(tmp_path, file_tp, load_tp):
    sd, meta = _state(file_tp)
    out = save_checkpoint(sd, str(tmp_path / "ck"), model_args=ARGS, param_meta=meta, tp=file_tp)
    for rank in range(load_tp):
        got = load_shard(out, load_tp, rank, "tree", verify=True)
        assert list(got) == list(sd)
        for name, t in sd.items():
            want = t[shard_index(t.shape, meta[name], load_tp, rank)]
            assert got[name].dtype == t.dtype, (name, rank)
            assert_same_bits(got[name], want, str((name, rank)))


def test_reshard_tp4_files_at_tp2_and_across_row_strategies(tmp_path):
    sd, meta = _state(3)
    out = save_checkpoint(sd, str(tmp_path / "ck"), model_args=ARGS, param_meta=meta, tp=4)
    column_only = dict(meta, **{"proj.weight": 0})  # row layer split along its output dim
    for rank in range(2):
        got = load_shard(out, 2, rank, "column_only", column_only)
        assert_same_bits(got["proj.weight"], sd["proj.weight"][12 * rank:12 * (rank + 1)], "got['proj.weight']")
        assert_same_bits(got["embed.weight"], sd["embed.weight"][20 * rank:20 * (rank + 1)], "got['embed.weight']")
        # the files' own split (tree: dim 1) is a different piece
        assert_same_bits(load_shard(out, 2, rank)["proj.weight"], sd["proj.weight"][:, 28 * rank:28 * (rank + 1)],
                         "load_shard(out, 2, rank)['proj.weight']")
    with pytest.raises(ValueError, match="pass param_meta"):
        load_shard(out, 2, 0, "column_only")


def test_iter_full_and_casting(tmp_path):
    sd, meta = _state(5)
    out = save_checkpoint(sd, str(tmp_path / "ck"), model_args=ARGS, param_meta=meta, tp=2)
    full = load_full(out)
    for n, t in sd.items():
        assert_same_bits(full[n], t, 'full[n]')
    assert [n for n, _ in iter_full_tensors(out)] == list(sd)
    cast = load_full(out, dtype=torch.float32)
    assert all(cast[n].dtype == torch.float32 and same_bits(cast[n], t.float()) for n, t in sd.items())


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 5), file_tp=st.sampled_from([1, 2, 4]),
       load_tp=st.sampled_from([1, 2, 4, 8]), file_dim=st.sampled_from([0, 1, None]),
       load_dim=st.sampled_from([0, 1, None]), seed=st.integers(0, 2**16))
def test_reshard_property(tmp_path_factory, rows, cols, file_tp, load_tp, file_dim, load_dim, seed):
    t = torch.randn(8 * rows, 8 * cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    out = save_checkpoint({"w": t}, str(tmp_path_factory.mktemp("p") / "ck"), model_args={}, param_meta={"w": file_dim},
                          tp=file_tp, checksums=False)
    for rank in range(load_tp):
        got = load_shard(out, load_tp, rank, param_meta={"w": load_dim})["w"]
        assert_same_bits(got, t[shard_index(t.shape, load_dim, load_tp, rank)], 'got')


# ---- integrity and bad input --------------------------------------------------------------------

def test_sha256_detects_a_flipped_byte(tmp_path):
    sd, meta = _state(7)
    out = save_checkpoint(sd, str(tmp_path / "ck"), model_args=ARGS, param_meta=meta, tp=2)
    path = os.path.join(out, "model-tp2-rank01.safetensors")
    data = bytearray(open(path, "rb").read())
    n = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:8 + n])["proj.weight"]["data_offsets"][0]
    data[8 + n + begin + 5] ^= 0x40  # inside rank 1's piece of proj.weight: the header stays valid
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch.*the file is corrupt") as e:
        load_shard(out, 2, 1, verify=True)
    assert "model-tp2-rank01.safetensors" in str(e.value)
    assert_bits_differ(load_shard(out, 2, 1)["proj.weight"], sd["proj.weight"][:, 28:],
                       "load_shard(out, 2, 1)['proj.weight']")  # the flip is real
    assert_same_bits(load_shard(out, 2, 0, verify=True)["proj.weight"], sd["proj.weight"][:, :28],
                     "load_shard(out, 2, 0, verify=True)['proj.weight']")


def test_missing_rank_file_and_bad_meta(tmp_path):
    sd, meta = _state()
    out = save_checkpoint(sd, str(tmp_path / "ck"), model_args=ARGS, param_meta=meta, tp=4)
    os.remove(os.path.join(out, "model-tp4-rank02.safetensors"))
    with pytest.raises(CheckpointError, match=r"model-tp4-rank02.safetensors \(rank 2 of tp_size=4\).*missing"):
        load_shard(out, 2, 0)
    with pytest.raises(CheckpointError, match="not a tpinv checkpoint"):
        read_info(str(tmp_path))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "tpinv.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="expected 'tpinv-checkpoint' version 1"):
        read_info(str(tmp_path / "x"))


def test_bad_sizes_and_names(tmp_path):
    sd, meta = _state()
    with pytest.raises(InvarianceError, match=r"embed.weight dim 0 \(shape \(40, 24\)\).*tp size=16"):
        save_checkpoint(sd, str(tmp_path / "a"), model_args=ARGS, param_meta=meta, tp=16, leaves=16)
    with pytest.raises(InvarianceError, match="group size 3 is not a power of two"):
        save_checkpoint(sd, str(tmp_path / "b"), model_args=ARGS, param_meta=meta, tp=3)
    with pytest.raises(CheckpointError, match=r"missing \['scale'\]"):
        save_checkpoint({k: v for k, v in sd.items() if k != "scale"}, str(tmp_path / "c"), model_args=ARGS,
                        param_meta=meta)
    out = save_checkpoint(sd, str(tmp_path / "d"), model_args=ARGS, param_meta=meta, tp=2)
    with pytest.raises(CheckpointError, match=r"unexpected \['extra'\]"):
        load_shard(out, 2, 0, param_meta=dict(meta, extra=None))
    with pytest.raises(ValueError, match="rank=2 is outside a TP group of size 2"):
        load_shard(out, 2, 2)
    assert not any(p.name.startswith(("a", "b", "c")) for p in tmp_path.iterdir())


# ---- atomic writes ------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failed_write_leaves_nothing(tmp_path, monkeypatch, error):
    sd, meta = _state()
    calls = []
    real = SafetensorsStreamWriter.write

    def failing(self, name, tensor):
        calls.append(name)
        if len(calls) == 7:  # mid-way through the second rank file
            raise error("disk gone")
        return real(self, name, tensor)

    monkeypatch.setattr(SafetensorsStreamWriter, "write", failing)
    with pytest.raises(error, match="disk gone"):
        save_checkpoint(sd, str(tmp_path / "out"), model_args=ARGS, param_meta=meta, tp=2)
    assert len(calls) == 7 and _listing(tmp_path) == []


def test_overwrite_replaces_only_when_complete(tmp_path, monkeypatch):
    sd, meta = _state(1)
    out = save_checkpoint(sd, str(tmp_path / "out"), model_args=ARGS, param_meta=meta)
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        save_checkpoint(sd, out, model_args=ARGS, param_meta=meta)
    new, _ = _state(2)
    monkeypatch.setattr(ckpt, "write_json", lambda *a: (_ for _ in ()).throw(OSError("no space")))
    with pytest.raises(OSError, match="no space"):
        save_checkpoint(new, out, model_args=ARGS, param_meta=meta, overwrite=True)
    assert _listing(tmp_path) == ["out"]
    assert_same_bits(load_full(out)["proj.weight"], sd["proj.weight"], "load_full(out)['proj.weight']")
    monkeypatch.undo()
    save_checkpoint(new, out, model_args=ARGS, param_meta=meta, tp=2, overwrite=True)
    assert _listing(tmp_path) == ["out"]
    assert_same_bits(load_full(out)["proj.weight"], new["proj.weight"], "load_full(out)['proj.weight']")


# ---- streaming: a bounded number of tensors alive -----------------------------------------------

class _LiveCounter:
    """Tracks the tensors handed out and the most of them alive at any one time."""

    def __init__(self):
        self.refs, self.peak, self.count = [], 0, 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        self.refs = [r for r in self.refs if r() is not None]
        self.refs.append(weakref.ref(t))
        self.count += 1
        self.peak = max(self.peak, len(self.refs))
        return t


def test_streaming_holds_a_bounded_number_of_tensors(tmp_path, monkeypatch):
    n, shape = 48, (64, 128)  # 48 tensors of 32 KiB (fp32)
    counter = _LiveCounter()

    def make(i):
        return lambda index: counter.track(torch.full(shape, float(i))[index])

    sources = [TensorSource(f"t{i}", shape, torch.bfloat16, i % 3 if i % 3 < 2 else None, make(i)) for i in range(n)]
    out = write_checkpoint(sources, str(tmp_path / "ck"), model_args={}, tp=4)
    assert counter.count == 4 * n and counter.peak <= 2, counter.peak

    reads = _LiveCounter()
    real_get = SafetensorsReader.get
    monkeypatch.setattr(SafetensorsReader, "get", lambda self, k, i=None: reads.track(real_get(self, k, i)))
    total = 0
    for name, t in iter_full_tensors(out):  # unshard: 4 file slices per tensor at most
        total += 1
        assert t.shape == shape and bool((t == int(name[1:])).all())
        del t
    assert total == n and reads.peak <= 4 + 2, reads.peak
    reads.peak = 0
    with CheckpointReader(out) as r:
        for name in list(r.info.tensors)[:5]:
            assert r.read(name).shape == shape
    assert reads.peak <= 4 + 2
