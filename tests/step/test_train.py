
import ignite.distributed as idist
import pytest
import torch
from ignite.engine import Events
from torch import nn
from torch.nn.functional import cross_entropy

from helpers import OOMAbove, id_batches, mlp
from ignite_amp import AmpEvents, create_amp_evaluator, create_amp_trainer


def grads_at_ready(trainer):
    seen = []
    trainer.add_event_handler(
        AmpEvents.GRADS_READY,
        lambda e: seen.append([p.grad.detach().clone() for p in e.amp_step.model.parameters()]),
    )
    return seen


def reference_grads(model, x, y):
    model = model.float()
    model.zero_grad()
    cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_grads_at_grads_ready_are_unscaled(dtype):
    model = mlp()
    ref_model = mlp()
    (x, y), = id_batches(8, 8)
    x[:, 0] = 0.1
    expected = reference_grads(ref_model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype=dtype,
                                 scaler_kwargs={"init_scale": 2.0**12} if dtype == "float16" else None)
    seen = grads_at_ready(trainer)
    trainer.run([(x, y)], max_epochs=1)
    assert len(seen) == 1
    tol = 1e-6 if dtype == "float32" else 3e-2
    for got, want in zip(seen[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert trainer.amp_step.scaler.is_enabled() == (dtype == "float16")


def test_inf_gradient_skips_step_fires_event_and_lowers_scale():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float16",
                                 scaler_kwargs={"init_scale": 1024.0})
    events = []
    trainer.add_event_handler(AmpEvents.STEP_SKIPPED, lambda e: events.append("skipped"))
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: events.append("ready"))
    x = torch.randn(4, 5)
    x[0, 0] = float("inf")
    trainer.run([(x, torch.tensor([0, 1, 2, 0]))], max_epochs=1)
    assert events == ["skipped"]
    assert trainer.amp_step.scaler.get_scale() == 512.0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


def test_finite_step_updates_weights_and_fires_grads_ready_only():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                                 device="cpu", dtype="float16")
    events = []
    trainer.add_event_handler(AmpEvents.STEP_SKIPPED, lambda e: events.append("skipped"))
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: events.append("ready"))
    trainer.run(id_batches(8, 8), max_epochs=1)
    assert events == ["ready"]
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("micro_batches", [2, 3, 8])
def test_micro_batches_give_the_full_batch_gradient(micro_batches):
    (x, y), = id_batches(8, 8)
    expected = reference_grads(mlp(), x, y)
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cross_entropy,
                                 device="cpu", dtype="float32", micro_batches=micro_batches)
    seen = grads_at_ready(trainer)
    trainer.run([(x, y)], max_epochs=1)
    for got, want in zip(seen[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.isclose(trainer.state.output, cross_entropy(mlp()(x), y).detach(), atol=1e-6)


def test_accumulation_gives_the_full_batch_gradient_and_steps_once_per_cycle():
    (x, y), = id_batches(8, 8)
    expected = reference_grads(mlp(), x, y)
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cross_entropy,
                                 device="cpu", dtype="float32", accumulation_steps=2)
    seen = grads_at_ready(trainer)
    trainer.run([(x[:4], y[:4]), (x[4:], y[4:])], max_epochs=1)
    assert len(seen) == 1
    for got, want in zip(seen[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_output_is_detached_tensor():
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    trainer.run(id_batches(8, 8), max_epochs=1)
    out = trainer.state.output  # Ignite's habit: the loss, here a detached 0-d tensor (no host sync)
    assert torch.is_tensor(out) and out.dim() == 0 and not out.requires_grad and out is trainer.amp_step.loss
    assert f"{out:.2f}" == f"{out.item():.2f}" and trainer.amp_step.batch_size == 8


def test_oom_without_handler_reraises_the_original_error():
    model = OOMAbove(limit=4)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                                 device="cpu", dtype="float32")
    fired = []
    trainer.add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: fired.append(e.amp_step.micro_batches))
    with pytest.raises(torch.OutOfMemoryError, match="stand-in") as info:
        trainer.run(id_batches(8, 8), max_epochs=1)
    assert fired == [1]
    assert trainer.amp_step.oom_count == 1
    # The very error the model raised, its traceback still pointing at the model's forward.
    assert info.value is model.raised
    assert info.traceback[-1].name == "forward"


@pytest.mark.slow
def test_oom_with_handler_retries_same_batch_and_loses_no_sample():
    batches = id_batches(24, 8)
    model = OOMAbove(limit=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # The stand-in records every forward's samples, the split check's too (tested in
    # tests/split_check/test_split_check.py).
    trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float32", check_split=False)

    def halve(engine):
        engine.amp_step.micro_batches *= 2

    trainer.add_event_handler(AmpEvents.OUT_OF_MEMORY, halve)
    trainer.run(batches, max_epochs=2)
    assert trainer.amp_step.micro_batches == 4  # 8 -> 4 -> 2 per chunk
    assert sorted(model.seen) == sorted(list(range(24)) * 2)

    # Same weights as a model that never runs out of memory.
    ref = OOMAbove(limit=1000)
    ref.load_state_dict({k: v for k, v in OOMAbove(limit=3).state_dict().items()})
    torch.manual_seed(0)
    ref2, model2 = OOMAbove(limit=1000), OOMAbove(limit=3)
    model2.load_state_dict(ref2.state_dict())
    t_ref = create_amp_trainer(ref2, torch.optim.SGD(ref2.parameters(), lr=0.1), cross_entropy,
                               device="cpu", dtype="float32")
    t_oom = create_amp_trainer(model2, torch.optim.SGD(model2.parameters(), lr=0.1), cross_entropy,
                               device="cpu", dtype="float32")
    t_oom.add_event_handler(AmpEvents.OUT_OF_MEMORY, halve)
    t_ref.run(batches, max_epochs=2)
    t_oom.run(batches, max_epochs=2)
    for a, b in zip(ref2.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_handler_that_cannot_shrink_chunks_does_not_loop_forever():
    model = OOMAbove(limit=0)  # fails even at one sample
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                                 device="cpu", dtype="float32")
    trainer.add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: setattr(e.amp_step, "micro_batches",
                                                                         e.amp_step.micro_batches * 2))
    with pytest.raises(torch.OutOfMemoryError):
        trainer.run(id_batches(8, 8), max_epochs=1)
    assert trainer.amp_step.oom_count == 4  # 1, 2, 4, 8 chunks; 16 would be no smaller


@pytest.mark.parametrize("error", [ValueError("bad shape"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered")])
def test_other_errors_propagate_untouched(error):
    class Broken(nn.Linear):
        def forward(self, x):
            raise error

    model = Broken(5, 3)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    fired = []
    trainer.add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: fired.append(1))
    with pytest.raises(type(error)) as info:
        trainer.run(id_batches(8, 8), max_epochs=1)
    assert info.value is error and fired == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_trains_on_cpu(dtype):
    torch.manual_seed(0)
    x = torch.randn(256, 5)
    y = (x[:, 1] > 0).long() + (x[:, 2] > 0).long()
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), cross_entropy,
                                 device="cpu", dtype=dtype)
    losses = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: losses.append(e.state.output.item()))
    trainer.run(batches, max_epochs=15)
    assert trainer.amp_step.dtype == getattr(torch, dtype)
    assert losses[-1] < 0.5 * losses[0]


def test_state_dict_round_trip():
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                                 device="cpu", dtype="float16", scaler_kwargs={"init_scale": 64.0})
    trainer.amp_step.micro_batches = 4
    state = trainer.amp_step.state_dict()
    other_model = mlp()
    other = create_amp_trainer(other_model, torch.optim.SGD(other_model.parameters(), lr=0.1), cross_entropy,
                               device="cpu", dtype="float16")
    other.amp_step.load_state_dict(state)
    assert other.amp_step.micro_batches == 4 and other.amp_step.scaler.get_scale() == 64.0
    with pytest.raises(ValueError, match="scaler"):
        other.amp_step.load_state_dict({"micro_batches": 1})


def test_a_checkpoint_of_another_dtype_is_said_when_a_script_loads_it(caplog):
    """A script resuming a bfloat16 checkpoint into a float32 step: nothing was said (a config run names it)."""
    model = mlp()
    trained = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="bfloat16")
    state = trained.amp_step.state_dict()
    model = mlp()
    resumed = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32")
    with caplog.at_level("WARNING", logger="ignite_amp"):
        resumed.amp_step.load_state_dict(state)
        resumed.amp_step.load_state_dict(resumed.amp_step.state_dict())  # the same dtype: nothing
        resumed.amp_step.load_state_dict({k: v for k, v in state.items() if k != "dtype"})  # 0.2.0's: not recorded
    assert [r.getMessage() for r in caplog.records] == [
        "resumed a checkpoint trained in bfloat16 into a float32 step: dtype bfloat16 -> float32 (the weights load "
        "as they are; expect the loss to move a little in the first steps)"]


def test_fp32_modules_run_outside_autocast():
    class Probe(nn.Linear):
        def forward(self, x):
            self.seen = (x.dtype, torch.is_autocast_enabled("cpu"))
            return super().forward(x)

    model = nn.Sequential(Probe(5, 8), Probe(8, 3))
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                                 device="cpu", dtype="bfloat16", fp32_modules=["1"])
    trainer.run(id_batches(8, 8), max_epochs=1)
    assert model[0].seen == (torch.float32, True)   # input batch is float32; autocast on
    assert model[1].seen == (torch.float32, False)  # bf16 activations cast back, autocast off
    with pytest.raises(ValueError, match="no submodule 'head'"):
        create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                           device="cpu", fp32_modules=["head"])


def test_channels_last_and_evaluator():
    from ignite.metrics import Accuracy

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    x, y = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 0, 1, 0, 1])
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                                 device="cpu", channels_last=True)
    trainer.run([(x, y)], max_epochs=1)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy()}, device="cpu", micro_batches=4)
    state = evaluator.run([(x, y)])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = (model(x).argmax(1) == y).float().mean().item()
    assert state.metrics["accuracy"] == pytest.approx(expected)
    assert not model.training


def test_evaluator_retries_after_oom_with_more_chunks():
    from ignite.metrics import Accuracy

    model = OOMAbove(limit=3)
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy()}, device="cpu", dtype="float32")
    evaluator.add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: setattr(e.amp_step, "micro_batches", 4))
    state = evaluator.run(id_batches(16, 8))
    assert evaluator.amp_step.micro_batches == 4 and 0.0 <= state.metrics["accuracy"] <= 1.0


def test_float16_step_reads_the_inf_flag_once(monkeypatch):
    """One host sync per float16 step: GradScaler.step (which reads the flag again) is not called."""
    import ignite_amp.step.train as step_module

    calls = {"found_inf": 0}
    real = step_module.found_inf

    def counting(*args):
        calls["found_inf"] += 1
        return real(*args)

    monkeypatch.setattr(step_module, "found_inf", counting)
    monkeypatch.setattr(torch.amp.GradScaler, "step", lambda *a, **k: pytest.fail("GradScaler.step re-reads the flag"))
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float16", scaler_kwargs={"init_scale": 64.0})
    before = [p.detach().clone() for p in model.parameters()]
    trainer.run(id_batches(24, 8), max_epochs=1)
    assert calls["found_inf"] == 3
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_out_of_memory_inside_the_optimizer_step_is_not_retried():
    from ignite_amp.errors import OptimizerOutOfMemoryError

    class OOMOnSecondStep(torch.optim.AdamW):
        calls = 0

        def step(self, closure=None):
            OOMOnSecondStep.calls += 1
            if OOMOnSecondStep.calls == 2:
                # Half applied, as a foreach update cut short would leave it.
                with torch.no_grad():
                    next(iter(self.param_groups[0]["params"])).add_(1.0)
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in, inside optimizer.step)")
            return super().step(closure)

    model = mlp()
    trainer = create_amp_trainer(model, OOMOnSecondStep(model.parameters(), lr=1e-3), cross_entropy, device="cpu",
                                 dtype="bfloat16")
    fired = []
    trainer.add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: fired.append(e.state.iteration))
    trainer.add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: setattr(e.amp_step, "micro_batches", 4))
    with pytest.raises(OptimizerOutOfMemoryError,
                       match=r"inside optimizer.step\(\) \(OOMOnSecondStep\).*iteration 2.*not retried"):
        trainer.run(id_batches(24, 8), max_epochs=1)
    assert fired == [] and OOMOnSecondStep.calls == 2  # no retry applied the update a second time


def test_out_of_memory_in_a_grads_ready_handler_retries_with_a_clean_scaler():
    model, ref = mlp(), mlp()
    batches = id_batches(16, 8)
    trainers = []
    for m in (model, ref):
        t = create_amp_trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), cross_entropy, device="cpu",
                               dtype="float16", scaler_kwargs={"init_scale": 64.0})
        trainers.append(t)
    failed = []

    def oom_once(engine):  # e.g. clipping allocating its norms
        if not failed:
            failed.append(engine.state.iteration)
            raise torch.OutOfMemoryError("out of memory (stand-in, in a GRADS_READY handler)")

    trainers[0].add_event_handler(AmpEvents.GRADS_READY, oom_once)
    trainers[0].add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: setattr(e.amp_step, "micro_batches", 2))
    for t in trainers:
        t.run(batches, max_epochs=1)
    assert failed == [1] and trainers[0].amp_step.scaler.get_scale() == trainers[1].amp_step.scaler.get_scale()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("loss_fn, message", [
    (lambda y_pred, y: cross_entropy(y_pred, y, reduction="none"), r"scalar \(0-d\) tensor, got \(8,\)"),
])
def test_a_non_scalar_loss_is_named(loss_fn, message):
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, device="cpu")
    with pytest.raises(ValueError, match=message):
        trainer.run(id_batches(8, 8), max_epochs=1)


def test_wrong_optimizer_or_reduction_is_refused_at_construction():
    import functools

    model = mlp()
    with pytest.raises(ValueError, match="optimizer: none of its parameters belong to the model"):
        create_amp_trainer(model, torch.optim.SGD(mlp().parameters(), lr=0.1), cross_entropy, device="cpu")
    for loss_fn in (nn.CrossEntropyLoss(reduction="sum"), functools.partial(cross_entropy, reduction="sum")):
        with pytest.raises(ValueError, match="reduction='sum' is a sum over the samples; the step needs a mean"):
            create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, device="cpu")
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                 device="cpu")
    with pytest.raises(ValueError, match="micro_batches should be a positive integer"):
        trainer.amp_step.micro_batches = 0
    with pytest.raises(ValueError, match="empty batch"):
        trainer.run([(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))], max_epochs=1)


@pytest.mark.parametrize("epoch_length, steps", [(5, [2, 4, 5]), (4, [2, 4]), (1, [1])])
def test_an_accumulation_cycle_ends_with_the_epoch(epoch_length, steps):
    """accumulation_steps=2: the epoch's last iteration steps, with the mean of its (shorter) cycle."""
    batches = id_batches(8 * epoch_length, 8)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float32", accumulation_steps=2)
    stepped, grads = [], []
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: (
        stepped.append((e.state.iteration - 1) % epoch_length + 1),
        grads.append([p.grad.clone() for p in model.parameters()])))
    snapshot = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: snapshot.append(copy_model(model)))
    trainer.run(batches, max_epochs=2)
    assert stepped == steps * 2
    # The gradient of the last cycle is the mean over its batches (one batch when the cycle is cut short).
    last = steps[-1] - (steps[-2] if len(steps) > 1 else 0)
    ref = snapshot[epoch_length - last]
    ref.zero_grad()
    for x, y in batches[epoch_length - last:epoch_length]:
        (cross_entropy(ref(x), y) / last).backward()
    for got, want in zip(grads[len(steps) - 1], [p.grad for p in ref.parameters()], strict=True):
        torch.testing.assert_close(got, want)


def copy_model(model):
    import copy

    return copy.deepcopy(model)


def test_a_submodule_kept_in_eval_mode_stays_there():
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    model[1].eval()  # the user froze it; the step must not flip it back every iteration
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    trainer.run(id_batches(16, 8), max_epochs=2)
    assert model.training and not model[1].training


def test_oom_count_is_kept_in_the_state_dict():
    model = OOMAbove(limit=4)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32")
    trainer.add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: setattr(e.amp_step, "micro_batches", 2))
    trainer.run(id_batches(8, 8), max_epochs=1)
    state = trainer.amp_step.state_dict()
    other = OOMAbove(limit=4)
    resumed = create_amp_trainer(other, torch.optim.SGD(other.parameters(), lr=0.1), cross_entropy, device="cpu")
    resumed.amp_step.load_state_dict(state)
    assert resumed.amp_step.oom_count == 1 and resumed.amp_step.micro_batches == 2


def test_skipped_steps_do_not_advance_a_schedule():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float16",
                                 scaler_kwargs={"init_scale": 64.0})
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer.add_event_handler(AmpEvents.OPTIMIZER_STEPPED, lambda _: scheduler.step())
    skipped = []
    trainer.add_event_handler(AmpEvents.STEP_SKIPPED, lambda e: skipped.append(e.state.iteration))
    batches = id_batches(32, 8)
    x, y = batches[1]
    batches[1] = (x * float("inf"), y)
    trainer.run(batches, max_epochs=1)
    assert skipped == [2] and scheduler.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)


def test_cuda_random_states_of_more_gpus_than_here_restore_what_fits(monkeypatch, caplog):
    from ignite_amp.core.rng import get_rng_state, set_rng_state

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, index: restored.append((index, state)))
    state = dict(get_rng_state(), cuda=[torch.tensor([7], dtype=torch.uint8), torch.tensor([8], dtype=torch.uint8)])
    set_rng_state(state)
    assert [(i, s.item()) for i, s in restored] == [(0, 7)]
    assert "CUDA random states of 2 GPUs and this machine has 1" in caplog.text


def test_after_evaluating_the_unwrapped_module_a_ddp_trainer_trains_it_in_train_mode(tmp_path):
    """The evaluator .eval()s the module inside DDP; the next training step must set it back."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 3))
        ddp = DistributedDataParallel(model)
        trainer = create_amp_trainer(ddp, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
        evaluator = create_amp_evaluator(ddp, device="cpu")
        modes = []
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: modes.append(model[1].training))
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: evaluator.run(id_batches(8, 8)))
        trainer.run(id_batches(24, 8), max_epochs=1)
        assert modes == [True, True, True] and not model.training  # evaluated last
    finally:  # idist caches the group it saw; finalize resets it to serial for the tests that follow
        idist.finalize()
        if dist.is_initialized():
            dist.destroy_process_group()
