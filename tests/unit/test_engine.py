"""The engine at TP=1: batch/slot/arrival/budget invariance, trainer parity, bad input, stops, loading.

Invariance is bitwise (``assert_same_bits`` on the fp32 log-probs, ``==`` on tokens); each has a
negative control: the vanilla engine (BLAS, SDPA) on the same weights and requests changes
log-probs with the batch and disagrees with the vanilla trainer.
"""
from __future__ import annotations

import io
import math
import re

import pytest
import torch

from tpinv.engine import Engine, Request, SamplingParams
from tpinv.engine.metrics import (count_unique_outputs, fraction_bitwise_equal, k3_kl, max_probability_divergence,
                                  mismatch_metrics, token_mult_prob_error, trainer_log_probs)
from tpinv.testing import assert_same_bits, num_threads, same_bits, sharpened_model
from tpinv.models import Transformer, get_config

FAMILIES = ("qwen3-tiny", "llama-tiny", "mistral-tiny")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with num_threads(1):   # tiny ops: a thread pool only adds overhead
        yield


def build(name="qwen3-tiny", dtype=torch.float32) -> Transformer:
    return sharpened_model(name, dtype)


@pytest.fixture(scope="module")
def model():
    return build()


def make_requests(n=5, seed=0, max_tokens=5, **kw):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
        sampling = SamplingParams(0.0) if i % 2 == 0 else SamplingParams(0.8, top_k=40, top_p=0.9, seed=7)
        out.append(Request(f"r{i}", prompt, max_tokens=max_tokens, sampling=sampling, **kw))
    return out


def same(a, b) -> bool:
    return (a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and same_bits(a.logprobs, b.logprobs)
            and same_bits(a.sampled_logprobs, b.sampled_logprobs))


# ---- invariance ------------------------------------------------------------------------------------

CONFIGS = [  # (max_batch, slot_order, arrival_steps, token_budget)
    (2, [1, 0], [0, 0, 1, 3, 3], None),
    (3, [2, 0, 1], [2, 0, 4, 1, 0], 12),
    (5, [3, 1, 4, 0, 2], [0, 1, 2, 3, 4], None),
    (8, [7, 2, 5, 0, 6, 1, 4, 3], [0, 0, 0, 0, 0], 9),
]


def test_outputs_do_not_depend_on_batch_slot_arrival_or_budget(model):
    reqs = make_requests()
    ref = Engine(model, max_batch=1).generate(reqs)
    assert all(r.ok and len(r.token_ids) == 5 for r in ref)
    for b, slots, arrivals, budget in CONFIGS:
        out = Engine(model, max_batch=b, slot_order=slots, token_budget=budget, max_context=40).generate(
            reqs, arrival_steps=arrivals)
        assert all(same(o, r) for o, r in zip(out, ref)), (b, slots, arrivals, budget)


def test_a_live_engine_serves_weights_copied_in_place():
    """One engine across weight updates, as an RL loop keeps it: new weights copied into its
    model's parameters in place give a fresh engine's bits on those weights, though the second
    call's requests land in slots holding the first call's keys and values.  Control: the same
    engine's outputs before the copy differ from after (the update reached it)."""
    live_model, new_model = build(), build()
    with torch.no_grad():
        for p in new_model.parameters():
            p.mul_(1.25)
    reqs = make_requests()
    live = Engine(live_model, max_batch=3, slot_order=[2, 0, 1], max_context=40)
    before = live.generate(reqs)
    with torch.no_grad():
        for p, q in zip(live_model.parameters(), new_model.parameters()):
            p.copy_(q)
    after = live.generate(reqs, arrival_steps=[1, 0, 2, 0, 1])
    fresh = Engine(new_model, max_batch=1).generate(reqs)
    assert all(same(a, f) for a, f in zip(after, fresh))
    assert not any(same(b, a) for b, a in zip(before, after))


def test_negative_control_vanilla_engine_depends_on_the_batch(model):
    reqs = make_requests()
    ref = Engine(model, max_batch=1, vanilla=True).generate(reqs)
    differs = []
    for b, slots, arrivals, budget in CONFIGS:
        out = Engine(model, max_batch=b, slot_order=slots, token_budget=budget, vanilla=True).generate(
            reqs, arrival_steps=arrivals)
        differs.append(any(not same(o, r) for o, r in zip(out, ref)))
    assert any(differs)


@pytest.mark.parametrize("name,dtype", [("qwen3-tiny", torch.float32), ("llama-tiny", torch.bfloat16),
                                        ("mistral-tiny", torch.float16)])
def test_engine_log_probs_are_the_training_forward_bits(name, dtype):
    m = build(name, dtype)
    reqs = make_requests(4, seed=1)
    res = Engine(m, max_batch=3, slot_order=[1, 2, 0]).generate(reqs, arrival_steps=[0, 2, 1, 0])
    seqs = [(r.prompt_ids, r.token_ids) for r in res]
    train = trainer_log_probs(m, seqs)
    for r, t in zip(res, train):
        assert_same_bits(r.logprobs, t, str(name))
    gen_lp, train_lp = torch.cat([r.logprobs for r in res]), torch.cat(train)
    assert mismatch_metrics(gen_lp, train_lp) == {"tokens": gen_lp.numel(), "token_mult_prob_error": 1.0,
                                                  "k3_kl": 0.0, "max_abs_logprob_diff": 0.0,
                                                  "fraction_bitwise_equal": 1.0}
    # negative control: the vanilla engine and the vanilla trainer disagree on their own rollouts
    van = Engine(m, max_batch=3, vanilla=True).generate(reqs)
    van_train = trainer_log_probs(m, [(r.prompt_ids, r.token_ids) for r in van], vanilla=True)
    assert token_mult_prob_error(torch.cat([r.logprobs for r in van]), torch.cat(van_train)) > 1.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_metrics_of_identical_log_probs_are_exact_at_every_token_count(device):
    """1.0 / 0.0 exactly for identical log-probs whatever the number of tokens, on the CPU and on
    CUDA: the means are the sum over the count, divided on the host.  (On CUDA, ``mean`` multiplies
    by a rounded ``1 / n``: the RL demo's bitwise-equal rollouts read token_mult_prob_error
    0.9999999999999999 at some steps.)"""
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 513):
        lp = (-torch.rand(n, generator=gen) * 5).to(device)
        mask = (torch.rand(n, generator=gen) < 0.7).to(device)
        mask[0] = True
        for m in (None, mask):
            got = mismatch_metrics(lp, lp.clone(), m)
            assert got["token_mult_prob_error"] == 1.0 and got["k3_kl"] == 0.0, (n, got)
            assert got["fraction_bitwise_equal"] == 1.0 and got["max_abs_logprob_diff"] == 0.0, (n, got)
    # control: one token's log-prob moved changes every metric
    other = lp.clone()
    other[n // 2] -= 1e-3
    got = mismatch_metrics(lp, other)
    assert got["token_mult_prob_error"] > 1.0 and got["k3_kl"] > 0.0
    assert got["fraction_bitwise_equal"] == (n - 1) / n and got["max_abs_logprob_diff"] > 0.0


def test_raw_and_top_log_probs_agree_with_plain_torch(model):
    """Parity: raw log-probs and top-5 log-probs against torch.log_softmax (fp32, atol 1e-5)."""
    reqs = make_requests(2, seed=3, top_logprobs=5)
    res = Engine(model, max_batch=2).generate(reqs)
    for r in res:
        seq = torch.tensor(r.prompt_ids + r.token_ids)
        with torch.no_grad():
            plain = torch.log_softmax(model(seq[None, :-1])[0].float(), -1)[len(r.prompt_ids) - 1:]
        torch.testing.assert_close(r.logprobs, plain.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0],
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(r.top_logprobs, plain.topk(5).values, rtol=0, atol=1e-5)
        assert r.top_token_ids.shape == (len(r.token_ids), 5)
    greedy = res[0]                                 # the argmax is the top-1 entry, with the raw bits
    assert greedy.token_ids == greedy.top_token_ids[:, 0].tolist()
    assert_same_bits(greedy.top_logprobs[:, 0], greedy.logprobs, 'greedy.top_logprobs[:, 0]')
    assert not greedy.sampled_logprobs.any()
    plain_t1 = Engine(model).generate([Request("t1", [3, 4, 5], max_tokens=4, sampling=SamplingParams(1.0, seed=9))])[0]
    assert_same_bits(plain_t1.sampled_logprobs, plain_t1.logprobs,
                     'plain_t1.sampled_logprobs')   # temperature 1, no filter: q = p


# ---- bad input ---------------------------------------------------------------------------------------

BAD = [
    (Request("long", list(range(40))), "does not fit the context of 40"),
    (Request("unknown", [1, 256, 3]), r"256 is not an int in \[0, vocab_size=256\)"),
    (Request("negative", [1, -1]), "-1"),
    (Request("empty", []), "empty prompt"),
    (Request("temp", [1, 2], sampling=SamplingParams(temperature=-1.0)), "temperature"),
    (Request("top_p", [1, 2], sampling=SamplingParams(top_p=0.0)), "top_p"),
    (Request("top_k", [1, 2], sampling=SamplingParams(top_k=-3)), "top_k"),
    (Request("max_tokens", [1, 2], max_tokens=0), "max_tokens"),
    (Request("text", "hello"), "needs a tokenizer"),
    (Request("stop", [1, 2], stop=["x"]), "stop strings need a tokenizer"),
    ("not a request", "expected a tpinv.engine.Request"),
]


def test_bad_requests_get_clear_errors_and_leave_the_batch_untouched(model):
    good = make_requests(4, seed=2)
    clean = Engine(model, max_batch=3, max_context=40, slot_order=[2, 0, 1]).generate(good, arrival_steps=[0, 0, 1, 2])
    mixed, arrivals = [], []
    for i, g in enumerate(good):
        mixed.append(g)
        arrivals.append([0, 0, 1, 2][i])
        for bad, _ in BAD[i::4]:
            mixed.append(bad)
            arrivals.append(i % 3)
    out = Engine(model, max_batch=3, max_context=40, slot_order=[2, 0, 1]).generate(mixed, arrival_steps=arrivals)
    by_id = {getattr(r, "request_id", r): o for r, o in zip(mixed, out)}
    for g, c in zip(good, clean):
        assert same(by_id[g.request_id], c) and by_id[g.request_id].ok
    for bad, match in BAD:
        res = by_id[getattr(bad, "request_id", bad)]
        assert res.finish_reason == "error" and not res.ok and res.token_ids == []
        assert re.search(match, res.error), (match, res.error)


# ---- stop conditions ---------------------------------------------------------------------------------

def test_eos_stop_ids_max_tokens_and_context(model):
    base = Request("a", [5, 6, 7], max_tokens=8)
    free = Engine(model, max_batch=2).generate([base])[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    eos = free.token_ids[2]
    stop_at = free.token_ids.index(eos)            # its first occurrence ends the generation
    res = Engine(model, max_batch=2, eos_token_id=eos).generate([base])[0]
    assert res.finish_reason == "eos" and res.token_ids == free.token_ids[:stop_at + 1]
    assert_same_bits(res.logprobs, free.logprobs[:stop_at + 1], 'res.logprobs')
    ignored = Engine(model, max_batch=2, eos_token_id=eos).generate([Request("a", [5, 6, 7], 8, ignore_eos=True)])[0]
    assert same(ignored, free)
    res = Engine(model, max_batch=2).generate([Request("a", [5, 6, 7], 8, stop_token_ids=[eos])])[0]
    assert res.finish_reason == "stop" and res.token_ids == free.token_ids[:stop_at + 1]
    res = Engine(model, max_batch=2, max_context=6).generate([base])[0]
    assert res.finish_reason == "length" and res.token_ids == free.token_ids[:3]   # 3 prompt + 3 = context of 6


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import sentencepiece as spm
    from tpinv.io.tokenizer import load_tokenizer
    corpus = ["the quick brown fox jumps over the lazy dog", "same bits at any tensor parallel size",
              "hello world of reproducible sums"] * 30
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=out, vocab_size=80, model_type="bpe",
                                   character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    d = tmp_path_factory.mktemp("sp")
    (d / "tokenizer.model").write_bytes(out.getvalue())
    return load_tokenizer(str(d))


def test_text_prompts_and_stop_strings(model, tokenizer):
    prompt = "the lazy fox"
    free = Engine(model, tokenizer=tokenizer, eos_token_id=-1).generate([Request("t", prompt, max_tokens=12)])[0]
    assert free.prompt_ids == tokenizer.encode(prompt) and free.text is not None
    text = free.text
    cut = next(i for i in range(2, len(text) - 1) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    stop = text[cut:cut + 2]
    res = Engine(model, tokenizer=tokenizer, eos_token_id=-1).generate(
        [Request("t", prompt, max_tokens=12, stop=[stop, "never-there"])])[0]
    assert res.finish_reason == "stop" and res.text == text[:cut]
    assert res.token_ids == free.token_ids[:len(res.token_ids)] and len(res.token_ids) < len(free.token_ids)


# ---- continuous batching -----------------------------------------------------------------------------

def test_requests_join_and_leave_mid_flight(model):
    a, b, c = make_requests(3, seed=4, max_tokens=4)
    alone = {r.request_id: Engine(model, max_batch=1).generate([r])[0] for r in (a, b, c)}
    eng = Engine(model, max_batch=2, slot_order=[1, 0])
    eng.submit(a)
    done = eng.step() + eng.step()
    assert [s.request.request_id for s in eng.scheduler.running.values()] == ["r0"]
    eng.submit(b)
    eng.submit(c)                                  # waits: both slots are taken after b joins
    done += eng.step()
    assert sorted(s.request.request_id for s in eng.scheduler.running.values()) == ["r0", "r1"]
    assert [s.request.request_id for s in eng.scheduler.waiting] == ["r2"]
    while eng.has_unfinished():
        done += eng.step()
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    for r in done:
        assert same(r, alone[r.request_id])


def test_engine_rejects_bad_settings(model):
    with pytest.raises(TypeError, match="Transformer"):
        Engine(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="max_context"):
        Engine(model, max_context=1)
    with pytest.raises(ValueError, match="arrival_steps"):
        Engine(model).generate(make_requests(2), arrival_steps=[0])


# ---- metrics -----------------------------------------------------------------------------------------

def test_metric_definitions_on_hand_values():
    g, p = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -2.5, -0.25])
    assert math.isclose(token_mult_prob_error(g, p), (1 + math.exp(0.5) + math.exp(0.25)) / 3)
    r = [0.0, -0.5, 0.25]
    assert math.isclose(k3_kl(g, p), sum(math.exp(x) - x - 1 for x in r) / 3)
    mask = torch.tensor([True, False, True])
    assert math.isclose(token_mult_prob_error(g, p, mask), (1 + math.exp(0.25)) / 2)
    assert fraction_bitwise_equal(g, p) == pytest.approx(1 / 3)
    assert count_unique_outputs([[1, 2], [1, 2], [1, 3]]) == 2
    a = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05], [0.6, 0.3, 0.05, 0.03, 0.01]])
    b = a.clone()
    b[1, 2] += 0.02
    assert max_probability_divergence([a, a]) == 0.0
    assert max_probability_divergence([a, b, a]) == pytest.approx(0.02 / 2)
    assert max_probability_divergence([a, b[:1]]) == 0.0            # only the common positions count


# ---- loading -----------------------------------------------------------------------------------------

def test_load_named_config_tpinv_checkpoint_and_hf_directory(tmp_path, tokenizer):
    import shutil

    import transformers
    from tpinv.io.checkpoint import param_meta_from_module, save_checkpoint
    from tpinv.io.hf_convert import convert_hf_to_tpinv
    from tpinv.io.hf_keys import args_to_dict, hf_config_from_args
    reqs = make_requests(3, seed=6, max_tokens=3)
    named = Engine.load("llama-tiny", init_seed=3, max_batch=2)
    again = Engine.load("llama-tiny", init_seed=3, max_batch=3).generate(reqs)
    assert all(same(a, b) for a, b in zip(named.generate(reqs), again))
    m = named.model
    ck = save_checkpoint(m.state_dict(), str(tmp_path / "ck"), model_args=args_to_dict(m.args),
                         param_meta=param_meta_from_module(m), tp=2)
    assert all(same(a, b) for a, b in zip(Engine.load(ck, max_batch=2).generate(reqs), again))
    # a HF directory (random tiny Qwen3 from transformers) with a tokenizer beside it
    cfg = hf_config_from_args(get_config("qwen3-tiny"))
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(str(hf_dir))
    shutil.copy(tokenizer.path, hf_dir / "tokenizer.model")
    from_hf = Engine.load(str(hf_dir), max_batch=2)
    assert from_hf.tokenizer is not None and from_hf.eos_token_id == 2
    text = [Request("t", "the lazy fox", max_tokens=3, ignore_eos=True)]
    converted = Engine.load(convert_hf_to_tpinv(str(hf_dir), str(tmp_path / "conv"), tp=4), max_batch=3)
    assert converted.tokenizer is not None
    assert all(same(a, b) for a, b in zip(from_hf.generate(reqs + text), converted.generate(reqs + text)))
    with pytest.raises(ValueError, match="neither a directory nor a named config"):
        Engine.load("no-such-model")
    with pytest.raises(FileNotFoundError, match="holds neither"):
        Engine.load(str(tmp_path))
