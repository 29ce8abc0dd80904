"""Builders shared by the run, ``compare`` and the CLI: device, seeding, optimizer, scheduler.

Each turns a validated config section into a torch object, or raises :class:`ConfigError`
naming the key.
"""
from typing import Callable, Optional, Union

import torch
from ignite.utils import manual_seed

from ignite_amp.config.run_keys import OptimizerConfig, SchedulerConfig, check_boolean_kwargs  # noqa: F401  (their old home)
from ignite_amp.config.tree import Config
from ignite_amp.core.collectives import is_distributed
from ignite_amp.core.config_values import section_of
from ignite_amp.core.device import is_oom_error, run_device
from ignite_amp.data.datasets import DataConfig
from ignite_amp.errors import ConfigError, first_line
from ignite_amp.run.fused import fused_choice, keep_kernels
from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks
from ignite_amp.transforms.float8 import convert_to_float8

__all__ = ["OptimizerConfig", "SchedulerConfig", "check_boolean_kwargs", "config_device", "seed_everything",
           "build_optimizer", "build_scheduler", "input_shape", "check_classes", "check_model_runs",
           "checkpoint_activations"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA): Ignite's ``manual_seed``."""
    manual_seed(seed)


def config_device(cfg: Config) -> torch.device:
    """The config's ``device`` as this process's torch device (:func:`ignite_amp.core.device.run_device`)."""
    return run_device(cfg.device)


def build_optimizer(opt: Union[OptimizerConfig, dict], model: torch.nn.Module, device: Optional[torch.device] = None,
                    sharded: bool = False) -> torch.optim.Optimizer:
    """``torch.optim.<name>(model.parameters(), lr=lr, **kwargs)``; given the run's ``device``, with ``fused=True``
    where :func:`ignite_amp.run.fused.fused_choice` turns it on (CUDA)."""
    opt = section_of(OptimizerConfig, opt)
    cls = getattr(torch.optim, opt.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer.name: unknown torch.optim optimizer {opt.name!r}")
    if opt.name == "LBFGS":
        raise ConfigError("optimizer.name: LBFGS needs a closure that evaluates the loss again, which a training "
                          "step does not give; use a first-order optimizer (AdamW, SGD...)")
    kwargs = dict(opt.kwargs)
    factory: Callable[..., torch.optim.Optimizer] = cls  # a subclass: its own arguments (lr...), not Optimizer's
    if device is not None and fused_choice(opt.name, kwargs, device, sharded).fused and "fused" not in kwargs:
        kwargs["fused"] = True
    try:
        optimizer = factory(model.parameters(), lr=opt.lr, **kwargs)
    except Exception as exc:  # TypeError, ValueError, an IndexError for betas=[0.9]...: the kwargs are wrong
        raise ConfigError(f"optimizer.kwargs: {opt.name} refused its arguments ({exc.__class__.__name__}: "
                          f"{exc})") from None
    keep_kernels(optimizer)  # a resume keeps this run's fused/foreach choice, not the checkpoint's
    return optimizer


def build_scheduler(sched: Union[SchedulerConfig, dict], optimizer: torch.optim.Optimizer, lr: float,
                    total_steps: int) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
    """A cosine or one-cycle schedule over ``total_steps`` optimizer steps, or None."""
    sched = section_of(SchedulerConfig, sched)
    from torch.optim import lr_scheduler

    def make(opt: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        if sched.name == "cosine":
            return lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps, **sched.kwargs)
        return lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps, **sched.kwargs)

    if sched.name not in ("cosine", "onecycle"):
        return None
    try:
        # A kwarg of the wrong type (eta_min: "abc") fails only when the schedule computes a step:
        # step a throwaway copy now rather than fail in the first iteration.
        probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr, momentum=0.9)
        probe_schedule = make(probe)
        for _ in range(min(2, total_steps - 1)):
            probe.step()
            probe_schedule.step()
        return make(optimizer)
    except Exception as exc:  # torch raises TypeError, ValueError, ZeroDivisionError... for bad arguments
        raise ConfigError(f"scheduler.kwargs: {sched.name} refused its arguments ({exc})") from None


def checkpoint_activations(cfg: Config, model: torch.nn.Module, device: torch.device) -> None:
    """The model transforms of ``amp:`` in place as soon as the model is built, before the batch-size search,
    DDP or FSDP2 sharding and compile, in the order of :mod:`ignite_amp.transforms.activation_checkpointing`:
    ``dtype: float8``'s conversion first (on the run's ``device``), then ``activation_checkpointing`` of the blocks
    (``distributed.blocks``, or the repeated ones), so a block that is itself an ``nn.Linear`` stays
    checkpointed as the ``Float8Linear`` it becomes (converted later, it would lose its checkpoint).
    float8 without checkpointing is converted by the trainer's factory (nothing comes between); ``auto`` checkpoints
    once the optimizer is built (:mod:`ignite_amp.run.plan`), after this conversion."""
    amp = cfg.amp
    if amp.dtype == "float8" and amp.activation_checkpointing:
        try:  # sharded on several processes: FSDP2 all-gathers the float8 weights in float8 (as run._shard)
            convert_to_float8(model, amp.float8_recipe, device, amp.fp32_modules,
                              fsdp_all_gather=cfg.distributed.sharded and is_distributed())
        except ValueError as exc:
            raise ConfigError(f"amp: {exc}") from None
    if amp.activation_checkpointing in (True, "selective"):  # auto: once the optimizer is built (run.plan)
        try:
            checkpoint_blocks(model, cfg.distributed.blocks or None,
                              "selective" if amp.activation_checkpointing == "selective" else "full")
        except ValueError as exc:
            raise ConfigError(f"distributed.{exc}") from None


def input_shape(data: Union[DataConfig, dict]) -> tuple:
    """(C, H, W) of the config's images."""
    data = section_of(DataConfig, data)
    if data.name in ("cifar10", "cifar100"):
        return (3, 32, 32)
    size = data.image_size or (224 if data.name == "imagefolder" else 32)
    return (3, size, size)


def check_classes(cfg: Config, n_classes: int) -> None:
    """The data set's class count must be the model's head width."""
    if n_classes != cfg.model.num_classes:
        raise ConfigError(f"model.num_classes: {cfg.model.num_classes} but data set "
                          f"{cfg.data.name} has {n_classes} classes")


def check_model_runs(cfg: Config, step, passes: tuple = ()) -> None:
    """Run the model once on two blank images of the config's shape: a shape the model cannot take,
    or a head of the wrong width, is a one-line error now rather than a traceback mid-epoch (``passes``: errors
    raised as they are, e.g. what fake tensors cannot run, for the plan)."""
    model, shape = step.model, (2, *input_shape(cfg.data))
    x = torch.zeros(shape, device=step.device)
    if step.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), step.autocast():
            out = model(x)
    except passes:
        raise
    except RuntimeError as exc:
        if is_oom_error(exc):
            raise
        first = first_line(exc)
        raise ConfigError(f"model.name: {cfg.model.name} cannot run on {shape[1]}x{shape[2]}x{shape[3]} images "
                          f"({first}); check data.image_size and model.kwargs") from None
    finally:
        model.train(was_training)
    classes = cfg.model.num_classes
    if not torch.is_tensor(out) or out.dim() != 2 or out.shape[1] != classes:
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ConfigError(f"model.name: {cfg.model.name} returns {got} for a batch of 2, not (2, {classes}) "
                          f"logits for model.num_classes {classes}")
