"""The memory plan of a config's run (``ignite-amp plan``): its model, optimizer, step settings and input shape.

The model and optimizer are built under fake tensors (nothing allocated: a model too large for this machine
plans too); a model whose construction reads values falls back to a real build.
"""
import contextlib
import copy
import logging
import types
from typing import Callable, List, Optional, Sequence, Tuple, Union

import ignite.distributed as idist
import torch

from ignite_amp.data.datasets import train_samples
from ignite_amp.errors import ConfigError
from ignite_amp.memory_plan.auto_checkpoint import CheckpointChoice, checkpoint_to_fit
from ignite_amp.memory_plan.choices import CheckpointOption, checkpoint_options, options_lines
from ignite_amp.memory_plan.fake_step import quiet_trace
from ignite_amp.memory_plan.plan import DEFAULT_MARGIN, MemoryPlan, estimate_memory
from ignite_amp.models import build_model
from ignite_amp.run.builders import (
    build_optimizer,
    check_model_runs,
    checkpoint_activations,
    config_device,
    input_shape,
    seed_everything,
)
from ignite_amp.run.dtype_probe import config_dtype

__all__ = ["plan_config", "plan_dtype", "config_batch_sizes", "checkpoint_config_to_fit", "plan_run",
           "config_checkpoint_options", "checkpoint_options_lines"]

logger = logging.getLogger("ignite_amp")


def _make_batch(cfg: dict) -> Callable:
    shape, classes = input_shape(cfg["data"]), cfg["model"]["num_classes"]
    return lambda n: (torch.randn(n, *shape), torch.randint(0, classes, (n,)))


def _step_kwargs(cfg: dict) -> dict:
    return {k: v for k, v in cfg["amp"].items() if k not in ("cudnn_benchmark", "compile", "activation_checkpointing")}


def _no_fsdp(cfg: dict, what: str) -> None:
    if cfg["distributed"]["strategy"] == "fsdp":
        raise ConfigError(f"{what}: not with distributed.strategy fsdp yet (a sharded step's memory is each rank's "
                          f"shard); plan the same config with distributed.strategy ddp for one process's peak")


def checkpoint_config_to_fit(cfg: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             device: torch.device, memory: Union[None, int, str] = None,
                             batch_size: Optional[int] = None) -> CheckpointChoice:
    """``amp.activation_checkpointing: auto``: the fewest blocks (``distributed.blocks``, or the repeated ones)
    that make the planned step fit the GPU's free memory (or ``memory``) at ``data.batch_size`` per process,
    checkpointed in place (:func:`~ignite_amp.memory_plan.auto_checkpoint.checkpoint_to_fit`)."""
    _no_fsdp(cfg, "amp.activation_checkpointing: auto")
    if batch_size is None:
        if cfg["data"]["batch_size"] == "auto":
            raise ConfigError("amp.activation_checkpointing: auto fits the blocks to data.batch_size, which is auto "
                              "too; give one of them a value")
        batch_size = max(1, cfg["data"]["batch_size"] // idist.get_world_size())
    try:
        return checkpoint_to_fit(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(cfg), batch_size,
                                 memory=memory, device=device, blocks=cfg["distributed"]["blocks"] or None,
                                 **_step_kwargs(cfg))
    except ValueError as exc:
        raise ConfigError(f"amp.activation_checkpointing: {exc}") from None


def config_batch_sizes(cfg: dict) -> list:
    """The sizes a plan traces by default: the config's batch size per process (``distributed.nproc_per_node``
    share the global batch), or 8, 32 and 128 for ``auto``."""
    size = cfg["data"]["batch_size"]
    world = max(cfg["distributed"]["nproc_per_node"] or 1, idist.get_world_size())
    return [8, 32, 128] if size == "auto" else [max(1, size // world)]


def _fake_limits() -> tuple:
    """The errors of an operation fake tensors cannot run (one that reads values, or has no fake kernel)."""
    from torch._subclasses import fake_tensor
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
            fake_tensor.UnsupportedOperatorException, fake_tensor.UnsupportedFakeTensorException,
            GuardOnDataDependentSymNode)


def _model_and_optimizer(cfg: dict, device: torch.device) -> tuple:
    from torch._subclasses.fake_tensor import FakeTensorMode

    for context in (FakeTensorMode, contextlib.nullcontext):
        seed_everything(cfg["seed"])
        try:
            with context():
                model = build_model(cfg["model"]["name"], cfg["model"]["num_classes"], cfg["model"]["kwargs"])
                checkpoint_activations(cfg, model, device)  # as the run will (its blocks keep only their inputs)
                # the run's optimizer, fused on CUDA as train builds it (its step's temporaries differ)
                sharded = cfg["distributed"]["strategy"] == "fsdp"
                return model, build_optimizer(cfg["optimizer"], model, device, sharded=sharded)
        except Exception as exc:
            # a constructor that reads values (data-dependent under fake tensors): build it for real
            reads = isinstance(exc.__cause__ if isinstance(exc, ConfigError) else exc, _fake_limits())
            if context is contextlib.nullcontext or isinstance(exc, ConfigError) and not reads:
                raise
    raise RuntimeError("unreachable")


def _check_model_runs(cfg: dict, model: torch.nn.Module, device: torch.device) -> None:
    """The run's first check (:func:`~ignite_amp.run.builders.check_model_runs`: a forward on two images of
    the config's shape), on the fake model: an image size the model cannot take is the run's one line, not a
    plan of a step that cannot run. What fake tensors cannot run is left to the trace."""
    from torch._subclasses.fake_tensor import FakeTensor

    first = next(model.parameters(), None)
    mode = first.fake_mode if isinstance(first, FakeTensor) else contextlib.nullcontext()
    step = types.SimpleNamespace(model=model, device=device, autocast=contextlib.nullcontext, channels_last=False)
    try:
        with mode, quiet_trace():
            check_model_runs(cfg, step, passes=_fake_limits())
    except _fake_limits():
        pass


def plan_dtype(cfg: dict) -> Tuple[dict, str]:
    """The config with ``amp.dtype: auto`` decided as ``train`` decides it on a CPU, without a probe (a plan builds
    nothing for real and runs no step): this machine's kept choice for the model, the rule where no probe runs, else
    float32, saying that train's probe decides (:func:`~ignite_amp.run.dtype_probe.config_dtype`); and why.
    ``(cfg, "")`` where there is nothing to decide (a named dtype, a GPU: the engines' rule)."""
    dtype, why = config_dtype(cfg, None, config_device(cfg))
    return ({**cfg, "amp": {**cfg["amp"], "dtype": dtype}}, why) if why else (cfg, "")


def plan_config(cfg: dict, batch_sizes: Optional[Sequence[int]] = None, memory: Union[None, int, str] = None,
                margin: float = DEFAULT_MARGIN, progress: Optional[Callable] = None) -> MemoryPlan:
    """:func:`~ignite_amp.memory_plan.plan.estimate_memory` for a loaded config: its model, optimizer, ``amp:``
    settings (``compile`` planned off; ``dtype: auto`` on a CPU as :func:`plan_dtype` decides it) and image shape;
    ``memory`` None: the GPU's free memory on a GPU. With ``activation_checkpointing: auto`` the blocks are chosen
    for the largest of ``batch_sizes`` first."""
    _no_fsdp(cfg, "plan")
    cfg, _ = plan_dtype(cfg)
    device = config_device(cfg)
    model, optimizer = _model_and_optimizer(cfg, device)
    _check_model_runs(cfg, model, device)
    sizes = batch_sizes or config_batch_sizes(cfg)
    choice = None
    if cfg["amp"]["activation_checkpointing"] == "auto":  # the blocks the run would checkpoint, at the largest size
        choice = checkpoint_config_to_fit(cfg, model, optimizer, device, memory, max(sizes))
    try:
        plan = estimate_memory(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(cfg), sizes,
                               memory=memory, margin=margin, device=device, progress=progress, **_step_kwargs(cfg))
    except ValueError as exc:
        raise ConfigError(f"plan: {exc}") from None
    plan.auto_checkpointing = choice.line() if choice is not None else None
    samples = train_samples(cfg["data"])
    plan.data_samples = samples // (cfg["distributed"]["nproc_per_node"] or 1) if samples else None
    return plan


def plan_run(cfg: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
             say: Callable[[str], None]) -> dict:
    """What a run being built takes from the plan: ``activation_checkpointing: auto``'s blocks (said in a line),
    and on a GPU the planned peak at ``data.batch_size`` per process, as the run fact ``planned_peak_mb`` (the
    health summary sets the measured peak beside it). Returns the facts."""
    if cfg["amp"]["activation_checkpointing"] == "auto":  # the first transform: before the search and sharding
        say(checkpoint_config_to_fit(cfg, model, optimizer, device).line())
    size = cfg["data"]["batch_size"]
    if device.type != "cuda" or size == "auto" or cfg["distributed"]["strategy"] == "fsdp":
        return {}
    try:
        plan = estimate_memory(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(cfg),
                               [max(1, size // idist.get_world_size())], device=device, fit=False, **_step_kwargs(cfg))
    except Exception as exc:  # a fact for the summary, not a reason to stop the run
        logger.info("memory plan: %s: %s", type(exc).__name__, exc)
        return {}
    return {"planned_peak_mb": round(plan.peaks[0].peak / 2 ** 20, 1)} if plan.peaks else {}


# -- the table of activation checkpointing choices (``ignite-amp plan --checkpointing``): none, selective and full on
# a quarter of the blocks up to all, at the config's batch size, each with its planned peak and recompute
# (:mod:`ignite_amp.memory_plan.choices`); the model built as plan_config builds it, without checkpointing.
def config_checkpoint_options(cfg: dict, batch_size: int) -> List[CheckpointOption]:
    """The choices for ``cfg``'s run at ``batch_size`` per process (``distributed.blocks``, or the repeated blocks);
    empty when the model has no blocks or its step cannot be traced fake."""
    plain = copy.deepcopy(cfg)
    plain["amp"]["activation_checkpointing"] = False
    device = config_device(plain)
    model, optimizer = _model_and_optimizer(plain, device)
    try:
        return checkpoint_options(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(plain), batch_size,
                                  device=device, blocks=plain["distributed"]["blocks"] or None, **_step_kwargs(plain))
    except ValueError as exc:
        raise ConfigError(f"plan: {exc}") from None


def checkpoint_options_lines(options: List[CheckpointOption], batch_size: int,
                             budget: Optional[float] = None) -> List[str]:
    """The table, under a line that says what it is."""
    if not options:
        return ["activation checkpointing choices: none planned: the step cannot be traced fake"]
    if len(options) == 1:
        return ["activation checkpointing choices: the model has no repeated blocks (distributed.blocks names them)"]
    return [f"activation checkpointing choices at batch {batch_size} (first blocks from the input end; recompute: "
            f"the FLOPs checkpointing adds to a step without it)", *options_lines(options, budget=budget)]
