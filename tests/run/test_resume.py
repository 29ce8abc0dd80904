"""Resume says what it keeps: what may change between a checkpoint's config and the new one."""
import os
import re
import shlex

import pytest
import torch
import yaml

from helpers import tiny_config
from ignite_amp.cli.main import main
from ignite_amp.config.tree import load_config
from ignite_amp.errors import CheckpointError
from ignite_amp.run.resume import check_resume, config_changes, rerun_of_a_finished_run


def cfg_with(**overrides):
    return load_config({}, [f"{k}={v}" for k, v in overrides.items()])


def dict_with(**overrides):
    """The plain dict a checkpoint stores, which check_resume and config_changes compare."""
    return cfg_with(**overrides).to_dict()


@pytest.mark.parametrize("key, value, shown", [
    ("model.name", "resnet34", "model.name resnet18 -> resnet34"),
    ("model.kwargs.width", 16, "model.kwargs {} -> {'width': 16}"),
    ("optimizer.name", "SGD", "optimizer.name AdamW -> SGD"), ("data.name", "fake", "data.name shapes -> fake"),
    ("data.image_size", 64, "data.image_size null -> 64"),
    ("amp.accumulation_steps", 4, "amp.accumulation_steps 1 -> 4"),
    ("scheduler.name", "cosine", "scheduler.name none -> cosine"),
    ("handlers.checkpoint.metric", "loss", "handlers.checkpoint.metric accuracy -> loss"),
    ("seed", 5, "seed 0 -> 5"),
])
def test_keys_that_never_change_under_a_resume(key, value, shown):
    with pytest.raises(CheckpointError, match=rf"^cannot resume ck.pt: {re.escape(shown)} "
                                              r"cannot change under a resume"):
        check_resume(dict_with(), dict_with(**{key: value}), "ck.pt")


@pytest.mark.parametrize("key, value", [
    ("train.epochs", 9), ("train.epoch_length", 7), ("data.batch_size", 128), ("data.train_size", 500),
    ("optimizer.lr", 0.1), ("optimizer.kwargs.weight_decay", 0.1),
])
def test_a_schedule_fixes_the_length_and_the_optimizer_settings(key, value):
    old = dict_with(**{"scheduler.name": "onecycle"})
    new = dict_with(**{key: value, "scheduler.name": "onecycle"})
    assert [c.key for c in check_resume(dict_with(), dict_with(**{key: value}), "x")] == [key.split(".kwargs")[0] + (
        ".kwargs" if ".kwargs" in key else "")]
    with pytest.raises(CheckpointError, match=r"the onecycle schedule was made for the old values.*resume=never"):
        check_resume(old, new, "x")


def test_everything_else_takes_effect_and_is_named():
    new = dict_with(**{"optimizer.lr": 0.01, "handlers.tensorboard.log_every": 5, "data.num_workers": 0,
                       "amp.dtype": "float16", "device": "cpu", "handlers.checkpoint.resume": "never",
                       "output_dir": "elsewhere"})
    changes = check_resume(dict_with(), new, "x")
    assert [c.key for c in changes] == ["device", "amp.dtype", "data.num_workers", "optimizer.lr",
                                        "handlers.tensorboard.log_every"]
    assert config_changes(dict_with(), dict_with()) == []


@pytest.mark.parametrize("done, sets, verdict", [
    (5, {}, "resume"),  # the same command again: nothing to train, and it says so
    (3, {"train.epochs": 2}, "resume"),  # an interrupted run resumes (or is refused) as before
    (3, {"amp.dtype": "float16"}, "resume"),
    (5, {"train.epochs": 8}, "extend"),  # no schedule: continuing equals a run that long from the start
    (5, {"train.epochs": 8, "optimizer.lr": 0.01}, "extend"),
    (5, {"train.epochs": 2}, "new"),  # fewer epochs than it trained
    (5, {"train.epochs": 8, "scheduler.name": "onecycle"}, "new"),  # the schedule cannot be stretched
    (5, {"train.epochs": 8, "optimizer.name": "SGD"}, "new"),
    (5, {"amp.dtype": "float8"}, "new"),  # the README's float8 example after the quickstart
    (5, {"handlers.profiler.enabled": True}, "new"),  # a finished run has nothing left to profile
])
def test_a_changed_config_over_a_finished_run_is_a_new_run_unless_it_trains_longer(done, sets, verdict):
    stored = dict_with(**{"train.epochs": 5})
    new = cfg_with(**{"train.epochs": 5, **sets})
    got, changes = rerun_of_a_finished_run(stored, done, new)
    assert got == verdict and [c.key for c in changes] == [c.key for c in config_changes(stored, new.to_dict())]
    assert rerun_of_a_finished_run(stored, None, new)[0] == "resume"  # a checkpoint that does not say: as before


@pytest.mark.slow
def test_a_finished_run_rerun_with_fewer_epochs_starts_anew_and_moves_it_aside(tmp_path, capsys):
    path, cfg = base(tmp_path, train={"epochs": 2})
    assert main(["train", path]) == 0
    capsys.readouterr()
    assert main(["train", path, "--set", "train.epochs=1"]) == 0
    out = capsys.readouterr().out
    moved = re.search(rf"^starting a new run in {re.escape(cfg['output_dir'])}: its run had finished, and the config "
                      r"changed \(train.epochs 2 -> 1\); moved the finished run's files to (\S+)$", out, re.M)
    assert moved, out
    assert os.path.exists(os.path.join(moved.group(1), "checkpoints", "last_checkpoint_2.pt"))
    assert "epoch 1/1" in out and os.path.exists(os.path.join(cfg["output_dir"], "checkpoints", "last_checkpoint_1.pt"))


def test_a_stored_config_from_an_older_schema_compares_at_the_defaults():
    old = dict_with()
    del old["amp"]["cudnn_benchmark"]
    assert config_changes(old, dict_with()) == []


# --- end to end: the CLI resumes, refuses, or starts over, saying so in one line --------------

def base(tmp_path, **over):
    cfg = tiny_config(tmp_path, data={"train_size": 128}, **over)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), cfg


def last(cfg, epoch):
    return torch.load(os.path.join(cfg["output_dir"], "checkpoints", f"last_checkpoint_{epoch}.pt"), weights_only=True)


@pytest.mark.slow
def test_changed_settings_take_effect_and_the_epoch_length_follows_the_loader(tmp_path, capsys):
    path, cfg = base(tmp_path)
    assert main(["train", path]) == 0
    capsys.readouterr()
    args = ["train", path, "--set", "train.epochs=2", "--set", "optimizer.lr=0.01", "--set", "data.train_size=64",
            "--set", "optimizer.kwargs.weight_decay=0.2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and ("now in effect: data.train_size 128 -> 64, optimizer.lr 0.003 -> 0.01, "
                                      "optimizer.kwargs {'weight_decay': 0.05} -> {'weight_decay': 0.2}, "
                                      "train.epochs 1 -> 2") in out
    state = last(cfg, 2)
    group = state["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.01 and group["weight_decay"] == 0.2
    # Epoch 1 had 4 iterations of 32, epoch 2 the new loader's 2: the state counts whole epochs of the new length.
    assert state["trainer"]["epoch_length"] == 2 and state["trainer"]["iteration"] == 4
    saved = yaml.safe_load(open(os.path.join(cfg["output_dir"], "config.yaml")))
    assert saved["optimizer"]["lr"] == 0.01 and state["config"]["value"]["optimizer"]["lr"] == 0.01
    # A kwarg the config no longer sets is back at the optimizer's default, as in a fresh run.
    assert main(["train", path, "--set", "train.epochs=3", "--set", "optimizer.kwargs={}"]) == 0
    assert "optimizer.kwargs {'weight_decay': 0.2} -> {}" in capsys.readouterr().out
    assert last(cfg, 3)["optimizer"]["param_groups"][0]["weight_decay"] == torch.optim.AdamW([torch.zeros(1)]).defaults[
        "weight_decay"]


def test_a_config_runs_change_of_dtype_is_said_once_in_its_resume_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, amp={"dtype": "bfloat16"})))
    assert main(["train", str(path)]) == 0
    capsys.readouterr()
    assert main(["train", str(path), "--set", "amp.dtype=float32", "--set", "train.epochs=2"]) == 0
    captured = capsys.readouterr()
    resumed = [line for line in captured.out.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1 and "amp.dtype bfloat16 -> float32" in resumed[0], captured.out
    assert "resumed a checkpoint trained in" not in captured.out + captured.err  # the step's own line: not twice


@pytest.mark.slow
def test_a_refused_change_is_one_line_and_changes_nothing(tmp_path, capsys):
    path, cfg = base(tmp_path)
    assert main(["train", path]) == 0
    before = sorted(os.listdir(os.path.join(cfg["output_dir"], "checkpoints")))
    config_before = open(os.path.join(cfg["output_dir"], "config.yaml")).read()
    capsys.readouterr()
    # A checkpoint named to resume is continued, or refused (resume: auto over a finished run starts a new one).
    named = os.path.join(cfg["output_dir"], "checkpoints", "last_checkpoint_1.pt")
    assert main(["train", path, "--set", "optimizer.name=SGD", "--set", "train.epochs=2",
                 "--set", f"handlers.checkpoint.resume={named}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optimizer.name AdamW -> SGD cannot change under a resume" in err
    assert sorted(os.listdir(os.path.join(cfg["output_dir"], "checkpoints"))) == before
    assert open(os.path.join(cfg["output_dir"], "config.yaml")).read() == config_before


@pytest.mark.slow
def test_resume_never_moves_the_old_run_aside_so_auto_never_picks_it_up(tmp_path, capsys):
    path, cfg = base(tmp_path, train={"epochs": 2})
    assert main(["train", path]) == 0
    capsys.readouterr()
    assert main(["train", path, "--set", "handlers.checkpoint.resume=never", "--set", "train.epochs=1"]) == 0
    out = capsys.readouterr().out
    moved = re.search(r"moved the previous run's files to (\S+)", out).group(1)
    assert os.path.exists(os.path.join(moved, "checkpoints", "last_checkpoint_2.pt"))
    assert sorted(f for f in os.listdir(os.path.join(cfg["output_dir"], "checkpoints"))
                  if f.startswith("last")) == ["last_checkpoint_1.pt"]
    assert main(["train", path, "--set", "train.epochs=2"]) == 0
    assert f"resumed from {cfg['output_dir']}/checkpoints/last_checkpoint_1.pt at epoch 1" in capsys.readouterr().out


@pytest.mark.slow
def test_starting_over_moves_the_tensorboard_split_runs_aside_too(tmp_path, capsys):
    """The train and val runs (subdirectories of output_dir) go with the rest: no old curve under a new run."""
    path, cfg = base(tmp_path, handlers={"tensorboard": {"enabled": True}})
    assert main(["train", path]) == 0
    assert main(["train", path, "--set", "handlers.checkpoint.resume=never"]) == 0
    moved = re.search(r"moved the previous run's files to (\S+)", capsys.readouterr().out).group(1)
    for split in ("train", "val"):
        assert len(os.listdir(os.path.join(moved, split))) == 1 \
            == len(os.listdir(os.path.join(cfg["output_dir"], split)))


@pytest.mark.slow
def test_a_start_that_failed_its_checks_is_not_a_previous_run_to_move_aside(tmp_path, capsys):
    path, cfg = base(tmp_path)
    bad = ["--set", "data.name=cifar10", "--set", f"data.root={tmp_path / 'none'}"]
    assert main(["train", path, *bad]) == 2
    assert main(["train", path]) == 0
    assert "moved the previous run" not in capsys.readouterr().out
    assert not [p for p in os.listdir(tmp_path) if ".replaced-" in p]
    log = open(os.path.join(cfg["output_dir"], "train.log")).read()
    assert "building the run failed: ConfigError: data.root" in log and "epoch 1/1" in log  # its details, then the run


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["none", "cosine"])
def test_the_hint_of_a_finished_run_names_a_command_that_works(tmp_path, capsys, schedule):
    path, cfg = base(tmp_path, scheduler={"name": schedule})
    elsewhere = ["--set", f"output_dir={tmp_path / 'my run'}", "--set", "train.epochs=1"]  # the hint keeps --set
    assert main(["train", path, *elsewhere]) == 0
    capsys.readouterr()
    assert main(["train", path, *elsewhere]) == 0
    out = capsys.readouterr().out
    assert "already trained 1 epoch (" in out
    hint = re.search(r"(ignite-amp train .*)", out).group(1).split(" (")[0].replace("=N", "=2")
    assert ("resume=never" in hint) == (schedule == "cosine")
    assert main(shlex.split(hint)[1:]) == 0
    out = capsys.readouterr().out
    assert "epoch 2/2" in out and ("epoch 1/2" in out) == (schedule == "cosine")
    assert os.path.exists(tmp_path / "my run" / "checkpoints" / "last_checkpoint_2.pt")
    assert not os.path.exists(cfg["output_dir"])


@pytest.mark.slow
def test_batch_size_auto_on_resume_reuses_the_stored_size_without_searching(tmp_path, capsys):
    path, cfg = base(tmp_path)
    assert main(["train", path]) == 0
    capsys.readouterr()
    # Here a search would refuse to run (no GPU); a resume takes the size the checkpoint ran with.
    assert main(["train", path, "--set", "data.batch_size=auto", "--set", "train.epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "data.batch_size: auto: using 32, the batch size of the resumed run (no new search)" in out
    assert last(cfg, 2)["config"]["value"]["data"]["batch_size"] == 32


@pytest.mark.slow
@pytest.mark.subprocess
def test_configs_compare_in_linear_time_however_often_aliases_repeat_a_value():
    """Issue 32.8: a stored config whose kwargs repeat a value 2**60 times through shared objects (what YAML
    aliases load as) is compared, and a change in it shown, in time linear in what is written. In a child
    process with a deadline: the exponential comparison it replaces runs in C code no signal interrupts."""
    import subprocess
    import sys

    code = """if True:
        from ignite_amp.config.tree import load_config
        from ignite_amp.run.resume import config_changes

        def bomb(leaf, levels=60):
            value = [leaf]
            for _ in range(levels):
                value = [value, value]
            return value

        old, new = load_config({}).to_dict(), load_config({}).to_dict()
        old["model"]["kwargs"], new["model"]["kwargs"] = {"a": bomb(1)}, {"a": bomb(1)}
        assert config_changes(old, new) == []
        new["model"]["kwargs"] = {"a": bomb(2)}
        (change,) = config_changes(old, new)
        print(change.key, len(str(change)))
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    key, length = proc.stdout.split()
    assert key == "model.kwargs" and int(length) < 400


@pytest.mark.slow
def test_a_run_resumed_from_an_older_checkpoint_is_the_one_timeline_of_its_directory(tmp_path, capsys, monkeypatch):
    """Cases 32.2 and 32.3: resuming epoch 1 of a 3-epoch run deleted its newer best checkpoints; stopped at
    epoch 2, ``resume: auto`` then took the abandoned last_checkpoint_3, and the SIGTERM line's "same command"
    resumed epoch 1 again."""
    import signal

    from ignite_amp.files.checkpoints import SafeDiskSaver

    path, cfg = base(tmp_path, train={"epochs": 3}, handlers={"tensorboard": {"enabled": False},
                                                              "checkpoint": {"n_saved": 3}})
    assert main(["train", path]) == 0
    ckpts = os.path.join(cfg["output_dir"], "checkpoints")
    before = sorted(os.listdir(ckpts))
    older = os.path.join(ckpts, next(n for n in before if n.startswith("best_checkpoint_1_")))
    save = SafeDiskSaver.__call__

    def stop_after_epoch_2(self, checkpoint, filename, metadata=None):
        save(self, checkpoint, filename, metadata)
        if filename == "last_checkpoint_2.pt":
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(SafeDiskSaver, "__call__", stop_after_epoch_2)
    capsys.readouterr()
    assert main(["train", path, "--set", f"handlers.checkpoint.resume={older}"]) == 143
    captured = capsys.readouterr()
    moved = re.search(r"moved (.+) to (\S+): saved after the checkpoint resumed from \(epoch 1\)", captured.err)
    aside = sorted(os.listdir(moved.group(2)))
    assert "last_checkpoint_3.pt" in aside and sorted(set(before) - {os.path.basename(older)}) == aside
    assert captured.err.strip().splitlines()[-1] == (
        f"ignite-amp: terminated (SIGTERM): run ignite-amp train {path} --set handlers.checkpoint.resume=auto to "
        f"resume from the last checkpoint")
    monkeypatch.setattr(SafeDiskSaver, "__call__", save)
    assert main(["train", path, "--set", "handlers.checkpoint.resume=auto"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ckpts}/last_checkpoint_2.pt at epoch 2" in out and "epoch 3/3" in out


# --- a run killed mid-epoch resumes to the uninterrupted run's weights, bit for bit ------------------------------
OOM = {"model": {"name": "helpers:oom_cnn", "num_classes": 10, "kwargs": {"limit": 16}}}  # batches of 32: 2 chunks
COMBINATIONS = {  # a pass over the loader is 4 batches of 32
    "float8-epoch_length-cosine": {"amp": {"dtype": "float8"}, "scheduler": {"name": "cosine"},
                                   "model": {"name": "helpers:image_mlp", "num_classes": 10, "kwargs": {}},
                                   "train": {"epoch_length": 3}},
    "epoch_length-cosine": {"train": {"epoch_length": 3}, "scheduler": {"name": "cosine"}},
    "epoch_length-longer-than-the-loader-onecycle": {"train": {"epoch_length": 6}, "scheduler": {"name": "onecycle"}},
    "oom-micro_batch-onecycle": dict(OOM, scheduler={"name": "onecycle"}),
    "oom-batch-accumulation": dict(OOM, handlers={"oom_backoff": {"mode": "batch"}}, amp={"accumulation_steps": 3}),
    # data.on_device (ignite_amp.data.device_batches): the batches and the augmentation's draws of a resumed pass
    "on_device-augment-epoch_length": {"data": {"on_device": True, "augment": True}, "train": {"epoch_length": 3}},
    "on_device-oom-batch": dict(OOM, data={"on_device": True, "augment": True},
                                handlers={"oom_backoff": {"mode": "batch"}}),
}


def resumable(tmp_path, name, over):
    if over.get("amp", {}).get("dtype") == "float8":
        pytest.importorskip("torchao")
    cfg = tiny_config(tmp_path, output_dir=str(tmp_path / name), data={"train_size": 128, "val_size": 32},
                      amp={"dtype": "bfloat16"}, train={"epochs": 2})
    for key, value in over.items():
        cfg[key] = {**cfg[key], **value} if key in ("amp", "train", "handlers", "data") else value
    return cfg


def _killed_in_epoch_2(cfg):
    """A forked child: the run ends by ``os._exit`` inside epoch 2, after the epoch-1 checkpoint (nothing of the
    process runs afterwards, as with kill -9; one thread, as in tests/run/test_run_state.py)."""
    from ignite.engine import Events

    from ignite_amp.run.compose import build_run

    torch.set_num_threads(1)
    run = build_run(cfg, print_fn=lambda *a: None)
    run.trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: e.state.epoch == 2 and os._exit(137))
    run.train()
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("over", COMBINATIONS.values(), ids=COMBINATIONS)
def test_a_run_killed_mid_epoch_resumes_to_the_uninterrupted_weights(tmp_path, over):
    """Issue 39.2, 39.3: train.epoch_length shorter than the loader (a resume started a new pass where the run was in
    the middle of one), OOMBackoff mode batch (the checkpoint was written before the loader shrank); with float8, the
    schedules and the other backoff mode: the run is killed in epoch 2 and resumes to the same weights."""
    import multiprocessing

    from ignite_amp.run.compose import build_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the killed child's count: the weights then compare bit for bit
    try:
        straight = build_run(resumable(tmp_path, "straight", over), print_fn=lambda *a: None)
        straight.train()
        child = multiprocessing.get_context("fork").Process(target=_killed_in_epoch_2,
                                                            args=(resumable(tmp_path, "killed", over),))
        child.start()
        child.join(300)
        assert child.exitcode == 137
        resumed = build_run(resumable(tmp_path, "killed", over), print_fn=lambda *a: None)
        assert resumed.resumed_from.endswith("last_checkpoint_1.pt")
        resumed.train()
    finally:
        torch.set_num_threads(threads)
    assert [h["epoch"] for h in resumed.history] == [2]
    expected, got = straight.model.state_dict(), resumed.model.state_dict()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


@pytest.mark.parametrize("world", [1, 2])
def test_a_stream_started_at_a_position_yields_what_the_stream_from_the_start_yields_there(world):
    """The pass order follows the pass's number, and the batches of a pass already trained are skipped in the
    sampler: on one process (EpochShuffleSampler) and on each of N ranks (ShuffleShardSampler)."""
    import itertools

    from torch.utils.data import DataLoader

    from ignite_amp.data.datasets import EpochShuffleSampler, ShuffleShardSampler
    from ignite_amp.data.passes import PassStream

    data = list(range(22))

    def stream(start, rank=0):
        sampler = EpochShuffleSampler(len(data), seed=3) if world == 1 else ShuffleShardSampler(
            data, num_replicas=world, rank=rank, shuffle=True, seed=3)
        return [b.tolist() for b in itertools.islice(PassStream(DataLoader(data, 4, sampler=sampler),
                                                                lambda: start), 12 - start)]

    first_pass = []
    for rank in range(world):
        whole = stream(0, rank)
        assert all(stream(start, rank) == whole[start:] for start in (1, 3, 5, 6, 9)), rank
        first_pass += sum(whole[:-(-len(data) // world // 4)], [])
    assert sorted(first_pass) == data  # a pass: each sample once over the ranks
