"""ignite_amp.engine: the engines, amp_step_of, and which AmpEvents are dispatched."""
import inspect

import ignite
import pytest
import torch
from ignite.engine import Events
from torch.nn.functional import cross_entropy

import ignite_amp.engine
from helpers import assert_doctests_pass, id_batches, mlp
from ignite_amp import AmpEvents, create_amp_trainer


def test_handlers_need_an_amp_trainer():
    from ignite.engine import Engine

    from ignite_amp.handlers import GradientClipping

    with pytest.raises(TypeError, match="create_amp_trainer"):
        GradientClipping(max_norm=1.0).attach(Engine(lambda e, b: None))


@pytest.mark.parametrize("make", ["GradientClipping(max_norm=1.0)", "NonFiniteGuard()", "TensorBoardMetrics(logdir)"])
def test_handlers_that_need_gradients_refuse_an_evaluator_naming_themselves(make, tmp_path):
    # Found by the type checker: attached to an evaluator they failed with "'EvalStep' object has no attribute
    # 'track_grad_norm'" (or 'scaler'), not with what to do.
    from ignite_amp import create_amp_evaluator
    from ignite_amp.handlers import GradientClipping, NonFiniteGuard, TensorBoardMetrics  # noqa: F401 (eval below)

    handler = eval(make, {**locals(), "logdir": str(tmp_path)})
    evaluator = create_amp_evaluator(torch.nn.Linear(3, 2), device="cpu")
    with pytest.raises(TypeError, match=f"^{type(handler).__name__} attaches to a trainer .*got an evaluator"):
        handler.attach(evaluator)
    assert not list(tmp_path.iterdir())  # nothing written for a refused attach


def test_amp_events_nobody_listens_to_are_not_dispatched_and_late_handlers_still_fire(monkeypatch):
    from ignite_amp.engine import AmpEngine as Engine  # its own _fire_event (Ignite's without the debug line)

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


def test_events_reach_handlers_as_ignites_fire_event_passes_them(caplog):
    """AmpEngine's _fire_event (Ignite's loop less its debug line): the engine first where the handler takes it,
    the event's arguments, then the handler's own; keyword arguments; none for a handler without the engine."""
    import logging

    from ignite.engine import Engine

    def record(engines):
        model = mlp()
        engine = engines(model)
        got = []
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e, a, k=0: got.append((e.state.iteration, a, k)),
                                 "a", k=2)
        engine.add_event_handler(Events.ITERATION_COMPLETED(every=2), lambda: got.append("filtered, no engine"))
        engine.add_event_handler(Events.TERMINATE_SINGLE_EPOCH,
                                 lambda e, iter_counter: got.append(("single", iter_counter)))
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=3), lambda e: e.terminate_epoch())
        engine.run(id_batches(32, 8), max_epochs=1)
        return got, engine.last_event_name

    def ours(model):
        return create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")

    def ignites(model):
        return Engine(lambda e, b: None)

    expected = record(ignites)
    assert record(ours) == expected and ("single", 3) in expected[0]
    with caplog.at_level(logging.DEBUG):  # with debug logging on, Ignite's own (its "Firing handlers" lines)
        assert record(ours) == expected
    assert any("Firing handlers for event" in r.getMessage() for r in caplog.records)


# Ignite's Engine._fire_event bodies (docstring and debug line left out, ast-normalised) that AmpEngine's copy was
# read against: 0.5.0.post2 to 0.5.2 (the engine itself first in a handler's arguments), 0.5.3 to 0.5.5 (a weak
# reference to it).
KNOWN_FIRE_EVENT = {"8a28bf35bfe1", "ee28f626dcda"}


def test_ignites_fire_event_is_the_one_amp_engine_copies():
    """The canary of the copy: .ci/versions runs it on every tested Ignite. A new body fails here, by name, until
    AmpEngine._fire_event is read against it (and the test above passes) and its hash is added."""
    import ast
    import hashlib
    import textwrap

    from ignite.engine import Engine

    (function,) = ast.parse(textwrap.dedent(inspect.getsource(Engine._fire_event))).body
    body = [node for node in function.body[1:] if "self.logger.debug" not in ast.unparse(node)]
    digest = hashlib.sha1("\n".join(ast.unparse(node) for node in body).encode()).hexdigest()[:12]
    assert digest in KNOWN_FIRE_EVENT, f"Ignite {ignite.__version__} changed Engine._fire_event ({digest})"


def test_positional_event_arguments_reach_handlers_as_ignites_fire_event_passes_them():
    """Ignite's own events pass keywords only; a positional argument of _fire_event goes after the engine and before
    the handler's own arguments, on each Ignite (the engine first as itself before 0.5.3, as a weak reference on)."""
    from ignite.engine import Engine

    from ignite_amp.engine import AmpEngine

    def record(engine_class):
        engine, got = engine_class(lambda e, b: None), []
        engine.add_event_handler(Events.STARTED, lambda e, *xs, k=0: got.append((e is engine, xs, k)), "own", k=1)
        engine._fire_event(Events.STARTED, "fired", k=2)
        return got

    assert record(AmpEngine) == record(Engine) == [(True, ("fired", "own"), 2)]


def test_docstring_examples_run():
    assert_doctests_pass(ignite_amp.engine)
