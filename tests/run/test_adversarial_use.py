"""Issue 21's cases: what an adversarial user broke, each now survived, refused in one line, or warned."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from PIL import Image
from torch.nn.functional import cross_entropy

from helpers import ROOT, error_lines, mlp
from ignite_amp import create_amp_trainer
from ignite_amp.cli.main import main
from ignite_amp.config.tree import load_config
from ignite_amp.files.run_directory import move_previous_run


def write(tmp_path, cfg, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def image_tree(root, classes=("a", "b"), per_class=3, splits=("train", "val")):
    for split in splits:
        for cls in classes:
            folder = root / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.new("RGB", (12, 12), (40 * i, 80, 120)).save(folder / f"{i}.png")


def folder_cfg(quick_cfg, root, **data):
    return dict(quick_cfg, model={"name": "ignite_amp.models:small_cnn", "num_classes": 2},
                data=dict(quick_cfg["data"], **{"name": "imagefolder", "root": str(root), "image_size": 16,
                                                "batch_size": 4, "train_size": None, "val_size": None, **data}),
                train={"epochs": 1})


@pytest.mark.slow
def test_a_corrupt_validation_image_is_refused_before_training(quick_cfg, tmp_path, capsys):
    image_tree(tmp_path / "data")
    bad = tmp_path / "data" / "val" / "b" / "1.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    assert main(["train", write(tmp_path, folder_cfg(quick_cfg, tmp_path / "data"))]) == 2
    out, err = capsys.readouterr()
    assert error_lines(err) == [f"ignite-amp: error: data.root: cannot read image {bad} "
                                f"(OSError: Truncated File Read); remove or replace the file"], err
    assert "epoch 1/" not in out  # found before the first iteration, not after an epoch


@pytest.mark.slow
def test_a_symlink_loop_in_an_image_folder_is_not_followed(quick_cfg, tmp_path):
    from ignite_amp.data.datasets import build_datasets

    image_tree(tmp_path / "data")
    os.symlink("..", tmp_path / "data" / "train" / "a" / "loop")
    os.symlink(tmp_path / "data" / "val" / "b", tmp_path / "data" / "train" / "b" / "more")  # a real link: kept
    cfg = load_config(folder_cfg(quick_cfg, tmp_path / "data"))
    train, val, classes = build_datasets(cfg.data, 2)
    assert classes == 2 and len(val) == 6
    assert len(train) == 3 + 3 + 3  # a: its 3 images once; b: its 3 and the 3 behind the link


@pytest.mark.slow
def test_links_into_another_class_are_left_out_with_a_warning(quick_cfg, tmp_path, caplog):
    from ignite_amp.data.datasets import build_datasets

    image_tree(tmp_path / "data")
    train = tmp_path / "data" / "train"
    os.symlink("../b", train / "a" / "linkb")  # a's folder links to b's: b's images would be a's too
    os.symlink(train / "a" / "0.png", train / "b" / "froma.png")
    os.symlink(train / "a" / "1.png", train / "a" / "again.png")  # the same image twice in one class
    with caplog.at_level("WARNING", logger="ignite_amp"):
        train_set, _, _ = build_datasets(load_config(folder_cfg(quick_cfg, tmp_path / "data")).data, 2)
    assert sorted(label for _, label in train_set.samples) == [0, 0, 0, 1, 1, 1]
    assert any("left out 2 link(s) to another class's folder" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_truncated_jpeg_is_refused_before_training(quick_cfg, tmp_path, capsys):
    image_tree(tmp_path / "data")
    bad = tmp_path / "data" / "train" / "a" / "photo.jpg"
    Image.effect_noise((200, 200), 64).convert("RGB").save(bad, quality=95)
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # the header is intact: only decoding finds it
    assert main(["train", write(tmp_path, folder_cfg(quick_cfg, tmp_path / "data"))]) == 2
    out, err = capsys.readouterr()
    (line,) = error_lines(err)
    assert line.startswith(f"ignite-amp: error: data.root: cannot read image {bad} (OSError: image file is "
                           f"truncated") and "epoch 1/" not in out and "health" not in out


@pytest.mark.slow
def test_one_class_and_train_size_on_an_image_folder_are_one_line(quick_cfg, tmp_path, capsys):
    image_tree(tmp_path / "one", classes=("a",))
    assert main(["train", write(tmp_path, folder_cfg(quick_cfg, tmp_path / "one"))]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"ignite-amp: error: data.root: {tmp_path / 'one'}/train has one class folder (a); a classifier needs at "
        f"least two"]
    image_tree(tmp_path / "two")
    assert main(["train", write(tmp_path, folder_cfg(quick_cfg, tmp_path / "two", train_size=4))]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "ignite-amp: error: data.train_size: imagefolder takes every image under root/train; leave it null (and "
        "data.val_size too)"]


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    ("optimizer.name=LBFGS", "optimizer.name: LBFGS needs a closure"),
    ("optimizer.kwargs.betas=[0.9]", "optimizer.kwargs: AdamW refused its arguments (IndexError"),
    ("model.name=math:pi", "model.name: math:pi is a float, not a callable that builds a torch.nn.Module"),
    ("model.name=collections:OrderedDict", "model.name: collections:OrderedDict built a OrderedDict, not a "
                                           "torch.nn.Module"),
    ("model.name=helpers:raises_when_built", "model.name: helpers:raises_when_built raised ValueError: the user's "
                                             "model code failed"),
])
def test_user_mistakes_are_user_errors(quick_cfg, tmp_path, capsys, override, message):
    assert main(["train", write(tmp_path, quick_cfg), "--set", override]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"ignite-amp: error: {message}"), line


@pytest.mark.slow
def test_a_batch_of_one_with_batchnorm(quick_cfg, tmp_path, capsys):
    # A batch size of 1 can never train BatchNorm: refused before anything runs.
    assert main(["train", write(tmp_path, quick_cfg), "--set", "data.batch_size=1"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "ignite-amp: error: data.batch_size: 1 sample per batch (per process), but the model has BatchNorm layers, "
        "whose training statistics need at least 2"]
    # A last batch of one sample (33 = 2 x 16 + 1) is dropped, with a warning, instead of failing each epoch.
    cfg = dict(quick_cfg, data=dict(quick_cfg["data"], train_size=33, batch_size=16), train={"epochs": 1})
    assert main(["train", write(tmp_path, cfg)]) == 0
    err = capsys.readouterr().err
    assert "the last batch of each epoch would hold 1 sample" in err


@pytest.mark.slow
def test_micro_batches_of_one_sample_with_batchnorm(quick_cfg, tmp_path, capsys):
    """Issue 39: micro-batches of one sample were "internal error: ValueError: Expected more than 1 value per
    channel" (exit 1); a batch whose micro-batches all hold 2 or more samples is refused before anything runs."""
    assert main(["train", write(tmp_path, quick_cfg), "--set", "data.batch_size=6",
                 "--set", "amp.micro_batches=4"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "ignite-amp: error: amp.micro_batches: 4 micro-batches of a batch of 6 (per process) hold 1 sample, but the "
        "model has BatchNorm layers, whose training statistics need at least 2: use at most 3, or a larger "
        "data.batch_size"]
    # A last batch of 3 (35 = 2 x 16 + 3) in 2 micro-batches would hold one of 1: dropped, with a warning.
    cfg = dict(quick_cfg, data=dict(quick_cfg["data"], train_size=35, batch_size=16), train={"epochs": 1},
               amp={"micro_batches": 2})
    assert main(["train", write(tmp_path, cfg)]) == 0
    assert "the last batch of each epoch would hold 3 samples, a micro-batch of 1 in 2 micro-batches, which " \
           "BatchNorm layers cannot train on: it is left out" in capsys.readouterr().err


def test_a_frozen_model_or_an_integer_loss_says_why_it_cannot_backpropagate():
    model = mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    with pytest.raises(ValueError, match=r"^loss_fn: the loss does not require grad: no parameter of the model "
                                         r"requires grad \(a frozen model\?\)"):
        trainer.run([(torch.randn(4, 5), torch.zeros(4).long())])
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 lambda y_pred, y: (y_pred.argmax(1) != y).float().mean(), device="cpu")
    with pytest.raises(ValueError, match=r"^loss_fn: the loss does not require grad: it was computed without the "
                                         r"model's parameters"):
        trainer.run([(torch.randn(4, 5), torch.zeros(4).long())])


def test_output_dir_dot_moves_the_old_run_beside_it_not_inside(tmp_path, monkeypatch):
    run = tmp_path / "exp"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    monkeypatch.chdir(run)
    moved = move_previous_run(".")
    assert os.path.dirname(moved) == str(tmp_path) and os.path.basename(moved).startswith("exp.replaced-")
    assert os.listdir(moved) == ["config.yaml"] and not (run / "config.yaml").exists()


@pytest.mark.slow
def test_a_hand_written_config_in_output_dir_is_not_replaced(quick_cfg, tmp_path, capsys):
    exp = tmp_path / "myexp"
    exp.mkdir()
    mine = exp / "config.yaml"
    text = "# my experiment\nname: mine\ntrain: {epochs: 1}\n"
    mine.write_text(text)
    assert main(["train", str(mine), "--set", f"output_dir={exp}"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"ignite-amp: error: output_dir: {exp} holds the config you train from ({mine}), where the run writes its "
        f"resolved config; keep yours elsewhere, or choose another output_dir"]
    assert mine.read_text() == text


def sigterm_after_first_epoch(cmd):
    """Start ``cmd``, send SIGTERM once it printed epoch 1; (return code, epoch lines, stderr, seconds to exit)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("epoch 1/"):
            break
    assert any(x.startswith("epoch 1/") for x in lines), lines
    os.kill(proc.pid, signal.SIGTERM)
    stopped = time.monotonic()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    epochs = [x for x in lines + out.splitlines() if x.startswith("epoch ")]
    return proc.returncode, epochs, err, time.monotonic() - stopped, proc.pid


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_sigterm_to_the_launcher_of_spawned_ranks_stops_every_rank(quick_cfg, tmp_path):
    """A scheduler's SIGTERM goes to the launcher alone: the ranks stop as on Ctrl-C, the launcher exits 143."""
    cfg = dict(quick_cfg, train={"epochs": 8}, data=dict(quick_cfg["data"], train_size=4096, batch_size=32),
               distributed={"nproc_per_node": 2, "backend": "gloo"}, device="cpu")
    code, epochs, err, took, pid = sigterm_after_first_epoch([sys.executable, "-m", "ignite_amp", "train",
                                                              write(tmp_path, cfg)])
    assert code == 143, err
    assert len(epochs) <= 3 and took < 100, (epochs, took)  # not epochs 2-8 first
    assert "ignite-amp: terminated (SIGTERM): run the same command to resume" in err
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", "spawn_main"], capture_output=True, text=True).stdout.split()
    children = [child for child in leftover if os.path.exists(f"/proc/{child}") and
                str(pid) in open(f"/proc/{child}/stat").read().split()[3:4]]
    assert not children  # no rank trains on


@pytest.mark.slow
def test_disk_full_in_tensorboard_s_writer_thread_is_one_true_line(quick_cfg, tmp_path, capsys, monkeypatch):
    """TensorBoard writes from a thread: its ENOSPC used to print a raw traceback before the one line."""
    import errno

    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    import threading

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # as outside pytest: print to stderr
    path = write(tmp_path, dict(quick_cfg, train={"epochs": 2}))
    assert main(["train", path]) == 1
    err = capsys.readouterr().err
    assert error_lines(err) == ["ignite-amp: stopped: no space left on device (writing TensorBoard's event files); "
                                "no checkpoint was written yet: free space and run the same command again"], err
    assert "Traceback" not in err and "Logging error" not in err


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_a_signal_while_the_ranks_start_is_one_line_too(quick_cfg, tmp_path):
    """SIGTERM while the spawned ranks still import torch or join the process group: no rank traceback."""
    cfg = dict(quick_cfg, train={"epochs": 3}, distributed={"nproc_per_node": 2, "backend": "gloo"}, device="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "ignite_amp", "train", write(tmp_path, cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(3)  # the launcher has spawned; the ranks are starting
    os.kill(proc.pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert len(error_lines(err)) == 1 and "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_sigterm_to_torchrun_stops_its_ranks_with_one_line_of_ours(quick_cfg, tmp_path):
    """torchrun forwards SIGTERM to its workers: they stop as on Ctrl-C, and rank 0 alone says so."""
    cfg = dict(quick_cfg, train={"epochs": 8}, data=dict(quick_cfg["data"], train_size=4096, batch_size=32),
               device="cpu")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, epochs, err, _, _ = sigterm_after_first_epoch([sys.executable, "-m", "torch.distributed.run",
                                                      "--nproc_per_node", "2", "--master_port", str(port), "-m",
                                                      "ignite_amp", "train", write(tmp_path, cfg)])
    assert len(epochs) <= 3, epochs
    ours = [x for x in err.splitlines() if x.startswith("ignite-amp:")]
    assert ours == ["ignite-amp: terminated (SIGTERM): run the same command to resume from the last checkpoint"], err
    assert not subprocess.run(["pgrep", "-f", f"ignite_amp train {tmp_path}"], capture_output=True).stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_a_torchrun_worker_whose_peer_stopped_first_leaves_the_line_to_rank_0(monkeypatch, capsys, tmp_path):
    """Case 32.10: SIGTERM during a sharded save: rank 0 stopped first, rank 1's collective failed ("Connection
    closed by peer") before its own SIGTERM arrived, and it printed a second, internal-error line."""
    import threading

    import ignite_amp.cli.main as cli

    def save_loses_its_peer(args):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()  # torchrun's signal, a bit later
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("name: c\n")  # a CONFIG that exists (the command line looks it up first)
    monkeypatch.setitem(cli.COMMANDS, "train", save_loses_its_peer)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli.main(["train", "c.yaml"]) == 143
    assert capsys.readouterr().err == ""
    monkeypatch.setitem(cli.COMMANDS, "train", lambda args: 1 / 0)  # an error of its own, no signal: said
    assert cli.main(["train", "c.yaml"]) == 1
    assert "internal error: ZeroDivisionError" in capsys.readouterr().err
