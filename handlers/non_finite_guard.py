"""Stop a run whose loss or gradients go non-finite, naming the iteration, before anything saves."""
import dataclasses
import logging
import math
from collections import deque
from types import SimpleNamespace
from typing import Any, Deque, List, Tuple

import torch
from ignite.engine import Engine, Events

from ignite_amp.core.config_keys import POSITIVE_INT, Boolean, argument, setting
from ignite_amp.core.config_values import Section
from ignite_amp.core.device import dtype_name
from ignite_amp.engine import trainer_step_of
from ignite_amp.errors import NonFiniteError
from ignite_amp.step.events import AmpEvents

__all__ = ["NonFiniteConfig", "NonFiniteGuard", "NonFiniteError"]

logger = logging.getLogger("ignite_amp")
BAD, EMPTY = 1, 2  # a loss check's codes: non-finite; no loss at all (a batch of padding only)


@dataclasses.dataclass(frozen=True, eq=False)
class NonFiniteConfig(Section):
    """handlers.non_finite: stop on a NaN/inf loss or weights (NonFiniteGuard)."""

    enabled: bool = setting(True, Boolean(), "attach the guard")
    max_consecutive: int = setting(20, POSITIVE_INT, "skipped float16 steps in a row that stop the run")


def loss_code(loss: torch.Tensor, items: Any) -> torch.Tensor:
    """0: finite; 1: non-finite; 2: no loss at all (num_items counted 0 items: padding only), on the loss's
    device. ``items`` as the step has it: a count (a Python int is never copied to the device: that copy
    would wait for it) or a device tensor."""
    flag = (~torch.isfinite(loss)).to(torch.uint8)
    return flag * (1 + (items == 0)) if torch.is_tensor(items) else flag * (2 if items == 0 else 1)


class NonFiniteGuard:
    """Stop the run on non-finite losses or gradients.

    - float16 (with a scaler): a skipped step is the scaler's job; the run stops after
      ``max_consecutive`` skipped steps in a row (``AmpEvents.STEP_SKIPPED``; no extra sync),
      or at the end of an epoch in which every step was skipped.
    - bfloat16 / float32 (no scaler to skip the step): the run stops at the first non-finite
      loss. On CUDA the check never waits for the device: each iteration's flag is copied
      (non-blocking) to a small ring of pinned host buffers and read once its CUDA event reports
      the copy done (``query()``, no sync), usually an iteration or two later. Only when all
      ``RING`` buffers are still in flight does the guard wait for the oldest.

    The lagged check is flushed at ``EPOCH_COMPLETED`` and ``COMPLETED``: attach the guard before
    the handlers that evaluate and checkpoint at the epoch's end (``train_from_config`` does), so
    a loss that went bad on the epoch's last iteration stops the run before anything is saved.
    (:class:`~ignite_amp.handlers.BestCheckpoint` also refuses to save non-finite weights.)

    Args:
        max_consecutive: skipped float16 steps in a row that stop the run.
    """

    #: Flags in flight before the guard waits for the oldest (the device would be 8 iterations behind).
    RING = 8

    def __init__(self, max_consecutive: int = 20):
        self.max_consecutive = argument(NonFiniteConfig, "max_consecutive", max_consecutive)
        self.consecutive = 0
        self.empty_batches = 0  # batches of padding only (no loss), said once
        self.stepped_in_epoch = 0
        self.skipped_in_epoch = 0
        self._pending: Deque[Tuple[int, SimpleNamespace]] = deque()  # (iteration, slot), oldest first
        self._free: List[SimpleNamespace] = []  # slots (a pinned flag and an event), made once each

    def attach(self, engine: Engine) -> None:
        """Watch ``engine``'s skipped steps, finite steps and (without a scaler) its losses."""
        self.step = trainer_step_of(engine, type(self).__name__)
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        if self.step.scaler.is_enabled():  # only a scaler skips steps: without one nothing to count per step
            engine.add_event_handler(AmpEvents.STEP_SKIPPED, self._skipped)
            engine.add_event_handler(AmpEvents.GRADS_READY, self._stepped)
        else:
            self._on_cpu = self.step.device.type == "cpu"
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._check_loss)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)
        engine.add_event_handler(Events.COMPLETED, self._flush)

    def _epoch_started(self, engine: Engine) -> None:
        self.stepped_in_epoch = self.skipped_in_epoch = 0

    def _skipped(self, engine: Engine) -> None:
        self.consecutive += 1
        self.skipped_in_epoch += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"non-finite gradients in {self.consecutive} float16 steps in a row, the last at iteration "
                f"{engine.state.iteration} (loss scale now {self.step.scaler.get_scale():g}): stopping")

    def _stepped(self, engine: Engine) -> None:
        self.consecutive = 0
        self.stepped_in_epoch += 1

    def _epoch_completed(self, engine: Engine) -> None:
        self._flush(engine)
        if self.skipped_in_epoch and not self.stepped_in_epoch:
            raise NonFiniteError(
                f"no optimizer step in epoch {engine.state.epoch}: all {self.skipped_in_epoch} float16 steps had "
                f"non-finite gradients (loss scale now {self.step.scaler.get_scale():g}): stopping")

    def _check_loss(self, engine: Engine) -> None:
        loss = self.step.loss
        if loss is None:  # the trainer's process function did not run its step (an AmpEngine built by hand)
            raise RuntimeError("NonFiniteGuard: the trainer's iteration ended without a loss from its AMP step: its "
                               "process function should run the step (as create_amp_trainer's does)")
        if self._on_cpu:  # no pipeline to protect: reading it costs no wait
            if not math.isfinite(loss.item()):
                self._report(engine.state.iteration, EMPTY if float(self.step.items) == 0 else BAD)
            return
        bad = loss_code(loss, self.step.items)
        if bad.device.type != "cuda":  # another device: check now
            self._report(engine.state.iteration, int(bad))
            return
        self._poll(block=False)
        if not self._free and len(self._pending) == self.RING:  # every slot in flight: wait for the oldest
            self._poll(block=True, only_one=True)
        slot = self._free.pop() if self._free else self._new_slot()
        # The copy runs on the current stream of the loss's device: record the event there.
        slot.host.copy_(bad, non_blocking=True)
        slot.event.record(torch.cuda.current_stream(bad.device))
        self._pending.append((engine.state.iteration, slot))

    def _new_slot(self) -> SimpleNamespace:
        # Pinned memory is expensive to allocate: at most RING slots, reused (each is free or pending).
        return SimpleNamespace(host=torch.empty((), dtype=torch.uint8, pin_memory=True), event=torch.cuda.Event())

    def _poll(self, block: bool, only_one: bool = False) -> None:
        """Read the flags whose copies are done (all of them, waiting, when ``block``), oldest first."""
        while self._pending and (block or self._pending[0][1].event.query()):
            iteration, slot = self._pending.popleft()
            if block:
                slot.event.synchronize()
            self._free.append(slot)
            if int(slot.host) == BAD:
                self._pending.clear()
            self._report(iteration, int(slot.host))
            if only_one:
                return

    def _flush(self, engine: Engine) -> None:
        self._poll(block=True)

    def _report(self, iteration: int, code: int) -> None:
        if code == EMPTY:
            if not self.empty_batches:
                logger.warning("iteration %d: every item of the batch was padding (num_items counted 0), so it has no "
                               "loss to report and adds nothing to the gradient; training goes on (said once)",
                               iteration)
            self.empty_batches += 1
        elif code == BAD:
            counted = torch.is_tensor(self.step.items)  # num_items gave tensors
            items = " (or num_items counted a negative or NaN number of items)" if counted else ""
            raise NonFiniteError(f"non-finite loss at iteration {iteration} in {dtype_name(self.step.dtype)}{items} "
                                 f"(no loss scaler to skip the step): stopping")
