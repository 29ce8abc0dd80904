"""One plan for a run (:class:`RunPlan`), and its memory plan (``ignite-amp plan``).

:func:`resolve` turns ``(config, world, device)`` into a :class:`RunPlan` that settles what the config alone
leaves open: the device, the number of processes, the global batch and each process's share of it (one rule:
:func:`ignite_amp.core.collectives.per_process`), the evaluation batch. ``data.batch_size: auto`` is settled
later by the batch-size search, and a resume of an ``auto`` run by its checkpoint: each makes a new plan
(:meth:`RunPlan.with_batch_size`), nothing edits the config. The run (:mod:`ignite_amp.run.compose`), the memory
plan (``ignite-amp plan``), the search and the run's facts read their batches here.

The memory plan of a config's run traces its model, optimizer, step settings and input shape.

The model and optimizer are built under fake tensors (nothing allocated: a model too large for this machine
plans too); a model whose construction reads values falls back to a real build.
"""
import contextlib
import dataclasses
import logging
import types
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import ignite.distributed as idist
import torch

from ignite_amp.config.tree import Config
from ignite_amp.core.collectives import per_process
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
from ignite_amp.step.facts import config_facts

__all__ = ["RunPlan", "Settled", "CHOICES", "resolve", "plan_config", "plan_dtype", "config_batch_sizes",
           "planned_world", "checkpoint_config_to_fit", "plan_run", "config_checkpoint_options",
           "checkpoint_options_lines"]

logger = logging.getLogger("ignite_amp")


class Settled(NamedTuple):
    """One choice of the run, and why (empty where the config named the value)."""

    value: Any
    why: str = ""


#: The choices a run settles as it is built, in the order its facts list them: each needs what the config alone
#: does not hold (the model, the optimizer, the data sets, the engines), so each is settled where that is built.
CHOICES = ("dtype", "activation_checkpointing", "compile", "channels_last", "fused_optimizer", "num_workers",
           "data_on_device", "prefetch", "planned_peak_mb")


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A config's run on ``world`` processes on ``device`` (this process's), and every choice settled so far."""

    config: Config
    device: torch.device
    world: int
    batch_size: Optional[int]  #: the global batch; None while ``data.batch_size: auto`` waits for the search
    batch_searched: bool = False  #: the search chose ``batch_size`` (now, or in the run a resume continues)
    settled: Tuple[Tuple[str, Settled], ...] = ()  #: (name, choice) in CHOICES, each settled once

    def choice(self, name: str) -> Optional[Settled]:
        """The choice ``name`` (one of :data:`CHOICES`), or None while it is not settled."""
        return dict(self.settled).get(name)

    def settle(self, **choices: Settled) -> "RunPlan":
        """The plan with ``choices`` settled (each a :class:`Settled`; a name of :data:`CHOICES`, settled once)."""
        for name in choices:
            if name not in CHOICES or self.choice(name) is not None:
                raise ValueError(f"{name}: {'not a choice of a run' if name not in CHOICES else 'settled already'}")
        return dataclasses.replace(self, settled=self.settled + tuple(choices.items()))

    def facts(self) -> Dict[str, Any]:
        """The run facts (TensorBoard's text and HParams, the start line's words): what the config asked and what
        each "auto" chose, and why."""
        cfg, got = self.config, dict(self.settled)

        def value(name: str, default: Any = None) -> Any:
            return got[name].value if name in got else default

        facts = config_facts(cfg, None, batch_size_searched=self.batch_searched)  # the config's (its batch settled)
        facts.update(compile=value("compile", cfg.amp.compile),
                     channels_last=value("channels_last", cfg.amp.channels_last))
        if "planned_peak_mb" in got:
            facts["planned_peak_mb"] = value("planned_peak_mb")
        if "dtype" in got and got["dtype"].why:
            facts["dtype_auto"] = got["dtype"].why
        if "num_workers" in got:  # the speed defaults (run.fast_path)
            facts.update({"data_on_device": value("data_on_device"), "channels_last_why": got["channels_last"].why,
                          "fused_optimizer": value("fused_optimizer"),
                          "fused_optimizer_why": got["fused_optimizer"].why,
                          "num_workers": value("num_workers"), "num_workers_why": got["num_workers"].why,
                          "prefetch": value("prefetch")})
        return facts

    @property
    def per_process_batch(self) -> Optional[int]:
        """Each process's share of the global batch (None while the search has not run)."""
        return None if self.batch_size is None else per_process(self.batch_size, self.world)

    @property
    def eval_batch_size(self) -> Optional[int]:
        """The global evaluation batch: ``data.eval_batch_size``, else the training batch."""
        return self.config.data.eval_batch_size or self.batch_size

    @property
    def per_process_eval_batch(self) -> Optional[int]:
        batch = self.eval_batch_size
        return None if batch is None else per_process(batch, self.world)

    def to_dict(self) -> Dict[str, Any]:
        """The plan as JSON values (``ignite-amp plan --json``'s ``run``): the device, the processes, the batches
        (null while the search has not run), and each choice settled so far with its reason."""
        return {"device": str(self.device), "processes": self.world, "batch_size": self.batch_size,
                "batch_size_per_process": self.per_process_batch,
                "eval_batch_size_per_process": self.per_process_eval_batch,
                **{name: {"value": choice.value, "why": choice.why} for name, choice in self.settled}}

    def with_batch_size(self, batch_size: int, searched: bool = True) -> "RunPlan":
        """The plan with ``data.batch_size: auto`` settled: ``batch_size`` global (the search's, or a resumed run's),
        also in its config (what ``config.yaml`` and the checkpoints record, so a resume trains on at that size)."""
        config = self.config.replace(data=self.config.data.replace(batch_size=batch_size))
        return dataclasses.replace(self, config=config, batch_size=batch_size, batch_searched=searched)


def resolve(config: Config, world: int, device: torch.device) -> RunPlan:
    """The plan of ``config``'s run on ``world`` processes with this process on ``device``."""
    if not isinstance(config, Config):
        raise TypeError(f"resolve: expected a loaded config (ignite_amp.load_config(...)), got {type(config).__name__}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"resolve: world should be a positive number of processes, got {world!r}")
    size = config.data.batch_size
    return RunPlan(config, device, world, None if size == "auto" else size)


def _make_batch(cfg: Config) -> Callable:
    shape, classes = input_shape(cfg.data), cfg.model.num_classes
    return lambda n: (torch.randn(n, *shape), torch.randint(0, classes, (n,)))


def _step_kwargs(cfg: Config) -> dict:
    """The step settings a plan traces (``compile`` planned off; checkpointing is done to the model itself)."""
    amp = cfg.amp
    return {"dtype": amp.dtype, "float8_recipe": amp.float8_recipe, "accumulation_steps": amp.accumulation_steps,
            "micro_batches": amp.micro_batches, "fp32_modules": amp.fp32_modules, "channels_last": amp.channels_last,
            "check_split": amp.check_split}


def _no_fsdp(cfg: Config, what: str) -> None:
    if cfg.distributed.sharded:
        raise ConfigError(f"{what}: not with distributed.strategy fsdp yet (a sharded step's memory is each rank's "
                          f"shard); plan the same config with distributed.strategy ddp for one process's peak")


def checkpoint_config_to_fit(cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             device: torch.device, memory: Union[None, int, str] = None,
                             batch_size: Optional[int] = None) -> CheckpointChoice:
    """``amp.activation_checkpointing: auto``: the fewest blocks (``distributed.blocks``, or the repeated ones)
    that make the planned step fit the GPU's free memory (or ``memory``) at ``data.batch_size`` per process,
    checkpointed in place (:func:`~ignite_amp.memory_plan.auto_checkpoint.checkpoint_to_fit`)."""
    _no_fsdp(cfg, "amp.activation_checkpointing: auto")
    if batch_size is None:
        if cfg.data.batch_size == "auto":
            raise ConfigError("amp.activation_checkpointing: auto fits the blocks to data.batch_size, which is auto "
                              "too; give one of them a value")
        batch_size = per_process(cfg.data.batch_size, idist.get_world_size())
    try:
        return checkpoint_to_fit(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(cfg), batch_size,
                                 memory=memory, device=device, blocks=cfg.distributed.blocks or None,
                                 **_step_kwargs(cfg))
    except ValueError as exc:
        raise ConfigError(f"amp.activation_checkpointing: {exc}") from None


def planned_world(cfg: Config) -> int:
    """The processes a config's run will have (``distributed.nproc_per_node``, or this process group's)."""
    return max(cfg.distributed.nproc_per_node or 1, idist.get_world_size())


def config_batch_sizes(cfg: Config) -> list:
    """The sizes a plan traces by default: the config's batch size per process (:func:`planned_world` processes
    share the global batch), or 8, 32 and 128 for ``auto``."""
    size = cfg.data.batch_size
    return [8, 32, 128] if size == "auto" else [per_process(size, planned_world(cfg))]


def _fake_limits() -> tuple:
    """The errors of an operation fake tensors cannot run (one that reads values, or has no fake kernel)."""
    from torch._subclasses import fake_tensor
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
            fake_tensor.UnsupportedOperatorException, fake_tensor.UnsupportedFakeTensorException,
            GuardOnDataDependentSymNode)


def _model_and_optimizer(cfg: Config, device: torch.device) -> tuple:
    from torch._subclasses.fake_tensor import FakeTensorMode

    for context in (FakeTensorMode, contextlib.nullcontext):
        seed_everything(cfg.seed)
        try:
            with context():
                model = build_model(cfg.model.name, cfg.model.num_classes, cfg.model.kwargs)
                checkpoint_activations(cfg, model, device)  # as the run will (its blocks keep only their inputs)
                # the run's optimizer, fused on CUDA as train builds it (its step's temporaries differ)
                sharded = cfg.distributed.sharded
                return model, build_optimizer(cfg.optimizer, model, device, sharded=sharded)
        except Exception as exc:
            # a constructor that reads values (data-dependent under fake tensors): build it for real
            reads = isinstance(exc.__cause__ if isinstance(exc, ConfigError) else exc, _fake_limits())
            if context is contextlib.nullcontext or isinstance(exc, ConfigError) and not reads:
                raise
    raise RuntimeError("unreachable")


def _check_model_runs(cfg: Config, model: torch.nn.Module, device: torch.device) -> None:
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


def plan_dtype(cfg: Config) -> Tuple[Config, str]:
    """The config with ``amp.dtype: auto`` decided as ``train`` decides it on a CPU, without a probe (a plan builds
    nothing for real and runs no step): this machine's kept choice for the model, the rule where no probe runs, else
    float32, saying that train's probe decides (:func:`~ignite_amp.run.dtype_probe.config_dtype`); and why.
    ``(cfg, "")`` where there is nothing to decide (a named dtype, a GPU: the engines' rule)."""
    dtype, why = config_dtype(cfg, None, config_device(cfg))
    return (cfg.replace(amp=cfg.amp.replace(dtype=dtype)), why) if why else (cfg, "")


def plan_config(cfg: Config, batch_sizes: Optional[Sequence[int]] = None, memory: Union[None, int, str] = None,
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
    if cfg.amp.activation_checkpointing == "auto":  # the blocks the run would checkpoint, at the largest size
        choice = checkpoint_config_to_fit(cfg, model, optimizer, device, memory, max(sizes))
    try:
        plan = estimate_memory(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(cfg), sizes,
                               memory=memory, margin=margin, device=device, progress=progress, **_step_kwargs(cfg))
    except ValueError as exc:
        raise ConfigError(f"plan: {exc}") from None
    plan.auto_checkpointing = choice.line() if choice is not None else None
    samples = train_samples(cfg.data)
    plan.data_samples = samples // (cfg.distributed.nproc_per_node or 1) if samples else None
    return plan


def plan_run(plan: RunPlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             say: Callable[[str], None]) -> RunPlan:
    """What a run being built takes from the memory plan: ``activation_checkpointing: auto``'s blocks (said in a
    line), and on a GPU the planned peak at the batch per process (``planned_peak_mb``: the health summary sets the
    measured peak beside it). Returns the plan with them settled."""
    cfg, device, size = plan.config, plan.device, plan.per_process_batch
    if cfg.amp.activation_checkpointing == "auto":  # the first transform: before the search and sharding
        choice = checkpoint_config_to_fit(cfg, model, optimizer, device, batch_size=size)
        say(choice.line())
        plan = plan.settle(activation_checkpointing=Settled(list(choice.checkpointed), choice.line()))
    if device.type != "cuda" or size is None or cfg.distributed.sharded:
        return plan
    try:
        memory = estimate_memory(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(cfg), [size],
                                 device=device, fit=False, **_step_kwargs(cfg))
    except Exception as exc:  # a fact for the summary, not a reason to stop the run
        logger.info("memory plan: %s: %s", type(exc).__name__, exc)
        return plan
    if not memory.peaks:
        return plan
    return plan.settle(planned_peak_mb=Settled(round(memory.peaks[0].peak / 2 ** 20, 1)))


# -- the table of activation checkpointing choices (``ignite-amp plan --checkpointing``): none, selective and full on
# a quarter of the blocks up to all, at the config's batch size, each with its planned peak and recompute
# (:mod:`ignite_amp.memory_plan.choices`); the model built as plan_config builds it, without checkpointing.
def config_checkpoint_options(cfg: Config, batch_size: int) -> List[CheckpointOption]:
    """The choices for ``cfg``'s run at ``batch_size`` per process (``distributed.blocks``, or the repeated blocks);
    empty when the model has no blocks or its step cannot be traced fake."""
    plain = cfg.replace(amp=cfg.amp.replace(activation_checkpointing=False))
    device = config_device(plain)
    model, optimizer = _model_and_optimizer(plain, device)
    try:
        return checkpoint_options(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(plain), batch_size,
                                  device=device, blocks=plain.distributed.blocks or None, **_step_kwargs(plain))
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
