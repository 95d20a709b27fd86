"""Invariant rotary position embedding: one way to compute every position's table and rotation.

Tables: ``inv_freq`` depends only on ``(head_dim, theta, scaling)`` and is computed the
same way every call (fp32, as Hugging Face transformers does); a position's angle is the
single fp32 product ``float(p) * inv_freq`` and its ``cos``/``sin`` are elementwise, so a
token's table row has the same bits whether it is computed alone, in a chunk or in a full
sequence (exact for positions below 2**24).  The ``D/2`` frequencies are duplicated to
``D`` (HF's ``rotate_half`` convention).  No scaling depends on the sequence length.

Rotation: ``out = x*cos + rotate_half(x)*sin`` with ``rotate_half(x) = cat(-x2, x1)``, in
fp32 from separate elementwise ops, rounded once; the backward is the rotation by
``-sin``: ``dx = g*cos - rotate_half(g)*sin``.  The tables receive no gradient.
"""
from __future__ import annotations

import math

import torch

from tpinv.core.contract import InvarianceError, check_dtype

_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _scaling_type(scaling: dict | None) -> str:
    if scaling is None:
        return "default"
    if not isinstance(scaling, dict):
        raise TypeError("rope scaling must be None or a dict with a 'rope_type', "
                        f"got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported by tpinv (supported: "
            f"{', '.join(_ROPE_KEYS)}); sequence-length dependent types would break invariance")
    return rope_type


def _check_scaling(scaling: dict | None, theta: float) -> str:
    rope_type = _scaling_type(scaling)
    if scaling is None:
        return rope_type
    needed = _ROPE_KEYS[rope_type]
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs the keys {list(needed)}; missing {missing}")
    unknown = sorted(set(scaling) - set(needed) - set(_COMMON_KEYS))
    if unknown:
        raise ValueError(f"rope_type {rope_type!r} does not take the keys {unknown}; "
                         f"it takes {list(needed)}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1.0 is not supported by tpinv rope")
    if "rope_theta" in scaling and float(scaling["rope_theta"]) != float(theta):
        raise ValueError(f"rope scaling has rope_theta={scaling['rope_theta']} but theta={theta}")
    return rope_type


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short kept, middle blended."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = context / low
    high_freq_wavelen = context / high
    wavelen = (2 * math.pi) / inv_freq
    long_scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * long_scaled / factor + smooth * long_scaled
    is_middle = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_middle, blended, long_scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """fp32 inverse frequencies ``[head_dim // 2]`` for the given rope type."""
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope head_dim must be a positive even int, got {head_dim!r}")
    if not theta > 0:
        raise ValueError(f"rope theta must be positive, got {theta!r}")
    rope_type = _check_scaling(scaling, theta)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


_INV_FREQ: dict = {}


def _inv_freq_on(device: torch.device, head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """:func:`rope_inv_freq` computed on the CPU once and kept on ``device`` (a captured CUDA
    graph cannot copy from unpinned host memory, and the table is the same bits every step)."""
    key = (device, head_dim, theta, None if scaling is None else tuple(sorted(scaling.items(), key=str)))
    try:
        hit = _INV_FREQ.get(key)
    except TypeError:  # unhashable scaling values: no caching
        return rope_inv_freq(head_dim, theta, scaling).to(device)
    if hit is None:
        hit = _INV_FREQ[key] = rope_inv_freq(head_dim, theta, scaling).to(device)
    return hit


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` tables of shape ``[*positions.shape, head_dim]``."""
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point \
            or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError("rope positions must be an integer tensor (e.g. int64 position ids), got "
                        f"{getattr(positions, 'dtype', type(positions).__name__)}")
    inv_freq = _inv_freq_on(positions.device, head_dim, theta, scaling)
    angle = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angle = torch.cat((angle, angle), dim=-1)
    return torch.cos(angle), torch.sin(angle)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dim (halves ``x1 = x[..., :D/2]``, ``x2 = x[..., D/2:]``)."""
    half = x.shape[-1] // 2
    return torch.cat((torch.neg(x[..., half:]), x[..., :half]), dim=-1)


def check_rope_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise a clear error for inputs :func:`apply_rope_forward` does not accept."""
    if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)):
        raise TypeError("apply_rope expects tensors x [B, H, S, D], cos and sin [B, S, D] or [S, D]")
    check_dtype(x.dtype, "apply_rope input x")
    if x.dim() != 4:
        raise InvarianceError(f"apply_rope x must have shape [B, H, S, D], got {tuple(x.shape)}")
    batch, _, seq, dim = x.shape
    if dim % 2:
        raise InvarianceError(f"apply_rope head dim D={dim} must be even")
    allowed = ((seq, dim), (batch, seq, dim))
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32:
            raise TypeError(f"apply_rope {name} must be an fp32 table (from rope_cos_sin), got {table.dtype}")
        if tuple(table.shape) not in allowed:
            raise InvarianceError(
                f"apply_rope {name} must have shape [B, S, D] = {allowed[1]} or [S, D] = {allowed[0]} "
                f"for x of shape {tuple(x.shape)}, got {tuple(table.shape)}")


def _broadcast_table(table: torch.Tensor) -> torch.Tensor:
    return table.unsqueeze(-3) if table.dim() == 3 else table


def apply_rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x*cos + rotate_half(x)*sin`` in fp32, rounded once to ``x.dtype``."""
    check_rope_inputs(x, cos, sin)
    c, s = _broadcast_table(cos), _broadcast_table(sin)
    x_f32 = x.to(torch.float32)
    return (x_f32 * c + rotate_half(x_f32) * s).to(x.dtype)


def apply_rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``grad*cos - rotate_half(grad)*sin`` in fp32, rounded once to ``grad.dtype``."""
    check_rope_inputs(grad, cos, sin)
    c, s = _broadcast_table(cos), _broadcast_table(sin)
    g = grad.to(torch.float32)
    return (g * c - rotate_half(g) * s).to(grad.dtype)
