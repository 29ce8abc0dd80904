"""A handler used before its attach, or on an iteration that did not run the AMP step, says what to do in one line
(not an AttributeError, nor an assert that ``python -O`` drops)."""
import pytest
import torch
from torch.nn.functional import cross_entropy

from helpers import mlp
from ignite_amp import AmpEvents, create_amp_trainer
from ignite_amp.engine import AmpEngine
from ignite_amp.handlers import BestCheckpoint, GradientClipping, NonFiniteGuard, OOMBackoff, TensorBoardMetrics


def trainer_of(model):
    return create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                              dtype="float32")


def batches():
    torch.manual_seed(0)
    return [(torch.randn(4, 5), torch.randint(0, 3, (4,)))] * 2


@pytest.mark.parametrize("handler, event, fix", [
    (GradientClipping(max_norm=1.0), AmpEvents.GRADS_READY, r"call clip\.attach\(trainer\) first"),
    (OOMBackoff(), AmpEvents.OUT_OF_MEMORY, r"call backoff\.attach\(trainer\) first"),
])
def test_a_handler_added_without_attach_names_attach(handler, event, fix):
    trainer = trainer_of(mlp())
    trainer.add_event_handler(event, handler)
    with pytest.raises(RuntimeError, match=fix) as info:
        handler(trainer)  # as the event would call it
    assert "\n" not in str(info.value)


def test_the_handlers_after_attach_read_what_attach_made(tmp_path):
    """Before attach: no state to read (None, empty, nothing to close); after: the trainer's step."""
    model = mlp()
    trainer = trainer_of(model)
    tb, backoff = TensorBoardMetrics(str(tmp_path), log_every=1), OOMBackoff()
    ckpt = BestCheckpoint(str(tmp_path / "ckpt"), {"model": model})
    assert (tb.step, tb.window, tb.facts_written, tb.samples, tb.health()) == (None, None, {}, 0, [])
    assert (backoff.step, ckpt.best, ckpt.last, ckpt.best_path) == (None, None, None, None)
    tb.close()  # not attached: nothing to write or close
    with pytest.raises(RuntimeError, match=r"resume\(\) needs attach\(\) first"):
        ckpt.resume()
    tb.attach(trainer)
    backoff.attach(trainer)
    ckpt.attach(trainer, trainer_of(mlp()))
    assert tb.step is trainer.amp_step and backoff.step is trainer.amp_step and tb.window is not None
    assert ckpt.best is not None and ckpt.last is not None and ckpt.resume() is None  # nothing saved yet
    trainer.run(batches(), max_epochs=1)
    tb.close()
    assert tb.samples == 0 and tb.window.history[-1]["iterations"] == 1 and tb.health()


@pytest.mark.parametrize("handler, name", [(NonFiniteGuard, "NonFiniteGuard"),
                                           (lambda: TensorBoardMetrics("unused", log_every=1), "TensorBoardMetrics")])
def test_an_iteration_that_did_not_run_the_step_is_named(handler, name, tmp_path, monkeypatch):
    """An AmpEngine built by hand whose process function skips the step: no loss to read."""
    monkeypatch.chdir(tmp_path)
    engine = AmpEngine(lambda engine, batch: None)
    engine.amp_step = trainer_of(mlp()).amp_step
    h = handler()
    h.attach(engine)
    with pytest.raises(RuntimeError, match=f"^{name}: the trainer's iteration ended without a loss from its AMP step: "
                                           "its process function should run the step") as info:
        engine.run(batches(), max_epochs=1)
    assert "\n" not in str(info.value)
    if isinstance(h, TensorBoardMetrics):
        h.close()
