"""StepSchedule: optimizer step k uses the schedule's value k, for both kinds of schedule (issue 28)."""
import pytest
import torch
from ignite.handlers import CosineAnnealingScheduler, PiecewiseLinear
from torch.nn.functional import cross_entropy

import ignite_amp.handlers.step_schedule
from helpers import assert_doctests_pass, tiny_config
from ignite_amp import AmpEvents, create_amp_trainer
from ignite_amp.handlers import StepSchedule

STEPS = 5  # optimizer steps that are taken


def batches(skip_at=None):
    """Pairs of batches (accumulation 2); the pair ``skip_at`` holds an inf, so float16 skips that step."""
    data = []
    for i in range(STEPS + (skip_at is not None)):
        for j in range(2):
            x = torch.randn(8, 4)
            if i == skip_at and j == 1:
                x[0, 0] = float("inf")
            data.append((x, torch.randint(0, 3, (8,))))
    return data


def used_lrs(make_schedule, dtype="float32", skip_at=None):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=123.0)  # never the value a step should use
    trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype=dtype, accumulation_steps=2)
    schedule = make_schedule(opt)
    StepSchedule(schedule).attach(trainer)
    used, skipped = [], []
    # The lr a step used: read after optimizer.step(), before any schedule handler advances it.
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: used.append(opt.param_groups[0]["lr"]))
    trainer.add_event_handler(AmpEvents.STEP_SKIPPED, lambda e: skipped.append(e.state.iteration))
    trainer.run(batches(skip_at), max_epochs=1)
    return used, skipped


def torch_cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 1, eta_min=0.01)


def expected_torch():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=123.0)
    sched, values = torch_cosine(opt), []
    for _ in range(STEPS):
        values.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return values


def ignite_cosine(opt):
    return CosineAnnealingScheduler(opt, "lr", start_value=0.05, end_value=0.01, cycle_size=2 * (STEPS - 1))


def expected_ignite():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=123.0)
    return CosineAnnealingScheduler.simulate_values(STEPS, param_name="lr", optimizer=opt, start_value=0.05,
                                                    end_value=0.01, cycle_size=2 * (STEPS - 1))


@pytest.mark.parametrize("make, expected", [(torch_cosine, expected_torch), (ignite_cosine, expected_ignite)])
@pytest.mark.parametrize("dtype, skip_at", [("float32", None), ("float16", 2)])
def test_step_k_uses_value_k_with_accumulation_and_a_skipped_float16_step(make, expected, dtype, skip_at):
    used, skipped = used_lrs(make, dtype, skip_at)
    want = [v[1] if isinstance(v, (list, tuple)) else v for v in expected()]
    assert used == pytest.approx(want, rel=1e-6), (used, want)
    assert len(skipped) == (skip_at is not None)  # the inf batch's step was skipped and did not advance it


def test_a_resumed_ignite_schedule_is_not_restarted():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=123.0)
    schedule = PiecewiseLinear(opt, "lr", milestones_values=[(0, 0.5), (10, 0.0)])
    first = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float32")
    StepSchedule(schedule).attach(first)
    first.run(batches()[:3], max_epochs=1)
    state = schedule.state_dict()
    schedule2 = PiecewiseLinear(opt, "lr", milestones_values=[(0, 0.5), (10, 0.0)])
    schedule2.load_state_dict(state)
    second = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float32")
    StepSchedule(schedule2).attach(second)
    used = []
    second.add_event_handler(AmpEvents.GRADS_READY, lambda e: used.append(opt.param_groups[0]["lr"]))
    second.run(batches()[:2], max_epochs=1)
    assert used == pytest.approx([0.35, 0.3])  # values 3 and 4: it goes on, not back to 0.5


def test_plateau_schedules_and_other_objects_are_refused():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(TypeError, match="steps on a validation metric"):
        StepSchedule(torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(TypeError, match="should be a torch.optim.lr_scheduler.LRScheduler or an Ignite"):
        StepSchedule(lambda engine: None)



@pytest.mark.parametrize("backoff_first", [True, False])
def test_a_batch_mode_oom_backoff_is_refused_before_the_first_step_in_either_order(backoff_first):
    """Issue 39: the config path refused it; in Python OneCycleLR died in epoch 3 ("Tried to step 13 times")."""
    from ignite_amp.handlers import OOMBackoff

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float32")
    handlers = [OOMBackoff(mode="batch"), StepSchedule(torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=4))]
    for handler in handlers if backoff_first else handlers[::-1]:
        handler.attach(trainer)
    with pytest.raises(ValueError, match=r'^StepSchedule: OOMBackoff\(mode="batch"\) changes the steps per epoch, '
                                         r'which a schedule cannot follow; use OOMBackoff\(mode="micro_batch"\)$'):
        trainer.run(batches(), max_epochs=1)
    assert trainer.state.iteration == 0
    trainer = create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float32")  # micro_batch mode: fine
    OOMBackoff().attach(trainer)
    StepSchedule(torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=len(batches()))).attach(trainer)
    assert trainer.run(batches(), max_epochs=1).iteration == len(batches())

@pytest.mark.slow
def test_the_config_path_is_exact_too(tmp_path):
    from ignite_amp.run.compose import build_run

    cfg = tiny_config(tmp_path, scheduler={"name": "cosine"}, amp={"accumulation_steps": 2},
                      data={"train_size": 128, "batch_size": 16})
    run = build_run(cfg)
    try:
        used = []
        opt = run.optimizer
        run.trainer.add_event_handler(AmpEvents.GRADS_READY, lambda e: used.append(opt.param_groups[0]["lr"]))
        run.train()
    finally:
        run.close()
    steps = 4  # 8 iterations of 16 samples, accumulation 2
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-3), T_max=steps)
    want = []
    for _ in range(steps):
        want.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    assert used == pytest.approx(want, rel=1e-6)


def test_doctest():
    assert_doctests_pass(ignite_amp.handlers.step_schedule)
