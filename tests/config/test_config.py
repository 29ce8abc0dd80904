import os

import pytest
import yaml

import ignite_amp.config.tree
from helpers import assert_doctests_pass
from ignite_amp.cli.main import main
from ignite_amp.config.tree import Config, ConfigError, default_config, flatten_config, load_config
from ignite_amp.core.config_keys import leaves


def test_defaults_are_complete_and_valid():
    cfg = load_config(None)
    assert cfg.data.batch_size == 64 and cfg.handlers.checkpoint.resume == "auto"
    assert cfg.output_dir == os.path.join("runs", "ignite-amp")
    # A resolved config validates again unchanged (it is what checkpoints and config.yaml store).
    assert load_config(cfg) == cfg
    assert set(default_config()) == set(cfg)


def test_overrides_parse_yaml_values_and_reach_kwargs():
    cfg = load_config({}, ["optimizer.lr=1e-3", "train.epochs=3", "optimizer.kwargs.momentum=0.9",
                           "amp.fp32_modules=[head]", "handlers.clipping.max_norm=null"])
    assert cfg.optimizer.lr == 1e-3 and cfg.train.epochs == 3
    assert cfg.optimizer.kwargs == {"weight_decay": 0.05, "momentum": 0.9}
    assert cfg.amp.fp32_modules == ["head"] and cfg.handlers.clipping.max_norm is None


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\ndata: {batch_size: 16}\n")
    cfg = load_config(str(path), ["data.batch_size=8"])
    assert cfg.name == "x" and cfg.data.batch_size == 8


BAD = [
    ({"handlers": {"clipping": {"max_norm": "x"}}},
     'handlers.clipping.max_norm: expected a positive number or null, got "x"'),
    ({"handlers": {"clipping": {"max_norm": -1}}}, "handlers.clipping.max_norm: expected a positive number"),
    ({"amp": {"dtyp": "float16"}}, "amp.dtyp: unknown key"),
    ({"amp": {"dtype": "half"}}, 'amp.dtype: expected one of auto, float16, bfloat16, float32, float8, got "half"'),
    ({"data": {"batch_size": 0}}, 'data.batch_size: expected an integer from 1 to 1048576 or "auto", got 0'),
    ({"data": {"batch_size": 2.5}}, "data.batch_size: expected an integer from 1 to 1048576"),
    ({"data": {"num_workers": True}}, "data.num_workers: expected an integer from 0 to 256 or \"auto\", got True"),
    ({"data": {"image_size": 100000}}, "data.image_size: expected an integer from 8 to 4096 or null, got 100000"),
    ({"data": {"name": "mnist"}}, "data.name: expected one of"),
    ({"train": {"epochs": "five"}}, "train.epochs: expected a positive integer"),
    ({"train": []}, "train: expected a mapping, got a list"),
    ({"device": "gpu"}, 'device: expected auto, cpu, cuda, cuda:N, mps or xpu, got "gpu"'),
    ({"model": {"kwargs": [1]}}, "model.kwargs: expected a mapping of keyword names (letters, digits, '_') to "
                                 "values, got a list"),
    ({"handlers": {"profiler": {"enabled": "yes please"}}}, "handlers.profiler.enabled: expected true or false"),
    ({"bogus": 1}, "bogus: unknown key"),
    ([1, 2], "config: expected a mapping at the top level, got a list"),
]


@pytest.mark.parametrize("raw, message", BAD)
def test_bad_values_name_the_key_path(tmp_path, raw, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("raw, message", BAD)
def test_cli_exits_2_with_one_line_for_each_bad_config(tmp_path, capsys, raw, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = main(["train", str(path), "--set", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything ran


@pytest.mark.parametrize("args, message", [
    (["--set", "train.epochs"], "--set train.epochs: expected key.path=value"),
    (["--set", "train.nope=1"], "train.nope: unknown key"),
    (["--set", "seed.x=1"], "seed: is a value, not a section"),
    # 3,000 levels: one line, not "internal error: RecursionError" (issue 32.18)
    (["--set", "model.kwargs." + ".".join(["a"] * 3000) + "=1"], "a key path of 3002 levels (the limit is 64)"),
    pytest.param(["--set", "model.kwargs.a=" + "[" * 3000 + "]" * 3000], "the value is nested too deeply",
                 marks=pytest.mark.slow),  # seconds (measured), the rest milliseconds
    (["--set", "model.kwargs.a=" + "[" * 100 + "]" * 100], "model.kwargs.a: nested 102 levels deep (the limit is 64)"),
])
def test_bad_overrides(tmp_path, capsys, args, message):
    path = tmp_path / "ok.yaml"
    path.write_text("name: ok\n")
    assert main(["train", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and len(err) < 300


def _alias_bomb(levels: int, width: int = 10) -> str:
    """About 1 KB of YAML whose model.kwargs names ``width**levels`` values through aliases."""
    lines = ["name: bomb", "model:", "  name: ignite_amp.models:small_cnn", "  kwargs:", "    l0: &l0 [1, 2, 3]"]
    lines += [f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_a_config_whose_aliases_expand_past_the_limit_is_one_line(tmp_path, capsys):
    """Issue 32.8: 12 levels x 10 aliases (over 10**12 values) in 1 KB: refused at once, in one line."""
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(12))
    assert len(path.read_bytes()) < 1200
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == ("ignite-amp: error: model.kwargs: expands to 4,567,901,234,567 values through YAML aliases (the "
                   "limit is 100,000); write the value out or alias less\n")
    path.write_text(_alias_bomb(3))  # 3,000 values: aliases are fine below the limit
    assert load_config(str(path)).model.kwargs["l3"][9][9][9] == [1, 2, 3]
    path.write_text("model:\n  kwargs: &k\n    a: *k\n")  # a value inside itself
    with pytest.raises(ConfigError, match=r"^config: a YAML alias refers to a value that contains it"):
        load_config(str(path))


def test_missing_and_broken_files(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: {batch_size: 4\nmodel: [\n")
    assert main(["train", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "broken.yaml: not valid YAML (line" in err and err.count("\n") == 1


def test_a_list_or_a_mapping_as_a_key_is_one_line(tmp_path, capsys):
    """Issue 59, unclear: a YAML complex key (``? [a, b]``) ended in "internal error: TypeError: unhashable type"."""
    path = tmp_path / "complex.yaml"
    for text, what in (("name: x\n? [a, b]\n: 1\n", "a list as a key (['a', 'b'])"),
                       ("data:\n  ? {a: 1}\n  : 2\n", "a mapping as a key ({'a': 1})")):
        path.write_text(text)
        assert main(["train", str(path)]) == 2
        line = capsys.readouterr().err
        assert line.startswith(f"ignite-amp: error: {path}: not valid YAML (line ") and line.count("\n") == 1
        assert line.endswith(f": {what}; a config's keys are names\n"), line
    assert main(["train", "quickstart", "--set", "model.kwargs={? [a, b]: 1}"]) == 2  # not read as the text itself
    assert capsys.readouterr().err.endswith("ignite-amp: error: --set model.kwargs={? [a, b]: 1}: a list as a key "
                                            "(['a', 'b']); a config's keys are names\n")


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explode"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice" in err


def test_flatten_config():
    flat = flatten_config(load_config({}))
    assert flat["optimizer.lr"] == 3e-4 and flat["amp.fp32_modules"] == []
    assert flat["optimizer.kwargs"] == {"weight_decay": 0.05} and flat["handlers.clipping.max_norm"] == 1.0
    assert list(flat) == [path for path, _ in leaves(Config)]  # the same paths as the declarations


def test_docstring_examples_run():
    assert_doctests_pass(ignite_amp.config.tree)
