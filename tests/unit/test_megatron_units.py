"""Single-process pieces of the megatron-core integration: version range, invariant dropout,
the fixed-order broadcast-bias gradient, the grad norm equal to tpinv's trainer's."""
import pytest
import torch

from tpinv.testing import assert_bits_differ, assert_same_bits


def test_version_range_refuses_outside():
    from tpinv.megatron.version import check_version

    assert check_version("0.12.3") == (0, 12, 3)
    assert check_version("0.16.1") == (0, 16, 1)
    assert check_version("0.15.0rc2") == (0, 15, 0)
    for bad in ("0.11.0", "0.17.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=rf"megatron-core {bad} is not supported.*0\.12\.x through 0\.16\.x"):
            check_version(bad)


def test_installed_version_is_supported():
    pytest.importorskip("megatron.core")
    from tpinv.megatron import megatron_version

    assert (0, 12) <= megatron_version()[:2] <= (0, 16)


def test_dropout_masks_of_shards_and_micro_batches_are_slices_of_the_whole():
    from tpinv.layers.dropout import dropout_key, token_dropout
    from tpinv.megatron.dropout import bnqk_keep_mask, sbh_keep_mask

    key, ids = dropout_key(3, 9), torch.arange(10, 14)
    heads = bnqk_keep_mask((4, 8, 5, 5), 0.1, key, ids)
    hidden = sbh_keep_mask((8, 4, 6), 0.1, key, ids)
    for tp in (2, 4):
        n, s = 8 // tp, 8 // tp
        parts = [bnqk_keep_mask((4, n, 5, 5), 0.1, key, ids, first_head=r * n) for r in range(tp)]
        assert_same_bits(torch.cat(parts, dim=1), heads, f"attention mask, heads over TP={tp}")
        chunks = [sbh_keep_mask((s, 4, 6), 0.1, key, ids, first_token=r * s) for r in range(tp)]
        assert_same_bits(torch.cat(chunks, dim=0), hidden, f"hidden mask, sequence chunks over TP={tp}")
    for mbs in (1, 2):  # micro-batches: the rows' ids name them, wherever they sit
        rows = [sbh_keep_mask((8, mbs, 6), 0.1, key, ids[i:i + mbs]) for i in range(0, 4, mbs)]
        assert_same_bits(torch.cat(rows, dim=1), hidden, f"hidden mask, micro-batches of {mbs}")
        rows = [bnqk_keep_mask((mbs, 8, 5, 5), 0.1, key, ids[i:i + mbs]) for i in range(0, 4, mbs)]
        assert_same_bits(torch.cat(rows, dim=0), heads, f"attention mask, micro-batches of {mbs}")
    assert 0.8 < hidden.float().mean().item() < 0.97 and 0.8 < heads.float().mean().item() < 0.97
    # the words of tpinv's own models: [s, b, h] gets the [b, s, h] mask of token_dropout, transposed
    x = torch.ones(4, 8, 6)
    assert_same_bits(token_dropout(x, 0.1, key, ids) != 0, hidden.transpose(0, 1), "tpinv models' token mask")
    # other rows, site or seed draw other masks
    assert_bits_differ(sbh_keep_mask((8, 4, 6), 0.1, key, ids + 4), hidden, "other sample ids")
    assert_bits_differ(sbh_keep_mask((8, 4, 6), 0.1, dropout_key(3, 10), ids), hidden, "next site")
    # control: torch's RNG dropout on the shards (same seed per rank) is not the slice of the full mask
    x = torch.ones(2, 8, 5, 5)
    torch.manual_seed(0)
    stock_full = torch.nn.functional.dropout(x, 0.1)
    torch.manual_seed(0)
    stock_half = torch.nn.functional.dropout(x[:, :4], 0.1)
    assert_bits_differ(stock_half, stock_full[:, :4], "torch dropout on a shard")


def test_dropout_counts_samples_or_takes_the_given_ids():
    import tpinv.megatron.dropout as dropout
    from tpinv.layers.dropout import dropout_key

    x = torch.ones(8, 4, 6)
    whole = dropout.InvariantDropout(0.1, seed=3, site=9).train()
    y = whole(x)
    want = torch.where(dropout.sbh_keep_mask(x.shape, 0.1, dropout_key(3, 9), torch.arange(4)), x / 0.9,
                       torch.zeros(()))
    assert_same_bits(y, want, "module output")
    assert whole.samples == 4 and whole.eval()(x) is x and whole.samples == 4
    split = dropout.InvariantDropout(0.1, seed=3, site=9).train()
    assert_same_bits(torch.cat([split(x[:, :2]), split(x[:, 2:])], dim=1), y, "two micro-batches of 2 rows")
    # control: keyed by the row's index in its micro-batch, the second micro-batch repeats the first's masks
    by_row = dropout.InvariantDropout(0.1, seed=3, site=9).train()
    by_row._counted_ids = lambda rows, device: torch.arange(rows)
    assert_bits_differ(torch.cat([by_row(x[:, :2]), by_row(x[:, 2:])], dim=1), y, "row-in-micro-batch keying")
    # the ids API: the same rows named explicitly, out of order, on another module instance
    model = torch.nn.Sequential(dropout.InvariantDropout(0.1, seed=3, site=9)).train()
    with dropout.dropout_sample_ids(model, torch.tensor([3, 2])):
        got = model(x[:, [3, 2]])
    assert_same_bits(got, y[:, [3, 2]], "rows 3, 2 named by their ids")
    assert model[0].samples == 0 and model[0].sample_ids is None
    with pytest.raises(ValueError, match="gave 2 ids for a micro-batch of 4 rows"):
        with dropout.dropout_sample_ids([model], torch.tensor([0, 1])):
            model(x)
    with pytest.raises(ValueError, match="int64 tensor"):
        with dropout.dropout_sample_ids(model, torch.tensor([0.0, 1.0])):
            pass
    with pytest.raises(ValueError, match="no tpinv dropout"):
        with dropout.dropout_sample_ids(torch.nn.Linear(2, 2), torch.tensor([0])):
            pass
    with pytest.raises(ValueError, match=r"expected hidden states \[s, b, h\]"):
        whole.train()(torch.ones(4, 6))
    # attention probabilities: heads of TP rank 1 of 2 are heads 4..7 of the whole
    probs = torch.ones(2, 8, 5, 5)
    full = dropout.InvariantDropout(0.1, seed=3, site=10, layout="bnqk").train()(probs)
    half = dropout.InvariantDropout(0.1, seed=3, site=10, layout="bnqk").train()
    half.tp_rank, half.tp_size = 1, 2
    assert_same_bits(half(probs[:, 4:]), full[:, 4:], "heads 4..7 at TP rank 1")
    # sequence parallelism: rank 1's chunk of the hidden states is tokens 4..7
    chunk = dropout.InvariantDropout(0.1, seed=3, site=9, sequence_parallel=True).train()
    chunk.tp_rank, chunk.tp_size = 1, 2
    assert_same_bits(chunk(x[4:]), y[4:], "sequence chunk of TP rank 1")


def test_broadcast_bias_grad_is_width_independent():
    from tpinv.megatron.layers import BroadcastBias
    from tpinv.testing import record_ops

    torch.manual_seed(0)
    dy = torch.randn(37, 3, 24) * 1e3
    grads = []
    for width in (24, 12, 6, 3):
        for j in range(24 // width):
            b = torch.zeros(width, requires_grad=True)
            with record_ops() as seen:
                BroadcastBias.apply(b, (37, 3, width)).backward(dy[..., j * width:(j + 1) * width])
            assert "tpinv::tree_sum" in seen
            grads.append(b.grad)
        assert_same_bits(torch.cat(grads[-(24 // width):]), grads[0] if width == 24 else full, f"width {width}")
        full = grads[0]
    # control: the token sum in another order
    assert_bits_differ(dy.reshape(-1, 24).flip(0).cumsum(0)[-1], full, "reversed token order")


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_parameter_grads_are_the_same_bits_at_any_thread_count(kind, dtype):
    from tpinv.kernels.reference_tree import halving_sum
    from tpinv.megatron.norms import InvariantNorm
    from tpinv.testing import num_threads, record_ops

    torch.manual_seed(0)
    stock = (torch.nn.LayerNorm(24) if kind == "LayerNorm" else torch.nn.RMSNorm(24, eps=1e-5)).to(dtype)
    with torch.no_grad():
        stock.weight.normal_()
    x, dy = torch.randn(3000, 24).to(dtype), torch.randn(3000, 24).to(dtype)
    grads = {}
    for threads in (1, 2, 4):
        norm = InvariantNorm.from_torch(stock)
        with num_threads(threads), record_ops() as seen:
            norm(x.clone().requires_grad_()).backward(dy)
        assert "tpinv::tree_sum" in seen
        grads[threads] = (norm.weight.grad, getattr(norm.bias, "grad", None))
    for threads in (2, 4):
        assert_same_bits(grads[threads][0], grads[1][0], f"{kind} {dtype} weight grad, {threads} threads")
        if kind == "LayerNorm":
            assert_same_bits(grads[threads][1], grads[1][1], f"{kind} {dtype} bias grad, {threads} threads")
    # the order: the fp32 products of each token, summed over the tokens by contiguous halving
    normed = (torch.nn.functional.layer_norm(x.float(), (24,), None, None, 1e-5) if kind == "LayerNorm"
              else torch.nn.functional.rms_norm(x.float(), (24,), None, 1e-5))
    want = halving_sum((dy.float() * normed).t()).to(dtype)
    assert_same_bits(grads[1][0], want, f"{kind} {dtype} weight grad: the fixed token order")


def test_affine_by_tokens_sums_tokens_in_the_fixed_order():
    from tpinv.megatron.norms import AffineByTokens

    # four tokens whose products are 1, 2**24, -2**24, 0: contiguous halving adds 1 - 2**24 and
    # 2**24 first (both exact), then gives 1; a token-by-token chain loses the 1 beside 2**24 and
    # gives 0 -- the control, different by construction
    dy = torch.tensor([1.0, 2.0 ** 24, -(2.0 ** 24), 0.0])[:, None].expand(4, 3).contiguous()
    weight, bias = torch.ones(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    AffineByTokens.apply(torch.ones(4, 3), weight, bias, torch.float32).backward(dy)
    assert_same_bits(weight.grad, torch.ones(3), "weight grad")
    assert_same_bits(bias.grad, torch.ones(3), "bias grad")
    chain = torch.zeros(3)
    for row in dy:
        chain = chain + row
    assert_bits_differ(chain, weight.grad, "the token-by-token chain")


def test_grad_norm_equals_the_trainers_norm():
    from tpinv.megatron.grad_norm import invariant_grad_norm
    from tpinv.training.optim import ParamLayout, global_grad_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 8))
    model(torch.randn(5, 16)).square().sum().backward()
    for p in model.parameters():  # megatron DDP's fp32 main_grad buffers
        p.main_grad = p.grad.float().clone() * 1e3
        p.grad = None
    layout = ParamLayout(model)
    flat = torch.cat([p.main_grad.reshape(-1) for p in model.parameters()])
    ours = invariant_grad_norm([model], tp_group=None)
    assert_same_bits(ours, global_grad_norm(flat, layout, None), "grad norm")
    # control by construction: 4096**2 = 2**24 first, then ones.  A left-to-right fp32 sum drops
    # every +1 (2**24 + 1 rounds to 2**24); the leaf tree adds the ones together first.
    for p in model.parameters():
        p.main_grad = torch.ones_like(p.main_grad)
    first = next(model.parameters())
    first.main_grad.view(-1)[0] = 4096.0
    flat = torch.cat([p.main_grad.reshape(-1) for p in model.parameters()])
    ours = invariant_grad_norm([model], tp_group=None)
    assert_same_bits(ours, global_grad_norm(flat, layout, None), "grad norm, ones")
    chain = torch.zeros((), dtype=torch.float32)
    for v in (flat * flat).tolist():
        chain = chain + torch.tensor(v, dtype=torch.float32)
    assert_bits_differ(ours, torch.sqrt(chain), "left-to-right sum of squares (control)")


def test_plain_rng_dropout_is_refused():
    from tpinv.megatron.dropout import InvariantDropout, install_invariant_dropout

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    with pytest.raises(NotImplementedError, match=r"1 is a torch.nn.Dropout\(p=0.1\) on megatron's RNG path"):
        install_invariant_dropout(model, tp_group=None, seed=1)
    emb = torch.nn.Module()
    emb.embedding_dropout = torch.nn.Dropout(0.1)
    assert install_invariant_dropout(emb, tp_group=None, seed=1) == 1
    assert isinstance(emb.embedding_dropout, InvariantDropout)


def test_leaf_error_names_the_config_field():
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from tpinv.core.contract import InvarianceError
    from tpinv.megatron.layers import MegatronRowParallelLinear

    cfg = SimpleNamespace(params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=True)
    with pytest.raises(InvarianceError, match=r"input_size=12 is not divisible by leaves=8.*config\.tpinv_leaves"):
        MegatronRowParallelLinear(12, 12, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
                                  input_is_parallel=True, skip_bias_add=False)
    cfg.tpinv_leaves = 4
    layer = MegatronRowParallelLinear(12, 12, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
                                      input_is_parallel=True, skip_bias_add=False)
    assert layer.leaves == 4


def test_invariant_norm_refuses_what_it_cannot_gather():
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from tpinv.megatron.grad_norm import use_invariant_grad_norm

    opt = SimpleNamespace(config=SimpleNamespace(fp16=False, use_distributed_optimizer=True))
    with pytest.raises(NotImplementedError, match="pass megatron's DistributedDataParallel modules"):
        use_invariant_grad_norm(opt, [torch.nn.Linear(2, 2)], tp_group=None)
    chunk = torch.nn.Linear(2, 2)
    chunk.bucket_groups = [SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=True,
                                                                      num_distributed_optimizer_instances=2))]
    with pytest.raises(NotImplementedError, match="num_distributed_optimizer_instances > 1"):
        use_invariant_grad_norm(opt, [chunk], tp_group=None)
    with pytest.raises(NotImplementedError, match="fp16 loss scaling"):
        use_invariant_grad_norm(SimpleNamespace(config=SimpleNamespace(fp16=True)), [chunk], tp_group=None)
