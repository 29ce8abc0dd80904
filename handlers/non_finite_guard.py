"""Stop a run whose loss or gradients stay non-finite, naming the iteration."""
from typing import Optional, Tuple

import torch
from ignite.engine import Engine, Events

from ignite_amp.errors import NonFiniteError
from ignite_amp.events import AmpEvents
from ignite_amp.step import amp_step_of

__all__ = ["NonFiniteGuard", "NonFiniteError"]


class NonFiniteGuard:
    """Stop the run on non-finite losses or gradients.

    - float16 (with a scaler): a skipped step is the scaler's job; the run stops only after
      ``max_consecutive`` skipped steps in a row (``AmpEvents.STEP_SKIPPED``; no extra sync).
    - bfloat16 / float32 (no scaler to skip the step): the run stops at the first non-finite
      loss. On CUDA the check is lagged by one iteration (a non-blocking copy to the host, read
      once the next iteration is queued) so it never stalls the device pipeline.

    Checkpoints already on disk stay as they were: the error is raised inside the iteration,
    before any epoch-end evaluation could save a ruined model.

    Args:
        max_consecutive: skipped float16 steps in a row that stop the run.
    """

    def __init__(self, max_consecutive: int = 20):
        if not isinstance(max_consecutive, int) or isinstance(max_consecutive, bool) or max_consecutive < 1:
            raise ValueError(f"Argument max_consecutive should be a positive integer, got {max_consecutive!r}.")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self._pending: Optional[Tuple[int, torch.Tensor, Optional[torch.cuda.Event]]] = None

    def attach(self, engine: Engine) -> None:
        self.step = amp_step_of(engine)
        engine.add_event_handler(AmpEvents.STEP_SKIPPED, self._skipped)
        engine.add_event_handler(AmpEvents.GRADS_READY, self._stepped)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._check_loss)
        engine.add_event_handler(Events.COMPLETED, self._flush)

    def _skipped(self, engine: Engine) -> None:
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"non-finite gradients in {self.consecutive} float16 steps in a row, the last at iteration "
                f"{engine.state.iteration} (loss scale now {self.step.scaler.get_scale():g}): stopping")

    def _stepped(self, engine: Engine) -> None:
        self.consecutive = 0

    def _check_loss(self, engine: Engine) -> None:
        if self.step.scaler.is_enabled():
            return
        self._flush(engine)
        bad = ~torch.isfinite(engine.state.output["loss"])
        if bad.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(bad, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (engine.state.iteration, host, event)
        else:  # no pipeline to protect: check now
            self._pending = (engine.state.iteration, bad, None)
            self._flush(engine)

    def _flush(self, engine: Engine) -> None:
        if self._pending is None:
            return
        iteration, bad, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        if bool(bad):
            raise NonFiniteError(f"non-finite loss at iteration {iteration} in {str(self.step.dtype)[6:]} "
                                 f"(no loss scaler to skip the step): stopping")
