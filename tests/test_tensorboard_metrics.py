import os
import re

import pytest
import torch
from ignite.engine import Events
from ignite.metrics import Accuracy, Loss
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.nn.functional import cross_entropy

from conftest import ROOT, id_batches, mlp
from ignite_amp.handlers import TensorBoardMetrics
from ignite_amp.handlers.tensorboard_metrics import TAGS
from ignite_amp import AmpEvents, create_amp_evaluator, create_amp_trainer


def read(path):
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.fixture
def logged(tmp_path):
    """A float16 run with an inf batch (one skipped step), logging every 2 iterations."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", dtype="float16",
                                 scaler_kwargs={"init_scale": 256.0, "growth_interval": 3})
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(cross_entropy)}, device="cpu",
                                     dtype="float16")
    batches = id_batches(64, 8)
    x, y = batches[2]
    batches[2] = (x.clone().index_fill_(0, torch.tensor([0]), float("inf")), y)
    record = {"scale": {}, "loss": {}}

    @trainer.on(Events.ITERATION_COMPLETED)
    def remember(engine):
        record["scale"][engine.state.iteration] = engine.amp_step.scaler.get_scale()
        record["loss"][engine.state.iteration] = engine.state.output["loss"].item()

    tb = TensorBoardMetrics(str(tmp_path), log_every=2, hparams={"name": "t", "optimizer.lr": 0.05})
    tb.attach(trainer, evaluator=evaluator, optimizer=optimizer)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(id_batches(16, 8)))
    trainer.run(batches, max_epochs=2)
    return read(tmp_path), record, trainer


def values(acc, tag):
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_logs_every_tag_of_a_cpu_run(logged):
    acc, _, _ = logged
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "amp/loss_scale", "amp/skipped_steps",
                "perf/samples_per_sec", "perf/data_wait_fraction", "memory/rss_mb", "batch/size",
                "batch/micro_batches", "oom/events", "val/accuracy", "val/loss"}
    assert expected <= tags
    assert sorted(values(acc, "train/loss")) == list(range(2, 17, 2))


def test_loss_scale_and_skipped_steps_match_the_scaler(logged):
    acc, record, _ = logged
    for step, value in values(acc, "amp/loss_scale").items():
        assert value == record["scale"][step]
    skipped = values(acc, "amp/skipped_steps")
    # The inf batch is iteration 3 of each epoch (3 and 11): each skip halves the scale.
    assert (skipped[2], skipped[4], skipped[10], skipped[12], skipped[16]) == (0, 1, 1, 2, 2)
    assert record["scale"][2] == 256.0 and record["scale"][3] == 128.0


def test_window_means(logged):
    acc, record, _ = logged
    for step, value in values(acc, "train/loss").items():
        window = [record["loss"][step - 1], record["loss"][step]]
        assert value == pytest.approx(sum(window) / 2, rel=1e-5, nan_ok=True)
    assert all(v == 8 for v in values(acc, "batch/size").values())
    assert all(v == pytest.approx(0.05) for v in values(acc, "train/lr").values())  # stored as float32
    assert all(v > 0 for v in values(acc, "perf/samples_per_sec").values())
    assert all(0 <= v <= 1 for v in values(acc, "perf/data_wait_fraction").values())
    assert all(v > 0 for v in values(acc, "train/grad_norm").values())


def test_validation_and_hparams(logged, tmp_path):
    acc, _, trainer = logged
    val = values(acc, "val/accuracy")
    assert sorted(val) == [8, 16]  # x axis: the trainer's iteration
    tensors = set(acc.Tags()["tensors"])
    plugin = acc.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in plugin or any("hparams" in t for t in tensors)


@pytest.mark.parametrize("clip_first", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_grad_norm_is_pre_clip_whatever_the_attach_order(tmp_path, clip_first, norm_type):
    from ignite_amp.handlers import GradientClipping

    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cross_entropy, device="cpu",
                                 dtype="float32")
    norms = []  # the L2 norm of the gradients as the step left them, before any handler
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: norms.append(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()))
    tb = TensorBoardMetrics(str(tmp_path), log_every=1)
    clip = GradientClipping(max_norm=1e-3, norm_type=norm_type)
    for handler in ([clip, tb] if clip_first else [tb, clip]):
        handler.attach(trainer)
    trainer.run(id_batches(16, 8), max_epochs=1)
    logged = values(read(tmp_path), "train/grad_norm")
    assert [logged[1], logged[2]] == pytest.approx(norms, rel=1e-5) and min(norms) > 1e-3


def test_readme_lists_every_tag():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    for tag in TAGS:
        assert f"`{tag}`" in readme, tag


def test_bad_log_every(tmp_path):
    with pytest.raises(ValueError, match="log_every should be a positive integer"):
        TensorBoardMetrics(str(tmp_path), log_every=0)
