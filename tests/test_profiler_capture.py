import glob
import json
import os

import pytest
import torch
from ignite.engine import Events
from torch.nn.functional import cross_entropy

from conftest import id_batches, mlp
from ignite_amp.handlers import ProfilerCapture
from ignite_amp import create_amp_trainer


def trainer_with_profiler(tmp_path, **kwargs):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    capture = ProfilerCapture(str(tmp_path), **kwargs)
    capture.attach(trainer)
    return trainer, capture


def read_trace(tmp_path):
    (trace,) = glob.glob(os.path.join(tmp_path, "*.pt.trace.json"))
    with open(trace) as f:
        return json.load(f)


def test_writes_a_json_trace_and_the_operator_table(tmp_path):
    trainer, capture = trainer_with_profiler(tmp_path, wait=1, warmup=1, active=2)
    trainer.run(id_batches(48, 8), max_epochs=1)
    events = read_trace(tmp_path)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::addmm") or n.startswith("aten::linear") for n in names)
    table = open(os.path.join(tmp_path, ProfilerCapture.TABLE)).read()
    assert "Self CPU" in table and "aten::" in table
    assert capture.traces == 1 and capture.profiler is None

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert "profiler/top_ops/text_summary" in acc.Tags()["tensors"]


def test_a_run_ending_inside_the_window_still_writes(tmp_path):
    trainer, capture = trainer_with_profiler(tmp_path, wait=1, warmup=1, active=10)
    trainer.run(id_batches(32, 8), max_epochs=1)  # 4 iterations: ends in the active window
    assert read_trace(tmp_path)["traceEvents"]
    assert capture.profiler is None


def test_stop_after_an_exception(tmp_path):
    trainer, capture = trainer_with_profiler(tmp_path, wait=0, warmup=1, active=10)

    @trainer.on(Events.ITERATION_COMPLETED)
    def boom(engine):
        if engine.state.iteration == 3:
            raise KeyError("boom")

    with pytest.raises(KeyError):  # the error still propagates
        trainer.run(id_batches(32, 8), max_epochs=1)
    capture.stop()
    assert read_trace(tmp_path)["traceEvents"]


@pytest.mark.parametrize("kwargs, message", [
    ({"active": 0}, "active should be an integer >= 1"),
    ({"wait": -1}, "wait should be an integer >= 0"),
    ({"warmup": 1.5}, "warmup should be an integer >= 0"),
])
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProfilerCapture(str(tmp_path), **kwargs)
