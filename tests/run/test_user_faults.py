"""User faults end in one line and a non-zero exit, with nothing lost; two runs never share a directory."""
import hashlib
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import yaml

from helpers import ROOT
from helpers import tiny_config as config
from ignite_amp.cli.main import main


def write(tmp_path, cfg, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg) if isinstance(cfg, dict) else cfg)
    return str(path)


def image_folder(root, classes, corrupt=None):
    from PIL import Image

    for split, names in classes.items():
        for name in names:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (20, 20), color=(40 * i, 80, 120)).save(folder / f"{i}.png")
    if corrupt:
        (root / corrupt).write_bytes(b"\x89PNG\r\n\x1a\n not really an image")


def blocked(tmp_path, name):
    """A path under which nothing can be created (a regular file stands where a directory should be)."""
    (tmp_path / name).write_text("")
    return str(tmp_path / name / "x")


# (what, config changes or a callable building them, exit code, what the one line says)
CASES = [
    ("absent mps", {"device": "mps"}, 2, "device: device 'mps' was asked for but mps is not available"),
    ("absent cuda:1", {"device": "cuda:1"}, 2, "device: device 'cuda:1' was asked for but"),
    ("seed overflow", {"seed": 2**40}, 2, "seed: expected an integer from 0 to 4294967295"),
    ("schedule kwarg of the wrong type", {"scheduler": {"name": "cosine", "kwargs": {"eta_min": "abc"}}}, 2,
     "scheduler.kwargs: cosine refused its arguments (unsupported operand"),
    ("image too small for the model", {"data": {"image_size": 8}}, 2,
     "model.name: ignite_amp.models:small_cnn cannot run on 3x8x8 images"),
    ("wrong head width", {"model": {"name": "helpers:three_outputs", "num_classes": 10, "kwargs": {}}}, 2,
     "model.name: helpers:three_outputs returns (2, 3) for a batch of 2, not (2, 10) logits"),
    ("corrupt image", lambda t: (image_folder(t / "imgs", {"train": ["a", "b"], "val": ["a", "b"]},
                                              corrupt="train/a/bad.png"),
                                 {"data": {"name": "imagefolder", "root": str(t / "imgs"), "image_size": 16,
                                           "train_size": None, "val_size": None},
                                  "model": {"name": "ignite_amp.models:small_cnn", "num_classes": 2,
                                            "kwargs": {"width": 8}}})[1],
     2, "data.root: cannot read image"),
    ("val classes differ", lambda t: (image_folder(t / "imgs", {"train": ["a", "b"], "val": ["a", "c"]}),
                                      {"data": {"name": "imagefolder", "root": str(t / "imgs"), "image_size": 16,
                                                "train_size": None, "val_size": None},
                                       "model": {"name": "ignite_amp.models:small_cnn", "num_classes": 2,
                                                 "kwargs": {"width": 8}}})[1],
     2, "has other classes than"),
    ("cifar with no data and no download", {"data": {"name": "cifar10", "root": "nowhere"}}, 2,
     "data.root: nowhere/cifar-10-batches-py/data_batch_1 is missing (set data.download: true"),
    ("output_dir not writable", lambda t: {"output_dir": blocked(t, "f")}, 2, "output_dir: cannot write to"),
    ("output_dir a file", lambda t: ((t / "f").write_text(""), {"output_dir": str(t / "f")})[1], 2,
     "f is a file, not a folder)"),  # issue 59: "File exists"
    ("output_dir a symlink loop", lambda t: (os.symlink(t / "loop", t / "loop"), {"output_dir": str(t / "loop")})[1],
     2, "loop is a symbolic link that leads nowhere: a loop, or its target is missing)"),  # issue 39: "File exists"
    ("resume from a missing file", {"handlers": {"checkpoint": {"resume": "nope.pt"}}}, 2,
     "checkpoint nope.pt: no such file"),
]


@pytest.mark.slow
@pytest.mark.parametrize("what, change, code, message", CASES, ids=[c[0] for c in CASES])
def test_each_user_fault_is_one_line(tmp_path, capsys, what, change, code, message):
    change = change(tmp_path) if callable(change) else change
    cfg = config(tmp_path, **change)
    assert main(["train", write(tmp_path, cfg)]) == code
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert captured.err.startswith("ignite-amp: error: " if code == 2 else "ignite-amp: stopped: ")
    assert "epoch 1/" not in captured.out  # found before training, not after an epoch


@pytest.mark.slow
def test_an_unwritable_profiler_dir_is_found_before_training_not_after_an_epoch(tmp_path, capsys):
    # TensorBoard's event files sit in output_dir itself (checked first); the profiler writes under it.
    cfg = config(tmp_path)
    path = write(tmp_path, cfg)
    assert main(["train", path]) == 0  # TensorBoard off: a checkpoint to resume
    (tmp_path / "run" / "profiler").write_text("")  # now something is in its way
    capsys.readouterr()
    assert main(["train", path, "--set", "train.epochs=2", "--set", "handlers.tensorboard.enabled=true",
                 "--set", "handlers.profiler.enabled=true"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "output_dir: cannot write to" in captured.err
    assert "run/profiler (" in captured.err and "epoch 2/2" not in captured.out


@pytest.mark.slow
def test_duplicate_yaml_keys_name_the_key_and_the_lines(tmp_path, capsys):
    text = "optimizer:\n  name: AdamW\n  lr: 0.1\n  lr: 0.2\n"
    assert main(["train", write(tmp_path, text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(line 4, column 3): duplicate key 'lr' (first on line 3)" in err


@pytest.mark.slow
def test_cifar_download_without_network_is_one_line(tmp_path, capsys, monkeypatch):
    import urllib.error

    import torchvision.datasets

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    cfg = config(tmp_path, data={"name": "cifar10", "root": str(tmp_path / "data"), "download": True})
    assert main(["train", write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.download: cannot download CIFAR-10 into" in err
    assert "Temporary failure in name resolution" in err and "cifar-10-batches-py folder there yourself" in err


@pytest.mark.slow
def test_compare_into_an_unwritable_dir_is_one_line(tmp_path, capsys):
    cfg = config(tmp_path, output_dir=blocked(tmp_path, "f"))
    assert main(["compare", write(tmp_path, cfg), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output_dir: cannot write to" in err


@pytest.mark.slow
def test_an_internal_error_is_one_line_pointing_at_the_log_and_debug_shows_it(tmp_path, capsys, monkeypatch):
    import ignite_amp.run.compose as run_module

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    cfg = config(tmp_path)
    path = write(tmp_path, cfg)
    monkeypatch.setattr(run_module.EpochSummary, "measure", broken)
    assert main(["train", path]) == 1
    err = capsys.readouterr().err
    log = os.path.join(cfg["output_dir"], "train.log")
    assert err.count("\n") == 1 and f"internal error: ZeroDivisionError: a bug (the traceback is in {log})" in err
    assert "Traceback (most recent call last)" in open(log).read() and "ZeroDivisionError: a bug" in open(log).read()
    assert main(["train", path, "--debug"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def _hold(path, ready, done):
    from ignite_amp.run.compose import build_run

    run = build_run(path, print_fn=lambda *a: None)
    ready.set()
    done.wait(60)
    run.close()
    os._exit(0)


@pytest.mark.slow
def test_a_second_run_into_the_same_directory_is_refused_at_once(tmp_path, capsys):
    cfg = config(tmp_path)
    path = write(tmp_path, cfg)
    ctx = multiprocessing.get_context("spawn")  # a plain new process, like a second terminal
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(path, ready, done))
    holder.start()
    try:
        assert ready.wait(120)
        config_yaml = os.path.join(cfg["output_dir"], "config.yaml")
        before = open(config_yaml).read()
        assert main(["train", path, "--set", "train.epochs=3"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is in use by another run (PID {holder.pid})" in err
        assert open(config_yaml).read() == before  # the first run's files are untouched
    finally:
        done.set()
        holder.join(60)
    assert main(["train", path]) == 0  # once it ended, the directory is free (and a killed run frees it too)


@pytest.mark.slow
def test_tilde_paths_put_every_file_of_the_run_in_one_place(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    cfg = config(tmp_path, output_dir="~/runs/x", handlers={"tensorboard": {"enabled": True}})
    assert main(["train", write(tmp_path, cfg)]) == 0
    run = home / "runs" / "x"
    assert (run / "config.yaml").exists() and (run / "train.log").exists()
    assert any(n.startswith("last_checkpoint_1") for n in os.listdir(run / "checkpoints"))
    assert not os.path.exists(cwd / "~") and os.listdir(cwd) == []
    assert yaml.safe_load((run / "config.yaml").read_text())["output_dir"] == str(run)
    assert main(["train", write(tmp_path, cfg), "--set", "train.epochs=2"]) == 0  # and resume finds them


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_closed_stdout_does_not_stop_training(tmp_path):
    cfg = config(tmp_path, train={"epochs": 3})
    proc = subprocess.Popen([sys.executable, "-m", "ignite_amp", "train", write(tmp_path, cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # like `| head -1`
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(300) == 0, err
    assert first.startswith("training u on cpu") and "Traceback" not in err and "BrokenPipe" not in err
    assert os.path.exists(os.path.join(cfg["output_dir"], "checkpoints", "last_checkpoint_3.pt"))


@pytest.mark.slow
def test_warnings_of_a_build_that_fails_go_to_the_log_not_before_the_one_line(tmp_path, capsys):
    model = {"name": "helpers:warns_when_built", "num_classes": 10, "kwargs": {"heads": 3}}
    cfg = config(tmp_path, model=model)
    assert main(["train", write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "returns (2, 3)" in err and "made-up concern" not in err
    assert "UserWarning: built with a made-up concern" in open(os.path.join(cfg["output_dir"], "train.log")).read()
    cfg = config(tmp_path, model=dict(model, kwargs={}))  # it builds: the warning is shown as usual
    with pytest.warns(UserWarning, match="made-up concern"):
        assert main(["train", write(tmp_path, cfg)]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", [".lock", "config.yaml"])
def test_a_directory_where_the_run_keeps_a_file_is_one_line(tmp_path, capsys, name):
    cfg = config(tmp_path)
    os.makedirs(os.path.join(cfg["output_dir"], name))
    assert main(["train", write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write {os.path.join(cfg['output_dir'], name)}" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("change, line", [
    ({"model": {"num_classes": 5}}, "model.num_classes: 5 but data set shapes has 10 classes"),
    ({"amp": {"fp32_modules": ["zz"]}}, "amp: fp32_modules: the model has no submodule 'zz'"),
    ({"data": {"image_size": 8}}, "model.name: ignite_amp.models:small_cnn cannot run on 3x8x8 images"),
], ids=["classes", "fp32_modules", "image size"])
def test_compare_refuses_what_train_refuses_in_one_line(tmp_path, capsys, change, line):
    assert main(["compare", write(tmp_path, config(tmp_path, **change)), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err, err


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_closed_stdout_does_not_fail_compare(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ignite_amp", "compare", write(tmp_path, config(tmp_path)),
                             "--steps", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # like `| head -1`
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(300) == 0, err
    assert first.startswith("comparing on CPU") and "Traceback" not in err and "BrokenPipe" not in err


def digests(folder):
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest() for f in os.listdir(folder)}


@pytest.mark.slow
def test_weights_ruined_on_an_epochs_last_step_are_never_saved(tmp_path, capsys):
    """SGD at lr 1e38 on the epoch's only iteration: the loss of that iteration is finite, the weights after
    it are not. Nothing is saved; the run stops in one line; last and best of epoch 1 stay."""
    cfg = config(tmp_path, amp={"dtype": "float32"}, optimizer={"name": "SGD", "lr": 0.01},
                 train={"epochs": 1, "epoch_length": 1})
    path = write(tmp_path, cfg)
    assert main(["train", path]) == 0
    ckpts = os.path.join(cfg["output_dir"], "checkpoints")
    before = digests(ckpts)
    capsys.readouterr()
    assert main(["train", path, "--set", "optimizer.lr=1e38", "--set", "train.epochs=2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite after epoch 2: stopping without saving" in err, err
    assert digests(ckpts) == before


@pytest.mark.slow
def test_a_float16_run_whose_loss_is_never_finite_stops(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NAN_AFTER", "1")
    cfg = config(tmp_path, amp={"dtype": "float16"}, model={"name": "helpers:nan_after", "num_classes": 10,
                                                            "kwargs": {}},
                 data={"train_size": 64}, handlers={"non_finite": {"max_consecutive": 50}})
    assert main(["train", write(tmp_path, cfg)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no optimizer step in epoch 1: all 2 float16 steps had non-finite" in err
    assert not os.listdir(os.path.join(cfg["output_dir"], "checkpoints"))


@pytest.mark.slow
def test_disk_full_while_saving_names_the_file_and_keeps_the_previous(tmp_path, capsys, monkeypatch):
    import ignite_amp.handlers.best_checkpoint as saver

    cfg = config(tmp_path)
    path = write(tmp_path, cfg)
    assert main(["train", path]) == 0
    ckpts = os.path.join(cfg["output_dir"], "checkpoints")
    before = digests(ckpts)
    real = torch.save

    def full(obj, f, *args, **kwargs):
        real(obj, f, *args, **kwargs)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1472 vs 1384")

    monkeypatch.setattr(saver.torch, "save", full)
    capsys.readouterr()
    assert main(["train", path, "--set", "train.epochs=2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write checkpoint" in err and "no space left on device" in err
    assert digests(ckpts) == before
    monkeypatch.setattr(saver.torch, "save", real)
    assert main(["train", path, "--set", "train.epochs=2"]) == 0


def test_disk_full_outside_a_save_says_whether_a_checkpoint_is_kept(tmp_path):
    """Disk full while TensorBoard or the log writes: the line is true about what is on disk."""
    import errno as errnos

    import ignite_amp.cli.failures as cli

    full = OSError(errnos.ENOSPC, "No space left on device", str(tmp_path / "events.out.tfevents.1"))
    cli.state.update(checkpoints=str(tmp_path / "checkpoints"))
    try:
        code, line = cli.describe(full)
        assert code == 1 and line.endswith("no checkpoint was written yet: free space and run the same command again")
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "last_checkpoint_1.pt").write_bytes(b"x")
        assert cli.describe(full)[1].endswith("the last checkpoint is kept: free space and run the same command to "
                                              "resume")
    finally:
        cli.state.clear()


@pytest.mark.slow
def test_interrupting_compare_promises_no_resume(quick_cfg, tmp_path, capsys, monkeypatch):
    import ignite_amp.cli.compare as compare_module
    from ignite_amp.cli.main import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare_module, "compare", interrupted)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(quick_cfg))
    assert main(["compare", str(path), "--steps", "2"]) == 130
    assert capsys.readouterr().err == "ignite-amp: interrupted: nothing was kept: run the command again\n"
