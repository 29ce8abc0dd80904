"""Builders shared by the run, ``compare`` and the CLI: device, seeding, optimizer, scheduler.

Each turns a validated config section into a torch object, or raises :class:`ConfigError`
naming the key.
"""
import dataclasses
import inspect
import typing
from typing import Any, Callable, Optional

import ignite.distributed as idist
import torch
from ignite.utils import manual_seed

from ignite_amp.core.collectives import is_distributed
from ignite_amp.core.config_keys import FIXED, FIXED_UNDER_SCHEDULE, Boolean, Choice, Mapping, Number, Text, setting
from ignite_amp.core.device import is_oom_error, resolve_device
from ignite_amp.errors import ConfigError, first_line
from ignite_amp.run.fused import fused_choice, keep_kernels
from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks
from ignite_amp.transforms.float8 import convert_to_float8

__all__ = ["OptimizerConfig", "SchedulerConfig", "check_boolean_kwargs", "config_device", "seed_everything",
           "build_optimizer", "build_scheduler", "input_shape", "check_classes", "check_model_runs",
           "checkpoint_activations"]


@dataclasses.dataclass
class OptimizerConfig:
    """optimizer: any torch.optim class, built as name(model.parameters(), lr=lr, **kwargs)."""

    name: str = setting("AdamW", Text(r"[A-Za-z_][A-Za-z0-9_]*", "a torch.optim class name"),
                        "a torch.optim class name", FIXED)
    lr: float = setting(3.0e-4, Number(), "the learning rate (a schedule's peak)", FIXED_UNDER_SCHEDULE)
    kwargs: dict = setting({"weight_decay": 0.05}, Mapping(), "more keyword arguments for the optimizer (those it "
                           "takes as booleans, such as fused or foreach, are checked as true or false)",
                           FIXED_UNDER_SCHEDULE)

    @staticmethod
    def check_values(values: dict, path: str) -> None:
        check_boolean_kwargs(getattr(torch.optim, values["name"], None), values["kwargs"], f"{path}.kwargs")


@dataclasses.dataclass
class SchedulerConfig:
    """scheduler: the learning-rate schedule, stepped once per optimizer step taken."""

    name: str = setting("none", Choice("none", "cosine", "onecycle"), "none, cosine or onecycle", FIXED)
    kwargs: dict = setting({}, Mapping(), "more keyword arguments for the torch scheduler", FIXED)

    @staticmethod
    def check_values(values: dict, path: str) -> None:
        from torch.optim import lr_scheduler

        cls = {"cosine": lr_scheduler.CosineAnnealingLR, "onecycle": lr_scheduler.OneCycleLR}.get(values["name"])
        check_boolean_kwargs(cls, values["kwargs"], f"{path}.kwargs")


def _takes_a_boolean(parameter: inspect.Parameter) -> Optional[Boolean]:
    """The check of a keyword its class takes as a boolean (its default is one, or it is annotated ``bool`` or
    ``Optional[bool]``), else None."""
    annotation = parameter.annotation
    if isinstance(annotation, str):  # postponed annotations
        annotation = {"bool": bool, "Optional[bool]": Optional[bool], "bool|None": Optional[bool]}.get(
            annotation.replace(" ", ""), inspect.Parameter.empty)
    kinds = set(typing.get_args(annotation)) or {annotation}
    if isinstance(parameter.default, bool) or annotation is bool or kinds == {bool, type(None)}:
        return Boolean(nullable=parameter.default is None or type(None) in kinds)
    return None


def check_boolean_kwargs(cls: Any, kwargs: dict, path: str) -> None:
    """A torch class's boolean keywords in a config's ``kwargs`` are true or false, as every boolean key of the config
    is: YAML 1.2 reads ``no`` as the string "no", which Python's truth would read as True (``fused: no`` turned the
    fused step on). A ConfigError naming the key path, e.g. ``optimizer.kwargs.fused: expected true or false or null,
    got "no"``."""
    if not isinstance(cls, type):
        return  # an unknown name: the builder says so
    parameters = inspect.signature(cls).parameters
    for key, value in kwargs.items():
        check = _takes_a_boolean(parameters[key]) if key in parameters else None
        if check is not None:
            check(value, f"{path}.{key}")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA): Ignite's ``manual_seed``."""
    manual_seed(seed)


def config_device(cfg: dict) -> torch.device:
    """The config's ``device`` as a torch device; a device that isn't there is a ConfigError.

    Inside a process group of several ranks it is this rank's device (``cuda:LOCAL_RANK`` on
    GPUs), whose type must match the config's.
    """
    try:
        device = resolve_device(cfg["device"])
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"device: {exc}") from None
    if not is_distributed():
        return device
    rank_device = idist.device()
    if rank_device.type != device.type:
        raise ConfigError(f"device: {cfg['device']} resolves to {device.type}, but ignite.distributed places "
                          f"this rank on {rank_device}; use device: auto")
    return rank_device


def build_optimizer(opt: dict, model: torch.nn.Module, device: Optional[torch.device] = None,
                    sharded: bool = False) -> torch.optim.Optimizer:
    """``torch.optim.<name>(model.parameters(), lr=lr, **kwargs)``; given the run's ``device``, with ``fused=True``
    where :func:`ignite_amp.run.fused.fused_choice` turns it on (CUDA)."""
    cls = getattr(torch.optim, opt["name"], None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer.name: unknown torch.optim optimizer {opt['name']!r}")
    if opt["name"] == "LBFGS":
        raise ConfigError("optimizer.name: LBFGS needs a closure that evaluates the loss again, which a training "
                          "step does not give; use a first-order optimizer (AdamW, SGD...)")
    kwargs = dict(opt["kwargs"])
    factory: Callable[..., torch.optim.Optimizer] = cls  # a subclass: its own arguments (lr...), not Optimizer's
    if device is not None and fused_choice(opt["name"], kwargs, device, sharded).fused and "fused" not in kwargs:
        kwargs["fused"] = True
    try:
        optimizer = factory(model.parameters(), lr=opt["lr"], **kwargs)
    except Exception as exc:  # TypeError, ValueError, an IndexError for betas=[0.9]...: the kwargs are wrong
        raise ConfigError(f"optimizer.kwargs: {opt['name']} refused its arguments ({exc.__class__.__name__}: "
                          f"{exc})") from None
    keep_kernels(optimizer)  # a resume keeps this run's fused/foreach choice, not the checkpoint's
    return optimizer


def build_scheduler(sched: dict, optimizer: torch.optim.Optimizer, lr: float,
                    total_steps: int) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
    """A cosine or one-cycle schedule over ``total_steps`` optimizer steps, or None."""
    from torch.optim import lr_scheduler

    def make(opt: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        if sched["name"] == "cosine":
            return lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps, **sched["kwargs"])
        return lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps, **sched["kwargs"])

    if sched["name"] not in ("cosine", "onecycle"):
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
        raise ConfigError(f"scheduler.kwargs: {sched['name']} refused its arguments ({exc})") from None


def checkpoint_activations(cfg: dict, model: torch.nn.Module, device: torch.device) -> None:
    """The model transforms of ``amp:`` in place as soon as the model is built, before the batch-size search,
    DDP or FSDP2 sharding and compile, in the order of :mod:`ignite_amp.transforms.activation_checkpointing`:
    ``dtype: float8``'s conversion first (on the run's ``device``), then ``activation_checkpointing`` of the blocks
    (``distributed.blocks``, or the repeated ones), so a block that is itself an ``nn.Linear`` stays
    checkpointed as the ``Float8Linear`` it becomes (converted later, it would lose its checkpoint).
    float8 without checkpointing is converted by the trainer's factory (nothing comes between); ``auto`` checkpoints
    once the optimizer is built (:mod:`ignite_amp.run.plan`), after this conversion."""
    amp = cfg["amp"]
    if amp["dtype"] == "float8" and amp["activation_checkpointing"]:
        try:  # sharded on several processes: FSDP2 all-gathers the float8 weights in float8 (as run._shard)
            convert_to_float8(model, amp["float8_recipe"], device, amp["fp32_modules"],
                              fsdp_all_gather=cfg["distributed"]["strategy"] == "fsdp" and is_distributed())
        except ValueError as exc:
            raise ConfigError(f"amp: {exc}") from None
    if amp["activation_checkpointing"] in (True, "selective"):  # auto: once the optimizer is built (run.plan)
        try:
            checkpoint_blocks(model, cfg["distributed"]["blocks"] or None,
                              "selective" if amp["activation_checkpointing"] == "selective" else "full")
        except ValueError as exc:
            raise ConfigError(f"distributed.{exc}") from None


def input_shape(data: dict) -> tuple:
    """(C, H, W) of the config's images."""
    if data["name"] in ("cifar10", "cifar100"):
        return (3, 32, 32)
    size = data["image_size"] or (224 if data["name"] == "imagefolder" else 32)
    return (3, size, size)


def check_classes(cfg: dict, n_classes: int) -> None:
    """The data set's class count must be the model's head width."""
    if n_classes != cfg["model"]["num_classes"]:
        raise ConfigError(f"model.num_classes: {cfg['model']['num_classes']} but data set "
                          f"{cfg['data']['name']} has {n_classes} classes")


def check_model_runs(cfg: dict, step, passes: tuple = ()) -> None:
    """Run the model once on two blank images of the config's shape: a shape the model cannot take,
    or a head of the wrong width, is a one-line error now rather than a traceback mid-epoch (``passes``: errors
    raised as they are, e.g. what fake tensors cannot run, for the plan)."""
    model, shape = step.model, (2, *input_shape(cfg["data"]))
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
        raise ConfigError(f"model.name: {cfg['model']['name']} cannot run on {shape[1]}x{shape[2]}x{shape[3]} images "
                          f"({first}); check data.image_size and model.kwargs") from None
    finally:
        model.train(was_training)
    classes = cfg["model"]["num_classes"]
    if not torch.is_tensor(out) or out.dim() != 2 or out.shape[1] != classes:
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ConfigError(f"model.name: {cfg['model']['name']} returns {got} for a batch of 2, not (2, {classes}) "
                          f"logits for model.num_classes {classes}")
