"""ignite_amp.engine: the engines, amp_step_of, and which AmpEvents are dispatched."""
import ignite_amp.engine
import pytest
import torch
from torch.nn.functional import cross_entropy

from ignite.engine import Events
from conftest import assert_doctests_pass, id_batches, mlp
from ignite_amp import AmpEvents, create_amp_trainer


def test_handlers_need_an_amp_trainer():
    from ignite.engine import Engine
    from ignite_amp.handlers import GradientClipping

    with pytest.raises(TypeError, match="create_amp_trainer"):
        GradientClipping(max_norm=1.0).attach(Engine(lambda e, b: None))


def test_amp_events_nobody_listens_to_are_not_dispatched_and_late_handlers_still_fire(monkeypatch):
    from ignite.engine import Engine

    calls = []
    real = Engine._fire_event

    def counting(self, event, *args, **kwargs):
        calls.append(getattr(event, "name", event))
        return real(self, event, *args, **kwargs)

    monkeypatch.setattr(Engine, "_fire_event", counting)
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    trainer.run(id_batches(16, 8), max_epochs=1)
    assert "GRADS_READY" not in calls and "OPTIMIZER_STEPPED" not in calls and "ITERATION_COMPLETED" in calls

    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=3), lambda e: e.add_event_handler(
        AmpEvents.GRADS_READY(every=2), lambda e2: seen.append(e2.state.iteration)))
    trainer.run(id_batches(64, 8), max_epochs=1)
    assert seen == [4, 6, 8]  # added during the run, with a filter: fires from the next step on


def test_docstring_examples_run():
    assert_doctests_pass(ignite_amp.engine)
