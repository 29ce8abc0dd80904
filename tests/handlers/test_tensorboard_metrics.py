import os
import re
import sys
import time

import pytest
import torch
from ignite.engine import Events
from ignite.metrics import Accuracy, Loss
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import api_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from torch.nn.functional import cross_entropy

import ignite_amp.handlers.tensorboard.metrics
from helpers import ROOT, assert_doctests_pass, id_batches, mlp
from helpers.tensorboard import read, values
from ignite_amp import AmpEvents, create_amp_evaluator, create_amp_trainer
from ignite_amp.handlers import GradientClipping, TensorBoardMetrics
from ignite_amp.handlers.tensorboard.facts import trial_name
from ignite_amp.handlers.tensorboard.metrics import FACTS_TAG, HEALTH_TAG, HPARAMS, LAYOUT, TAGS

MAX_NORM = 10.0


def runs(path):
    return {split: read(path, split) for split in ("", "train", "val")}


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
        record["loss"][engine.state.iteration] = engine.state.output.item()
        if engine.state.iteration == 5:
            engine.amp_step.micro_batches = 2

    clip = GradientClipping(max_norm=MAX_NORM)
    clip.attach(trainer)
    tb = TensorBoardMetrics(str(tmp_path), log_every=2, facts={"batch_size": 8, "model": "mlp"}, clipping=clip)
    tb.attach(trainer, evaluator=evaluator, optimizer=optimizer)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(id_batches(16, 8)))
    trainer.run(batches, max_epochs=2)
    tb.close()
    return runs(tmp_path), record, tb


def test_docstring_example_runs():
    assert_doctests_pass(ignite_amp.handlers.tensorboard.metrics)


@pytest.mark.slow
def test_logs_every_tag_of_a_cpu_run_one_run_per_split_and_no_hparam_scalars(logged):
    split, _, _ = logged
    tags = set(split["train"].Tags()["scalars"])
    expected = {"loss", "optimizer/lr/group_0",
                "optimizer/grad_norm", "optimizer/clip_share", "precision/loss_scale", "precision/skipped_steps",
                "throughput/samples_per_sec", "throughput/data_wait_share", "throughput/step_time_ms",
                "throughput/tflops", "memory/rss_mb", "memory/rss_growth_mb", "step/micro_batches",
                "throughput/median_samples_per_sec"}
    # Nothing constant or empty: the batch size (8, as the facts say), no OOM, the clip bound (a fact).
    assert expected == tags
    # The same tag names in the train and val runs: one chart overlays train and val, one colour each.
    assert set(split["val"].Tags()["scalars"]) == {"accuracy", "loss", "accuracy/best", "loss/best"}
    # the run itself: text, HParams (with its metric columns' values), layout
    assert sorted(split[""].Tags()["scalars"]) == ["run/median_samples_per_sec", "run/val_accuracy",
                                                   "run/val_accuracy_best", "run/val_loss", "run/val_loss_best"]
    assert not [t for t in tags if t.startswith("hparam")]
    assert sorted(values(split["train"], "loss")) == list(range(2, 17, 2))


@pytest.mark.slow
def test_time_series_opens_on_the_metrics(logged):
    """TensorBoard's Time Series sorts the groups (a tag's part before the first '/') by name."""
    split, _, _ = logged
    groups = sorted({t.split("/")[0] for run in ("train", "val") for t in split[run].Tags()["scalars"]})
    # Time Series opens the first two groups only: the metrics, each with its best so far (accuracy/best).
    assert groups[:2] == ["accuracy", "loss"] and groups[-1] == "throughput"


def test_constant_batch_values_are_logged_only_when_they_change(logged):
    acc = logged[0]["train"]
    assert values(acc, "step/micro_batches") == {6: 2}  # raised at iteration 5, from 1 in the facts


def test_batch_size_without_facts_is_logged_at_the_first_log_then_on_change(tmp_path):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    TensorBoardMetrics(str(tmp_path), log_every=2).attach(trainer)
    trainer.run(id_batches(32, 8) + id_batches(16, 4), max_epochs=1)  # 4 batches of 8, then 4 of 4
    assert values(read(tmp_path, "train"), "step/batch_size") == {2: 8, 6: 4}


@pytest.mark.slow
def test_loss_scale_and_skipped_steps_match_the_scaler(logged):
    acc, record = logged[0]["train"], logged[1]
    for step, value in values(acc, "precision/loss_scale").items():
        assert value == record["scale"][step]
    skipped = values(acc, "precision/skipped_steps")
    # The inf batch is iteration 3 of each epoch (3 and 11): each skip halves the scale.
    assert (skipped[2], skipped[4], skipped[10], skipped[12], skipped[16]) == (0, 1, 1, 2, 2)
    assert record["scale"][2] == 256.0 and record["scale"][3] == 128.0


@pytest.mark.slow
def test_window_means(logged):
    split, record, tb = logged
    acc = split["train"]
    for step, value in values(acc, "loss").items():
        window = [record["loss"][step - 1], record["loss"][step]]
        assert value == pytest.approx(sum(window) / 2, rel=1e-5, nan_ok=True)
    assert all(v == pytest.approx(0.05) for v in values(acc, "optimizer/lr/group_0").values())  # stored as float32
    speed = values(acc, "throughput/samples_per_sec")
    assert all(v > 0 for v in speed.values())
    assert all(0 <= v <= 1 for v in values(acc, "throughput/data_wait_share").values())
    assert all(v > 0 for v in values(acc, "throughput/step_time_ms").values())
    assert all(v > 0 for v in values(acc, "optimizer/grad_norm").values())
    # The mlp's FLOPs per sample: 2 x in x out per matmul; each linear layer has its forward, its weight
    # gradient and (all but the first: the input needs none) its input gradient.
    flops = tb.step.flops_per_sample
    layers = [m for m in tb.step.model.modules() if isinstance(m, torch.nn.Linear)]
    expected = sum((2 if i == 0 else 3) * 2 * m.in_features * m.out_features for i, m in enumerate(layers))
    assert flops == pytest.approx(expected, rel=0.01)
    for step, tflops in values(acc, "throughput/tflops").items():
        assert tflops == pytest.approx(flops * speed[step] / 1e12, rel=1e-3)
    assert "throughput/mfu" not in acc.Tags()["scalars"]  # no known peak on a CPU


@pytest.mark.slow
def test_clip_fraction_is_the_share_of_steps_above_max_norm(logged):
    split, record, _ = logged
    acc = split["train"]
    fractions = values(acc, "optimizer/clip_share")
    norms = record["norm"]  # iterations that stepped (the skipped ones fire no GRADS_READY)
    expected = {}
    for step in range(2, 17, 2):
        window = [norms[i] for i in (step - 1, step) if i in norms]
        if window:
            expected[step] = sum(n > MAX_NORM for n in window) / len(window)
    assert fractions == pytest.approx(expected)
    assert 0 < sum(expected.values()) < len(expected)  # the run has windows that bound and windows that did not


@pytest.mark.slow
def test_validation_best_values(logged):
    split, _, tb = logged
    val = split["val"]
    assert sorted(values(val, "accuracy")) == [8, 16]  # x axis: the trainer's iteration
    accuracy, best = values(val, "accuracy"), values(val, "accuracy/best")
    assert best[16] == pytest.approx(max(accuracy.values())) and best[8] == pytest.approx(accuracy[8])
    assert values(val, "loss/best")[16] == pytest.approx(min(values(val, "loss").values()))
    assert tb.final["accuracy"] == pytest.approx(accuracy[16]) and tb.best["loss"] == values(val, "loss/best")[16]


def fact_text(acc, last=False):
    """The facts written at the start (the first event), or with the FLOP count at the first log (the last)."""
    events = acc.Tensors(FACTS_TAG)
    return events[-1 if last else 0].tensor_proto.string_val[0].decode()


@pytest.mark.slow
def test_run_facts_text_says_what_ran(logged):
    acc, tb = logged[0][""], logged[2]
    text = fact_text(acc)
    assert text.startswith("**float16 autocast, GradScaler from scale 256, on cpu")
    assert "| grad_scaler | true |" in text and "| batch_size | 8 |" in text and "| model | mlp |" in text
    assert tb.facts_written["torch"] == torch.__version__ and tb.facts_written["micro_batches"] == 1
    assert "gflops_per_sample" not in text and "| gflops_per_sample | 6.08e-07 |" in fact_text(acc, last=True)


@pytest.mark.slow
def test_hparams_are_the_facts_with_metrics_read_from_scalar_tags(logged):
    acc = logged[0][""]
    content = acc.PluginTagToContent("hparams")
    experiment = hparams_metadata.parse_experiment_plugin_data(content[hparams_metadata.EXPERIMENT_TAG])
    shown = [info.display_name for info in experiment.hparam_infos]
    # The first columns answer what ran: dtype, device type, scaler, batch size (lr: not a fact of this run).
    assert shown[:4] == ["dtype", "device_type", "grad_scaler", "batch_size"] and shown == [
        n for n in HPARAMS if n in shown]
    names = [info.name for info in experiment.hparam_infos]
    assert names == sorted(names)  # TensorBoard orders the columns by name
    domains = {i.display_name: [v.string_value for v in i.domain_discrete.values] for i in experiment.hparam_infos
               if i.type == api_pb2.DATA_TYPE_STRING and i.domain_discrete.values}
    assert domains == {"dtype": ["float32", "float16", "bfloat16"], "device_type": ["cpu", "cuda", "mps", "xpu"],
                       "strategy": ["none", "ddp", "fsdp"]}
    assert "model" not in shown  # an open set of strings: in the text facts, not a column without a domain
    # whole numbers as strings (TensorBoard's table writes a number 64 as "64.000"), without a domain
    whole = {i.display_name for i in experiment.hparam_infos if i.type == api_pb2.DATA_TYPE_STRING
             and not i.domain_discrete.values}
    assert {"batch_size", "micro_batches", "accumulation_steps", "world_size"} <= whole
    # The metric columns read tags of the session's own run (group ""): found under --logdir <the run>, whose
    # session is ".", as under its parent (a group "val" is read at "./val", which is no run).
    metrics = [(m.name.group, m.name.tag) for m in experiment.metric_infos]
    assert metrics == [("", "run/val_accuracy"), ("", "run/val_accuracy_best"), ("", "run/val_loss"),
                       ("", "run/val_loss_best"), ("", "run/median_samples_per_sec")]
    run, val, train = logged[0][""], logged[0]["val"], logged[0]["train"]
    # each is its source, written at the same steps (every validation, every log)
    assert values(run, "run/val_accuracy") == values(val, "accuracy") and len(values(val, "accuracy")) == 2
    assert values(run, "run/val_loss_best") == values(val, "loss/best")
    assert values(run, "run/median_samples_per_sec") == values(train, "throughput/median_samples_per_sec")
    start = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
    by_name = {i.display_name: start.hparams[i.name] for i in experiment.hparam_infos}
    assert by_name["grad_scaler"].WhichOneof("kind") == "bool_value" and by_name["grad_scaler"].bool_value
    assert by_name["dtype"].string_value == "float16" and by_name["batch_size"].string_value == "8"
    # the row is named after the run's folder and its start, not "." (the session's run under --logdir <run>)
    name, day, clock, digest = start.group_name.split(" ")
    assert name == os.path.basename(logged[2].logdir) and re.fullmatch(r"\d{4}-\d\d-\d\d", day)
    assert digest == trial_name(logged[2].logdir, start.start_time_secs).split(" ")[-1]
    assert abs(time.mktime(time.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S")) - start.start_time_secs) < 1
    end = hparams_metadata.parse_session_end_info_plugin_data(content[hparams_metadata.SESSION_END_INFO_TAG])
    assert end.status == 1  # STATUS_SUCCESS


def test_runs_of_a_sweep_that_share_a_folder_name_and_a_start_have_rows_of_their_own(tmp_path):
    """TensorBoard makes one HParams row of the sessions that share a trial name: two runs started in the same
    second in sweep/lr0.01/seed0 and sweep/lr0.1/seed0 were one row (one's settings, their metrics' mean)."""
    when = 1_800_000_000.0
    a, b = trial_name(str(tmp_path / "lr0.01" / "seed0"), when), trial_name(str(tmp_path / "lr0.1" / "seed0"), when)
    assert a != b and a.split(" ")[0] == b.split(" ")[0] == "seed0" and a.split(" ")[1:3] == b.split(" ")[1:3]
    assert re.fullmatch(r"seed0 \d{4}-\d\d-\d\d \d\d:\d\d:\d\d #[0-9a-f]{4}", a)
    # the same folder: the same name (a resumed run keeps its row), however it is written
    assert trial_name(str(tmp_path / "lr0.01" / "seed0") + "/", when) == a
    assert trial_name(str(tmp_path / "lr0.01" / "x" / ".." / "seed0"), when) == a
    assert trial_name(str(tmp_path / "lr0.01" / "seed0"), when + 1) != a  # a later run moved into its place


def test_a_bfloat16_script_run_without_facts_says_no_grad_scaler(tmp_path):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="bfloat16")
    TensorBoardMetrics(str(tmp_path), log_every=2).attach(trainer)
    trainer.run(id_batches(32, 8), max_epochs=1)
    acc = read(tmp_path)
    assert fact_text(acc).startswith("**bfloat16 autocast, no GradScaler, on cpu")
    assert sorted(os.listdir(tmp_path))[-1] == "train"  # no evaluator: no val runs
    start = hparams_metadata.parse_session_start_info_plugin_data(
        acc.PluginTagToContent("hparams")[hparams_metadata.SESSION_START_INFO_TAG])
    assert start.hparams["02 grad_scaler"].bool_value is False
    assert not [t for t in read(tmp_path, "train").Tags()["scalars"] if t.startswith("precision/")]


def run_layout(acc):
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    return layout


@pytest.mark.slow
def test_dashboard_charts_have_one_scale_one_quantity_per_run_and_no_empty_card(logged):
    split, _, _ = logged
    layout = run_layout(split[""])
    assert [c.title for c in layout.category] == ["AMP health", "AMP details"]
    charts = {c.title: list(c.multiline.tag) for c in layout.category[0].chart}
    (rss,) = [c for c in layout.category[1].chart if c.HasField("margin")]  # a CPU run: the RSS over its growth
    (series,) = rss.margin.series
    assert (series.value, series.lower, series.upper) == ("memory/rss_mb", "memory/rss_growth_mb", "memory/rss_mb")
    growth = values(split["train"], "memory/rss_growth_mb")
    assert growth[2] == 0.0 and set(growth) == set(values(split["train"], "memory/rss_mb"))  # the margin's steps
    assert list(charts) == ["loss: train (window mean), val", "accuracy: train (when measured), val",
                            "best val accuracy so far", "best val loss so far", "loss scale (float16)",
                            "skipped optimizer steps (float16, since the start)",
                            "share of optimizer steps clipped (1.0: every step)", "samples/s of each window",
                            "samples/s: the median of the windows so far"]
    assert charts["loss: train (window mean), val"] == ["^loss$"]
    for category in layout.category:
        for chart in category.chart:
            if chart.HasField("margin"):
                continue
            (pattern,) = chart.multiline.tag
            matched = {(run, t) for run in ("train", "val") for t in split[run].Tags()["scalars"]
                       if re.search(pattern, t)}
            assert matched, chart.title  # no "Matches (0)" card
            # TensorBoard colours a line by its run: one tag per run, so no two quantities share a colour.
            runs_drawn = [run for run, _ in matched]
            assert len(runs_drawn) == len(set(runs_drawn)), (chart.title, matched)
            assert len({t for _, t in matched}) == 1, (chart.title, matched)  # one quantity, one scale


def test_every_layout_pattern_names_documented_tags():
    tags = [t.split("/", 1)[1] if t.startswith("val/") else t for t in TAGS]  # the val run's tags
    documented = [re.escape(t).replace(re.escape("<metric>"), r"\w+").replace(re.escape("<N>"), r"\d+") for t in tags]
    examples = [t.replace("<metric>", "accuracy").replace("<N>", "0") for t in tags]
    for category in LAYOUT.values():
        for title, (kind, patterns) in category.items():
            for pattern in patterns if kind == "Multiline" else [f"^{re.escape(tag)}$" for tag in patterns]:
                found = [t for t in examples if re.search(pattern, t)]
                assert found, (title, pattern)
                assert all(any(re.fullmatch(d, t) for d in documented) for t in found), pattern


def test_health_summary_is_written_and_returned(logged):
    acc, tb = logged[0][""], logged[2]
    (event,) = acc.Tensors(HEALTH_TAG)
    text = event.tensor_proto.string_val[0].decode()
    lines = tb.health()
    assert text == "\n".join(f"- {line}" for line in lines)
    assert lines[0].startswith("verdict: ")
    assert lines[1].startswith("precision: float16 with GradScaler, 2 of ") and "final loss scale" in lines[1]
    assert any(line.startswith("clipping: ") and "max_norm 10" in line for line in lines)
    assert any(line.startswith("speed: ") and "(medians of " in line for line in lines)
    assert any(line.startswith("compute: ") for line in lines)


def test_a_failed_run_still_writes_its_health(tmp_path):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    tb = TensorBoardMetrics(str(tmp_path), log_every=2)
    tb.attach(trainer)

    @trainer.on(Events.ITERATION_COMPLETED(once=3))
    def fail(engine):
        raise RuntimeError("the user's handler failed")

    with pytest.raises(RuntimeError, match="the user's handler failed"):
        trainer.run(id_batches(32, 8), max_epochs=1)
    tb.close()
    (event,) = read(tmp_path).Tensors(HEALTH_TAG)
    assert "3 optimizer steps" in event.tensor_proto.string_val[0].decode()


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
                if re.search(r"handlers/tensorboard/\w+\.py$|ignite/handlers/", frame.f_code.co_filename):
                    reads.append(_name)
                    break
                frame = frame.f_back
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: logs.append((e.state.iteration, len(reads))))
    trainer.run(id_batches(32, 8), max_epochs=1)
    # Every TensorBoard handler together: one read per log (loss, grad norm, clip count, scale), none between.
    assert logs == [(1, 0), (2, 1), (3, 1), (4, 2)] and reads[:2] == ["tolist", "tolist"]
    assert len(reads) <= 3  # and the end-of-run summary's final loss scale
    acc = read(tmp_path, "train")
    assert sorted(values(acc, "precision/loss_scale")) == [2, 4] and values(acc, "optimizer/clip_share")


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
    acc = read(tmp_path, "train")
    logged = values(acc, "optimizer/grad_norm")
    assert [logged[1], logged[2]] == pytest.approx(norms, rel=1e-5) and min(norms) > 1e-3
    assert values(acc, "optimizer/clip_share") == {1: 1.0, 2: 1.0}


def test_tensorboard_guide_lists_every_tag():
    guide = open(os.path.join(ROOT, "docs", "guides", "tensorboard.md"), encoding="utf-8").read()
    for tag in TAGS:
        assert f"`{tag}`" in guide, tag


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


def test_a_run_shorter_than_log_every_still_fills_the_dashboard(tmp_path):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    tb = TensorBoardMetrics(str(tmp_path), log_every=50)
    tb.attach(trainer)
    trainer.run(id_batches(24, 8), max_epochs=1)  # 3 iterations
    tb.close()
    acc = read(tmp_path, "train")
    assert values(acc, "loss").keys() == {3} and "throughput/samples_per_sec" in acc.Tags()["scalars"]
    assert run_layout(read(tmp_path)).category[0].title == "AMP health"


def test_trainer_metrics_are_logged_in_the_train_run_beside_val(tmp_path):
    """A metric attached to the trainer (after TensorBoardMetrics, as users do) reaches TensorBoard at each
    epoch's end, in the train run under its own name: one chart overlays train and val accuracy."""
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), cross_entropy, device="cpu",
                                 output_transform=lambda x, y, y_pred, loss: {"y_pred": y_pred, "y": y, "loss": loss})
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(cross_entropy)}, device="cpu")
    tb = TensorBoardMetrics(str(tmp_path), log_every=2)
    tb.attach(trainer, evaluator=evaluator)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(id_batches(16, 8)))
    Accuracy(output_transform=lambda out: (out["y_pred"], out["y"])).attach(trainer, "accuracy")
    Loss(cross_entropy, output_transform=lambda out: (out["y_pred"], out["y"])).attach(trainer, "loss")
    epochs = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: epochs.append(dict(e.state.metrics)))
    trainer.run(id_batches(32, 8), max_epochs=2)
    tb.close()
    train = read(tmp_path, "train")
    assert values(train, "accuracy") == pytest.approx({4: epochs[0]["accuracy"], 8: epochs[1]["accuracy"]})
    # "loss" is the train run's window mean: the trainer's epoch loss goes beside it, not into its line.
    assert values(train, "loss_epoch") == pytest.approx({4: epochs[0]["loss"], 8: epochs[1]["loss"]})
    assert sorted(values(train, "loss")) == [2, 4, 6, 8]
    assert sorted(values(read(tmp_path, "val"), "accuracy")) == [4, 8]


@pytest.mark.slow
def test_trainer_metrics_of_a_config_run_are_logged(quick_cfg):
    from ignite_amp.run.compose import build_run

    run = build_run(dict(quick_cfg, train={"epochs": 1}), print_fn=lambda *a: None)
    seen = []
    # The config trainer's output is the loss: a metric of it, as Ignite's RunningAverage docs attach one.
    from ignite.metrics import RunningAverage

    RunningAverage(output_transform=lambda out: out["loss"] if isinstance(out, dict) else out).attach(
        run.trainer, "smooth_loss")
    run.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen.append(e.state.metrics["smooth_loss"]))
    run.train()
    train = read(quick_cfg["output_dir"], "train")
    assert list(values(train, "smooth_loss").values()) == pytest.approx(seen)


def test_a_batch_of_padding_only_is_left_out_of_the_window_loss(tmp_path):
    """Issue 32, case 15: its loss is 0/0 (no items); the logged window mean is the other batches'."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    loss_fn = lambda y_pred, y: cross_entropy(y_pred, y, ignore_index=-100)  # noqa: E731
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn, device="cpu",
                                 dtype="float32", num_items=lambda x, y: (y != -100).sum())
    TensorBoardMetrics(str(tmp_path), log_every=3).attach(trainer)
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.amp_step.loss.item()))
    real = [(torch.randn(4, 5), torch.tensor([0, 1, 2, 0])) for _ in range(2)]
    trainer.run([real[0], (torch.randn(4, 5), torch.full((4,), -100)), real[1]], max_epochs=1)
    assert seen[1] != seen[1]  # the padding batch itself has no loss (NaN)
    (logged,) = values(read(tmp_path, "train"), "loss").values()
    assert logged == pytest.approx((seen[0] + seen[2]) / 2, rel=1e-5)
