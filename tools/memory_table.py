"""Per-rank training memory of real model shapes at TP 1/2/4/8, with and without sequence parallelism.

``python tools/memory_table.py [--models qwen3-8b llama3-70b] [--seq 4096] [--micro-batch 1]``
prints a markdown table (docs/scale-out.md holds its output).  Parameter counts come from the
code's own modules: one decoder layer, the embedding, the final norm and the LM head are built
as each TP rank builds them (a fake process group of the TP size, no weights drawn: the
tensors are left uninitialised and never touched) and their per-rank parameters counted.
Bytes per parameter, as :mod:`tpinv.training` keeps them: the model weight and its ``.grad``
in the model dtype (bf16: 2 + 2), one fp32 gradient buffer (4; the micro-batch tree holds
up to ``log2(M) + 1`` of them), and the fp32 master weight and AdamW moments (12).
Peak activations are the bytes the layers save for backward per micro-batch, counted from
the per-rank shapes of the built modules (``local_heads``, ``local_kv_heads``, KV ``replicas``,
the column/row shard widths) as listed in :func:`layer_saved_elements`.  No weight is
all-gathered anywhere: every all-gather in the model moves activations
(tests/distributed/test_scale_out_models.py checks this by tensor storage).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _world(tp: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())


def build_rank(args, tp: int, sp: bool):
    """The modules of TP rank 0 (one decoder layer stands for all): built, not initialised."""
    import torch.distributed as dist
    from tpinv.layers import ColumnParallelLinear, RMSNorm, VocabParallelEmbedding
    from tpinv.models.transformer import DecoderLayer, LayerConfig
    _world(tp)
    group = dist.group.WORLD
    cfg = LayerConfig(params_dtype=args.dtype, tpinv_leaves=8, tpinv_row_strategy="tree",
                      perform_initialization=False, sequence_parallel=sp and tp > 1)
    layer = DecoderLayer(args, cfg, group, tp)
    embed = VocabParallelEmbedding(args.vocab_size, args.hidden_size, init_method=None, config=cfg, tp_group=group)
    head = ColumnParallelLinear(args.hidden_size, args.vocab_size, config=cfg, init_method=None, bias=False,
                                skip_weight_param_allocation=args.tie_word_embeddings, tp_group=group)
    norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.dtype)
    return layer, [embed, head, norm]


def layer_saved_elements(layer, args, tp: int, sp: bool) -> dict:
    """Elements per token saved for backward by one decoder layer of TP rank 0 (dtype unless noted).

    Under SP a token's hidden-size tensors live on one rank: a per-token share of ``H / TP``.
    """
    a, H, D = layer.self_attn, args.hidden_size, args.head_dim
    hs = H / tp if sp and tp > 1 else H  # a hidden-size activation's per-rank share
    q_heads = a.local_heads * a.replicas  # heads attention runs on this rank (gathered replica group)
    inter = layer.mlp.gate_proj.output_size_per_partition
    return {
        "input_layernorm x": hs,
        "q/k/v input (one tensor)": hs,
        "q/k norm inputs": (a.local_heads + a.local_kv_heads) * D if a.q_norm is not None else 0,
        "attention q, k, v, out": (2 * q_heads + 2 * a.local_kv_heads) * D,
        "attention lse (fp32, in dtype units)": q_heads * 4 / args.dtype.itemsize,
        "o_proj input": a.local_heads * D,
        "post_attention_layernorm x": hs,
        "gate/up input (one tensor)": hs,
        "silu_mul gate, up": 2 * inter,
        "down_proj input": layer.mlp.down_proj.input_size_per_partition,
    }


def measure(name: str, tp: int, sp: bool, tokens: int) -> dict:
    from tpinv.models import get_config
    args = get_config(name, dtype=torch.bfloat16)
    layer, rest = build_rank(args, tp, sp)
    n_layer = sum(p.numel() for p in layer.parameters())
    n_rest = sum(p.numel() for m in rest for p in m.parameters())
    params = n_layer * args.num_layers + n_rest
    b = args.dtype.itemsize
    per_token = sum(layer_saved_elements(layer, args, tp, sp).values()) * args.num_layers
    hs = args.hidden_size / tp if sp and tp > 1 else args.hidden_size
    head = 2 * hs + args.vocab_size / tp * (1 + 4 / b)  # final norm x, lm_head x, logits + fp32 loss copy
    return {"params": params, "weights": params * b, "grads": params * (b + 4), "optimizer": params * 12,
            "activations": (per_token + head) * tokens * b}


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-8b", "llama3-70b"])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    a = p.parse_args(argv)
    if a.seq < 8 or a.seq % 8 or a.micro_batch < 1:
        p.error(f"--seq {a.seq} and --micro-batch {a.micro_batch}: expected a sequence length that is a positive "
                f"multiple of 8 (sequence parallelism splits it over TP up to 8) and at least one sequence")
    tokens = a.seq * a.micro_batch
    print(f"Per-rank GiB, bf16 weights, {a.micro_batch} x {a.seq} tokens per micro-batch.\n")
    print("| model | TP | SP | params/rank | weights | grads (bf16 + fp32 buffer) | optimizer (fp32 master, m, v) "
          "| weights+grads+optimizer | peak activations |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        _rows(a, tokens)
    finally:   # the fake group of the last TP size: never left behind for the caller
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _rows(a, tokens: int) -> None:
    for name in a.models:
        for tp in (1, 2, 4, 8):
            for sp in ((False,) if tp == 1 else (False, True)):
                m = measure(name, tp, sp, tokens)
                total = m["weights"] + m["grads"] + m["optimizer"]
                print(f"| {name} | {tp} | {'on' if sp else 'off'} | {m['params'] / 1e9:.3f} B | {gib(m['weights'])} | "
                      f"{gib(m['grads'])} | {gib(m['optimizer'])} | {gib(total)} | {gib(m['activations'])} |",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
