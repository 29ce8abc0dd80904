"""The gradients' total L2 norm, and clipping to a given norm, at the host cost of their kernels.

``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_`` enter ``no_grad``, group the tensors by
device and dtype in Python and check foreach support on every call: on a small model that host time is
as long as their kernels take. Where the gradients share one device and dtype on a CPU or CUDA device
(one group: nearly every model), :func:`total_norm` and :func:`clip_to_norm_` run torch's foreach kernels
in torch's order, so the values are the same to the bit (``tests/test_grad_norm.py``); other gradients
go through torch's functions. Gradients of an ordinary backward do not require grad, so no ``no_grad``
is needed around them.
"""
from typing import Iterable, List, Optional, Tuple

import torch

__all__ = ["total_norm", "clip_to_norm_"]

_FUSED = ("cpu", "cuda")  # device types whose foreach kernels torch's functions use with foreach=True


def _one_group(grads: List[torch.Tensor]) -> Optional[Tuple[torch.device, List[torch.Tensor]]]:
    """The device and the gradients, when they are one (device, dtype) group torch's foreach path takes whole."""
    groups = torch._C._group_tensors_by_device_and_dtype([grads], False)  # what torch's functions call
    if len(groups) != 1:
        return None
    (device, _), ((tensors,), _) = next(iter(groups.items()))
    return (device, tensors) if device.type in _FUSED else None


def total_norm(grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """``get_total_norm(grads, 2.0, foreach=True)``, a device tensor (no host sync); None for no gradients.
    Of sharded gradients (DTensors), the norm over every rank's shards."""
    if not grads:
        return None
    group = _one_group(grads)
    if group is not None:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(group[1], 2.0)), 2.0)
    else:
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_to_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """``clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)``: every gradient times
    ``min(max_norm / (norm + 1e-6), 1)``, in place, without a host sync."""
    parameters = parameters if isinstance(parameters, list) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    group = _one_group(grads) if grads else None
    if group is None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
        return
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)  # torch's expression, as torch writes it
    torch._foreach_mul_(group[1], coef.to(group[0]))
