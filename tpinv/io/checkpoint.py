"""tpinv checkpoints: one format for every TP size, written atomically, read tensor by tensor.

Format (a directory)::

    tpinv.json                         {"format": "tpinv-checkpoint", "format_version": 1,
                                        "model_args": {...ModelArgs as a dict, dtype as a name...},
                                        "tp_size": C, "leaves": L, "row_strategy": "tree"|"column_only",
                                        "tensors": {name: {"shape": [full shape], "dtype": "bfloat16",
                                                           "partition_dim": 0 | 1 | null}},
                                        "files": {file name: {"rank": r, "sha256": {name: hex}}},
                                        "extra": {...}}
    model.safetensors                  when C == 1: the full tensors
    model-tp{C}-rank{r:02d}.safetensors  when C > 1: rank r's shard of every tensor (r = 0..C-1)

A tensor with ``partition_dim`` d is cut into C equal contiguous pieces along d and rank r
holds piece r, the layout :class:`~tpinv.layers.ColumnParallelLinear` and friends use
(rank r owns leaves ``[r*L/C, (r+1)*L/C)``); a tensor with ``partition_dim`` null is
replicated in every file.  Values are stored verbatim: sharding, resharding and unsharding
only move bytes, so a model loaded at any TP size holds exactly the bits that were saved.

:func:`load_shard` returns rank r's tensors at any TP size from either layout, reading each
tensor's needed slices through the memory map, one tensor at a time.  Every write goes to
``OUT_DIR.tmp-XXXX`` (files fsynced), which is renamed to ``OUT_DIR`` only once complete.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from tpinv.io.atomic_dir import atomic_directory, copy_file, write_json
from tpinv.core.contract import DEFAULT_LEAVES, check_divisible, check_tp_size
from tpinv.core.dtypes import dtype_from_name, dtype_name
from tpinv.io.safetensors_stream import CheckpointError, SafetensorsReader, SafetensorsStreamWriter, TensorSpec

FORMAT_NAME, FORMAT_VERSION = "tpinv-checkpoint", 1
META_FILE, FULL_FILE = "tpinv.json", "model.safetensors"
ROW_STRATEGIES = ("tree", "column_only")

#: name -> partition dim (``None``: replicated) of every tensor.
ParamMeta = Mapping[str, Optional[int]]

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointReader", "TensorSource", "atomic_directory", "load_full",
           "load_shard", "param_meta_from_module", "read_info", "save_checkpoint", "shard_file_name",
           "shard_index", "write_checkpoint", "iter_full_tensors"]


def shard_file_name(tp: int, rank: int) -> str:
    return FULL_FILE if tp == 1 else f"model-tp{tp}-rank{rank:02d}.safetensors"


def shard_index(shape: Sequence[int], dim: Optional[int], tp: int, rank: int, name: str = "tensor",
                replicas: int = 1) -> tuple:
    """The slices selecting rank ``rank``'s piece of a tensor of ``shape`` split ``tp`` ways along ``dim``.

    With ``replicas`` R (replicated KV heads) the tensor is split ``tp / R`` ways and ranks
    ``[R*j, R*(j+1))`` all hold piece ``j``."""
    if replicas > 1:
        tp, rank = tp // replicas, rank // replicas
    index = [slice(None)] * len(shape)
    if dim is not None and tp > 1:
        n = check_divisible(f"{name} dim {dim} (shape {tuple(shape)})", shape[dim], tp, "tp size")
        index[dim] = slice(rank * n, (rank + 1) * n)
    return tuple(index)


def param_meta_from_module(module: torch.nn.Module) -> dict[str, Optional[int]]:
    """Partition dims read from the parameters' ``tensor_model_parallel`` / ``partition_dim`` attributes."""
    params = dict(module.named_parameters())
    meta = {}
    for name in module.state_dict():
        p = params.get(name)
        meta[name] = int(p.partition_dim) if p is not None and getattr(p, "tensor_model_parallel", False) else None
    return meta


def param_replicas_from_module(module: torch.nn.Module) -> dict[str, int]:
    """``{name: replicas}`` of the parameters that several TP ranks hold the same shard of."""
    return {n: p.tpinv_replicas for n, p in module.named_parameters() if getattr(p, "tpinv_replicas", 1) > 1}


def _jsonable_args(model_args: Any) -> dict:
    d = dataclasses.asdict(model_args) if dataclasses.is_dataclass(model_args) else dict(model_args)
    return {k: dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in d.items()}


@dataclass(frozen=True)
class TensorSource:
    """One full tensor to write: its name, full shape, partition dim, and a reader of slices.

    ``read(index)`` returns ``full_tensor[index]`` (``index`` a tuple of slices) in any dtype;
    the writer casts it to ``dtype``.  Nothing is read before the tensor is due.
    """
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: Optional[int]
    read: Callable[[tuple], torch.Tensor]


@dataclass(frozen=True)
class CheckpointInfo:
    """The parsed ``tpinv.json`` of a checkpoint directory."""
    path: str
    model_args: dict
    tp_size: int
    leaves: int
    row_strategy: str
    tensors: dict            # name -> {"shape", "dtype", "partition_dim"}
    files: dict              # file name -> {"rank", "sha256"}
    extra: dict

    def spec(self, name: str) -> TensorSpec:
        t = self.tensors[name]
        return TensorSpec(name, dtype_from_name(t["dtype"], error=CheckpointError), tuple(t["shape"]))

    def partition_dims(self) -> dict[str, Optional[int]]:
        return {name: t["partition_dim"] for name, t in self.tensors.items()}


def write_checkpoint(sources: Sequence[TensorSource], out_dir: str, *, model_args: Any, tp: int = 1,
                     leaves: int = DEFAULT_LEAVES, row_strategy: str = "tree", checksums: bool = True,
                     extra: Optional[dict] = None, copy_files: Sequence[str] = (), overwrite: bool = False,
                     progress: bool = False) -> str:
    """Write a tpinv checkpoint at TP size ``tp`` from lazily read sources (one tensor in memory at a time)."""
    check_tp_size(tp, leaves)
    if row_strategy not in ROW_STRATEGIES:
        raise ValueError(f"row_strategy={row_strategy!r}: expected one of {ROW_STRATEGIES}")
    for s in sources:  # validate every shape before anything is written
        shard_index(s.shape, s.partition_dim, tp, 0, s.name)
    files = {}
    with _progress(progress, tp * len(sources), "writing") as bar, atomic_directory(out_dir, overwrite) as tmp:
        for rank in range(tp):
            fname = shard_file_name(tp, rank)
            index = {s.name: shard_index(s.shape, s.partition_dim, tp, rank, s.name) for s in sources}
            specs = [TensorSpec(s.name, s.dtype, _sliced_shape(s.shape, index[s.name])) for s in sources]
            hashes = {}
            with SafetensorsStreamWriter(os.path.join(tmp, fname), specs, {"format": "pt"}) as w:
                for s, spec in zip(sources, specs):
                    t = s.read(index[s.name]).to(s.dtype)
                    w.write(s.name, t)
                    if checksums:
                        hashes[s.name] = tensor_sha256(t)
                    del t
                    bar.update(1)
            files[fname] = {"rank": rank, "sha256": hashes}
        for path in copy_files:
            copy_file(path, tmp)
        meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "model_args": _jsonable_args(model_args),
                "tp_size": tp, "leaves": leaves, "row_strategy": row_strategy,
                "tensors": {s.name: {"shape": list(s.shape), "dtype": dtype_name(s.dtype),
                                     "partition_dim": s.partition_dim} for s in sources},
                "files": files, "extra": extra or {}}
        write_json(os.path.join(tmp, META_FILE), meta)
    return os.path.abspath(out_dir)


def save_checkpoint(state_dict: Mapping[str, torch.Tensor], out_dir: str, *, model_args: Any,
                    param_meta: ParamMeta, tp: int = 1, **kwargs: Any) -> str:
    """Write full (unsharded) tensors as a tpinv checkpoint, unsharded or as ``tp`` rank files."""
    _check_names(set(state_dict), set(param_meta), "param_meta", "state_dict")
    sources = [TensorSource(n, tuple(t.shape), t.dtype, param_meta[n], lambda i, t=t: t[i])
               for n, t in state_dict.items()]
    return write_checkpoint(sources, out_dir, model_args=model_args, tp=tp, **kwargs)


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(data.numpy())).hexdigest()


def read_json_file(path: str, missing: str) -> Any:
    """The JSON document at ``path``; a :class:`CheckpointError` naming the file when it is
    missing (``missing`` says what was expected) or not valid JSON."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} not found: {missing}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def read_info(ckpt_dir: str) -> CheckpointInfo:
    """Parse and validate ``tpinv.json``; every rank file it lists must exist."""
    path = os.path.join(ckpt_dir, META_FILE)
    meta = read_json_file(path, f"{ckpt_dir} is not a tpinv checkpoint")
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}, "
                              f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}")
    tp = meta["tp_size"]
    for rank in range(tp):
        fname = shard_file_name(tp, rank)
        if fname not in meta["files"] or not os.path.isfile(os.path.join(ckpt_dir, fname)):
            raise CheckpointError(f"{fname} (rank {rank} of tp_size={tp}) listed by {path} is missing")
    return CheckpointInfo(os.path.abspath(ckpt_dir), meta["model_args"], tp, meta["leaves"], meta["row_strategy"],
                          meta["tensors"], meta["files"], meta.get("extra", {}))


def _sliced_shape(shape: Sequence[int], index: tuple) -> tuple[int, ...]:
    return tuple(len(range(*sl.indices(n))) for n, sl in zip(shape, index))


def _check_names(have: set, want: set, want_what: str, have_what: str) -> None:
    missing, extra = sorted(want - have), sorted(have - want)
    if missing or extra:
        raise CheckpointError(f"{have_what} and {want_what} disagree: missing {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                              f"{' ...' if len(extra) > 5 else ''}")


def _progress(enabled: bool, total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled)


class CheckpointReader:
    """Random access to the full tensors of a checkpoint (or any slice of them), whatever its layout."""

    def __init__(self, ckpt_dir: str, verify: bool = False):
        self.info, self.verify, self._verified = read_info(ckpt_dir), verify, set()
        self.readers = [SafetensorsReader(os.path.join(self.info.path, shard_file_name(self.info.tp_size, r)))
                        for r in range(self.info.tp_size)]
        for reader in self.readers:
            _check_names(set(reader.specs), set(self.info.tensors), f"{META_FILE} of {self.info.path}", reader.name)

    def read(self, name: str, index: Optional[tuple] = None) -> torch.Tensor:
        """``full[index]``, touching only the slices of the rank files that hold it."""
        info = self.info
        if name not in info.tensors:
            raise CheckpointError(f"{name} is not a tensor of {info.path}")
        shape = info.tensors[name]["shape"]
        want = tuple(index) if index is not None else tuple(slice(None) for _ in shape)
        dim = info.tensors[name]["partition_dim"]
        if dim is None or info.tp_size == 1:
            return self._read(self.readers[0], name, want)
        piece, parts = shape[dim] // info.tp_size, []
        start, stop, _ = want[dim].indices(shape[dim])
        for r, reader in enumerate(self.readers):
            lo, hi = max(start, r * piece), min(stop, (r + 1) * piece)
            if lo < hi:
                local = list(want)
                local[dim] = slice(lo - r * piece, hi - r * piece)
                parts.append(self._read(reader, name, tuple(local)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def _read(self, reader: SafetensorsReader, name: str, index: tuple) -> torch.Tensor:
        shape = reader.specs[name].shape
        full = _sliced_shape(shape, index) == tuple(shape)
        if not self.verify:
            return reader.get(name, None if full else index)
        # a slice cannot be checked against the file tensor's hash: read it whole, check, then cut
        if (reader.name, name) in self._verified:
            return reader.get(name, None if full else index)
        t = reader.get(name, None)
        want = self.info.files[reader.name].get("sha256", {}).get(name)
        if want is not None and tensor_sha256(t) != want:  # None: written with checksums=False
            raise CheckpointError(f"{name} in {reader.name}: sha256 mismatch, the file is corrupt "
                                  f"({os.path.join(self.info.path, reader.name)})")
        self._verified.add((reader.name, name))
        return t if full else t[index]

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_shard(ckpt_dir: str, tp: int = 1, rank: int = 0, row_strategy: Optional[str] = None,
               param_meta: Optional[ParamMeta] = None, *, dtype: Optional[torch.dtype] = None,
               verify: bool = False, replicas: Optional[dict[str, int]] = None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state dict at TP size ``tp`` from a checkpoint of any layout.

    ``param_meta`` gives the partition dim of each tensor in the model being loaded (e.g.
    :func:`param_meta_from_module`); without it the checkpoint's own dims are used, which
    needs ``row_strategy`` (if given) to match the one the checkpoint was written with.
    Each tensor is assembled from the slices of the files that hold its piece (concatenated
    along the files' partition dim, then sliced along the target's), one tensor at a time.
    ``verify=True`` checks the sha256 of every file tensor read in full.  ``replicas`` names
    the tensors held whole by several ranks (:func:`param_replicas_from_module`).
    """
    return dict(_iter_shard(ckpt_dir, tp, rank, row_strategy, param_meta, dtype, verify, replicas))


def load_full(ckpt_dir: str, *, dtype: Optional[torch.dtype] = None, verify: bool = False) -> dict:
    """The full (unsharded) tensors of a checkpoint."""
    return load_shard(ckpt_dir, 1, 0, dtype=dtype, verify=verify)


def iter_full_tensors(ckpt_dir: str, *, dtype: Optional[torch.dtype] = None,
                      verify: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` pairs in file order, one tensor in memory at a time."""
    yield from _iter_shard(ckpt_dir, 1, 0, None, None, dtype, verify)


def _iter_shard(ckpt_dir: str, tp: int, rank: int, row_strategy: Optional[str],
                param_meta: Optional[ParamMeta], dtype: Optional[torch.dtype], verify: bool,
                replicas: Optional[dict[str, int]] = None):
    with CheckpointReader(ckpt_dir, verify) as reader:
        info = reader.info
        check_tp_size(tp, info.leaves)
        if not 0 <= rank < tp:
            raise ValueError(f"rank={rank} is outside a TP group of size {tp}")
        if param_meta is None:
            if row_strategy is not None and row_strategy != info.row_strategy:
                raise ValueError(f"{info.path} was written with row_strategy={info.row_strategy!r}; to load "
                                 f"it with row_strategy={row_strategy!r} pass param_meta (the target's "
                                 f"partition dims)")
            param_meta = info.partition_dims()
        _check_names(set(param_meta), set(info.tensors), f"the tensors of {info.path}", "param_meta")
        for name in info.tensors:
            t = reader.read(name, shard_index(info.tensors[name]["shape"], param_meta[name], tp, rank, name,
                                              (replicas or {}).get(name, 1)))
            yield name, t if dtype is None else t.to(dtype)
