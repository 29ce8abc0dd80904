"""The keys of the run itself: its optimizer, schedule, length and processes (``optimizer``, ``scheduler``,
``train``, ``distributed``).

Every other section is declared beside the code that reads it (:mod:`ignite_amp.config.tree` gathers them); these four
are read by the run (:mod:`ignite_amp.run`) and the launcher, which sit above the config and build from it, so they are
declared here, below both (their old homes, ``run.builders``, ``run.epochs`` and ``launcher``, still export them).
"""
import dataclasses
import inspect
import typing
from typing import Any, Dict, List, Optional

import torch

from ignite_amp.core.config_keys import (
    FIXED,
    FIXED_UNDER_SCHEDULE,
    Boolean,
    Choice,
    Integer,
    Mapping,
    Names,
    Number,
    Text,
    setting,
)
from ignite_amp.core.config_values import Section

__all__ = ["OptimizerConfig", "SchedulerConfig", "TrainConfig", "DistributedConfig", "BACKENDS",
           "check_boolean_kwargs"]

@dataclasses.dataclass(frozen=True, eq=False)
class OptimizerConfig(Section):
    """optimizer: any torch.optim class, built as name(model.parameters(), lr=lr, **kwargs)."""

    name: str = setting("AdamW", Text(r"[A-Za-z_][A-Za-z0-9_]*", "a torch.optim class name"),
                        "a torch.optim class name", FIXED)
    lr: float = setting(3.0e-4, Number(), "the learning rate (a schedule's peak)", FIXED_UNDER_SCHEDULE)
    kwargs: Dict[str, Any] = setting(
        {"weight_decay": 0.05}, Mapping(), "more keyword arguments for the optimizer (those it "
        "takes as booleans, such as fused or foreach, are checked as true or false)",
        FIXED_UNDER_SCHEDULE)

    @staticmethod
    def check_values(values: dict, path: str) -> None:
        check_boolean_kwargs(getattr(torch.optim, values["name"], None), values["kwargs"], f"{path}.kwargs")


@dataclasses.dataclass(frozen=True, eq=False)
class SchedulerConfig(Section):
    """scheduler: the learning-rate schedule, stepped once per optimizer step taken."""

    name: str = setting("none", Choice("none", "cosine", "onecycle"), "none, cosine or onecycle", FIXED)
    kwargs: Dict[str, Any] = setting({}, Mapping(), "more keyword arguments for the torch scheduler", FIXED)

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


@dataclasses.dataclass(frozen=True, eq=False)
class TrainConfig(Section):
    """train: how long the run trains."""

    epochs: int = setting(5, Integer(1), "epochs to train (a resume trains up to this many)", FIXED_UNDER_SCHEDULE)
    epoch_length: Optional[int] = setting(
        None, Integer(1, nullable=True), "iterations per epoch; null for the whole loader",
        FIXED_UNDER_SCHEDULE)


BACKENDS = ("auto", "nccl", "gloo")


@dataclasses.dataclass(frozen=True, eq=False)
class DistributedConfig(Section):
    """distributed: processes of one run (see the guide "More than one GPU")."""

    backend: str = setting("auto", Choice(*BACKENDS), "auto (nccl on GPUs, gloo on CPU), nccl or gloo")
    nproc_per_node: Optional[int] = setting(
        None, Integer(1, 1024, nullable=True),
        "processes to spawn on this machine; null: one, or what torchrun started")
    strategy: str = setting("ddp", Choice("ddp", "fsdp"),
                            "ddp: every process holds the whole model; fsdp: the model, its gradients and the "
                            "optimizer state are sharded over the processes (FSDP2), checkpoints too", FIXED)
    reshard_after_forward: bool = setting(True, Boolean(),
                                          "fsdp: free each block's gathered parameters after its forward (least "
                                          "memory; the backward gathers them again)")
    blocks: List[str] = setting(
        [], Names(), "class names of the blocks fsdp shards one by one and "
        "amp.activation_checkpointing checkpoints; []: the repeated blocks "
        "(children of a ModuleList or Sequential of one class)")

    @property
    def sharded(self) -> bool:
        """``strategy: fsdp``: the model, its gradients and its optimizer state sharded over the processes."""
        return self.strategy == "fsdp"
