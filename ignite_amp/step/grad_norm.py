"""The gradients' total L2 norm, and clipping to a given norm, at the host cost of their kernels.

``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_`` enter ``no_grad``, group the tensors by
device and dtype in Python and check foreach support on every call: on a small model that host time is
as long as their kernels take. Where the gradients share one device and dtype on a CPU or CUDA device
(one group: nearly every model), :func:`total_norm` and :func:`clip_to_norm_` run torch's foreach kernels
in torch's order, so the values are the same to the bit (``tests/handlers/test_handler_cost.py``); other gradients
go through torch's functions. Gradients of an ordinary backward do not require grad, so no ``no_grad``
is needed around them. :class:`GradNorm` is the step's: the norm once per step, and clipping to it
without listing and grouping the gradients again.
"""
from typing import Iterable, List, Optional, Sequence, Tuple, cast

import torch

__all__ = ["total_norm", "clip_to_norm_", "clip_coefficient", "GradNorm"]

_FUSED = ("cpu", "cuda")  # device types whose foreach kernels torch's functions use with foreach=True
_foreach_norm, _foreach_mul_, _stack, _vector_norm = (torch._foreach_norm, torch._foreach_mul_, torch.stack,
                                                      torch.linalg.vector_norm)


def _one_group(grads: List[torch.Tensor]) -> Optional[Tuple[torch.device, List[torch.Tensor]]]:
    """The device and the gradients, when they are one (device, dtype) group torch's foreach path takes whole."""
    # What torch's functions call; typed for lists that may hold None (these hold none, and come back as they went).
    groups = torch._C._group_tensors_by_device_and_dtype([cast(List[Optional[torch.Tensor]], grads)], False)
    if len(groups) != 1:
        return None
    (device, _), ((tensors,), _) = next(iter(groups.items()))
    return (device, cast(List[torch.Tensor], tensors)) if device.type in _FUSED else None


def _full(norm: torch.Tensor) -> torch.Tensor:
    """Of sharded gradients (DTensors), the norm over every rank's shards."""
    return norm if type(norm) is torch.Tensor or not hasattr(norm, "full_tensor") else norm.full_tensor()


def _group_norm(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The norm of one foreach group's tensors, as ``get_total_norm`` computes it."""
    return _full(_vector_norm(_stack(_foreach_norm(tensors, 2.0)), 2.0))


def total_norm(grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """``get_total_norm(grads, 2.0, foreach=True)``, a device tensor (no host sync); None for no gradients.
    Of sharded gradients (DTensors), the norm over every rank's shards."""
    if not grads:
        return None
    group = _one_group(grads)
    if group is not None:
        return _group_norm(group[1])
    return _full(torch.nn.utils.get_total_norm(grads, 2.0, foreach=True))


def clip_coefficient(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """``torch.clamp(max_norm / (norm + 1e-6), max=1.0)`` as ``clip_grads_with_norm_`` computes it (the
    division is ``Tensor.__rtruediv__``: a reciprocal, then a product), in place on one new tensor."""
    return (norm + 1e-6).reciprocal_().mul_(float(max_norm)).clamp_(max=1.0)


def clip_to_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """``clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)``: every gradient times
    ``min(max_norm / (norm + 1e-6), 1)``, in place, without a host sync."""
    parameters = parameters if isinstance(parameters, list) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    group = _one_group(grads) if grads else None
    if group is None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
        return
    _foreach_mul_(group[1], clip_coefficient(max_norm, norm).to(group[0]))


class GradNorm:
    """A step's pre-clip gradient norm (:func:`total_norm` of its parameters' gradients), computed once per
    optimizer step when :attr:`tracked`, and clipping to it (:meth:`clip_`) that reuses the norm's grouping."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = params
        self.tracked = False  #: compute the norm at each :meth:`compute`
        self.value: Optional[torch.Tensor] = None  #: this step's norm; None before it or untracked
        self._device: Optional[torch.device] = None  # this step's gradients were one foreach group on it
        self._count = 0  # ... and this many

    def clear(self) -> None:
        """Forget the last step's norm (a new iteration, or a retry after out of memory)."""
        self.value = self._device = None

    def compute(self) -> None:
        """The norm of the gradients as they are now (before any ``GRADS_READY`` handler), when tracked."""
        if not self.tracked:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        group = _one_group(grads) if grads else None
        if group is None:
            self.value = total_norm(grads)
            return
        self._device, self._count = group[0], len(grads)
        self.value = _group_norm(group[1])

    def clip_(self, max_norm: float) -> None:
        """``clip_grads_with_norm_(params, max_norm, value, foreach=True)``; nothing without a norm."""
        norm = self.value
        if norm is None:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if self._device is None or len(grads) != self._count:  # not one group, or a handler changed which
            clip_to_norm_(self.params, max_norm, norm)
            return
        _foreach_mul_(grads, clip_coefficient(max_norm, norm))  # the norm is on the group's device
