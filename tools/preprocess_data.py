"""Tokenize a corpus into Megatron's indexed format (a thin CLI over tpinv.training.preprocess).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \\
        --tokenizer tokenizer.json [--json-keys text] [--append-eod]

writes ``out/corpus_text_document.bin`` and ``.idx`` (one pair per JSON key), megatron-core's
IndexedDatasetBuilder format: train on it with ``launch/pretrain.py --data-path
out/corpus_text_document --tokenizer tokenizer.json`` (or Megatron-LM's ``--data-path``).
Errors (a missing key, an empty document, an unreadable tokenizer) print ``error: ...`` and
leave no partial output.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="a .jsonl file (one JSON object per line) or a .txt file "
                   "(one document)")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, tokenizer.model, or a directory holding one")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="the JSON fields to tokenize (one dataset each)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's eos id")
    p.add_argument("--log-interval", type=int, default=10000, help="progress line every N documents (0: silent)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from tpinv.training.preprocess import load_corpus_tokenizer, preprocess_corpus
    try:
        if args.log_interval < 0:
            raise ValueError(f"--log-interval {args.log_interval}: expected >= 0")
        tokenizer = load_corpus_tokenizer(args.tokenizer)
        preprocess_corpus(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys,
                          append_eod=args.append_eod, log_interval=args.log_interval)
    except (ValueError, OSError, ImportError) as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
