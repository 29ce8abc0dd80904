"""The events through which handlers reach inside an AMP step."""
from ignite.engine import EventEnum

__all__ = ["AmpEvents"]


class AmpEvents(EventEnum):
    """Events fired from inside :class:`~ignite_amp.step.train.AmpStep`.

    - ``GRADS_READY``: after backward and ``scaler.unscale_``, before the optimizer step, only
      on iterations that step and whose gradients are finite. Gradients hold their true
      (unscaled) values; clipping and grad-norm logging attach here.
    - ``OPTIMIZER_STEPPED``: after ``optimizer.step()`` and ``scaler.update()``, when the
      optimizer did step. Per-step learning-rate schedules attach here.
    - ``STEP_SKIPPED``: the scaler found inf/NaN gradients and skipped the optimizer step.
    - ``OUT_OF_MEMORY``: the step caught an out-of-memory error, left the ``except`` block,
      zeroed the gradients and freed cached memory. A handler may raise the step's
      ``micro_batches``; the step then retries the same batch, else re-raises the error.
    """

    GRADS_READY = "grads_ready"
    OPTIMIZER_STEPPED = "optimizer_stepped"
    STEP_SKIPPED = "step_skipped"
    OUT_OF_MEMORY = "out_of_memory"
