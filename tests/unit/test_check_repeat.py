"""tools/check_repeat.py: identical training steps give identical bytes, and a tensor that varies
from step to step is reported (control: a gradient hook that adds the step count)."""
from __future__ import annotations

import json

import pytest
import torch

from tools.check_repeat import main, repeated_step_digests
from tpinv.models import Transformer, get_config


def test_identical_steps_report_nothing(tmp_path, capsys):
    out = tmp_path / "repeat.json"
    assert main(["--layers", "1", "--steps", "3", "--seq", "17", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["varying"] == {} and report["tensors"] > 10
    assert "0 varying" in capsys.readouterr().out


def test_a_tensor_that_varies_is_reported():
    torch.manual_seed(0)
    model = Transformer(get_config("qwen3-tiny", num_layers=1, dtype=torch.bfloat16))
    tokens = torch.randint(0, model.args.vocab_size, (1, 9))
    calls = [0]

    def drift(grad):
        calls[0] += 1
        return grad + calls[0] * 2.0 ** -4
    name, param = next(iter(model.named_parameters()))
    param.register_hook(drift)
    seen = repeated_step_digests(model, tokens, tokens, 3)
    varying = {n for n, d in seen.items() if len(d) > 1}
    assert varying == {f"grad {name}"}, varying
    assert len(seen[f"grad {name}"]) == 3


def test_one_step_compares_nothing():
    model = Transformer(get_config("qwen3-tiny", num_layers=1))
    with pytest.raises(ValueError, match="at least 2"):
        repeated_step_digests(model, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), 1)
