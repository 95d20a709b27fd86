"""A model of a vectorized CPU kernel whose vector body and scalar tail round differently.

On AVX-512 and AVX2, some torch kernels (``torch.sigmoid``, hence ``F.silu``; 16-bit
``rsqrt``; fused multiply-adds in a vector body only) give an element other bits in the
vector body than in the scalar tail, so its result depends on the tensor's length, layout and
thread split.  The generic (``default``) kernel set and other machines run other code, so a
negative control that *relies* on torch doing this passes on one machine and fails on another.

:func:`body_tail_map` writes that behaviour out with two different formulas, so a control
built on it differs on every machine by construction: the tensor is cut like ATen's loops cut
it (one contiguous run; ``torch.get_num_threads()`` equal pieces from ``GRAIN`` elements on;
per piece a body of whole ``WIDTH``-element iterations and a tail), the body takes
``vector_fn`` and the tail ``scalar_fn``; a non-contiguous tensor takes ``scalar_fn`` only.
"""
from __future__ import annotations

from typing import Callable

import torch

#: Elements per loop iteration (two 16-float AVX-512 vectors, as ATen's vectorized loop).
WIDTH = 32
#: Elements from which the work is split across threads (ATen's ``GRAIN_SIZE``).
GRAIN = 32768


def body_tail_map(vector_fn: Callable[..., torch.Tensor], scalar_fn: Callable[..., torch.Tensor],
                  *tensors: torch.Tensor) -> torch.Tensor:
    """``vector_fn`` on body elements, ``scalar_fn`` on tail elements (same-shape inputs)."""
    shape = tensors[0].shape
    if not all(t.is_contiguous() for t in tensors):
        return scalar_fn(*tensors)
    flats = [t.reshape(-1) for t in tensors]
    n = flats[0].numel()
    pieces = torch.get_num_threads() if n >= GRAIN else 1
    bounds = [n * i // pieces for i in range(pieces + 1)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        body = a + ((b - a) // WIDTH) * WIDTH
        if body > a:
            out.append(vector_fn(*(f[a:body] for f in flats)))
        if b > body:
            out.append(scalar_fn(*(f[body:b] for f in flats)))
    return torch.cat(out).reshape(shape) if out else scalar_fn(*tensors)
