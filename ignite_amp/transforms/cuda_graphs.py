"""``compile="reduce-overhead"``: CUDA graphs for launch-bound models, with the fallbacks to the eager forward.

``torch.compile(mode="reduce-overhead")`` records the compiled forward and backward as CUDA graphs (Inductor's
cudagraph trees) and replays them: one launch where a small model made hundreds (ResNet-18 at 32x32, batch 256:
about 10 ms an iteration on an H100, mostly waiting for launches; issue 51). The optimizer step stays outside (on
CUDA it is one fused kernel per group, :mod:`ignite_amp.run.fused`). What the graphs cannot follow, the step
handles by going back to the eager forward for the rest of the run, with a warning that says why:

- parity: on the first training step the compiled forward's loss is checked against the eager forward's on the
  same chunk, parameters, buffers and random state (restored after each); a relative difference over
  :data:`TOLERANCE` for the dtype (a few units of its rounding), or a compiled loss that is not finite, falls back.
  Not checked (and said) for a model with dropout (the compiled and eager forwards draw different random numbers),
  under DDP or FSDP2 (a forward without its backward would leave them waiting for it), or when the eager loss is not
  finite itself (nothing to compare: the model's or the data's fault, which the run meets next);
- shapes the project itself changes: the last short batch of an epoch and a micro-batch count an
  ``OUT_OF_MEMORY`` handler raised give new input shapes, each recorded as graphs of its own; past
  :data:`MAX_SHAPES` distinct shapes the step falls back rather than record more;
- an out-of-memory error: the graphs' private memory pools hold memory the retry needs: the retry and the rest of
  the run are eager.

Off CUDA, torch compiles without graphs (Inductor skips them on a CPU), and the same checks apply; the trainer says
so in one line (:func:`off_cuda`).

``compile`` takes what ``amp.compile`` takes (:data:`COMPILE`): True, False, None or ``"reduce-overhead"``, in
Python as in a config. torch's other mode names are refused rather than passed on: ``"max-autotune"`` records CUDA
graphs too, without these checks and fallbacks, and ``"default"`` is ``compile=True``.
"""
import logging
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from ignite_amp.core.collectives import unwrap
from ignite_amp.core.config_keys import Boolean

__all__ = ["REDUCE_OVERHEAD", "COMPILE", "TOLERANCE", "MAX_SHAPES", "GraphGuard", "check_compile", "loss_mismatch",
           "off_cuda"]

logger = logging.getLogger("ignite_amp")

REDUCE_OVERHEAD = "reduce-overhead"
#: What ``compile`` (``amp.compile``) takes: true, false, null (the factory's choice) or "reduce-overhead".
COMPILE = Boolean(nullable=True, also=(REDUCE_OVERHEAD,))
_TORCH_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs")
#: The largest relative difference of the first loss, compiled against eager, that passes the parity check.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
#: Distinct input shapes recorded as graphs before the step falls back to the eager forward.
MAX_SHAPES = 8


def check_compile(value: Any) -> Any:
    """``compile`` checked as the config checks ``amp.compile``: a ValueError naming the argument and what it takes.

    Example:
        >>> check_compile("reduce_overhead")
        Traceback (most recent call last):
        ...
        ValueError: Argument compile should be true or false or reduce-overhead or None, got 'reduce_overhead'.
    """
    try:
        return COMPILE.argument(value, "compile")
    except ValueError as exc:
        if value not in _TORCH_MODES:
            raise
        raise ValueError(f"{str(exc).rstrip('.')} (torch.compile's mode names are not taken: compile=True is its "
                         f"default mode; \"reduce-overhead\" records CUDA graphs, with the step's checks).") from None


def off_cuda(device: torch.device) -> str:
    """The line a trainer says for ``compile="reduce-overhead"`` on a device without CUDA graphs."""
    return (f"compile reduce-overhead: CUDA graphs apply on CUDA only; on {device.type} the forward is compiled "
            f"without them (torch.compile's code, the first steps compiling), with the same parity check")


def loss_mismatch(eager: float, compiled: float, dtype: torch.dtype) -> Optional[str]:
    """Why a compiled loss fails the parity check against the eager one in ``dtype``, or None when it passes.

    Example:
        >>> loss_mismatch(2.302, 2.303, torch.bfloat16) is None
        True
        >>> loss_mismatch(2.302, 2.5, torch.float16)
        'the compiled loss 2.5 differs from the eager 2.302 by 8.6% (tolerance 0.5% in float16)'
        >>> loss_mismatch(2.302, float("nan"), torch.float16)
        'the compiled loss is not finite (nan) where the eager one is 2.302'
    """
    if not math.isfinite(compiled):  # (an eager loss that is not finite is not compared: see check_parity)
        return f"the compiled loss is not finite ({compiled}) where the eager one is {eager:.4g}"
    tolerance = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    difference = abs(compiled - eager) / max(abs(eager), 1e-12)
    if difference == difference and difference <= tolerance:  # NaN fails
        return None
    return (f"the compiled loss {compiled:.4g} differs from the eager {eager:.4g} by {difference:.1%} (tolerance "
            f"{tolerance:.1%} in {str(dtype).replace('torch.', '')})")


class GraphGuard:
    """The forward of a step compiled with ``mode="reduce-overhead"``, and its fallbacks to the eager model (see the
    module). The step calls :attr:`forward`; the guard says which module that is, so no one else changes it.

    Args:
        eager: the model as the step runs it (DDP-wrapped under data-parallel training).
        compiled: ``torch.compile(eager, mode="reduce-overhead")``.
    """

    def __init__(self, eager: nn.Module, compiled: nn.Module):
        self.eager, self.compiled = eager, compiled
        self.checked = False
        self.parity: Optional[str] = None  # "passed", or why it was not checked
        self.off: Optional[str] = None  # why the step went back to the eager forward
        self._shapes: set = set()

    @property
    def forward(self) -> nn.Module:
        """The compiled module, or the eager one once the guard fell back."""
        return self.compiled if self.off is None else self.eager

    def fall_back(self, why: str) -> None:
        """The eager forward from now on, said once."""
        if self.off is None:
            self.off = why
            logger.warning(f"compile reduce-overhead: back to the eager forward: {why}")

    def saw(self, x: Any) -> None:
        """A chunk's input ``x``: a shape past :data:`MAX_SHAPES` falls back."""
        if self.off is not None or not torch.is_tensor(x):
            return
        self._shapes.add(tuple(x.shape))
        if len(self._shapes) > MAX_SHAPES:
            self.fall_back(f"{len(self._shapes)} input shapes, each recorded as its own graphs (at most "
                           f"{MAX_SHAPES}): the last short batch and micro-batch changes make new ones")

    def check_parity(self, loss_of: Callable[[nn.Module], torch.Tensor], device: torch.device, dtype: torch.dtype,
                     sharded: bool = False) -> None:
        """The first training chunk's loss, compiled against eager (the state restored after each): ``loss_of(forward)``
        is that chunk's scalar loss through ``forward``, in the step's autocast; ``sharded``: an FSDP2 model."""
        self.checked = True
        model = unwrap(self.eager)
        if model is not self.eager or sharded:
            self.parity = "not checked under DDP or FSDP2"
            return
        if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in model.modules()):
            self.parity = "not checked: dropout draws other random numbers compiled than eager"
            return
        eager = self._loss(loss_of, self.eager, device, grad=False)
        compiled = self._loss(loss_of, self.forward, device, grad=True)
        if not math.isfinite(eager):  # nothing to compare with: the model's or the data's fault, not compile's
            self.parity = f"not checked: the first loss is not finite ({eager} eager, {compiled} compiled)"
            logger.warning(f"compile reduce-overhead: parity {self.parity}")
            return
        why = loss_mismatch(eager, compiled, dtype)  # one host sync, once
        self.parity = "passed" if why is None else why
        if why is not None:
            self.fall_back(f"parity check failed on the first step: {why}")

    def _loss(self, loss_of: Callable[[nn.Module], torch.Tensor], forward: nn.Module, device: torch.device,
              grad: bool) -> float:
        """``loss_of(forward)``, the buffers and random state kept as they were (grad on for the compiled forward:
        its training graph, the one the step then runs)."""
        buffers = [(b, b.detach().clone()) for b in unwrap(self.eager).buffers()]
        devices = [device] if device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type), torch.set_grad_enabled(grad):
            loss = loss_of(forward).detach().float().item()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        return loss
