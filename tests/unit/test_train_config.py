"""Run settings: flags and YAML keys generated from the dataclasses, flags over the file over defaults."""
import dataclasses

import pytest

from tpinv.training import TrainConfig
from tpinv.training.config import LaunchConfig, build_parser, load_yaml_config, parse_configs


def test_every_field_has_one_flag_and_no_flag_is_listed_twice():
    parser = build_parser()
    dests = [a.dest for a in parser._actions if a.dest not in ("help", "config")]
    assert len(dests) == len(set(dests))
    fields = [f.name for cls in (TrainConfig, LaunchConfig) for f in dataclasses.fields(cls)]
    assert sorted(dests) == sorted(fields)
    assert len(fields) == len(set(fields))  # a setting lives in one dataclass only


def test_defaults_are_the_dataclass_defaults():
    train, launch = parse_configs([])
    assert train == TrainConfig() and launch == LaunchConfig()


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("global-batch: 64\nmicro_batch: 4\nlr: 1\ntp: 2\nsequence_parallel: true\nmin_lr: null\n")
    train, launch = parse_configs(["--config", str(path), "--micro-batch", "8"])
    assert train.global_batch == 64 and train.micro_batch == 8  # the flag wins over the file
    assert train.lr == 1.0 and isinstance(train.lr, float) and train.sequence_parallel and launch.tp == 2
    assert train.min_lr is None


@pytest.mark.parametrize("text, message", [
    ("glboal_batch: 4\n", "unknown setting 'glboal_batch'"),
    ("global_batch: four\n", "global_batch='four' is a str, expected int"),
    ("dtype: fp8\n", "dtype='fp8'; choose from bf16, fp32, fp16"),
    ("- 1\n", "expected a mapping"),
    ("steps: [3\n", "is not valid YAML: while parsing a flow sequence"),
])
def test_bad_yaml_is_refused_with_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_yaml_config(str(path))


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        parse_configs(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize("dp", [3, 5, 6])
def test_a_data_parallel_size_that_is_not_a_power_of_two_is_refused(dp):
    from tpinv.core.contract import InvarianceError
    with pytest.raises(InvarianceError, match=f"{dp} data-parallel ranks: .* needs a power of two"):
        TrainConfig(global_batch=8 * dp, micro_batch=1).check(dp)
    TrainConfig(global_batch=8 * dp, micro_batch=1, vanilla=True).check(dp)   # the control: no tree to keep
    TrainConfig(global_batch=32, micro_batch=1).check(4)


def test_sequence_parallel_with_column_only_rows_names_the_flags():
    with pytest.raises(NotImplementedError, match="--sequence-parallel needs --row-strategy tree"):
        TrainConfig(sequence_parallel=True, row_strategy="column_only").check(1)
    TrainConfig(sequence_parallel=True).check(1)   # the control: the tree strategy


def test_sequence_parallel_with_a_sequence_the_tp_size_does_not_split_is_refused_before_the_model():
    from tpinv.training.model import build_model
    with pytest.raises(ValueError, match=r"--seq-len 15 is not a multiple of --tp 2: .* \(e.g. --seq-len 16\)"):
        build_model(TrainConfig(sequence_parallel=True, seq_len=15), None, 2, 0)
    args, model = build_model(TrainConfig(sequence_parallel=True, seq_len=16), None, 1, 0)   # the control
    assert model.args.num_layers == args.num_layers
