"""Export a training checkpoint's model weights as a model directory (offline, one process).

    python tools/export_checkpoint.py STEP_DIR OUT_DIR [--hf] [--overwrite]

STEP_DIR is a ``step_XXXXXXXX`` directory of a ``--save`` root, or the root itself (its
``latest``).  OUT_DIR becomes a tpinv checkpoint (``--model OUT_DIR`` for training or
inference, any TP size), or with ``--hf`` a HF model directory.  The weights are copied bit for
bit; every file's sha256 is checked first; OUT_DIR appears atomically.  Exit status 2 on bad
input (a missing, incomplete or corrupt checkpoint, an OUT_DIR that exists), as the other tools.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("step_dir", help="a training step directory, or a --save root (its 'latest')")
    p.add_argument("out_dir", help="the model directory to write")
    p.add_argument("--hf", action="store_true", help="write a HF model directory instead of a tpinv checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from tpinv.training.export import export_model
    try:
        out = export_model(args.step_dir, args.out_dir, hf=args.hf, overwrite=args.overwrite)
    except (ValueError, OSError, KeyError) as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
