"""Ignite's documented factory behaviours, run case by case on Ignite's own factories and on ours.

Each parity case builds the same model twice and runs ``ignite.engine.create_supervised_trainer`` (or
``_evaluator``) and ``create_amp_trainer`` (or ``_evaluator``) with the same arguments. Ours is given
``dtype="float32"`` where numbers are compared: that ``dtype="auto"`` picks bfloat16 where supported
is one of the documented differences ("Coming from Ignite" guide), each of which has a case here too.
The data and the zeroed ``Linear(1, 1)`` are those of Ignite's own tests of these factories.
"""
import difflib
import importlib.util
import inspect
import os

import pytest
import torch
from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
from ignite.engine.deterministic import DeterministicEngine
from ignite.handlers import Checkpoint, DiskSaver, EarlyStopping, ModelCheckpoint
from ignite.metrics import MeanSquaredError
from torch.nn import Linear
from torch.nn.functional import mse_loss
from torch.optim import SGD

from helpers import ROOT
from ignite_amp import AmpEvents, create_amp_evaluator, create_amp_trainer

X = torch.tensor([[0.1], [0.3], [0.7], [0.9], [1.3], [0.5]])
Y = torch.tensor([[0.3], [0.5], [0.9], [1.3], [0.3], [0.8]])
SAMPLES = list(zip(X, Y, strict=True))  # Ignite's tests: one sample per batch, without a batch dimension
BATCHES = [(X[:3], Y[:3]), (X[3:], Y[3:])]


def linear(trace: bool = False) -> torch.nn.Module:
    model = Linear(1, 1)
    model.weight.data.zero_()
    model.bias.data.zero_()
    return torch.jit.trace(model, torch.randn(1)) if trace else model


def train_both(data=SAMPLES, trace=False, epochs=1, ours=None, model=linear, device="cpu", **kwargs):
    """``(state, model)`` of Ignite's trainer, then of ours, each on a fresh copy of the same model."""
    results = []
    for factory, extra in ((create_supervised_trainer, {}), (create_amp_trainer, {"dtype": "float32", **(ours or {})})):
        net = model(trace)
        trainer = factory(net, SGD(net.parameters(), 0.1), mse_loss, device=device, **kwargs, **extra)
        results.append((trainer.run(data, max_epochs=epochs), net))
    return results


def amp_trainer(*args, **kwargs):
    """Our trainer of a fresh zeroed Linear(1, 1) with SGD and mse_loss; the rest as given."""
    model = linear()
    return create_amp_trainer(model, SGD(model.parameters(), 0.1), mse_loss, *args, **kwargs)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def loss_and_pred(x, y, y_pred, loss):
    return y_pred, loss.item()  # Ignite's tests' output_transform


# -- the trainer: Ignite's behaviours that hold unchanged ---------------------------------------------------

@pytest.mark.parametrize("trace", [False, True], ids=["module", "traced"])
@pytest.mark.parametrize("steps", [1, 3])
def test_training_and_accumulation_match_ignite(steps, trace):
    """Ignite's accumulation cases (an epoch of 6 batches: whole cycles), on a module and a traced model."""
    (theirs, their_model), (ours, our_model) = train_both(
        trace=trace, gradient_accumulation_steps=steps, output_transform=loss_and_pred)
    assert same_weights(their_model, our_model) and their_model.weight.abs().sum() > 0
    assert ours.output[1] == pytest.approx(theirs.output[1], abs=1e-6)
    assert torch.allclose(ours.output[0], theirs.output[0].detach())
    for name in ("iteration", "epoch", "max_epochs", "epoch_length"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_accumulation_steps_is_the_alias_and_both_must_agree():
    (_, their_model), (_, our_model) = train_both(gradient_accumulation_steps=1, ours={"accumulation_steps": 3})
    (_, three), _ = train_both(gradient_accumulation_steps=3)
    assert same_weights(three, our_model) and not same_weights(their_model, our_model)
    with pytest.raises(ValueError, match=r"^Argument gradient_accumulation_steps \(3\) is Ignite's name of "
                                         r"accumulation_steps \(2\): pass one of them$"):
        amp_trainer(accumulation_steps=2, gradient_accumulation_steps=3)
    for factory in (create_supervised_trainer, create_amp_trainer):
        model = linear()
        with pytest.raises(ValueError, match="(?i)gradient_accumulation_steps"):  # zero steps: refused by both
            factory(model, SGD(model.parameters(), 0.1), mse_loss, gradient_accumulation_steps=0)


def test_hooks_match_ignite_with_ignites_names_and_order():
    """model_fn, model_transform, output_transform, prepare_batch, passed by name; then by position."""
    class Dict(torch.nn.Module):
        def __init__(self, trace=False):
            super().__init__()
            self.inner = linear()

        def forward(self, a, b):
            return {"out": self.inner(a + b)}

    calls = []

    def prepare(batch, device, non_blocking):
        calls.append(non_blocking)
        return (batch["a"].to(device), batch["b"].to(device)), batch["y"].to(device)

    hooks = dict(non_blocking=False, prepare_batch=prepare, model_fn=lambda model, x: model(*x),
                 model_transform=lambda out: out["out"],
                 output_transform=lambda x, y, y_pred, loss: {"pred": y_pred, "loss": loss.item(), "a": x[0]})
    data = [{"a": x, "b": x / 2, "y": y} for x, y in BATCHES]
    (theirs, their_model), (ours, our_model) = train_both(data, model=Dict, **hooks)
    assert same_weights(their_model, our_model) and calls == [False] * 4
    assert ours.output["loss"] == pytest.approx(theirs.output["loss"], abs=1e-6)
    assert torch.equal(ours.output["a"], theirs.output["a"])
    # Ignite's positional order after device: non_blocking, prepare_batch, model_transform, output_transform.
    model = Dict()
    trainer = create_amp_trainer(model, SGD(model.parameters(), 0.1), mse_loss, "cpu", False, prepare,
                                 hooks["model_transform"], hooks["output_transform"], model_fn=hooks["model_fn"],
                                 dtype="float32")
    trainer.run(data)
    assert same_weights(their_model, model)


def test_a_batch_that_is_a_two_row_tensor_unpacks_as_in_ignite():
    """Ignite's ``x, y = batch`` (its FastaiLRFinder tests feed such batches)."""
    rows = [torch.stack([x, y]) for x, y in BATCHES]  # each batch: a (2, n, 1) tensor, row 0 is x
    (theirs, their_model), (ours, our_model) = train_both(rows)
    assert same_weights(their_model, our_model) and ours.output == pytest.approx(theirs.output, abs=1e-6)
    with pytest.raises(ValueError, match=r"got a tensor of shape \(3, 4\)"):
        amp_trainer("cpu").run([torch.ones(3, 4)])


def test_device_none_is_where_the_model_is():
    """Ignite's default: the batches stay where the loader put them, with the model."""
    (_, their_model), (_, our_model) = train_both(BATCHES, device=None)
    assert same_weights(their_model, our_model)
    assert amp_trainer(None).amp_step.device == torch.device("cpu")


def test_deterministic_is_ignites_deterministic_engine_with_amp_events():
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = linear()
        trainer = create_amp_trainer(model, SGD(model.parameters(), 0.1), mse_loss, "cpu", deterministic=True)
        stepped = []
        trainer.add_event_handler(AmpEvents.OPTIMIZER_STEPPED,
                                  lambda e, stepped=stepped: stepped.append(e.state.iteration))
        loader = torch.utils.data.DataLoader(list(zip(X, Y, strict=True)), batch_size=2, shuffle=True)
        trainer.run(loader, max_epochs=2)
        runs.append(model.weight.item())
        assert isinstance(trainer, DeterministicEngine) and stepped == list(range(1, 7))
    assert runs[0] == runs[1]


# -- the scaler and trainer.state.scaler ---------------------------------------------------------------------

def test_a_grad_scaler_instance_is_used_as_given():
    """The bug: an instance was taken as an on/off flag (a new default scaler, is_enabled() the object)."""
    scales = []
    for factory in (create_supervised_trainer, create_amp_trainer):
        model = linear()
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
        trainer = factory(model, SGD(model.parameters(), 0.1), mse_loss, device="cpu", amp_mode="amp", scaler=scaler)
        trainer.run(BATCHES)
        scales.append(scaler.get_scale())
    assert scales == [16.0, 16.0]  # two steps, growth_interval=1: the user's settings held in both
    assert trainer.amp_step.scaler is scaler and trainer.state.scaler is scaler
    off = torch.amp.GradScaler("cpu", enabled=False)
    trainer = amp_trainer("cpu", amp_mode="amp", scaler=off)
    assert trainer.amp_step.dtype == torch.float16 and trainer.amp_step.scaler.is_enabled() is False
    with pytest.raises(TypeError, match=r"^Argument scaler should be True, False, None or a torch.amp.GradScaler"):
        amp_trainer("cpu", scaler="on")


def test_state_scaler_is_the_steps_and_a_checkpoint_restores_it(tmp_path):
    model = linear()
    trainer = create_amp_trainer(model, SGD(model.parameters(), 0.1), mse_loss, "cpu", amp_mode="amp", scaler=True,
                                 scaler_kwargs={"init_scale": 8.0, "growth_interval": 1})
    assert trainer.state.scaler is trainer.amp_step.scaler and trainer.state.scaler.is_enabled()
    to_save = {"model": model, "scaler": trainer.state.scaler, "trainer": trainer}
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, DiskSaver(tmp_path), n_saved=1))
    trainer.run(BATCHES, max_epochs=2)
    assert trainer.state.scaler.get_scale() == 8.0 * 2 ** 4
    fresh = linear()
    resumed = create_amp_trainer(fresh, SGD(fresh.parameters(), 0.1), mse_loss, "cpu", amp_mode="amp")
    Checkpoint.load_objects({"model": fresh, "scaler": resumed.state.scaler, "trainer": resumed},
                            torch.load(tmp_path / os.listdir(tmp_path)[0], weights_only=False))
    assert resumed.amp_step.scaler.get_scale() == 128.0 and resumed.state.epoch == 2


# -- the evaluator -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trace", [False, True], ids=["module", "traced"])
def test_the_evaluator_matches_ignite(trace):
    """Ignite's evaluator case (a zeroed model: predictions 0, targets passed through) and a metric."""
    outputs = []
    for factory in (create_supervised_evaluator, create_amp_evaluator):
        model = linear(trace)
        if not trace:
            model.weight.data.fill_(0.5)
        extra = {"dtype": "float32"} if factory is create_amp_evaluator else {}
        evaluator = factory(model, {"mse": MeanSquaredError()}, "cpu", **extra)
        state = evaluator.run(BATCHES)
        outputs.append((state.output, state.metrics["mse"]))
    (their_out, their_mse), (our_out, our_mse) = outputs
    assert our_mse == pytest.approx(their_mse) and our_mse > 0
    assert all(torch.allclose(a, b) for a, b in zip(our_out, their_out, strict=True))


def test_the_evaluator_hooks_and_amp_mode():
    hooks = dict(prepare_batch=lambda batch, device, non_blocking: (batch["x"], batch["y"]),
                 model_fn=lambda model, x: {"out": model(x)}, model_transform=lambda out: out["out"],
                 output_transform=lambda x, y, y_pred: (y_pred * 2, y))
    data = [{"x": x, "y": y} for x, y in BATCHES]
    their = create_supervised_evaluator(linear(), device="cpu", **hooks).run(data).output
    ours = create_amp_evaluator(linear(), None, "cpu", dtype="float32", **hooks).run(data).output
    assert all(torch.equal(a, b) for a, b in zip(ours, their, strict=True))
    half = create_amp_evaluator(linear(), None, "cpu", False, amp_mode="amp")
    assert half.amp_step.dtype == torch.float16 and half.run(BATCHES).output[0].dtype == torch.float32


# -- one-line errors for what neither takes ------------------------------------------------------------------

@pytest.mark.parametrize("factory, kwargs, message", [
    (create_amp_trainer, {"gradient_acumulation_steps": 2},
     r"^create_amp_trainer\(\) got an unexpected keyword argument 'gradient_acumulation_steps': "
     r"did you mean 'gradient_accumulation_steps'\?$"),
    (create_amp_evaluator, {"outputs_transform": None}, r"^create_amp_evaluator\(\) .*'outputs_transform': "
                                                        r"did you mean 'output_transform'\?$"),
    (create_amp_trainer, {"amp_mode": "apex"}, r"^Argument amp_mode: 'apex' \(NVIDIA apex\) is not supported"),
    (create_amp_trainer, {"amp_mode": "amp", "dtype": "bfloat16"},
     r"^Argument amp_mode='amp' means dtype float16, but dtype is 'bfloat16': pass one of them$"),
    (create_amp_trainer, {"non_blocking": "bfloat16"}, r"^Argument non_blocking should be True or False, got "
                                                       r"'bfloat16' \(the arguments after device follow Ignite's"),
])
def test_what_neither_takes_is_one_line(factory, kwargs, message):
    model = linear()
    args = (model, SGD(model.parameters(), 0.1), mse_loss) if factory is create_amp_trainer else (model,)
    with pytest.raises((TypeError, ValueError), match=message) as caught:
        factory(*args, device="cpu", **kwargs)
    assert "\n" not in str(caught.value) and "AmpStep" not in str(caught.value)


# -- documented differences, each with its reason (the "Coming from Ignite" guide) ---------------------------

def test_difference_the_output_is_a_0d_tensor_and_a_checkpoint_score_says_item(tmp_path):
    """No host sync per iteration: ``state.output`` is a detached 0-d tensor, not ``loss.item()``. It formats
    and compares as Ignite's float does; a Checkpoint score over it is told the one-word fix."""
    (theirs, _), (ours, _) = train_both(BATCHES)
    assert isinstance(theirs.output, float) and torch.is_tensor(ours.output) and ours.output.dim() == 0
    assert f"{ours.output:.4f}" == f"{theirs.output:.4f}"
    model = linear()
    trainer = create_amp_trainer(model, SGD(model.parameters(), 0.1), mse_loss, "cpu")
    checkpoint = ModelCheckpoint(tmp_path, "ckpt", score_function=lambda e: -e.state.output, require_empty=False)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint, {"model": model})
    with pytest.raises(ValueError, match=r"^Output of score_function should be a number: .* add \.item\(\), e\.g\. "
                                         r"score_function=lambda engine: -engine\.state\.output\.item\(\)$"):
        trainer.run(BATCHES)
    fixed = ModelCheckpoint(tmp_path, "fixed", score_function=lambda e: -e.state.output.item(), require_empty=False)
    stop = EarlyStopping(patience=1, score_function=lambda e: -e.state.output, trainer=trainer)
    trainer = create_amp_trainer(model, SGD(model.parameters(), 0.1), mse_loss, "cpu")
    trainer.add_event_handler(Events.EPOCH_COMPLETED, fixed, {"model": model})
    trainer.add_event_handler(Events.EPOCH_COMPLETED, stop)  # EarlyStopping compares tensors as they are
    trainer.run(BATCHES, max_epochs=2)
    assert len(os.listdir(tmp_path)) == 1


def test_difference_an_accumulation_cycle_never_crosses_an_epoch():
    """5 batches, 3 steps: Ignite steps at iteration 3 only, leaving two batches' gradients for the next epoch;
    ours also steps at the epoch's last iteration, on those two (a cycle of two). Ours equals Ignite run on
    the two parts separately."""
    data = SAMPLES[:5]
    (_, their_model), (_, our_model) = train_both(data, gradient_accumulation_steps=3)
    assert not same_weights(their_model, our_model)
    model = linear()
    optimizer = SGD(model.parameters(), 0.1)
    for part, steps in ((data[:3], 3), (data[3:], 2)):
        create_supervised_trainer(model, optimizer, mse_loss, "cpu", gradient_accumulation_steps=steps).run(part)
    assert same_weights(model, our_model)


def test_difference_dtype_auto_amp_mode_scales_non_blocking_and_a_sum_is_refused():
    model = linear()
    auto = create_amp_trainer(model, SGD(model.parameters(), 0.1), mse_loss, "cpu")
    assert auto.amp_step.dtype in (torch.bfloat16, torch.float32)  # Ignite: float32 unless amp_mode
    amp = create_amp_trainer(model, SGD(model.parameters(), 0.1), mse_loss, "cpu", amp_mode="amp")
    assert amp.amp_step.scaler.is_enabled()  # Ignite: amp_mode="amp" alone runs float16 without a scaler
    for factory in (create_amp_trainer, create_amp_evaluator):  # Ignite: False
        assert inspect.signature(factory).parameters["non_blocking"].default is True
    summed = create_amp_trainer(model, SGD(model.parameters(), 0.1), lambda p, y: mse_loss(p, y, reduction="sum"),
                                "cpu")
    with pytest.raises(ValueError, match="sum"):
        summed.run(BATCHES)


def test_difference_a_submodule_frozen_in_eval_mode_stays_frozen():
    """Ignite calls model.train() every iteration (a frozen BatchNorm flips back); ours only when the model is in
    eval mode, which also spares the walk over every submodule."""
    modes = []
    for factory, extra in ((create_supervised_trainer, {}), (create_amp_trainer, {"dtype": "float32"})):
        model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        model[1].eval()
        factory(model, SGD(model.parameters(), 0.1), mse_loss, device="cpu", **extra).run(BATCHES)
        modes.append(model[1].training)
    assert modes == [True, False]


# -- an Ignite MNIST script, ported by its import line -------------------------------------------------------

def _load(name: str, source: str):
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, name, "exec"), module.__dict__)
    return module


@pytest.mark.slow
def test_an_ignite_mnist_script_ports_by_one_line_and_resumes(tmp_path):
    import ignite.engine

    import ignite_amp.engine

    for name in ("Engine", "Events"):  # what else an Ignite script imports from ignite.engine
        assert getattr(ignite_amp.engine, name) is getattr(ignite.engine, name)
    path = os.path.join(ROOT, "examples", "ignite_mnist.py")
    ours = open(path, encoding="utf-8").read()
    theirs = ours.replace("from ignite_amp.engine import", "from ignite.engine import")
    changed = [line for line in difflib.ndiff(theirs.splitlines(), ours.splitlines()) if line[:1] in "+-"]
    assert len(changed) == 2, changed  # one line out, one in
    args = ["--tiny", "--epochs", "1", "--log_interval", "2"]
    ignite_run = _load("ignite_mnist_on_ignite", theirs).main(args + ["--output_dir", str(tmp_path / "ignite")])
    first = _load("ignite_mnist", ours).main(args + ["--output_dir", str(tmp_path / "amp")])
    assert ignite_run["iteration"] == first["iteration"] == 2 and len(first["accuracy"]) == 1
    for run in (ignite_run, first):  # ModelCheckpoint of the best accuracy, Checkpoint of the trainer
        best, last = run["checkpoints"]
        assert best.startswith("best_model_accuracy=") and last == "training_checkpoint_2.pt"
    resumed = _load("ignite_mnist", ours).main(
        ["--tiny", "--epochs", "2", "--output_dir", str(tmp_path / "amp"),
         "--resume_from", str(tmp_path / "amp" / "training_checkpoint_2.pt")])
    assert resumed["epoch"] == 2 and resumed["iteration"] == 4 and len(resumed["accuracy"]) == 1
