"""Models: any ``torchvision.models`` name, ``"pkg.module:callable"``, and two built-ins.

Built-ins, addressed like any callable:
- ``ignite_amp.models:small_cnn``: a four-block CNN that learns ``shapes`` in seconds on a CPU.
- ``ignite_amp.models:cifar_resnet18``: torchvision's ResNet-18 with the CIFAR stem
  (3x3 stride-1 first convolution, no max-pool), the usual recipe for 32x32 images.
"""
import dataclasses
import importlib
from typing import Any, Dict

from torch import nn

from ignite_amp.core.config_keys import FIXED, Integer, Mapping, Text, setting
from ignite_amp.core.config_values import Section
from ignite_amp.errors import ConfigError

__all__ = ["ModelConfig", "build_model", "small_cnn", "cifar_resnet18"]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelConfig(Section):
    """model: the network, built with no weights (nothing is downloaded)."""

    name: str = setting(
        "resnet18", Text(r"[A-Za-z0-9_.]+(:[A-Za-z0-9_.]+)?", 'a torchvision model name or "pkg.module:callable"'),
        'a torchvision model name, or "pkg.module:callable" (built-ins: ignite_amp.models:small_cnn, '
        "ignite_amp.models:cifar_resnet18)", FIXED)
    num_classes: int = setting(10, Integer(1), "the head's width; must match the data set (shapes, cifar10: 10)",
                               FIXED)
    kwargs: Dict[str, Any] = setting({}, Mapping(), "more keyword arguments for the model's constructor", FIXED)


def small_cnn(num_classes: int = 10, width: int = 32) -> nn.Module:
    """Conv-BN-ReLU blocks with pooling, then a linear head named ``head``."""

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True), nn.MaxPool2d(2))

    return nn.Sequential(
        block(3, width), block(width, 2 * width), block(2 * width, 4 * width), block(4 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes),
    )


def cifar_resnet18(num_classes: int = 10) -> nn.Module:
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_model(name: str, num_classes: int, kwargs: dict) -> nn.Module:
    """Build ``name`` (torchvision model or ``"pkg.module:callable"``) with ``num_classes``, no weights."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"model.name: cannot import {name!r} ({exc.__class__.__name__}: {exc})") from None
        if not callable(factory):
            raise ConfigError(f"model.name: {name} is a {type(factory).__name__}, not a callable that builds a "
                              f"torch.nn.Module")
        try:
            model = factory(num_classes=num_classes, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"model.kwargs: {name} refused its arguments ({exc})") from None
        except Exception as exc:  # the user's own code failed: name it (the traceback goes to train.log)
            raise ConfigError(f"model.name: {name} raised {exc.__class__.__name__}: {exc}") from exc
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.name: {name} built a {type(model).__name__}, not a torch.nn.Module")
    else:
        from torchvision import models

        if name not in models.list_models():
            raise ConfigError(f"model.name: unknown torchvision model {name!r}")
        try:
            model = models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model.kwargs: {name} refused its arguments ({exc})") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name: {name} returned {type(model).__name__}, not a torch.nn.Module")
    return model
