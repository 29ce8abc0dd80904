import os
import re
import sys

import pytest
import torch
from ignite.engine import Events
from ignite.metrics import Accuracy, Loss
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from torch.nn.functional import cross_entropy

import ignite_amp.handlers.tensorboard_metrics
from conftest import ROOT, assert_doctests_pass, id_batches, mlp
from ignite_amp import AmpEvents, create_amp_evaluator, create_amp_trainer
from ignite_amp.handlers import GradientClipping, TensorBoardMetrics
from ignite_amp.handlers.tensorboard_metrics import FACTS_TAG, LAYOUT, TAGS

MAX_NORM = 10.0


def read(path):
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.fixture
def logged(tmp_path):
    """A float16 run with an inf batch (one skipped step), clipping, logging every 2 iterations;
    a handler doubles the micro-batches at iteration 5."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", dtype="float16",
                                 scaler_kwargs={"init_scale": 256.0, "growth_interval": 3})
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(cross_entropy)}, device="cpu",
                                     dtype="float16")
    batches = id_batches(64, 8)
    x, y = batches[2]
    batches[2] = (x.clone().index_fill_(0, torch.tensor([0]), float("inf")), y)
    record = {"scale": {}, "loss": {}, "norm": {}}

    @trainer.on(AmpEvents.GRADS_READY)
    def pre_clip_norm(engine):
        record["norm"][engine.state.iteration] = engine.amp_step.grad_norm.item()

    @trainer.on(Events.ITERATION_COMPLETED)
    def remember(engine):
        record["scale"][engine.state.iteration] = engine.amp_step.scaler.get_scale()
        record["loss"][engine.state.iteration] = engine.state.output["loss"].item()
        if engine.state.iteration == 5:
            engine.amp_step.micro_batches = 2

    clip = GradientClipping(max_norm=MAX_NORM)
    clip.attach(trainer)
    tb = TensorBoardMetrics(str(tmp_path), log_every=2, facts={"batch_size": 8, "model": "mlp"}, clipping=clip)
    tb.attach(trainer, evaluator=evaluator, optimizer=optimizer)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(id_batches(16, 8)))
    trainer.run(batches, max_epochs=2)
    tb.close()
    return read(tmp_path), record, tb


def values(acc, tag):
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_docstring_example_runs():
    assert_doctests_pass(ignite_amp.handlers.tensorboard_metrics)


def test_logs_every_tag_of_a_cpu_run_and_no_hparam_scalars(logged):
    acc, _, _ = logged
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/lr/group_0", "train/grad_norm", "train/clip_max_norm", "train/clip_fraction",
                "amp/loss_scale", "amp/skipped_steps", "perf/samples_per_sec", "perf/data_wait_fraction",
                "perf/step_time_ms", "memory/rss_mb", "batch/micro_batches", "oom/events", "val/accuracy",
                "val/loss", "val/best_accuracy", "val/best_loss"}
    assert expected == tags  # batch/size is constant (8, as the facts say): never logged
    assert not [t for t in tags if t.startswith("hparam")]
    assert sorted(values(acc, "train/loss")) == list(range(2, 17, 2))


def test_constant_batch_values_are_logged_only_when_they_change(logged):
    acc, _, _ = logged
    assert values(acc, "batch/micro_batches") == {6: 2}  # raised at iteration 5, from 1 in the facts


def test_batch_size_without_facts_is_logged_at_the_first_log_then_on_change(tmp_path):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    TensorBoardMetrics(str(tmp_path), log_every=2).attach(trainer)
    trainer.run(id_batches(32, 8) + id_batches(16, 4), max_epochs=1)  # 4 batches of 8, then 4 of 4
    assert values(read(tmp_path), "batch/size") == {2: 8, 6: 4}


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
    assert all(v == pytest.approx(0.05) for v in values(acc, "train/lr/group_0").values())  # stored as float32
    assert all(v > 0 for v in values(acc, "perf/samples_per_sec").values())
    assert all(0 <= v <= 1 for v in values(acc, "perf/data_wait_fraction").values())
    assert all(v > 0 for v in values(acc, "perf/step_time_ms").values())
    assert all(v > 0 for v in values(acc, "train/grad_norm").values())


def test_clip_fraction_is_the_share_of_steps_above_max_norm(logged):
    acc, record, _ = logged
    fractions = values(acc, "train/clip_fraction")
    norms = record["norm"]  # iterations that stepped (the skipped ones fire no GRADS_READY)
    expected = {}
    for step in range(2, 17, 2):
        window = [norms[i] for i in (step - 1, step) if i in norms]
        if window:
            expected[step] = sum(n > MAX_NORM for n in window) / len(window)
    assert fractions == pytest.approx(expected)
    assert 0 < sum(expected.values()) < len(expected)  # the run has windows that bound and windows that did not
    assert set(values(acc, "train/clip_max_norm").values()) == {MAX_NORM}


def test_validation_best_values(logged):
    acc, _, tb = logged
    assert sorted(values(acc, "val/accuracy")) == [8, 16]  # x axis: the trainer's iteration
    accuracy, best = values(acc, "val/accuracy"), values(acc, "val/best_accuracy")
    assert best[16] == pytest.approx(max(accuracy.values())) and best[8] == pytest.approx(accuracy[8])
    assert values(acc, "val/best_loss")[16] == pytest.approx(min(values(acc, "val/loss").values()))


def fact_text(acc):
    (event,) = acc.Tensors(FACTS_TAG)
    return event.tensor_proto.string_val[0].decode()


def test_run_facts_text_says_what_ran(logged):
    acc, _, tb = logged
    text = fact_text(acc)
    assert text.startswith("**float16 autocast, GradScaler from scale 256, on cpu")
    assert "| grad_scaler | true |" in text and "| batch_size | 8 |" in text and "| model | mlp |" in text
    assert tb.facts_written["torch"] == torch.__version__ and tb.facts_written["micro_batches"] == 1


def test_hparams_are_the_facts_with_metrics_read_from_scalar_tags(logged):
    acc, _, tb = logged
    content = acc.PluginTagToContent("hparams")
    experiment = hparams_metadata.parse_experiment_plugin_data(content[hparams_metadata.EXPERIMENT_TAG])
    columns = [info.name for info in experiment.hparam_infos]
    assert columns == list(tb.facts_written)
    metrics = [m.name.tag for m in experiment.metric_infos]
    assert metrics == ["val/accuracy", "val/best_accuracy", "val/loss", "val/best_loss", "perf/samples_per_sec"]
    assert len(columns) + len(metrics) <= 25
    start = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
    assert start.hparams["grad_scaler"].WhichOneof("kind") == "bool_value" and start.hparams["grad_scaler"].bool_value
    assert start.hparams["dtype"].string_value == "float16" and start.hparams["init_scale"].number_value == 256
    end = hparams_metadata.parse_session_end_info_plugin_data(content[hparams_metadata.SESSION_END_INFO_TAG])
    assert end.status == 1  # STATUS_SUCCESS


def test_a_bfloat16_script_run_without_facts_says_no_grad_scaler(tmp_path):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="bfloat16")
    TensorBoardMetrics(str(tmp_path), log_every=2).attach(trainer)
    trainer.run(id_batches(32, 8), max_epochs=1)
    acc = read(tmp_path)
    assert fact_text(acc).startswith("**bfloat16 autocast, no GradScaler, on cpu")
    start = hparams_metadata.parse_session_start_info_plugin_data(
        acc.PluginTagToContent("hparams")[hparams_metadata.SESSION_START_INFO_TAG])
    assert start.hparams["grad_scaler"].bool_value is False and "init_scale" not in start.hparams
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("amp/")]


def test_dashboard_layout_comes_first_and_names_documented_tags(logged):
    acc, _, _ = logged
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    first = layout.category[0]
    assert first.title == "AMP health"
    charts = {c.title: list(c.multiline.tag) for c in first.chart}
    assert charts["loss: train, val"] == ["train/loss", "val/loss"]
    assert charts["loss scale, skipped steps (float16 only)"] == ["amp/loss_scale", "amp/skipped_steps"]
    assert charts["grad norm, clip threshold"] == ["train/grad_norm", "train/clip_max_norm"]
    documented = [re.escape(t).replace(re.escape("<metric>"), r"\w+").replace(re.escape("<N>"), r"\d+") for t in TAGS]
    logged_tags = set(acc.Tags()["scalars"])
    for category in LAYOUT.values():
        for _, (_, patterns) in category.items():
            for pattern in patterns:
                examples = [t for t in logged_tags | {"memory/allocated_mb", "memory/reserved_mb",
                                                      "memory/max_allocated_mb", "batch/size"}
                            if re.match(pattern, t)]
                assert examples, pattern
                assert all(any(re.fullmatch(d, t) for d in documented) for t in examples), pattern


def test_one_host_sync_per_log(tmp_path, monkeypatch):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float16")
    clip = GradientClipping(max_norm=0.1)
    clip.attach(trainer)
    tb = TensorBoardMetrics(str(tmp_path), log_every=2, clipping=clip)
    tb.attach(trainer)
    reads, logs = [], []
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name):
            frame = sys._getframe(1)
            while frame is not None:  # a read made by a TensorBoard handler, Ignite's included
                if re.search(r"handlers/tensorboard_\w+\.py$|ignite/handlers/", frame.f_code.co_filename):
                    reads.append(_name)
                    break
                frame = frame.f_back
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2), lambda e: logs.append(e.state.iteration))
    trainer.run(id_batches(32, 8), max_epochs=1)
    # Every TensorBoard handler together: one read per log (loss, grad norm, clip count, scale), none between.
    assert logs == [2, 4] and reads == ["tolist", "tolist"]
    acc = read(tmp_path)
    assert sorted(values(acc, "amp/loss_scale")) == [2, 4] and values(acc, "train/clip_fraction")


@pytest.mark.parametrize("clip_first", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_grad_norm_is_pre_clip_whatever_the_attach_order(tmp_path, clip_first, norm_type):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cross_entropy, device="cpu",
                                 dtype="float32")
    norms = []  # the L2 norm of the gradients as the step left them, before any handler
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: norms.append(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()))
    clip = GradientClipping(max_norm=1e-3, norm_type=norm_type)
    tb = TensorBoardMetrics(str(tmp_path), log_every=1, clipping=clip)
    for handler in ([clip, tb] if clip_first else [tb, clip]):
        handler.attach(trainer)
    trainer.run(id_batches(16, 8), max_epochs=1)
    acc = read(tmp_path)
    logged = values(acc, "train/grad_norm")
    assert [logged[1], logged[2]] == pytest.approx(norms, rel=1e-5) and min(norms) > 1e-3
    assert values(acc, "train/clip_fraction") == {1: 1.0, 2: 1.0}
    # The threshold line belongs on the L2 grad-norm chart only when clipping uses that norm.
    assert ("train/clip_max_norm" in acc.Tags()["scalars"]) == (norm_type == 2.0)


def test_readme_lists_every_tag():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    for tag in TAGS:
        assert f"`{tag}`" in readme, tag


@pytest.mark.parametrize("kwargs, error, message", [
    ({"log_every": 0}, ValueError, "log_every should be a positive integer"),
    ({"facts": [("dtype", "bf16")]}, TypeError, "facts should be a dict"),
    ({"facts": {"lr": [0.1]}}, TypeError, "facts should map names to bool, int, float, str or None"),
    ({"clipping": 1.0}, TypeError, "clipping should be a GradientClipping"),
    ({"hparam_metrics": "accuracy"}, TypeError, "hparam_metrics should be a sequence of metric names"),
    ({"texts": {"a": 1}}, TypeError, "texts should map tags to strings"),
])
def test_bad_arguments(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        TensorBoardMetrics(str(tmp_path), **kwargs)


def test_extra_texts_are_written_preformatted_at_the_start(tmp_path):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    table = "   size  result\n     32  fits"
    tb = TensorBoardMetrics(str(tmp_path), texts={"run/batch_size_search": table})
    tb.attach(trainer)
    trainer.run(id_batches(16, 8), max_epochs=1)
    tb.close()
    acc = read(tmp_path)
    text = acc.Tensors("run/batch_size_search")[0].tensor_proto.string_val[0].decode()
    assert text == "       size  result\n         32  fits"
