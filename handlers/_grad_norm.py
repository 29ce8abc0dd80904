"""The pre-clip total gradient norm of one optimizer step, computed once and shared.

GradientClipping and TensorBoardMetrics both need it at ``AmpEvents.GRADS_READY``; whichever
runs first computes it (on device, no host sync) and the other reuses it, so the logged norm
is always the one before clipping, whatever the order the handlers were attached in.
"""
from typing import Iterable

import torch
from ignite.engine import Engine

__all__ = ["total_grad_norm"]


def total_grad_norm(engine: Engine, parameters: Iterable[torch.Tensor], norm_type: float = 2.0,
                    share: bool = True) -> torch.Tensor:
    """Total norm of the gradients of ``parameters``; cached per iteration in ``engine.state``."""
    key = (engine.state.iteration, float(norm_type))
    cached = getattr(engine.state, "_grad_norm_cache", None)
    if share and cached is not None and cached[0] == key:
        return cached[1]
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
    else:
        norm = torch.zeros(())
    if share:
        engine.state._grad_norm_cache = (key, norm)
        engine.state.grad_norm = norm
    return norm
