"""tools/check_invariance.py: the invariant path is reproducible across TP x batch, the control is not."""
import json
import runpy
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_invariance.py"


def run_tool(args):
    saved = sys.argv
    sys.argv = [str(TOOL)] + args
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(TOOL), run_name="__main__")
    finally:
        sys.argv = saved
    return done.value.code


@pytest.mark.parametrize("model", ["mistral-tiny"])
def test_invariant_reproducible_vanilla_not(tmp_path, model):
    out = tmp_path / "report.json"
    code = run_tool(["--model", model, "--tp", "1,2", "--batch", "1,3", "--prompts", "3", "--new-tokens", "5",
                     "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    inv, van = report["paths"]["invariant"], report["paths"]["vanilla"]
    assert inv["avg_unique_outputs"] == 1.0 and inv["avg_max_prob_divergence"] == 0.0
    assert inv["positions_compared"] == 3 * 5
    # Negative control: the plain path moves probabilities between configurations.
    assert van["avg_max_prob_divergence"] > 0.0


def test_bad_arguments(tmp_path):
    assert run_tool(["--batch", "0"]) == 2
    assert run_tool(["--paths", "fast"]) == 2
