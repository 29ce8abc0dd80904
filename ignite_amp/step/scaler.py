"""The step's ``GradScaler`` (:func:`build_scaler`), and the reads of its state that torch keeps private.

torch has no public accessor for those; ``GradScaler`` itself reads them. ``tests/step/test_scaler.py``
fails loudly if a torch upgrade changes them.
"""
from typing import Optional, Union

import torch

__all__ = ["build_scaler", "found_inf", "agree_found_inf", "scale_tensor"]


def build_scaler(scaler: Union[bool, torch.amp.GradScaler, None], device: torch.device, float16: bool,
                 scaler_kwargs: Optional[dict] = None) -> torch.amp.GradScaler:
    """The step's ``GradScaler``: ``scaler`` itself when it is one (used as given, as Ignite does: its
    ``init_scale``, ``growth_interval`` and ``enabled`` stand), else a new one on ``device``, enabled
    for float16 (None) or as ``scaler`` says (True or False), built with ``scaler_kwargs``."""
    if isinstance(scaler, torch.amp.GradScaler):
        if scaler_kwargs:
            raise ValueError("Argument scaler_kwargs: scaler is a GradScaler already; set its arguments when "
                             "building it, or pass scaler=True with scaler_kwargs")
        return scaler
    if scaler is not None and not isinstance(scaler, bool):
        raise TypeError(f"Argument scaler should be True, False, None or a torch.amp.GradScaler, "
                        f"got {type(scaler).__name__}")
    return torch.amp.GradScaler(device.type, enabled=float16 if scaler is None else scaler, **(scaler_kwargs or {}))


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The inf/NaN flag that ``scaler.unscale_(optimizer)`` recorded, summed over devices (a device tensor).

    ``GradScaler.step`` reads the same private state.
    """
    flags = scaler._found_inf_per_device(optimizer)  # private: {device: 1-element float tensor}
    if not flags:
        raise RuntimeError("GradScaler recorded no inf/NaN check for this optimizer: call unscale_ first "
                           "(or torch changed GradScaler's internals)")
    values = list(flags.values())
    return values[0] if len(values) == 1 else torch.stack([v.to(values[0].device) for v in values]).sum()


def agree_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """After ``unscale_`` on sharded gradients: make the inf/NaN flag the maximum over the ranks, in
    place, so every rank skips the same steps and ``scaler.update()`` moves every scale alike."""
    import torch.distributed as dist

    for flag in scaler._found_inf_per_device(optimizer).values():  # private, as in found_inf
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)


def scale_tensor(scaler: torch.amp.GradScaler) -> Optional[torch.Tensor]:
    """The GradScaler's scale as a device tensor (no sync), None before its first use.

    ``get_scale()`` reads it with a host sync of its own.
    """
    return scaler._get_scale_async()
