"""Convert HF checkpoints to tpinv checkpoints and back (a thin CLI over tpinv.io.hf_convert).

    python tools/convert_hf.py to-tpinv HF_DIR OUT_DIR [--tp C] [--dtype bf16|fp16|fp32|keep]
    python tools/convert_hf.py to-hf TPINV_DIR OUT_DIR [--dtype ...] [--fuse] [--max-shard-size 5GB]

Values are copied bit for bit (or cast once with --dtype); output appears atomically, so a
failed or interrupted conversion leaves no OUT_DIR.
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Optional, Sequence

from tpinv.core.dtypes import CLI_CHOICES, cli_dtype

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000 (KB/MB/GB decimal, KiB/MiB/GiB binary, as HF's ``max_shard_size``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 500MB, 5GB or 4GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-tpinv", help="HF model directory -> tpinv checkpoint")
    a.add_argument("hf_dir")
    a.add_argument("out_dir")
    a.add_argument("--tp", type=int, default=1, help="write one file per rank of this TP size (1: one file)")
    a.add_argument("--dtype", choices=CLI_CHOICES, default="keep")
    a.add_argument("--leaves", type=int, default=8, help="the run's leaf count (TP_MAX)")
    a.add_argument("--row-strategy", choices=("tree", "column_only"), default="tree")
    a.add_argument("--no-checksums", action="store_true", help="skip the per-tensor sha256 in tpinv.json")
    b = sub.add_parser("to-hf", help="tpinv checkpoint (any TP layout) -> HF model directory")
    b.add_argument("tpinv_dir")
    b.add_argument("out_dir")
    b.add_argument("--dtype", choices=CLI_CHOICES, default="keep")
    b.add_argument("--fuse", action="store_true", help="write fused qkv_proj / gate_up_proj tensors")
    b.add_argument("--max-shard-size", type=parse_size, default="5GB")
    for q in (a, b):
        q.add_argument("--overwrite", action="store_true", help="replace OUT_DIR once the new one is complete")
        q.add_argument("--no-progress", action="store_true")
    return p


#: What each kind of model source is (:func:`tpinv.io.loading.source_kind`), for errors.
_KINDS = {"hf": "a HF model directory", "tpinv": "a tpinv checkpoint directory", "config": "a named config"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from tpinv.io.hf_convert import convert_hf_to_tpinv, convert_tpinv_to_hf
    from tpinv.io.loading import source_kind
    source, want = (args.hf_dir, "hf") if args.command == "to-tpinv" else (args.tpinv_dir, "tpinv")
    kind = source_kind(source)   # a missing directory, a training checkpoint: refused here, naming what it is
    if kind != want:
        raise ValueError(f"{source} is {_KINDS[kind]}; {args.command} reads {_KINDS[want]}")
    progress = not args.no_progress and sys.stderr.isatty()
    if args.command == "to-tpinv":
        out = convert_hf_to_tpinv(args.hf_dir, args.out_dir, tp=args.tp, dtype=cli_dtype(args.dtype),
                                  leaves=args.leaves, row_strategy=args.row_strategy,
                                  checksums=not args.no_checksums, overwrite=args.overwrite, progress=progress)
    else:
        out = convert_tpinv_to_hf(args.tpinv_dir, args.out_dir, dtype=cli_dtype(args.dtype), fuse=args.fuse,
                                  max_shard_size=args.max_shard_size, overwrite=args.overwrite, progress=progress)
    print(out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, NotImplementedError, OSError) as e:  # OSError: unreadable input, unwritable output
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
