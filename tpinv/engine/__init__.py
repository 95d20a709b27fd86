"""Inference engine: KV cache, continuous batching and counter-based sampling, the same bits at any TP
size and batch composition, with raw log-probs equal to the training forward's.

:class:`Engine` generates; :class:`Request` / :class:`Result` are its inputs and outputs;
:class:`SamplingParams` and :func:`counter_uniform` fix how tokens are drawn.
"""
from tpinv.engine.engine import Engine
from tpinv.io.loading import load_model
from tpinv.engine.metrics import (count_unique_outputs, k3_kl, max_probability_divergence, mismatch_metrics,
                                  token_mult_prob_error)
from tpinv.engine.sampling import SamplingParams, counter_uniform, prefix_sum, sample_row
from tpinv.engine.scheduler import FINISH_REASONS, Request, Result, Scheduler

__all__ = ["Engine", "FINISH_REASONS", "Request", "Result", "SamplingParams", "Scheduler", "count_unique_outputs",
           "counter_uniform", "k3_kl", "load_model", "max_probability_divergence", "mismatch_metrics", "prefix_sum",
           "sample_row", "token_mult_prob_error"]
