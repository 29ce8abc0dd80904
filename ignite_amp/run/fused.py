"""Fused optimizer steps: torch's one-kernel Adam, AdamW, SGD and Adagrad (``fused=True``) where they apply.

torch's default on CUDA is the ``foreach`` step (a few kernels per group of tensors); ``fused=True`` is one kernel
per group, the fastest torch has (its docs: "We expect the fused implementation to be the fastest"). A config run
turns it on for the optimizers that take it on CUDA; elsewhere (the CPU's quickstart included) the step stays
torch's default, so a CPU result does not change. A value the config gives (``optimizer.kwargs.fused``) wins.

A fused step under a float16 GradScaler: the step unscales the gradients itself (``scaler.unscale_``, before
``GRADS_READY``), reads the inf/NaN flag once and skips ``optimizer.step()`` on an overflow, then calls it without
``grad_scale`` or ``found_inf`` (it never calls ``scaler.step``): the fused kernel gets true gradients, as the
foreach one does, and an overflowed step is skipped the same way.

A resume keeps the kernels this run chose (:func:`keep_kernels`): torch's ``Optimizer.load_state_dict`` takes each
group's flags from the checkpoint, so a run resumed on a GPU from a checkpoint of a CPU run would otherwise step
unfused, and the reverse fused.
"""
import inspect
from typing import Any, Dict, List, NamedTuple, Optional

import torch

__all__ = ["FusedChoice", "fused_devices", "fused_choice", "keep_kernels"]


class FusedChoice(NamedTuple):
    """``fused``: the value given to the optimizer (None: not given, torch's default); ``why``: the reason."""

    fused: Optional[bool]
    why: str


def fused_devices() -> tuple:
    """The device types torch has fused optimizer kernels for. torch keeps the list private
    (``torch.utils._foreach_utils._get_fused_kernels_supported_devices``); read here only, and
    ``tests/run/test_fast_path.py`` breaks loudly when it moves."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return tuple(_get_fused_kernels_supported_devices())


def fused_choice(name: str, kwargs: dict, device: torch.device, sharded: bool = False) -> FusedChoice:
    """Whether a config run builds ``torch.optim.<name>`` with ``fused=True`` on ``device``, and why.

    Example:
        >>> fused_choice("AdamW", {}, torch.device("cuda"))
        FusedChoice(fused=True, why='auto: on CUDA')
        >>> fused_choice("AdamW", {}, torch.device("cpu")).fused is None
        True
    """
    if "fused" in kwargs:
        return FusedChoice(kwargs["fused"], "optimizer.kwargs.fused")
    cls = getattr(torch.optim, name, None)
    if not isinstance(cls, type) or "fused" not in inspect.signature(cls).parameters:
        return FusedChoice(None, f"torch {torch.__version__} has no fused {name}")
    if kwargs.get("foreach"):
        return FusedChoice(None, "optimizer.kwargs.foreach")
    if kwargs.get("differentiable"):
        return FusedChoice(None, "optimizer.kwargs.differentiable")
    if sharded:
        return FusedChoice(None, "auto: not under FSDP2")
    if device.type not in fused_devices():
        return FusedChoice(None, f"torch has no fused kernels on {device.type}")
    if device.type != "cuda":
        return FusedChoice(None, "auto: CUDA only")  # torch's default step there, as before
    return FusedChoice(True, "auto: on CUDA")


def keep_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Keep ``optimizer``'s ``fused`` and ``foreach`` flags as built when a state dict is loaded into it (torch's
    ``load_state_dict`` would take the saved groups' flags: the kernels are this run's choice, not the checkpoint's)."""
    built: List[Dict[str, Any]] = [{k: group[k] for k in ("fused", "foreach") if k in group}
                                   for group in optimizer.param_groups]

    def restore(loaded: torch.optim.Optimizer) -> None:
        for group, flags in zip(loaded.param_groups, built, strict=True):
            group.update(flags)

    optimizer.register_load_state_dict_post_hook(restore)
