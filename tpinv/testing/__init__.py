"""Test helpers for tpinv and its users: spawned multi-rank groups (:mod:`~tpinv.testing.ranks`),
dispatched-op recording (:mod:`~tpinv.testing.ops`), byte-level equality
(:mod:`~tpinv.testing.bits`), host synchronizations counted (:mod:`~tpinv.testing.syncs`) and small
fixtures (:mod:`~tpinv.testing.fixtures`); rows of a softmax's special values
(:mod:`~tpinv.testing.special_values`); the attention split launch checked as one unit
(:mod:`~tpinv.testing.split_launch`)."""
from tpinv.testing.bits import assert_bits_differ, assert_same_bits, bits, same_bits
from tpinv.testing.fixtures import (attention_inputs, num_threads, pack_row, packed_conversation, packed_document_rows,
                                    place_row, sharpened_model)
from tpinv.testing.ops import OpLog, record_ops
from tpinv.testing.ranks import RankFailedError, RankTimeoutError, caught, free_port, run_ranks
from tpinv.testing.special_values import special_rows

__all__ = ["RankFailedError", "RankTimeoutError", "caught", "run_ranks", "record_ops", "OpLog", "bits", "same_bits",
           "assert_same_bits", "assert_bits_differ", "free_port", "num_threads", "sharpened_model",
           "packed_document_rows", "packed_conversation", "pack_row", "place_row", "attention_inputs", "special_rows"]
