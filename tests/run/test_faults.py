"""Faults lose nothing: kills, bad checkpoints, NaN losses, unwritable output, fuzzed configs."""
import copy
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from helpers import ROOT, error_lines, id_batches, mlp
from ignite_amp import create_amp_trainer
from ignite_amp.cli.main import main
from ignite_amp.handlers import NonFiniteError, NonFiniteGuard


def cli(*args):
    return [sys.executable, "-m", "ignite_amp", *args]


def write(tmp_path, cfg, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_signal_after_the_first_checkpoint_resumes_with_the_same_command(quick_cfg, tmp_path, signum):
    cfg = dict(quick_cfg, train={"epochs": 4}, data=dict(quick_cfg["data"], train_size=512))
    path = write(tmp_path, cfg)
    ckpts = os.path.join(cfg["output_dir"], "checkpoints")
    proc = subprocess.Popen(cli("train", path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.isdir(ckpts)
                                          and any(f.startswith("last_") for f in os.listdir(ckpts))):
        time.sleep(0.05)
    os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    if signum == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # a scheduler's SIGTERM: one line, like Ctrl-C, and the same code a plain SIGTERM gives
        assert proc.returncode == 143 and error_lines(err) == [
            "ignite-amp: terminated (SIGTERM): run the same command to resume from the last checkpoint"], err
        assert "ignite-amp: terminated" in open(os.path.join(cfg["output_dir"], "train.log")).read()
    done = max(int(f.split("_")[-1].split(".")[0]) for f in os.listdir(ckpts) if f.startswith("last_"))
    assert 1 <= done < 4

    again = subprocess.run(cli("train", path), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    epochs = [int(line.split()[1].split("/")[0]) for line in again.stdout.splitlines() if line.startswith("epoch ")]
    assert epochs == list(range(done + 1, 5))  # no epoch lost or repeated
    assert f"resumed from {ckpts}/last_checkpoint_{done}.pt" in again.stdout


@pytest.mark.slow
def test_an_unreadable_last_checkpoint_falls_back_and_none_readable_is_one_line(quick_cfg, tmp_path, capsys):
    path = write(tmp_path, dict(quick_cfg, train={"epochs": 1}))
    assert main(["train", path]) == 0
    ckpts = os.path.join(quick_cfg["output_dir"], "checkpoints")
    last = os.path.join(ckpts, "last_checkpoint_1.pt")
    best, = [os.path.join(ckpts, f) for f in os.listdir(ckpts) if f.startswith("best_")]

    def digest():
        return {f: hashlib.sha256(open(os.path.join(ckpts, f), "rb").read()).hexdigest() for f in os.listdir(ckpts)}

    # Both unreadable (a truncated zip, a foreign pickle): one line, exit 2, nothing touched.
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) // 3)
    torch.save({"weights": torch.zeros(3)}, best)
    before = digest()
    capsys.readouterr()
    assert main(["train", path, "--set", "train.epochs=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint in" in err and "last_checkpoint_1.pt: truncated" in err
    assert "resume: never" in err and digest() == before

    # A readable best file: the run resumes from it, naming the file it skipped.
    other = write(tmp_path, dict(quick_cfg, train={"epochs": 1}, output_dir=str(tmp_path / "b")), name="b.yaml")
    assert main(["train", other]) == 0
    good_best, = [f for f in os.listdir(tmp_path / "b" / "checkpoints") if f.startswith("best_")]
    shutil.copy(tmp_path / "b" / "checkpoints" / good_best, best)
    assert main(["train", path, "--set", "train.epochs=2"]) == 0
    captured = capsys.readouterr()
    assert "skipped" in captured.err and "last_checkpoint_1.pt.unreadable" in captured.err
    assert f"resumed from {best} at epoch 1" in captured.out
    assert os.path.exists(last + ".unreadable") and os.path.exists(os.path.join(ckpts, "last_checkpoint_2.pt"))


def test_nan_in_float16_is_skipped_and_the_run_goes_on():
    model = mlp()
    # A small initial scale: from the default 65536 the scaler's own calibration skips a few steps.
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                                 device="cpu", dtype="float16", scaler_kwargs={"init_scale": 64.0})
    NonFiniteGuard(max_consecutive=3).attach(trainer)
    batches = id_batches(48, 8)
    x, y = batches[1]
    batches[1] = (x * float("nan"), y)
    trainer.run(batches, max_epochs=2)  # one NaN batch per epoch: skipped, never 3 in a row
    assert trainer.state.epoch == 2 and all(torch.isfinite(p).all() for p in model.parameters())


# The second command resumes after epoch 1 (8 iterations of 32), so NaN iteration k is 8 + k.
@pytest.mark.slow
@pytest.mark.parametrize("dtype, after, message", [
    ("float16", 1, "non-finite gradients in 3 float16 steps in a row, the last at iteration 11"),
    ("bfloat16", 3, "non-finite loss at iteration 11 in bfloat16"),
    ("float32", 2, "non-finite loss at iteration 10 in float32"),
])
def test_nan_stops_the_run_with_one_line_and_keeps_the_best_checkpoint(quick_cfg, tmp_path, capsys, monkeypatch,
                                                                       dtype, after, message):
    cfg = dict(quick_cfg, amp={"dtype": dtype}, train={"epochs": 2},
               model={"name": "helpers:nan_after", "num_classes": 10, "kwargs": {"after": 10**6}},
               handlers={"non_finite": {"max_consecutive": 3}})
    path = write(tmp_path, cfg)
    assert main(["train", path, "--set", "train.epochs=1"]) == 0  # one good epoch: a best checkpoint
    ckpts = os.path.join(cfg["output_dir"], "checkpoints")
    best = sorted(f for f in os.listdir(ckpts) if f.startswith("best_"))
    digest = {f: hashlib.sha256(open(os.path.join(ckpts, f), "rb").read()).hexdigest() for f in best}
    capsys.readouterr()
    monkeypatch.setenv("NAN_AFTER", str(after))
    code = main(["train", path])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and message in err and "Traceback" not in err
    assert {f: hashlib.sha256(open(os.path.join(ckpts, f), "rb").read()).hexdigest() for f in best} == digest


def test_non_finite_guard_arguments():
    with pytest.raises(ValueError, match="max_consecutive should be a positive integer"):
        NonFiniteGuard(0)


class FakeEvent:
    """A CUDA event stand-in: ``done`` says whether the device has reached it."""

    def __init__(self, done=False):
        self.done, self.waited = done, False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = self.done = True


def test_the_guard_reads_cuda_flags_without_waiting_and_in_order():
    """The CUDA path's bookkeeping on CPU stand-ins: a flag is read once its event is done, never by
    waiting, except at a flush or when every buffer of the ring is in flight."""
    from types import SimpleNamespace

    guard = NonFiniteGuard()
    guard.step = SimpleNamespace(dtype=torch.bfloat16, items=8)
    slot = lambda bad, done: SimpleNamespace(host=torch.tensor(bad), event=FakeEvent(done))  # noqa: E731
    guard._pending.extend([(1, slot(False, True)), (2, slot(True, False)), (3, slot(True, True))])
    guard._poll(block=False)  # 1 read; 2 not done yet: 3 waits behind it, nothing waited on
    assert [i for i, _ in guard._pending] == [2, 3] and not guard._pending[0][1].event.waited
    with pytest.raises(NonFiniteError, match="non-finite loss at iteration 2 in bfloat16"):
        guard._flush(None)  # an epoch's end waits for every flag: the first bad one is named
    assert not guard._pending and len(guard._free) == 2

    guard = NonFiniteGuard()
    guard._pending.extend((i, slot(False, False)) for i in range(guard.RING))
    guard._poll(block=True, only_one=True)  # the ring is full: wait for the oldest only
    assert len(guard._pending) == guard.RING - 1 and len(guard._free) == 1


@pytest.mark.slow
def test_unwritable_output_dir_is_one_line_before_training(quick_cfg, tmp_path, capsys):
    if os.geteuid() == 0:  # root writes anywhere: use a path under a regular file instead
        blocker = tmp_path / "blocker"
        blocker.write_text("")
        out = str(blocker / "run")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out = str(locked / "run")
    assert main(["train", write(tmp_path, dict(quick_cfg, output_dir=out))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output_dir: cannot write to" in err


VALUES = [None, True, False, 0, -1, 1, 2, 3.5, -0.5, 10**9, "", "x", "auto", "1e-3", [], [1], {}, {"a": 1},
          float("nan"), float("inf")]


def mutate(cfg: dict, rng: random.Random):
    """One random mutation: a wrong value, an unknown key, a removed key or a whole section replaced."""
    cfg = copy.deepcopy(cfg)
    paths = []

    def walk(node, prefix):
        for key, value in node.items():
            paths.append(prefix + [key])
            if isinstance(value, dict) and not key.endswith("kwargs"):
                walk(value, prefix + [key])

    walk(cfg, [])
    path = rng.choice(paths)
    parent = cfg
    for key in path[:-1]:
        parent = parent[key]
    kind = rng.random()
    if kind < 0.7:
        parent[path[-1]] = rng.choice(VALUES)
    elif kind < 0.85:
        parent[rng.choice(["bogus", "dtyp", "batchsize", path[-1] + "_"])] = rng.choice(VALUES)
    else:
        del parent[path[-1]]
    return cfg


@pytest.mark.slow
def test_config_fuzzing_never_shows_a_traceback(quick_cfg, tmp_path, capsys, monkeypatch):
    """300 mutations of a valid config: each runs (one iteration), exits 2 with one line, or (a huge
    learning rate, say) stops with one line and exit 1."""
    from ignite_amp.run import compose as run_module

    def one_iteration(self):  # keep the fuzz fast: build everything for real, train one iteration
        try:
            self.trainer.run(self.train_loader, max_epochs=1, epoch_length=1)
        finally:
            self.close()
        return {"history": [], "final": {}, "output_dir": self.output_dir, "best_checkpoint": None,
                "tensorboard_dir": None}

    monkeypatch.setattr(run_module.Run, "train", one_iteration)
    rng = random.Random(0)
    base = dict(quick_cfg, data=dict(quick_cfg["data"], train_size=64, val_size=32))
    outcomes = {0: 0, 1: 0, 2: 0}
    for i in range(300):
        cfg = mutate(base, rng)
        cfg["output_dir"] = str(tmp_path / f"run{i}")
        path = tmp_path / "fuzz.yaml"
        text = yaml.safe_dump(cfg)
        if rng.random() < 0.1:  # broken YAML
            cut = rng.randrange(len(text))
            text = text[:cut] + rng.choice(["{", "[", ": :", "\t", "'"]) + text[cut:]
        path.write_text(text)
        code = main(["train", str(path)])
        captured = capsys.readouterr()
        assert code in (0, 1, 2), (cfg, captured.err)
        assert "Traceback" not in captured.err
        if code:
            prefix = "ignite-amp: error: " if code == 2 else "ignite-amp: stopped: "
            assert captured.err.count("\n") == 1 and captured.err.startswith(prefix), captured.err
        outcomes[code] += 1
    assert outcomes[0] > 20 and outcomes[2] > 100  # both paths exercised
