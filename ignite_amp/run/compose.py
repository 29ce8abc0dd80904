"""The composition root: build a run from a config (data, model, optimizer, engines, handlers), then train.

Each component is built from its own config section (declared beside it, see
:mod:`ignite_amp.config.tree`) and attached in a fixed order; resume is :mod:`ignite_amp.run.resume`'s,
the run directory :mod:`ignite_amp.files.run_directory`'s. What it builds is a
:class:`~ignite_amp.run.built_run.Run` (re-exported here), which trains itself.
"""
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import ignite.distributed as idist
import torch
from ignite.engine import Engine
from ignite.metrics import Accuracy, Loss

from ignite_amp.config.tree import Config, load_config, save_config
from ignite_amp.core.collectives import global_batch, is_distributed
from ignite_amp.core.config_values import Section
from ignite_amp.core.device import dtype_name
from ignite_amp.data.datasets import build_loaders
from ignite_amp.data.passes import training_data
from ignite_amp.data.prefetch import device_loader
from ignite_amp.engine import AmpEngine, create_amp_evaluator, create_amp_trainer
from ignite_amp.errors import ConfigError
from ignite_amp.files.run_directory import RunFiles, RunLayout, check_run_directories, warn_if_disk_is_short
from ignite_amp.handlers import (
    BestCheckpoint,
    GradientClipping,
    NonFiniteGuard,
    OOMBackoff,
    ProfilerCapture,
    StepSchedule,
    TensorBoardMetrics,
)
from ignite_amp.launcher import launch
from ignite_amp.models import build_model
from ignite_amp.run.builders import (
    build_optimizer,
    build_scheduler,
    check_classes,
    check_model_runs,
    checkpoint_activations,
    config_device,
    seed_everything,
)
from ignite_amp.run.built_run import Log, Run
from ignite_amp.run.console import drop_unfinished_bar, progress_bar, safe_print, silent
from ignite_amp.run.dtype_probe import config_dtype
from ignite_amp.run.epochs import EpochSummary, Validation
from ignite_amp.run.fast_path import config_channels_last, speed_choices
from ignite_amp.run.plan import RunPlan, Settled, plan_run, resolve
from ignite_amp.run.resume import plan_resume, resume_run, resumed_dtype, with_precision
from ignite_amp.run.search import search_built, search_line
from ignite_amp.transforms.float8 import convert_to_float8
from ignite_amp.transforms.sharding import check_shardable, shard_model

__all__ = ["train_from_config", "build_run", "Run"]



def build_run(cfg: Any, progress: bool = False, print_fn: Callable = safe_print,
              command: str = "ignite-amp train CONFIG") -> Run:
    """Validate ``cfg`` (path, dict or loaded config) and build everything it describes.

    Before anything trains, rank 0 locks ``output_dir`` (one run at a time), opens its
    ``train.log``, decides what to resume (the newest checkpoint that loads; with
    ``resume: never``, or nothing to resume, an earlier run's files are moved aside), checks the
    checkpoint's config against this one (:mod:`ignite_amp.run.resume`), creates and test-writes
    every directory the run writes, runs the model once on a dummy batch, and writes
    ``config.yaml``. Every user fault is a one-line error before the first iteration.

    Inside a process group of N > 1 ranks (``torchrun``, or :func:`train_from_config` with
    ``distributed.nproc_per_node``) the model is wrapped by ``idist.auto_model`` (DDP), the
    loaders shard the global batch, and rank 0 alone prints and writes files.
    """
    cfg = load_config(cfg)
    device = config_device(cfg)
    main = idist.get_rank() == 0
    if not main:
        print_fn, progress = silent, False
    files = RunFiles(cfg.output_dir, main)
    # Warnings raised while building (torch's, say, about a zero-width layer) are held: shown if the
    # run builds, kept in train.log only if it fails, so a user error stays one line.
    with warnings.catch_warnings(record=True) as held:
        try:
            run = _build(cfg, device, main, files, progress, print_fn, command)
        except BaseException as exc:
            for w in held:
                files.log.line(f"warning: {w.filename}:{w.lineno}: {w.category.__name__}: {w.message}")
            files.log.traceback(f"building the run failed: {exc.__class__.__name__}: {exc}")
            files.close()
            raise
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return run


def _build(cfg: Config, device: torch.device, main: bool, files: RunFiles, progress: bool, print_fn: Callable,
           command: str) -> Run:
    """The composition root: each component built from its config section, then attached in order."""
    log = Log(print_fn, files)  # a line printed and kept in train.log
    plan = resolve(cfg, idist.get_world_size(), device)
    resuming = plan_resume(cfg, main, log)
    if resuming.batch_size is not None:  # data.batch_size: auto resumed: the resumed run's, no new search
        plan = plan.with_batch_size(resuming.batch_size)
    files.open_log()
    if main:
        check_run_directories(cfg.output_dir, cfg.handlers.tensorboard.enabled, cfg.handlers.profiler.enabled)
    seed_everything(cfg.seed)
    model = build_model(**cfg.model.to_dict())
    checkpoint_activations(cfg, model, device)  # float8, then checkpointing: before search, sharding, compile
    optimizer = build_optimizer(cfg.optimizer, model, device, sharded=cfg.distributed.sharded)  # fused on CUDA
    plan = plan_run(plan, model, optimizer, log)  # activation_checkpointing auto; the planned peak (GPU)
    batch_search = None
    if plan.batch_size is None:  # data.batch_size: auto: the search settles it
        batch_search = search_built(cfg, model, optimizer, device)
        plan = plan.with_batch_size(global_batch(batch_search.batch_size, plan.world))
        log(search_line(batch_search, plan.world))
    cfg = plan.config  # (with the batch size the search or the resumed run settled: config.yaml records it)
    batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    train_loader, val_loader, n_classes = build_loaders(cfg.data, cfg.model.num_classes, device,
                                                        cfg.seed, batch_norm=batch_norm,
                                                        lockstep=cfg.distributed.sharded,
                                                        micro_batches=cfg.amp.micro_batches,
                                                        batch_size=plan.batch_size)
    # On CUDA the next batch is copied to the device on a side stream while the current one computes.
    train_loader, val_loader = device_loader(train_loader, device), device_loader(val_loader, device)
    check_classes(cfg, n_classes)
    trainer, evaluator, optimizer, dtype = _engines(cfg, model, optimizer, device, files,
                                                    resumed_dtype(resuming.state))
    resuming = with_precision(resuming, cfg, dtype_name(trainer.amp_step.dtype))
    epoch_length = cfg.train.epoch_length or len(train_loader)
    scheduler = _schedule(cfg, trainer, optimizer, epoch_length)
    train_data = training_data(trainer, train_loader, cfg.train.epoch_length)  # each pass's order: its number
    # What each auto chose, and why: the start line, train.log and TensorBoard's run facts say it.
    plan = plan.settle(dtype=dtype, compile=Settled(trainer.amp_step.forward is not trainer.amp_step.model),
                       **speed_choices(cfg, model, optimizer, device, train_loader))

    to_save = {"model": model, "optimizer": optimizer, "amp_step": trainer.amp_step, "trainer": trainer}
    if scheduler is not None:
        to_save["scheduler"] = scheduler
    history: List[dict] = []  # a record per epoch (EpochSummary's)
    closers: List[Callable[[], None]] = []
    if progress:
        # Before the epoch-end handlers: the bar ends at 100% on its own line before the validation and the
        # epoch's line print. No loss in the bar: showing it would sync the host with the device every iteration.
        bar = progress_bar(persist=True, desc="Epoch")  # "Epoch" for one epoch too, not Ignite's "Iteration"
        bar.attach(trainer)
        closers.append(lambda: drop_unfinished_bar(bar))  # stopped mid-epoch: its line cleared
    attached = _attach_handlers(plan, trainer, evaluator, optimizer, val_loader, to_save, history, log,
                                batch_search)
    resumed_from = None
    if resuming.path is not None:
        log(resume_run(resuming, attached.checkpoint, trainer, optimizer, cfg.amp.micro_batches,
                       epoch_length, scheduled=scheduler is not None))
        resumed_from = attached.checkpoint.resumed_path  # an unreadable choice fell back to an older one
    run = Run(plan=plan, trainer=trainer, evaluator=evaluator, model=model, optimizer=optimizer, scheduler=scheduler,
              train_loader=train_loader, val_loader=val_loader, train_data=train_data, to_save=to_save, log=log,
              files=files, checkpoint=attached.checkpoint, history=history, closers=closers + attached.closers,
              health=attached.health, traces=attached.traces, command=command, batch_search=batch_search,
              resumed_from=resumed_from)
    if main:
        layout = RunLayout(cfg.output_dir)
        save_config(cfg, layout.config_path)
        warn_if_disk_is_short(layout.checkpoint_dir, sum(t.numel() * t.element_size()
                                                         for t in model.state_dict().values()),
                              cfg.handlers.checkpoint.n_saved)
    return run


def _engines(cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
             files: RunFiles, resumed: Optional[str] = None):
    """The trainer and evaluator of ``amp:`` (in a process group: DDP-wrapped, or sharded with FSDP2 and a new
    optimizer over the shards); checks the model runs once. Also the dtype it runs in, and why ``dtype: auto`` chose
    it ("" if not asked).
    ``resumed``: the dtype the resumed checkpoint trained in (``dtype: auto`` on a CPU keeps it)."""
    amp = cfg.amp
    step_args: Dict[str, Any] = {  # what the trainer and the evaluator both take, each "auto" settled
        "dtype": None, "float8_recipe": amp.float8_recipe, "fp32_modules": amp.fp32_modules, "compile": amp.compile,
        "channels_last": config_channels_last(cfg, model, device).on,  # auto: on CUDA for a convolutional model
    }
    # auto on a CPU: the checkpoint's, else this machine's kept choice for the model, else a timed probe's (dtype_probe)
    step_args["dtype"], dtype_why = config_dtype(cfg, model, device, resumed)
    loss_fn = torch.nn.functional.cross_entropy
    trained = model
    if cfg.distributed.sharded and not is_distributed():  # one process: the same checks of the blocks as on N
        _shard(cfg, model, device, check_only=True)
    if is_distributed():  # DDP wraps (FSDP shards) the model in its final place and memory format
        layout = torch.channels_last if step_args["channels_last"] else torch.preserve_format
        model.to(device, memory_format=layout)  # type: ignore[call-overload]  # (torch's stubs lack this form)
        if cfg.distributed.sharded:
            trained = model = _shard(cfg, model, device)
            optimizer = build_optimizer(cfg.optimizer, model, device, sharded=True)  # over the shards
        else:
            trained = idist.auto_model(model)
            optimizer = idist.auto_optim(optimizer)
    try:
        trainer = create_amp_trainer(trained, optimizer, loss_fn, device=device,
                                     accumulation_steps=amp.accumulation_steps, micro_batches=amp.micro_batches,
                                     check_split=amp.check_split, **step_args)
        # Metrics keep their sums on the run's device: no host sync per evaluation batch.
        metrics = {"accuracy": Accuracy(device=device), "loss": Loss(loss_fn, device=device)}
        evaluator = create_amp_evaluator(model, metrics, device=device, **step_args)
    except ValueError as exc:
        raise ConfigError(f"amp: {exc}") from None
    check_model_runs(cfg, trainer.amp_step)
    if device.type == "cuda" and amp.cudnn_benchmark:
        previous = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True  # fixed image shapes: autotune each convolution once
        files.restore_later(lambda: setattr(torch.backends.cudnn, "benchmark", previous))
    return trainer, evaluator, optimizer, Settled(dtype_name(trainer.amp_step.dtype), dtype_why)


def _shard(cfg: Config, model: torch.nn.Module, device: torch.device, check_only: bool = False) -> torch.nn.Module:
    """``distributed.strategy: fsdp``: the model sharded over the processes
    (:func:`ignite_amp.transforms.sharding.shard_model`)."""
    dist, amp = cfg.distributed, cfg.amp
    try:
        if check_only:
            check_shardable(model, dist.blocks or None, amp.fp32_modules)
            return model
        if amp.dtype == "float8":  # the first transform; FSDP2 then all-gathers the float8 weights in float8
            convert_to_float8(model, amp.float8_recipe, device, amp.fp32_modules, fsdp_all_gather=True)
        return shard_model(model, "bfloat16" if amp.dtype == "float8" else amp.dtype, dist.blocks or None,
                           dist.reshard_after_forward, amp.fp32_modules, device)
    except ValueError as exc:
        raise ConfigError(f"{'distributed' if str(exc).startswith('blocks') else 'amp'}.{exc}") from None


def _schedule(cfg: Config, trainer: Engine, optimizer: torch.optim.Optimizer, epoch_length: int):
    """The learning-rate schedule, stepped per optimizer step taken (a step the scaler skipped does not count)."""
    # An accumulation cycle ends at the epoch's end: ceil(epoch_length / accumulation) steps per epoch.
    total_steps = cfg.train.epochs * -(-epoch_length // cfg.amp.accumulation_steps)
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.optimizer.lr, total_steps)
    if scheduler is not None:
        StepSchedule(scheduler).attach(trainer)
    return scheduler


def _switched_on(section: Section) -> Optional[dict]:
    """A handler section's arguments, or None when ``enabled`` is false."""
    options = section.to_dict()
    return options if options.pop("enabled", True) else None


class _Attached(NamedTuple):
    """What the handlers give the run: the checkpoint handler, what ends them, the health summary, the traces."""

    checkpoint: BestCheckpoint
    closers: List[Callable[[], None]]
    health: Callable[[], list]
    traces: list


def _attach_handlers(plan: RunPlan, trainer: AmpEngine, evaluator: Engine, optimizer: torch.optim.Optimizer,
                     val_loader: Any, to_save: dict, history: List[dict], log: Log, batch_search: Any) -> _Attached:
    """Each ``handlers:`` section builds its handler from its own keys, attached in this order."""
    cfg, layout, closers = plan.config.handlers, RunLayout(plan.config.output_dir), []
    sharded = plan.config.distributed.sharded
    health: Callable[[], list] = list
    traces: list = []
    guard = _switched_on(cfg.non_finite)
    if guard is not None:  # first: its epoch-end check runs before evaluation and saving
        NonFiniteGuard(**guard).attach(trainer)
    summary = EpochSummary(evaluator, history, log)
    summary.attach(trainer)  # at each epoch's end: the training figures (one host sync),
    Validation(evaluator, val_loader).attach(trainer)  # then the evaluation (checkpoints, TensorBoard),
    summary.attach_report(trainer)  # then the epoch's line
    backoff = _switched_on(cfg.oom_backoff)
    if backoff is not None and sharded:  # also on one process: its checkpoints resume on N
        log("handlers.oom_backoff: off under distributed.strategy fsdp (an out-of-memory error inside a sharded "
            "forward leaves the other processes in a collective, so it cannot be retried safely)")
        backoff = None
    if backoff is not None:
        train_backoff = OOMBackoff(**backoff)
        train_backoff.attach(trainer)
        to_save["oom_backoff"] = train_backoff
        OOMBackoff(cfg.oom_backoff.min_batch_size).attach(evaluator)
    clipping = None
    if cfg.clipping.max_norm is not None or cfg.clipping.clip_value is not None:
        clipping = GradientClipping(**cfg.clipping.to_dict())
        clipping.attach(trainer)
    tensorboard = _switched_on(cfg.tensorboard)
    if tensorboard is not None:
        texts = {"run/batch_size_search": batch_search.table} if batch_search is not None else None
        tb = TensorBoardMetrics(layout.tensorboard_dir, facts=plan.facts(), clipping=clipping, texts=texts,
                                from_config=True, ranks_memory=is_distributed(), **tensorboard)
        tb.attach(trainer, evaluator=evaluator, optimizer=optimizer)
        closers.append(tb.close)
        health = tb.health
    profiler = _switched_on(cfg.profiler)
    if profiler is not None:
        capture = ProfilerCapture(layout.profiler_dir, **profiler, from_config=True)
        capture.attach(trainer)
        closers.append(capture.stop)
        traces = capture.files
    checkpoint = {k: v for k, v in cfg.checkpoint.to_dict().items() if k != "resume"}  # resume: run.resume's
    best = BestCheckpoint(layout.checkpoint_dir, to_save, config=plan.config.to_dict(), sharded=sharded,
                          **checkpoint)
    best.attach(trainer, evaluator)
    return _Attached(best, closers, health, traces)


def _train(cfg: Config, progress: bool, print_fn: Callable, command: str) -> dict:
    return build_run(cfg, progress=progress, print_fn=print_fn, command=command).train()


def train_from_config(cfg: Any, progress: bool = False, print_fn: Callable = safe_print,
                      command: str = "ignite-amp train CONFIG") -> dict:
    """Train what ``cfg`` (a YAML path, a dict, or a loaded config) describes.

    With ``distributed.nproc_per_node: N > 1`` it spawns N processes (``idist.Parallel``; then
    ``print_fn`` must be picklable, like ``print``); under ``torchrun`` this process is one rank.
    Returns rank 0's ``{"history": [per-epoch records], "final": last record, "output_dir": ...,
    "best_checkpoint": ..., "tensorboard_dir": ...}``.
    """
    cfg = load_config(cfg)
    return launch(cfg, _train, cfg, progress, print_fn, command)
