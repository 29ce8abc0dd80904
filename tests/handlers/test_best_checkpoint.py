import os

import pytest
import torch
from ignite.engine import Engine, Events

import ignite_amp.handlers.best_checkpoint
from helpers import assert_doctests_pass
from ignite_amp.cli.main import main
from ignite_amp.handlers import BestCheckpoint, CheckpointError
from ignite_amp.run.compose import build_run


def scripted(tmp_path, scores, metric="accuracy", n_saved=2, model=None, resume=False):
    """A trainer whose evaluator reports ``scores`` one per epoch."""
    model = model or torch.nn.Linear(2, 2)
    trainer, evaluator = Engine(lambda e, b: None), Engine(lambda e, b: None)
    values = iter(scores)
    evaluator.add_event_handler(Events.COMPLETED, lambda e: e.state.metrics.update({metric: next(values)}))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run([0]))
    ckpt = BestCheckpoint(str(tmp_path), {"model": model, "trainer": trainer}, metric=metric, n_saved=n_saved)
    ckpt.attach(trainer, evaluator)
    if resume:
        ckpt.resume()
    return trainer, ckpt


def files(path, prefix):
    return sorted(f for f in os.listdir(path) if f.startswith(prefix))


def test_docstring_example_runs():
    assert_doctests_pass(ignite_amp.handlers.best_checkpoint)


def test_keeps_the_n_best_by_accuracy_and_one_last(tmp_path):
    trainer, ckpt = scripted(tmp_path, [0.3, 0.8, 0.5, 0.9, 0.1])
    trainer.run([0], max_epochs=5)
    assert files(tmp_path, "best") == ["best_checkpoint_2_accuracy=0.8000.pt", "best_checkpoint_4_accuracy=0.9000.pt"]
    assert files(tmp_path, "last") == ["last_checkpoint_5.pt"]
    assert ckpt.best_path.endswith("best_checkpoint_4_accuracy=0.9000.pt")


def test_loss_is_minimised(tmp_path):
    trainer, ckpt = scripted(tmp_path, [0.9, 0.2, 0.5], metric="loss", n_saved=1)
    trainer.run([0], max_epochs=3)
    assert files(tmp_path, "best") == ["best_checkpoint_2_neg_loss=-0.2000.pt"]
    assert ckpt.mode == "min"


def test_resume_keeps_the_best_table(tmp_path):
    trainer, _ = scripted(tmp_path, [0.5, 0.9], n_saved=1)
    trainer.run([0], max_epochs=2)
    trainer, ckpt = scripted(tmp_path, [0.6, 0.7], n_saved=1, resume=True)
    assert trainer.state.epoch == 2
    trainer.run([0], max_epochs=4)
    # A worse model after the resume never replaced the better one from before it.
    assert files(tmp_path, "best") == ["best_checkpoint_2_accuracy=0.9000.pt"]
    assert files(tmp_path, "last") == ["last_checkpoint_4.pt"]


@pytest.mark.parametrize("scores, n_saved", [([0.50004, 0.50002], 1), ([0.1] * 8 + [0.5, 0.5, 0.9], 2)])
def test_a_resumed_run_keeps_the_best_an_uninterrupted_run_keeps(tmp_path, scores, n_saved):
    """Case 32.4: the table was rebuilt from names rounded to 4 decimals (0.50004 and 0.50002 are both 0.5000),
    and ties sorted by name (epoch 10 before epoch 9) instead of in the order they were saved."""
    trainer, _ = scripted(tmp_path / "whole", scores, n_saved=n_saved)
    trainer.run([0], max_epochs=len(scores))
    trainer, _ = scripted(tmp_path / "cut", scores[:-1], n_saved=n_saved)
    trainer.run([0], max_epochs=len(scores) - 1)
    trainer, _ = scripted(tmp_path / "cut", scores[-1:], n_saved=n_saved, resume=True)
    trainer.run([0], max_epochs=len(scores))
    assert files(tmp_path / "cut", "best") == files(tmp_path / "whole", "best")
    assert files(tmp_path / "whole", "best") == (["best_checkpoint_1_accuracy=0.5000.pt"] if n_saved == 1 else [
        "best_checkpoint_10_accuracy=0.5000.pt", "best_checkpoint_11_accuracy=0.9000.pt"])


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside_and_continues_its_own_timeline(tmp_path, caplog):
    """Cases 32.2 and 32.3: resuming epoch 1 deleted the abandoned run's newer best file, and left its
    last_checkpoint_3 for ``resume: auto`` to pick up over this run's epoch 2."""
    trainer, _ = scripted(tmp_path, [0.5, 0.9, 0.7])
    trainer.run([0], max_epochs=3)
    assert files(tmp_path, "") == ["best_checkpoint_2_accuracy=0.9000.pt", "best_checkpoint_3_accuracy=0.7000.pt",
                                   "last_checkpoint_3.pt"]
    trainer, ckpt = scripted(tmp_path, [0.6])
    ckpt.resume(str(tmp_path / "best_checkpoint_2_accuracy=0.9000.pt"))
    aside, = [p for p in os.listdir(tmp_path.parent) if p.startswith(tmp_path.name + ".replaced-")]
    assert sorted(os.listdir(tmp_path.parent / aside)) == ["best_checkpoint_3_accuracy=0.7000.pt",
                                                           "last_checkpoint_3.pt"]
    assert f"to {tmp_path.parent / aside}: saved after the checkpoint resumed from (epoch 2)" in caplog.text
    trainer.run([0], max_epochs=3)
    trainer, ckpt = scripted(tmp_path, [], resume=True)  # resume: auto continues this run
    assert trainer.state.epoch == 3 and files(tmp_path, "last") == ["last_checkpoint_3.pt"]
    assert files(tmp_path, "best") == ["best_checkpoint_2_accuracy=0.9000.pt", "best_checkpoint_3_accuracy=0.6000.pt"]


def test_a_last_checkpoint_a_killed_save_left_behind_is_removed_on_resume(tmp_path, caplog):
    """Case 32.9: a kill after the new last checkpoint's rename, before the old one's removal, left a stray
    last_checkpoint_1 that no later save removed."""
    trainer, _ = scripted(tmp_path, [0.5, 0.9])
    trainer.run([0], max_epochs=2)
    (tmp_path / "last_checkpoint_1.pt").write_bytes((tmp_path / "last_checkpoint_2.pt").read_bytes())
    trainer, _ = scripted(tmp_path, [0.7], resume=True)
    assert trainer.state.epoch == 2 and files(tmp_path, "last") == ["last_checkpoint_2.pt"]
    assert "removed last_checkpoint_1.pt: replaced by last_checkpoint_2" in caplog.text
    trainer.run([0], max_epochs=3)
    assert files(tmp_path, "last") == ["last_checkpoint_3.pt"]


def test_a_save_stopped_between_the_best_and_the_last_file_resumes_the_newer_best_file(tmp_path, caplog):
    """Issue 59.7: a disk full (or a kill) after best_checkpoint_2 was written, before last_checkpoint_2, resumed
    last_checkpoint_1 (epoch 1) although best_checkpoint_2 holds the whole state of epoch 2."""
    trainer, _ = scripted(tmp_path, [0.5, 0.9])
    trainer.run([0], max_epochs=2)
    (tmp_path / "last_checkpoint_1.pt").write_bytes((tmp_path / "best_checkpoint_1_accuracy=0.5000.pt").read_bytes())
    os.remove(tmp_path / "last_checkpoint_2.pt")  # the save of epoch 2 stopped before its last file
    path, state = BestCheckpoint.find_resumable(str(tmp_path), of_a_config=False)
    assert os.path.basename(path) == "best_checkpoint_2_accuracy=0.9000.pt" and state["trainer"]["iteration"] == 2
    trainer, ckpt = scripted(tmp_path, [0.7], resume=True)
    assert trainer.state.epoch == 2 and ckpt.resumed_path == path
    assert files(tmp_path, "last") == []  # epoch 1's last file is replaced by the state resumed
    assert "removed last_checkpoint_1.pt: replaced by best_checkpoint_2_accuracy=0.9000.pt" in caplog.text
    trainer.run([0], max_epochs=3)
    assert files(tmp_path, "last") == ["last_checkpoint_3.pt"]
    assert files(tmp_path, "best") == ["best_checkpoint_2_accuracy=0.9000.pt", "best_checkpoint_3_accuracy=0.7000.pt"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_attach_keeps_the_temp_files_of_saves_in_progress_in_other_live_processes(tmp_path):
    """Issue 39.6: a second script on the same directory removed the first's in-flight temp file as stale, and the
    first died in FileNotFoundError. A temp file is stale when its pid is gone, or this process's (a restart)."""
    import subprocess
    import sys

    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    live = os.getppid()  # alive, and not this process
    stale = [f".last_checkpoint_1.pt.tmp-{ended.pid}", f".best_checkpoint_1_accuracy=0.5000.pt.tmp-{os.getpid()}",
             ".last_checkpoint_2.dcp.tmp-save", f".last_checkpoint_2.dcp.tmp-{ended.pid}-old"]
    in_flight = [f".last_checkpoint_3.pt.tmp-{live}", f".last_checkpoint_3.dcp.tmp-{live}",
                 f".last_checkpoint_3.dcp.tmp-{live}-old"]
    for name in stale + in_flight:
        (tmp_path / name).mkdir() if ".dcp." in name else (tmp_path / name).write_bytes(b"half a checkpoint")
    trainer, _ = scripted(tmp_path, [])
    assert sorted(os.listdir(tmp_path)) == sorted(in_flight)


class Runs:
    """Pickles as a call of os.system: weights_only loading must refuse it, never run it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_file_that_holds_a_refused_class_is_one_line_and_never_renamed_or_run(tmp_path):
    """Issue 39.1: a sound pickle of a class weights_only loading refuses is not damage: resume stops in one line
    naming the class, and leaves the file (and the older checkpoints) as they are."""
    from ignite_amp.errors import CheckpointTypeError
    from ignite_amp.files.checkpoints import load_checkpoint

    trainer, _ = scripted(tmp_path / "ckpts", [0.5])
    trainer.run([0], max_epochs=1)
    marker = tmp_path / "ran"
    torch.save({"model": Runs(str(marker))}, tmp_path / "ckpts" / "last_checkpoint_2.pt")
    before = sorted(os.listdir(tmp_path / "ckpts"))
    with pytest.raises(CheckpointTypeError, match=r"last_checkpoint_2.pt: holds (posix|os|nt)\.system, which "
                                                  r"weights-only loading refuses \(a class ignite-amp does not save"):
        load_checkpoint(str(tmp_path / "ckpts" / "last_checkpoint_2.pt"))
    with pytest.raises(CheckpointTypeError, match=r"holds (posix|os|nt)\.system"):
        BestCheckpoint.find_resumable(str(tmp_path / "ckpts"), of_a_config=False)
    assert sorted(os.listdir(tmp_path / "ckpts")) == before and not marker.exists()


def test_nothing_to_resume_returns_none(tmp_path):
    _, ckpt = scripted(tmp_path, [])
    assert ckpt.resume() is None


def test_resume_with_a_state_and_no_path_is_refused(tmp_path):
    # Found by the type checker: the state's file was then read as path None (a TypeError deep in os.path).
    trainer, ckpt = scripted(tmp_path, [0.5])
    trainer.run([0], max_epochs=1)
    state = torch.load(tmp_path / "last_checkpoint_1.pt", weights_only=False)
    with pytest.raises(ValueError, match="state= is the file at path="):
        ckpt.resume(state=state)
    assert ckpt.resume(str(tmp_path / "last_checkpoint_1.pt"), state=state).endswith("last_checkpoint_1.pt")


def test_bad_checkpoints_are_one_line_and_nothing_is_overwritten(tmp_path):
    trainer, _ = scripted(tmp_path, [0.5], model=torch.nn.Linear(2, 2))
    trainer.run([0], max_epochs=1)
    last = tmp_path / "last_checkpoint_1.pt"
    good = last.read_bytes()

    # Incompatible: a different model.
    _, ckpt = scripted(tmp_path, [], model=torch.nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"last_checkpoint_1.pt: model does not fit this run \(Error"):
        ckpt.resume()
    # Truncated: named explicitly, a one-line error; found by resume(), skipped and set aside.
    last.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="truncated or not a checkpoint file"):
        scripted(tmp_path, [])[1].resume(str(last))
    assert scripted(tmp_path, [], resume=True)[1].resumed_config is None
    assert not last.exists() and (tmp_path / "last_checkpoint_1.pt.unreadable").read_bytes() == good[: len(good) // 2]
    # Foreign: a plain state dict.
    torch.save(torch.nn.Linear(2, 2).state_dict(), last)
    with pytest.raises(CheckpointError, match=r"holds none of model, trainer \(its keys: weight, bias\)"):
        scripted(tmp_path, [])[1].resume(str(last))
    with pytest.raises(CheckpointError, match="no such file"):
        scripted(tmp_path, [])[1].resume(str(tmp_path / "nope.pt"))
    assert files(tmp_path, "best") == ["best_checkpoint_1_accuracy=0.5000.pt"]


def test_reserved_keys_and_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="reserved key 'rng'"):
        BestCheckpoint(str(tmp_path), {"rng": torch.nn.Linear(1, 1)})
    with pytest.raises(ValueError, match="n_saved should be a positive integer"):
        BestCheckpoint(str(tmp_path), {}, n_saved=0)
    with pytest.raises(ValueError, match="mode should be 'max' or 'min'"):
        BestCheckpoint(str(tmp_path), {}, mode="up")
    (tmp_path / "a_file").write_text("")  # issue 39: accepted, then the first save failed after an epoch
    with pytest.raises(ValueError, match=r"^Argument dirname should be a directory \(or not exist yet\), .*a_file is a "
                                         r"file\.$"):
        BestCheckpoint(str(tmp_path / "a_file"), {})


def states(run):
    return (
        {k: v.clone() for k, v in run.model.state_dict().items()},
        run.optimizer.state_dict(),
        run.trainer.amp_step.scaler.get_scale(),
    )


@pytest.mark.slow
def test_resume_equivalence(quick_cfg, tmp_path):
    """4 epochs straight == 2 epochs, a fresh process-like rebuild, resume, 2 more (float16, scaler, onecycle)."""
    torch.use_deterministic_algorithms(True)
    try:
        base = dict(quick_cfg, amp={"dtype": "float16"}, train={"epochs": 4}, scheduler={"name": "onecycle"},
                    data=dict(quick_cfg["data"], augment=True),
                    handlers={"tensorboard": {"enabled": False}})
        straight = build_run(dict(base, output_dir=str(tmp_path / "a")), print_fn=lambda *a: None)
        straight.train()

        first = build_run(dict(base, output_dir=str(tmp_path / "b")), print_fn=lambda *a: None)
        first.trainer.add_event_handler(Events.EPOCH_COMPLETED(once=2), lambda e: e.terminate())
        first.train()
        assert first.trainer.state.epoch == 2
        second = build_run(dict(base, output_dir=str(tmp_path / "b")), print_fn=lambda *a: None)
        assert second.resumed_from.endswith("last_checkpoint_2.pt")
        second.train()
        assert second.trainer.state.epoch == 4 and [h["epoch"] for h in second.history] == [3, 4]
    finally:
        torch.use_deterministic_algorithms(False)

    (wa, oa, sa), (wb, ob, sb) = states(straight), states(second)
    assert sa == sb
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    for pa, pb in zip(oa["state"].values(), ob["state"].values(), strict=True):
        for name in pa:
            assert torch.equal(torch.as_tensor(pa[name]), torch.as_tensor(pb[name])), name


@pytest.mark.slow
def test_cli_reports_bad_checkpoint_in_one_line(quick_cfg, tmp_path, capsys):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(quick_cfg, handlers={"checkpoint": {"resume": str(tmp_path / "x.pt")}})))
    (tmp_path / "x.pt").write_bytes(b"not a checkpoint")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "x.pt: truncated or not a checkpoint file" in err and err.count("\n") == 1


def test_a_scripts_resume_loads_what_a_checkpoint_holds_and_says_what_it_did_not_find(tmp_path, caplog):
    """Issue 28: what examples/char_lm.py saves (model and optimizer only) was refused with a YAML key's advice."""
    import logging

    import torch
    from ignite.metrics import Loss
    from torch.nn.functional import cross_entropy

    from ignite_amp import create_amp_evaluator, create_amp_trainer
    from ignite_amp.errors import CheckpointError
    from ignite_amp.handlers import BestCheckpoint

    def run(to_save_extra, epochs, dirname):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float32")
        evaluator = create_amp_evaluator(model, {"loss": Loss(cross_entropy)}, device="cpu", dtype="float32")
        to_save = {"model": model, "optimizer": opt, **to_save_extra(trainer)}
        checkpoint = BestCheckpoint(str(dirname), to_save, metric="loss")
        checkpoint.attach(trainer, evaluator)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(data))
        return model, opt, trainer, checkpoint

    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))] * 2
    model, opt, trainer, first = run(lambda t: {}, 2, tmp_path / "a")  # model + optimizer only
    trainer.run(data, max_epochs=2)
    saved = os.path.join(first.dirname, "last_checkpoint_2.pt")  # the end of epoch 2: the weights trained

    resumed_model, resumed_opt, trainer2, second = run(lambda t: {"trainer": t, "amp_step": t.amp_step}, 1,
                                                       tmp_path / "b")
    with caplog.at_level(logging.WARNING, logger="ignite_amp"):
        assert second.resume(saved) == saved
    said = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert len(said) == 1 and "loaded model, optimizer" in said[0] and "it holds no trainer, amp_step" in said[0]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True))
    assert resumed_opt.state_dict()["state"][0]["momentum_buffer"].equal(
        opt.state_dict()["state"][0]["momentum_buffer"])

    plain = tmp_path / "plain.pt"  # a hand-written loop's checkpoint
    torch.save({"model": model.state_dict()}, plain)
    assert second.resume(str(plain)) == str(plain)
    torch.save({"weights": model.state_dict()}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match=r"holds none of model, optimizer, trainer, amp_step \(its keys: weights"):
        second.resume(str(tmp_path / "foreign.pt"))
    # Resumed from its own directory with nothing newer that loads: the way out speaks of Python, not YAML.
    os.makedirs(tmp_path / "c")
    with open(tmp_path / "c" / "last_checkpoint_3.pt", "w") as f:
        f.write("truncated")
    *_, third = run(lambda t: {}, 1, tmp_path / "c")
    with pytest.raises(CheckpointError, match="move them out of the directory, or give BestCheckpoint another one"):
        third.resume()


def test_a_script_run_again_after_it_finished_trains_nothing_and_one_run_longer_trains_only_the_new_epochs(
        tmp_path, caplog):
    """The same script three times: resume() then run(data, max_epochs=3), again, then max_epochs=5. Ignite starts a
    finished run over from epoch 0; the second run must train nothing and leave every file as it was."""
    def script(scores, max_epochs):
        trainer, ckpt = scripted(tmp_path, scores, n_saved=1)
        trained = []
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: trained.append(e.state.epoch))
        resumed = ckpt.resume()
        trainer.run([0, 1], max_epochs=max_epochs)
        return trainer, resumed, trained

    def snapshot():
        return {name: (tmp_path / name).read_bytes() for name in sorted(os.listdir(tmp_path))}

    trainer, resumed, trained = script([0.5, 0.9, 0.7], 3)
    assert resumed is None and trained == [1, 1, 2, 2, 3, 3]
    first = snapshot()
    assert list(first) == ["best_checkpoint_2_accuracy=0.9000.pt", "last_checkpoint_3.pt"]
    caplog.clear()
    trainer, resumed, trained = script([0.95, 0.95, 0.95], 3)  # would replace the best, were it trained again
    assert resumed == str(tmp_path / "last_checkpoint_3.pt") and trained == []
    assert (trainer.state.epoch, trainer.state.iteration) == (3, 6)
    assert snapshot() == first
    said = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("already trained 3 epochs (checkpoint ") \
        and "trainer.run(data, max_epochs=4)" in said[0]
    # Longer: only epochs 4 and 5, and a worse score (0.8) never replaces the better best file.
    trainer, resumed, trained = script([0.8, 0.6], 5)
    assert trained == [4, 4, 5, 5] and trainer.state.epoch == 5
    assert files(tmp_path, "best") == ["best_checkpoint_2_accuracy=0.9000.pt"]
    assert files(tmp_path, "last") == ["last_checkpoint_5.pt"]
