"""TP-invariant parallel layers with megatron-core's names and signatures."""
from tpinv.layers.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_log_probs
from tpinv.layers.embedding import VocabParallelEmbedding
from tpinv.layers.linear import ColumnParallelLinear, RowParallelLinear, column_parallel_group
from tpinv.layers.linear_cross_entropy import linear_cross_entropy, linear_log_probs
from tpinv.layers.norm import HeadRMSNorm, RMSNorm, head_rms_norm
from tpinv.layers.query_key import norm_and_rope

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_parallel_group", "VocabParallelEmbedding", "RMSNorm",
           "HeadRMSNorm", "head_rms_norm", "norm_and_rope", "vocab_parallel_cross_entropy", "vocab_parallel_log_probs",
           "linear_cross_entropy", "linear_log_probs"]
