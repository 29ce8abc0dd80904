
import pytest
import torch
from torch.nn.functional import cross_entropy

import ignite_amp.handlers.gradient_clipping
from helpers import assert_doctests_pass, id_batches, mlp
from ignite_amp import AmpEvents, create_amp_trainer
from ignite_amp.handlers import GradientClipping


def total_norm(model, norm_type=2.0):
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type).item()


def big_batches():
    torch.manual_seed(0)
    return [(50 * torch.randn(8, 5), torch.randint(0, 3, (8,))) for _ in range(3)]


def test_docstring_example_runs():
    assert_doctests_pass(ignite_amp.handlers.gradient_clipping)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_total_norm_after_clipping_is_at_most_max_norm(dtype, norm_type):
    model = mlp()
    # A small initial scale: with 50x inputs the default 65536 overflows and every step is skipped.
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy,
                                 device="cpu", dtype=dtype, scaler_kwargs={"init_scale": 16.0})
    before, after = [], []
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: before.append(total_norm(model, norm_type)))
    clip = GradientClipping(max_norm=0.5, norm_type=norm_type)
    clip.attach(trainer)
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: after.append(total_norm(model, norm_type)))
    trainer.run(big_batches(), max_epochs=1)
    assert len(after) == 3 and all(b > 0.5 for b in before)
    assert all(a <= 0.5 * (1 + 1e-4) for a in after)
    # The kept norm is the pre-clip one, as a tensor (no host sync of its own).
    assert torch.is_tensor(clip.last_norm)
    assert clip.last_norm.item() == pytest.approx(before[-1], rel=1e-5)
    # The L2 norm is the step's own grad_norm, computed once and shared with logging.
    if norm_type == 2.0:
        assert trainer.amp_step.grad_norm is clip.last_norm


def test_value_clipping():
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy,
                                 device="cpu", dtype="float16", scaler_kwargs={"init_scale": 16.0})
    GradientClipping(clip_value=0.01).attach(trainer)
    largest = []
    trainer.add_event_handler(AmpEvents.GRADS_READY,
                              lambda e: largest.append(max(p.grad.abs().max().item() for p in model.parameters())))
    trainer.run(big_batches(), max_epochs=1)
    assert largest and max(largest) <= 0.01


def test_runs_once_per_optimizer_step_with_accumulation():
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy,
                                 device="cpu", accumulation_steps=2)
    clip = GradientClipping(max_norm=1.0)
    calls = []
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: calls.append(e.state.iteration))
    clip.attach(trainer)
    trainer.run(id_batches(32, 8), max_epochs=1)
    assert calls == [2, 4]


def test_explicit_parameters():
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cross_entropy, device="cpu",
                                 dtype="float32")
    GradientClipping(max_norm=1e-3, parameters=model[0].parameters()).attach(trainer)
    norms = {}
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: norms.update(
        first=torch.nn.utils.get_total_norm([p.grad for p in model[0].parameters()]).item(),
        last=torch.nn.utils.get_total_norm([p.grad for p in model[2].parameters()]).item()))
    trainer.run(big_batches(), max_epochs=1)
    assert norms["first"] <= 1e-3 * (1 + 1e-4) and norms["last"] > 1e-3


@pytest.mark.parametrize("kwargs, message", [
    ({}, "max_norm or clip_value should be given"),
    ({"max_norm": 1.0, "clip_value": 1.0}, "and not both"),
    ({"max_norm": 0}, "max_norm should be a positive number"),
    ({"max_norm": "1"}, "max_norm should be a positive number"),
    ({"clip_value": -2}, "clip_value should be a positive number"),
    ({"max_norm": 1.0, "norm_type": 0}, "norm_type should be a positive number"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradientClipping(**kwargs)
