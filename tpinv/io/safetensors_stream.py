"""Streaming safetensors IO: one tensor in memory at a time, bytes written verbatim.

The writer lays out the header from the names, dtypes and shapes alone, then takes
the tensors one by one in that order and copies their bytes to disk unchanged, so a
file of any size is written holding a single tensor.  The reader validates the header
against the file size before anything is read (a truncated or corrupt file fails with
its path named) and returns tensors or slices of tensors through ``safe_open``'s
memory map, so only the requested slice is copied.  No value is ever converted here:
what is written is what is read back, bit for bit.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch
from safetensors import safe_open

from tpinv.core.dtypes import SAFETENSORS_CODES as _CODES

_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file or key that is missing, malformed, or disagrees with its config."""


@dataclass(frozen=True)
class TensorSpec:
    """What the header says about one tensor: its name, dtype and shape."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def dtype_from_code(code: str, where: str = "") -> torch.dtype:
    if code not in _DTYPES:
        raise CheckpointError(f"{where}: dtype {code!r} is not supported; expected one of {sorted(_DTYPES)}")
    return _DTYPES[code]


def read_header(path: str) -> dict[str, TensorSpec]:
    """The tensors a safetensors file holds, checked against the file size (nothing else is read)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{name} is truncated or not a safetensors file: {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{name} is truncated or corrupt: header length {n}, file size {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{name} has a corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{name} has a corrupt safetensors header: not a JSON object")
    specs, end = {}, 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            spec = TensorSpec(key, dtype_from_code(entry["dtype"], f"{name}:{key}"), tuple(entry["shape"]))
            begin, stop = entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{name} has a corrupt header entry for {key}: {entry!r}") from None
        if stop - begin != spec.nbytes:
            raise CheckpointError(f"{key} in {name}: {stop - begin} data bytes, expected {spec.nbytes} "
                                  f"for shape {spec.shape} {spec.dtype}")
        specs[key], end = spec, max(end, stop)
    if 8 + n + end != size:
        raise CheckpointError(f"{name} is truncated or corrupt: the header describes {8 + n + end} bytes, "
                              f"the file has {size}")
    return specs


class SafetensorsReader:
    """Reads tensors (or slices of them) one at a time from a validated safetensors file."""

    def __init__(self, path: str):
        self.path, self.name = path, os.path.basename(path)
        self.specs = read_header(path)
        try:
            self._file = safe_open(path, framework="pt")
        except Exception as e:  # the rust error type is not importable by a stable name
            raise CheckpointError(f"{self.name} cannot be opened as safetensors: {e}") from None

    def get(self, key: str, index: Optional[tuple] = None) -> torch.Tensor:
        """The tensor ``key``, or ``tensor[index]`` read through the memory map (``index`` of slices)."""
        if key not in self.specs:
            raise CheckpointError(f"{key} is not in {self.name}")
        if index is None or not self.specs[key].shape:
            return self._file.get_tensor(key)
        return self._file.get_slice(key)[index]

    def metadata(self) -> dict:
        return self._file.metadata() or {}

    def close(self) -> None:
        self._file = None

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fsync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


class SafetensorsStreamWriter:
    """Writes a safetensors file tensor by tensor, in the order of ``specs``.

    The header is written first from ``specs``; each :meth:`write` checks the tensor's
    dtype and shape against its spec and appends its bytes; :meth:`close` checks that
    every tensor arrived and fsyncs.  A writer left without :meth:`close` leaves an
    incomplete file that no reader accepts (its size disagrees with its header).
    """

    def __init__(self, path: str, specs: Sequence[TensorSpec], metadata: Optional[Mapping[str, str]] = None):
        if sys.byteorder != "little":
            raise RuntimeError("safetensors stores little-endian bytes; this machine is big-endian")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in {path}")
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        for s in specs:
            if s.dtype not in _CODES:
                raise TypeError(f"{s.name}: dtype {s.dtype} cannot be stored in safetensors")
            header[s.name] = {"dtype": _CODES[s.dtype], "shape": list(s.shape),
                              "data_offsets": [offset, offset + s.nbytes]}
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self._specs, self._next = path, list(specs), 0
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._specs):
            raise ValueError(f"{name}: all {len(self._specs)} tensors of {self.path} are already written")
        spec = self._specs[self._next]
        if name != spec.name:
            raise ValueError(f"{self.path}: expected tensor {spec.name} next, got {name}")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, expected shape "
                             f"{spec.shape} {spec.dtype} for {os.path.basename(self.path)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if data.numel():
            self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        if self._file is None:
            return
        if self._next != len(self._specs):
            missing = [s.name for s in self._specs[self._next:]]
            self.abort()
            raise ValueError(f"{self.path}: closed before writing {missing[:3]} ({len(missing)} tensors)")
        _fsync(self._file)
        self._file.close()
        self._file = None

    def abort(self) -> None:
        """Close the file without completing it."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "SafetensorsStreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_safetensors(path: str, tensors: Iterable[tuple[TensorSpec, Callable[[], torch.Tensor]]],
                      metadata: Optional[Mapping[str, str]] = None,
                      on_tensor: Optional[Callable[[TensorSpec], None]] = None) -> None:
    """Write ``(spec, load)`` pairs, calling each ``load()`` only when its tensor is due."""
    pairs = list(tensors)
    with SafetensorsStreamWriter(path, [s for s, _ in pairs], metadata) as w:
        for spec, load in pairs:
            w.write(spec.name, load())
            if on_tensor is not None:
                on_tensor(spec)
