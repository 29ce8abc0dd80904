"""The names the AMP step gives its phases in a ``torch.profiler`` trace, defined once.

The step labels them (:func:`phase_label`); ``ProfilerCapture`` reads them back into its
per-step breakdown.
"""
import contextlib
from typing import Any, Callable

import torch

__all__ = ["FORWARD", "BACKWARD", "OPTIMIZER", "PHASES", "phase_label"]

FORWARD = "ignite_amp.forward"  # the forward and the loss, under autocast
BACKWARD = "ignite_amp.backward"  # scaler.scale(loss).backward()
OPTIMIZER = "ignite_amp.optimizer"  # unscale_, GRADS_READY handlers, optimizer.step(), scaler.update()
PHASES = {"forward": FORWARD, "backward": BACKWARD, "optimizer": OPTIMIZER}

_NO_LABEL = contextlib.nullcontext()


def _no_label(name: str) -> contextlib.nullcontext:
    return _NO_LABEL


def phase_label() -> Callable[[str], Any]:
    """``torch.profiler.record_function`` while a profiler records, else a no-op label.

    A ``record_function`` range costs microseconds even with no profiler running; the check
    (``torch.autograd._profiler_enabled``, what torch's own fast paths read) costs about 0.1 us.
    ``tests/core/test_phases.py`` fails loudly if a torch upgrade changes it.
    """
    return torch.profiler.record_function if torch.autograd._profiler_enabled() else _no_label
