"""A per-step schedule (Ignite's param schedulers or torch's ``LRScheduler``) advanced per optimizer step taken."""
from typing import Any

import torch
from ignite.engine import Engine, Events
from ignite.handlers.param_scheduler import ParamGroupScheduler, ParamScheduler, ReduceLROnPlateauScheduler

from ignite_amp.handlers.oom_backoff import OOMBackoff
from ignite_amp.step.events import AmpEvents

__all__ = ["StepSchedule"]


class StepSchedule:
    """Advance a schedule once per optimizer step taken, so that optimizer step ``k`` uses its value ``k``.

    The two kinds of schedule set their values at different times, and this handler knows both:

    - torch's ``LRScheduler`` (``CosineAnnealingLR``, ``OneCycleLR``, ``LambdaLR``...) sets value 0 when it is
      built and its ``step()`` sets the next one: it steps at ``AmpEvents.OPTIMIZER_STEPPED``.
    - Ignite's param schedulers (``CosineAnnealingScheduler``, ``PiecewiseLinear``, ``LRScheduler``,
      ``create_lr_scheduler_with_warmup``, ``ParamGroupScheduler``...) set the value for the next use each time
      they are called: called once when the run starts (not on a resumed scheduler), then at each
      ``OPTIMIZER_STEPPED``.

    A float16 step the scaler skipped does not advance it, nor do the iterations of an accumulation cycle
    that do not step. (Attached at ``ITERATION_STARTED`` as Ignite's docs show, an Ignite scheduler would
    advance once per iteration, so twice per step with ``accumulation_steps=2``; at ``OPTIMIZER_STEPPED``
    without this handler, the first step would run at the optimizer's own lr.) Put the scheduler itself in
    the checkpoint's ``to_save`` to resume it.

    Args:
        scheduler: a torch ``LRScheduler`` or an Ignite ``ParamScheduler`` / ``ParamGroupScheduler``.

    Example:
        >>> import torch
        >>> from ignite.handlers import PiecewiseLinear
        >>> from ignite_amp import AmpEvents, create_amp_trainer
        >>> from ignite_amp.handlers import StepSchedule
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> trainer = create_amp_trainer(model, opt, torch.nn.functional.cross_entropy, device="cpu",
        ...                              dtype="float32", accumulation_steps=2)
        >>> schedule = PiecewiseLinear(opt, "lr", milestones_values=[(0, 0.4), (3, 0.1)])
        >>> StepSchedule(schedule).attach(trainer)
        >>> used = []
        >>> _ = trainer.add_event_handler(AmpEvents.GRADS_READY,
        ...                               lambda e: used.append(round(opt.param_groups[0]["lr"], 2)))
        >>> _ = trainer.run([(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 8, max_epochs=1)
        >>> used  # 8 iterations, 4 optimizer steps: values 0, 1, 2, 3 of the schedule
        [0.4, 0.3, 0.2, 0.1]
    """

    def __init__(self, scheduler: Any):
        if isinstance(scheduler, (ReduceLROnPlateauScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            raise TypeError(f"scheduler: {type(scheduler).__name__} steps on a validation metric, not per optimizer "
                            f"step: call it after each evaluation instead")
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            self.ignite = False
        elif isinstance(scheduler, (ParamScheduler, ParamGroupScheduler)):
            self.ignite = True
        else:
            raise TypeError(f"scheduler should be a torch.optim.lr_scheduler.LRScheduler or an Ignite ParamScheduler, "
                            f"got {type(scheduler).__name__}")
        self.scheduler = scheduler

    def attach(self, engine: Engine) -> None:
        """Advance the schedule at each ``AmpEvents.OPTIMIZER_STEPPED`` of ``engine``."""
        engine.add_event_handler(Events.STARTED, _refuse_batch_backoff)  # at the start: attached in either order
        if self.ignite:
            engine.add_event_handler(Events.STARTED, self._first_value)
        engine.add_event_handler(AmpEvents.OPTIMIZER_STEPPED, self)

    def _first_value(self, engine: Engine) -> None:
        """Value 0 for the first step, unless the scheduler was resumed (its state says it already ran)."""
        group = isinstance(self.scheduler, ParamGroupScheduler)
        schedulers = self.scheduler.schedulers if group else [self.scheduler]
        if all(s.event_index == 0 for s in schedulers):
            self.scheduler(engine)

    def __call__(self, engine: Engine) -> None:
        if self.ignite:
            self.scheduler(engine)
        else:
            self.scheduler.step()


def _refuse_batch_backoff(engine: Engine) -> None:
    """``OOMBackoff(mode="batch")`` shrinks the loader's batch, so the steps per epoch change, which a schedule
    of steps cannot follow (``OneCycleLR`` dies past its ``total_steps``), as the config path refuses it.
    Ignite lists an event's handlers nowhere public: ``engine._event_handlers`` (a test breaks if it moves).
    Every event's handlers are read, not one event's: where OOMBackoff shrinks the loader is its own business."""
    for handler, *_ in (entry for handlers in engine._event_handlers.values() for entry in handlers):
        backoff = getattr(handler, "__self__", None)
        if isinstance(backoff, OOMBackoff) and backoff.mode == "batch":
            raise ValueError('StepSchedule: OOMBackoff(mode="batch") changes the steps per epoch, which a schedule '
                             'cannot follow; use OOMBackoff(mode="micro_batch")')
