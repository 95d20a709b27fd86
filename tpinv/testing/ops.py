"""Which ops ran: :func:`record_ops` records the ops dispatched inside a block, so a test can
assert that the invariant path was taken rather than a silent fallback."""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpLog", "record_ops"]


class OpLog:
    """Names of dispatched ops in order: ``"ns::op"`` plus the overload form ``"ns::op.overload"``.

    ``"aten::add" in log`` and ``"aten::add.Tensor" in log`` both hold after an add.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.overloads: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.names or name in self.overloads

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def count(self, name: str) -> int:
        return self.names.count(name) + self.overloads.count(name)

    def __repr__(self) -> str:
        return f"OpLog({sorted(set(self.names))})"


class _RecordingMode(TorchDispatchMode):
    def __init__(self, log: OpLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.log.names.append(name)
        overload = getattr(func, "_overloadname", "default")
        self.log.overloads.append(f"{name}.{overload}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_ops() -> Iterator[OpLog]:
    """Record the ops dispatched inside the block (this thread); nests with other modes."""
    log = OpLog()
    with _RecordingMode(log):
        yield log
