"""megatron's mixed-precision and distributed optimizers on a tpinv GPT model (GPT-2-style, dropout 0.1
keyed by ``tpinv.megatron.dropout_sample_ids``), megatron DDP with fp32 ``main_grad`` buffers,
``get_megatron_optimizer`` with ``clip_grad=1.0``, 4 steps, on CPU/gloo
(``tpinv.testing.megatron_cpu``):

* bf16 parameters (``OptimizerConfig(bf16=True)``: megatron's ``Float16Module`` and fp32 main
  parameters) train to the same losses, grad norms and weight bits at TP 1 and 2; the stock model
  (megatron's layers, RNG dropout and grad norm) differs between TP 1 and 2 (control);
* ``use_distributed_optimizer=True`` over DP=2 (each rank steps its shard of the parameters) at
  TP 1 and 2 trains to the bits of the plain optimizer at TP1 x DP1, fp32 and bf16 (the reduced
  gradient shards are all-gathered for the norm; without that the norm differs: control); the
  stock model differs between TP 1 and 2 (control);
* the grad norm megatron's optimizer clips with is, bit for bit, tpinv's trainer's
  ``global_grad_norm`` of the same ``main_grad``s (fp32 and bf16).
"""
import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_samples  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

LR = 1e-2


def run(precision, optimizer="plain", variant="tpinv"):
    return (2, "ids" if variant == "tpinv" else "count", LR, precision, optimizer, variant)


PLAIN = [run("fp32"), run("bf16"), run("bf16", variant="stock")]
DISTRIBUTED = [run("fp32", "distributed"), run("bf16", "distributed"), run("fp32", "distributed", "stock")]
SHARDS = run("fp32", "distributed/shards")


@pytest.fixture(scope="module")
def runs():
    return {"tp1": run_ranks(megatron_samples.worker, 1, 1, PLAIN, timeout=600)[0],
            "tp2": run_ranks(megatron_samples.worker, 2, 2, PLAIN[1:], timeout=600)[0],
            "tp1xdp2": run_ranks(megatron_samples.worker, 2, 1, DISTRIBUTED + [SHARDS], timeout=600)[0],
            "tp2xdp2": run_ranks(megatron_samples.worker, 4, 2, DISTRIBUTED, timeout=600)[0]}


def test_bf16_params_train_to_the_same_bits_at_tp1_and_tp2(runs):
    ref = runs["tp1"][run("bf16")]
    assert ref[2]["decoder.layers.0.mlp.linear_fc1.weight"].dtype == torch.bfloat16
    megatron_samples.assert_same_run(runs["tp2"][run("bf16")], ref, "bf16 at TP=2")
    # bf16 is its own contract: it does not give fp32's weights
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert_bits_differ(ref[2][name].float(), runs["tp1"][run("fp32")][2][name], f"{name}, bf16 vs fp32")


def test_control_stock_bf16_differs_across_tp(runs):
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    assert_bits_differ(runs["tp2"][run("bf16", variant="stock")][2][name],
                       runs["tp1"][run("bf16", variant="stock")][2][name], f"stock bf16 {name} at TP=2 vs TP=1")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_distributed_optimizer_dp2_trains_like_the_plain_optimizer(runs, precision):
    ref = runs["tp1"][run(precision)]
    for layout in ("tp1xdp2", "tp2xdp2"):
        megatron_samples.assert_same_run(runs[layout][run(precision, "distributed")], ref,
                         f"{precision} distributed optimizer at {layout}")


def test_control_norm_of_the_ranks_own_shards_differs(runs):
    # without gathering the reduce-scattered shards each rank's main_grad is partly unreduced
    _, norms, w, _ = runs["tp1xdp2"][SHARDS]
    _, ref_norms, ref_w, _ = runs["tp1"][run("fp32")]
    assert_bits_differ(torch.tensor(norms[0]), torch.tensor(ref_norms[0]), "first grad norm from shards (control)")
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert_bits_differ(w[name], ref_w[name], f"{name} clipped by the shards' norm (control)")


def test_control_stock_distributed_optimizer_differs_across_tp(runs):
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    stock = run("fp32", "distributed", "stock")
    assert_bits_differ(runs["tp2xdp2"][stock][2][name], runs["tp1xdp2"][stock][2][name],
                       f"stock distributed-optimizer {name} at TP2xDP2 vs TP1xDP2")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_clipped_norm_is_the_trainers_norm_of_the_same_grads(runs, precision):
    for layout in ("tp1", "tp2") if precision == "bf16" else ("tp1",):
        _, norms, _, trainer = runs[layout][run(precision)]
        assert norms[0] > 1.0, "the first step clips (clip_grad=1.0), so the norm scaled the update"
        assert_same_bits(torch.tensor(norms[0], dtype=torch.float32), trainer,
                         f"{precision} norm at {layout} vs tpinv.training.optim.global_grad_norm")
