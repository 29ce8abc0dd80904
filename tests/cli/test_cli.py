import math
import os
import subprocess
import sys

import pytest
import yaml

from helpers import CONFIGS, ROOT
from ignite_amp import __version__, load_config, train_from_config
from ignite_amp.cli.main import main


def test_quickstart_config_is_valid_and_uses_no_download():
    cfg = load_config(os.path.join(CONFIGS, "quickstart.yaml"))
    assert cfg.data.name == "shapes" and cfg.data.download is False
    gpu = load_config(os.path.join(CONFIGS, "cifar10_resnet18.yaml"))
    assert gpu.data.name == "cifar10"


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_quickstart_end_to_end_through_the_cli(tmp_path, forks):
    """The README quickstart as written (`python -m ignite_amp train configs/quickstart.yaml`), into a
    temporary output_dir: it reaches the validation accuracy the README states (above 0.9). In a process of its
    own forked from the suite's fork server (``helpers.forks``)."""
    out = tmp_path / "qs"
    proc = forks.run(["-m", "ignite_amp", "train", os.path.join(CONFIGS, "quickstart.yaml"),
                      "--set", f"output_dir={out}"], ROOT, limit=900)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 5 and "val accuracy" in epochs[0] and "val loss" in epochs[0]
    best = next(i for i, line in enumerate(lines) if line.startswith("best checkpoint:"))
    assert lines[best] == "best checkpoint:" and lines[best + 1].startswith(f"  {out}/checkpoints/best_")  # too long
    # for one line of 80 columns: the path on a line of its own
    assert float(epochs[-1].split("val accuracy ")[1].split()[0]) > 0.9
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["epochs"] == 5 and saved["output_dir"] == str(out)
    assert "Traceback" not in proc.stderr
    # The event files sit in output_dir: `tensorboard --logdir <output_dir>` shows this run alone.
    assert [f for f in os.listdir(out) if f.startswith("events.out.tfevents")]
    assert not (out / ".lock").exists()  # a finished run leaves no lock file
    # The last line names the dashboard; before it, the health summary, with no warning on the quickstart.
    assert lines[-4:] == [f"dashboard: tensorboard --logdir {out}",
                          "  then open http://localhost:6006/#custom_scalars&_smoothingWeight=0",
                          "  and untick \"Ignore outliers in chart scaling\" (left pane) to see every point",
                          "  (Time Series has its own: untick it in its Settings pane, right, too)"]
    health = lines[lines.index("health of the run:") + 1:lines.index(next(x for x in lines if x.startswith("done: ")))]
    assert health[0].startswith("  verdict: healthy (") and health[1].startswith("  precision: ")
    assert any(x.startswith("  speed: ") and "(medians of " in x for x in health)
    fixed = epochs + [x for x in health if x.startswith(("  verdict: ", "  precision: ", "  speed: ", "  data wait: "))]
    assert all(len(line) <= 80 for line in fixed), [x for x in fixed if len(x) > 80]  # no wrap (a path may)
    assert not [x for x in health if "warning" in x], health


@pytest.mark.slow
@pytest.mark.subprocess
def test_train_from_config_learns_shapes(quick_cfg):
    result = train_from_config(dict(quick_cfg, train={"epochs": 3}), print_fn=lambda *a: None)
    history = result["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    # Too little data to learn shapes in 3 epochs (test_quickstart_end_to_end_through_the_cli checks the
    # README's accuracy); here: every epoch's record holds finite validation metrics and a throughput.
    assert all(set(h) >= {"val_accuracy", "val_loss", "samples_per_sec"} and math.isfinite(h["val_loss"])
               and h["samples_per_sec"] > 0 for h in history)


def test_num_classes_mismatch_and_unknown_model(quick_cfg, capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(quick_cfg))
    assert main(["train", str(path), "--set", "model.num_classes=5"]) == 2
    assert "model.num_classes: 5 but data set shapes has 10 classes" in capsys.readouterr().err
    assert main(["train", str(path), "--set", "model.name=resnet181"]) == 2
    assert "model.name: unknown torchvision model 'resnet181'" in capsys.readouterr().err
    assert main(["train", str(path), "--set", "optimizer.name=Adamw"]) == 2
    assert "optimizer.name: unknown torch.optim optimizer 'Adamw'" in capsys.readouterr().err


def test_unwritable_output_dir_fails_before_training(quick_cfg, capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(quick_cfg, output_dir=str(blocker / "run"))))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ignite-amp: error: output_dir: cannot write to") and err.count("\n") == 1


@pytest.mark.subprocess
def test_help_and_version_do_not_import_torch():
    """`python -m ignite_amp --help` and `--version` answer without importing torch (or Ignite)."""
    code = ("import runpy, sys\n"
            "for argv in (['--help'], ['--version']):\n"
            "    sys.argv = ['ignite-amp', *argv]\n"
            "    try:\n"
            "        runpy.run_module('ignite_amp', run_name='__main__', alter_sys=True)\n"
            "    except SystemExit as exc:\n"
            "        assert exc.code == 0, exc.code\n"
            "print('heavy:', sorted(m for m in ('torch', 'ignite', 'tensorboard') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: ignite-amp" in proc.stdout and "find-batch-size" in proc.stdout
    assert f"ignite-amp {__version__}" in proc.stdout
    assert proc.stdout.rstrip().endswith("heavy: []"), proc.stdout


def test_version(capsys):
    from ignite_amp import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"ignite-amp {__version__}\n"


def test_bare_command_prints_the_usage_with_its_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ignite-amp") and all(c in err for c in ("train", "compare", "find-batch-size"))


def test_every_command_s_help_fits_the_cli_page_s_width():
    """Issue 44: the CLI reference prints each command's help at 100 columns; compare's usage line ran to 139
    (argparse does not wrap a list of choices), cut off on the page."""
    import argparse

    from ignite_amp.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in [("ignite-amp", parser)] + list(sub.choices.items()):
        command.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
        wide = [line for line in command.format_help().splitlines() if len(line) > 100]
        assert not wide, (name, wide)


def test_init_refuses_an_existing_file_at_once_without_torch_and_names_the_option_given(tmp_path):
    """The refusal answers before torch loads (it took 44-52 s through the failure path's imports), and blames -o
    only when -o named the file; the message it writes fits 80 columns, cut between words."""
    script = ("import sys; from ignite_amp.cli.main import main; rc = main(sys.argv[1:]); "
              "print(rc, 'torch' in sys.modules)")
    (tmp_path / "quickstart.yaml").write_text("name: mine\n")
    for args, blamed in ((["init"], "quickstart.yaml: exists (init writes NAME.yaml when no -o is given)"),
                         (["init", "quickstart", "-o", "quickstart.yaml"], "-o quickstart.yaml: exists")):
        proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120)
        assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr)
        assert proc.stderr.startswith(f"ignite-amp: error: {blamed}") and "--force" in proc.stderr
    assert (tmp_path / "quickstart.yaml").read_text() == "name: mine\n"
    proc = subprocess.run([sys.executable, "-m", "ignite_amp", "init", "-o", "a-longer-name-for-my-config.yaml"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and all(len(line) <= 80 for line in proc.stdout.splitlines()), proc.stdout
    assert "(for editors)" in proc.stdout


@pytest.mark.parametrize("command, says", [("train", "train what a config describes"),
                                           ("find-batch-size", "(needs CUDA)"), ("init", "write a built-in config"),
                                           ("plan", "the peak memory of a training step"), ("configs", "list the"),
                                           ("compare", "float32 against"), ("schema", "JSON Schema")])
def test_each_commands_help_opens_with_what_it_does(command, says, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    usage, description = capsys.readouterr().out.split("\n\n")[:2]
    assert usage.startswith(f"usage: ignite-amp {command}") and says in " ".join(description.split())
