"""``channels_last="auto"``: the memory format a model trains fastest in, chosen from its device and its layers.

On CUDA, cuDNN's tensor-core convolutions work in channels-last (NHWC) layout: in the default layout (NCHW) each
convolution transposes its input and output around the kernel. Measured on one H100 (issue 51), ResNet-50 at 224x224
in float16 went from 1.30x to 1.56x float32's images/s with model and images in channels-last. Elsewhere (CPU, MPS)
the gain is not measured, and a model of linear layers gains nothing: ``auto`` is on only on CUDA for a model whose
2-d convolutions hold at least half of its weight matrices (:data:`CONV_SHARE`). The rule reads weights, not FLOPs,
since no input is known when a step is built: a convolutional network with a wide fully connected head (VGG: 11% of
its weights in convolutions) stays off, and is turned on with ``channels_last=True``. An explicit True or False wins.
"""
from typing import NamedTuple, Optional, Union

import torch
from torch import nn

from ignite_amp.core.config_keys import Boolean

__all__ = ["CHANNELS_LAST", "CONV_SHARE", "ChannelsLastChoice", "conv_share", "choose_channels_last"]

#: What ``channels_last`` may be: true, false or "auto" (the config's check and the factories' argument check).
CHANNELS_LAST = Boolean(also=("auto",))
#: The share of a model's weight matrices in 2-d convolutions from which ``auto`` turns channels-last on (on CUDA).
CONV_SHARE = 0.5
_CONVS = (nn.Conv2d, nn.ConvTranspose2d)


class ChannelsLastChoice(NamedTuple):
    """Whether the step runs model and images in channels-last, and why (empty when the caller said so)."""

    on: bool
    why: str


def conv_share(model: nn.Module) -> Optional[float]:
    """The share of ``model``'s weight matrices (its parameters of 2 or more dimensions) that belong to 2-d
    convolutions, by element count; None for a model without one. Lazy (uninitialised) parameters are not counted.

    Example:
        >>> conv_share(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 2)))  # 216 and 16 weights
        0.9310344827586207
    """
    conv = convs = 0
    seen = set()
    for module in model.modules():
        if isinstance(module, _CONVS) and _counted(module.weight):
            seen.add(id(module.weight))
            conv += module.weight.numel()
            convs += 1
    if not convs:
        return None
    other = sum(p.numel() for p in model.parameters() if _counted(p) and p.dim() >= 2 and id(p) not in seen)
    return conv / (conv + other)


def _counted(p: torch.Tensor) -> bool:
    return not isinstance(p, nn.parameter.UninitializedParameter)


def choose_channels_last(requested: Union[bool, str], model: nn.Module, device: torch.device) -> ChannelsLastChoice:
    """``requested`` (True, False or "auto") resolved for ``model`` on ``device``; see the module's rule.

    Example:
        >>> cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 2))
        >>> choose_channels_last("auto", cnn, torch.device("cpu")).on
        False
        >>> choose_channels_last("auto", cnn, torch.device("cuda")).why
        'auto: 2-d convolutions hold 93% of the weights'
    """
    requested = CHANNELS_LAST.argument(requested, "channels_last")
    if requested != "auto":
        return ChannelsLastChoice(bool(requested), "")
    if device.type != "cuda":
        return ChannelsLastChoice(False, "auto: CUDA only")
    share = conv_share(model)
    if share is None:
        return ChannelsLastChoice(False, "auto: no 2-d convolution")
    if share < CONV_SHARE:
        return ChannelsLastChoice(False, f"auto: 2-d convolutions hold {share:.0%} of the weights, under "
                                         f"{CONV_SHARE:.0%}")
    return ChannelsLastChoice(True, f"auto: 2-d convolutions hold {share:.0%} of the weights")
