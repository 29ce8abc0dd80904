"""The memory plan of a config's run (``ignite-amp plan``): its model, optimizer, step settings and input shape.

The model and optimizer are built under fake tensors (nothing allocated: a model too large for this machine
plans too); a model whose construction reads values falls back to a real build.
"""
import contextlib
from typing import Callable, Optional, Sequence, Union

import torch

from ignite_amp.builders import build_optimizer, checkpoint_activations, config_device, input_shape, seed_everything
from ignite_amp.errors import ConfigError
from ignite_amp.memory_plan import DEFAULT_MARGIN, MemoryPlan, estimate_memory
from ignite_amp.models import build_model

__all__ = ["plan_config", "config_batch_sizes"]


def config_batch_sizes(cfg: dict) -> list:
    """The sizes a plan traces by default: the config's batch size (per process), or 8, 32 and 128 for ``auto``."""
    size = cfg["data"]["batch_size"]
    return [8, 32, 128] if size == "auto" else [size]


def _model_and_optimizer(cfg: dict) -> tuple:
    from torch._subclasses.fake_tensor import FakeTensorMode

    for context in (FakeTensorMode, contextlib.nullcontext):
        seed_everything(cfg["seed"])
        try:
            with context():
                model = build_model(cfg["model"]["name"], cfg["model"]["num_classes"], cfg["model"]["kwargs"])
                checkpoint_activations(cfg, model)  # as the run will (its blocks keep only their inputs)
                return model, build_optimizer(cfg["optimizer"], model)
        except ConfigError:
            raise
        except Exception:  # a constructor that reads values (data-dependent under fake tensors): build it for real
            if context is contextlib.nullcontext:
                raise
    raise RuntimeError("unreachable")


def plan_config(cfg: dict, batch_sizes: Optional[Sequence[int]] = None, memory: Union[None, int, str] = None,
                margin: float = DEFAULT_MARGIN, progress: Optional[Callable] = None) -> MemoryPlan:
    """:func:`~ignite_amp.memory_plan.estimate_memory` for a loaded config: its model, optimizer, ``amp:``
    settings (``compile`` planned off) and image shape; ``memory`` None: the GPU's free memory on a GPU."""
    if cfg["distributed"]["strategy"] == "fsdp":
        raise ConfigError("plan: not with distributed.strategy fsdp yet (a sharded step's memory is each rank's "
                          "shard); plan the same config with distributed.strategy ddp for one process's peak")
    device = config_device(cfg)
    model, optimizer = _model_and_optimizer(cfg)
    shape, classes = input_shape(cfg["data"]), cfg["model"]["num_classes"]

    def make_batch(n: int):
        return torch.randn(n, *shape), torch.randint(0, classes, (n,))

    amp = {k: v for k, v in cfg["amp"].items() if k not in ("cudnn_benchmark", "compile", "activation_checkpointing")}
    try:
        return estimate_memory(model, optimizer, torch.nn.functional.cross_entropy, make_batch,
                               batch_sizes or config_batch_sizes(cfg), memory=memory, margin=margin, device=device,
                               progress=progress, **amp)
    except ValueError as exc:
        raise ConfigError(f"plan: {exc}") from None
