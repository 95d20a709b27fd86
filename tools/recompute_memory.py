"""Bytes saved for backward by one training forward, per activation-recompute setting (CPU).

``python tools/recompute_memory.py --model qwen3-tiny --num-layers 4 --batch 4 --seq 64``

prints one row per Megatron setting (none, selective, full uniform / block) with the bytes of the
distinct non-parameter tensors autograd keeps (:mod:`tpinv.testing.saved_activations`) and
whether the loss and every gradient are the bits of the run without recompute.
"""
from __future__ import annotations

import argparse
import sys


def _settings(layers: int) -> list[tuple[str, dict]]:
    rows = [("none", {}), ("selective", dict(granularity="selective"))]
    rows += [(f"full block {n}", dict(granularity="full", method="block", num_layers=n))
             for n in sorted({max(1, layers // 2), layers})]
    rows += [(f"full uniform {n}", dict(granularity="full", method="uniform", num_layers=n))
             for n in sorted({1, layers}) if layers % n == 0]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-tiny", help="named config")
    p.add_argument("--num-layers", type=int, default=4, help="layers (overrides the config's)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    a = p.parse_args(argv)

    import torch

    from tpinv.core.dtypes import dtype_from_name
    from tpinv.models import Transformer, get_config
    from tpinv.testing import same_bits
    from tpinv.testing.saved_activations import saved_activation_bytes

    args = get_config(a.model, num_layers=a.num_layers, dtype=dtype_from_name(a.dtype))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq), generator=g)
    targets = torch.randint(0, args.vocab_size, (a.batch, a.seq), generator=g)
    ref = None
    print(f"{a.model}, {a.num_layers} layers, batch {a.batch} x seq {a.seq}, {a.dtype}")
    print(f"{'recompute':<18} {'saved bytes':>12} {'vs none':>8}  same bits")
    for name, setting in _settings(a.num_layers):
        torch.manual_seed(0)
        model = Transformer(args).train().set_recompute(**setting)
        saved = saved_activation_bytes(lambda: model.loss(tokens, targets), model.parameters())
        loss = model.loss(tokens, targets).sum()
        loss.backward()
        got = [loss.detach()] + [q.grad for q in model.parameters()]
        ref = ref or (got, saved)
        same = all(same_bits(x, y) for x, y in zip(got, ref[0]))
        print(f"{name:<18} {saved:>12,} {saved / ref[1]:>7.0%}  {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
