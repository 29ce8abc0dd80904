"""Build a run from a config: data, model, optimizer, trainer, evaluator, handlers; then train.

This is the one module of ``ignite_amp`` that imports ``handlers``.
"""
import logging
import os
import sys
import warnings
import weakref
from typing import Any, Callable, Optional, Tuple

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.metrics import Accuracy, Loss

from ignite_amp.builders import (build_optimizer, build_scheduler, check_classes, check_model_runs, config_device,
                                 seed_everything)
from ignite_amp.collectives import is_distributed
from ignite_amp.config import load_config, save_config
from ignite_amp.config_search import search_built
from ignite_amp.data import build_loaders
from ignite_amp.errors import CheckpointError, ConfigError
from ignite_amp.events import AmpEvents
from ignite_amp.facts import config_facts
from ignite_amp.handlers import (BestCheckpoint, GradientClipping, NonFiniteGuard, OOMBackoff, ProfilerCapture,
                                 TensorBoardMetrics)
from ignite_amp.checkpoint_io import load_checkpoint
from ignite_amp.launcher import launch
from ignite_amp.models import build_model
from ignite_amp.resume import check_resume
from ignite_amp.rundir import LogFile, RunLayout, RunLock, check_writable, free_bytes, move_previous_run
from ignite_amp.device import describe_device, dtype_name
from ignite_amp.engine import create_amp_evaluator, create_amp_trainer
from ignite_amp.epochs import EpochSummary, Validation

__all__ = ["train_from_config", "build_run", "Run", "safe_print"]

logger = logging.getLogger("ignite_amp")


def safe_print(*args: Any, **kwargs: Any) -> None:
    """``print`` that outlives a closed stdout (``ignite-amp train ... | head``): the run goes on.

    After the first broken pipe, stdout is pointed at /dev/null for the rest of the process.
    """
    try:
        print(*args, **kwargs, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: stdout already closed
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


class Run:
    """Everything a config builds; ``run.train()`` trains it, then ``run.close()`` ends it.

    On rank 0 the run holds ``output_dir``'s lock and writes ``train.log`` from the moment it
    is built until :meth:`close` (which :meth:`train` calls at its end).
    """

    def __init__(self, cfg: dict, trainer: Engine, evaluator: Engine, model, optimizer, scheduler,
                 train_loader, val_loader, to_save: dict, print_fn: Callable, files: "_RunFiles"):
        self.cfg, self.trainer, self.evaluator = cfg, trainer, evaluator
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_loader, self.val_loader = train_loader, val_loader
        self.to_save = to_save
        self._print = print_fn
        self.files = files
        self.history = []
        self.checkpoint: Optional[BestCheckpoint] = None
        self.closers: list = []
        self.resumed_from: Optional[str] = None
        self.command = "ignite-amp train CONFIG"
        self.batch_search = None  # the batch-size search's result when data.batch_size was auto
        self.facts: dict = {}  # what the config resolved to, for TensorBoard's run facts

    def print(self, line: str) -> None:
        self._print(line)
        self.files.log.line(line)

    @property
    def output_dir(self) -> str:
        return self.cfg["output_dir"]

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.cfg["output_dir"])

    @property
    def tensorboard_dir(self) -> str:
        return self.layout.tensorboard_dir

    @property
    def profiler_dir(self) -> str:
        return self.layout.profiler_dir

    @property
    def checkpoint_dir(self) -> str:
        return self.layout.checkpoint_dir

    def train(self) -> dict:
        """Train to ``train.epochs``; returns the history and where things were written."""
        cfg = self.cfg
        state = self.trainer.state
        try:
            if self.resumed_from and state.epoch >= cfg["train"]["epochs"]:
                self.print(f"already trained {state.epoch} epochs (checkpoint {self.resumed_from}); to train "
                           f"more: {self._more_epochs_hint(state.epoch)}")
            else:
                step, world = self.trainer.amp_step, idist.get_world_size()
                where = (f"{world} processes ({idist.backend()}), {step.device.type}" if world > 1
                         else describe_device(step.device))
                precision = ("float32 (autocast off)" if step.dtype == torch.float32
                             else f"{dtype_name(step.dtype)} autocast")
                self.print(f"training {cfg['name']} on {where} with {precision}; "
                           f"output in {self.output_dir}")
                try:
                    self.trainer.run(self.train_loader, max_epochs=cfg["train"]["epochs"],
                                     epoch_length=cfg["train"]["epoch_length"])
                finally:  # also after an exception: stop the profiler, flush TensorBoard
                    for close in self.closers:
                        close()
        except BaseException as exc:
            self.files.log.traceback(f"the run stopped: {exc.__class__.__name__}: {exc}")
            raise
        finally:
            self.close()
        return {"history": self.history, "final": self.history[-1] if self.history else {},
                "output_dir": self.output_dir,
                "best_checkpoint": self.checkpoint.best_path if self.checkpoint else None,
                "tensorboard_dir": self.tensorboard_dir if self.writes_tensorboard else None}

    def _more_epochs_hint(self, epoch: int) -> str:
        schedule = self.cfg["scheduler"]["name"]
        if schedule == "none":
            return f"{self.command} --set train.epochs={epoch + self.cfg['train']['epochs']}"
        return (f"its {schedule} schedule ended with epoch {epoch} and cannot be stretched, so start over: "
                f"{self.command} --set train.epochs=N --set handlers.checkpoint.resume=never (this run is moved "
                f"aside)")

    def close(self) -> None:
        """Release the run directory (lock, log file) and the global switches the run set."""
        self.files.close()

    @property
    def writes_tensorboard(self) -> bool:
        handlers = self.cfg["handlers"]
        return handlers["tensorboard"]["enabled"] or handlers["profiler"]["enabled"]


class _RunFiles:
    """Rank 0's hold on the run directory: the lock, the log file, and switches to restore at the end."""

    def __init__(self, cfg: dict, main: bool):
        self.lock: Optional[RunLock] = None
        self.log = LogFile(cfg["output_dir"])
        self._restore: list = []
        if main:
            check_writable(cfg["output_dir"])
            self.lock = RunLock(cfg["output_dir"]).acquire()
        self._finalizer = weakref.finalize(self, _release, self.lock, self.log)

    def open_log(self) -> None:
        """Start ``train.log`` (rank 0), once an earlier run's files were moved aside or resumed."""
        if self.lock is not None:
            self.log.open()

    def restore_later(self, undo: Callable) -> None:
        self._restore.append(undo)

    def close(self) -> None:
        while self._restore:
            self._restore.pop()()
        self._finalizer()


def _release(lock: Optional[RunLock], log: LogFile) -> None:
    log.close()
    if lock is not None:
        lock.release()


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


def build_run(cfg: Any, progress: bool = False, print_fn: Callable = safe_print,
              command: str = "ignite-amp train CONFIG") -> Run:
    """Validate ``cfg`` (path, dict or loaded config) and build everything it describes.

    Before anything trains, rank 0 locks ``output_dir`` (one run at a time), opens its
    ``train.log``, decides what to resume (the newest checkpoint that loads; with
    ``resume: never``, or nothing to resume, an earlier run's files are moved aside), checks the
    checkpoint's config against this one (:func:`ignite_amp.resume.check_resume`), creates and
    test-writes every directory the run writes, runs the model once on a dummy batch, and writes
    ``config.yaml``. Every user fault is a one-line error before the first iteration.

    Inside a process group of N > 1 ranks (``torchrun``, or :func:`train_from_config` with
    ``distributed.nproc_per_node``) the model is wrapped by ``idist.auto_model`` (DDP), the
    loaders shard the global batch, and rank 0 alone prints and writes files.
    """
    cfg = load_config(cfg)
    device = config_device(cfg)
    main = idist.get_rank() == 0
    if not main:
        print_fn, progress = _silent, False
    files = _RunFiles(cfg, main)
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


def _build(cfg: dict, device: torch.device, main: bool, files: _RunFiles, progress: bool, print_fn: Callable,
           command: str) -> Run:
    def say(line: str) -> None:
        print_fn(line)
        files.log.line(line)

    searched = cfg["data"]["batch_size"] == "auto"  # for the run facts (a resume replaces "auto" below)
    resume_path, state = _choose_resume(cfg, main, say)
    files.open_log()
    changes = []
    if state is not None:
        stored = _stored_config(state, resume_path)
        if cfg["data"]["batch_size"] == "auto" and isinstance(stored["data"]["batch_size"], int):
            cfg["data"]["batch_size"] = stored["data"]["batch_size"]  # the resumed run's search result
            say(f"data.batch_size: auto: using {cfg['data']['batch_size']}, the batch size of the resumed run "
                f"(no new search)")
        changes = check_resume(stored, cfg, resume_path)
    if main:
        layout = RunLayout(cfg["output_dir"])
        check_writable(layout.checkpoint_dir, "output_dir")
        handlers = cfg["handlers"]
        if handlers["tensorboard"]["enabled"] or handlers["profiler"]["enabled"]:
            check_writable(layout.tensorboard_dir, "output_dir")
        if handlers["profiler"]["enabled"]:
            check_writable(layout.profiler_dir, "output_dir")
    seed_everything(cfg["seed"])
    _check_backoff_mode(cfg)
    model = build_model(cfg["model"]["name"], cfg["model"]["num_classes"], cfg["model"]["kwargs"])
    optimizer = build_optimizer(cfg["optimizer"], model)
    batch_search = None
    if cfg["data"]["batch_size"] == "auto":
        batch_search = search_built(cfg, model, optimizer, device)
        world = idist.get_world_size()
        cfg["data"]["batch_size"] = batch_search.batch_size * world
        per_rank = f" per process x {world} processes" if world > 1 else ""
        say(f"batch-size search: largest fit {batch_search.largest_fit}, using {batch_search.batch_size}{per_rank} "
            f"({len(batch_search.trials)} trials; {batch_search.reason})")

    train_loader, val_loader, n_classes = build_loaders(cfg["data"], cfg["model"]["num_classes"], device,
                                                        cfg["seed"])
    check_classes(cfg, n_classes)
    amp = cfg["amp"]
    loss_fn = torch.nn.functional.cross_entropy
    step_kwargs = dict(device=device, dtype=amp["dtype"], channels_last=amp["channels_last"],
                       compile=amp["compile"], fp32_modules=amp["fp32_modules"])
    trained = model
    if is_distributed():  # DDP wraps the model in its final place and memory format
        model.to(device, memory_format=torch.channels_last if amp["channels_last"] else torch.preserve_format)
        trained = idist.auto_model(model)
        optimizer = idist.auto_optim(optimizer)
    try:
        trainer = create_amp_trainer(trained, optimizer, loss_fn, accumulation_steps=amp["accumulation_steps"],
                                     micro_batches=amp["micro_batches"], **step_kwargs)
        # Metrics keep their sums on the run's device: no host sync per evaluation batch.
        metrics = {"accuracy": Accuracy(device=device), "loss": Loss(loss_fn, device=device)}
        evaluator = create_amp_evaluator(model, metrics, **step_kwargs)
    except ValueError as exc:
        raise ConfigError(f"amp: {exc}") from None
    check_model_runs(cfg, trainer.amp_step)
    if device.type == "cuda" and amp["cudnn_benchmark"]:
        previous = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True  # fixed image shapes: autotune each convolution once
        files.restore_later(lambda: setattr(torch.backends.cudnn, "benchmark", previous))

    epoch_length = cfg["train"]["epoch_length"] or len(train_loader)
    # An accumulation cycle ends at the epoch's end: ceil(epoch_length / accumulation) steps per epoch.
    total_steps = cfg["train"]["epochs"] * -(-epoch_length // amp["accumulation_steps"])
    scheduler = build_scheduler(cfg["scheduler"], optimizer, cfg["optimizer"]["lr"], total_steps)
    if scheduler is not None:  # per optimizer step taken: a step the scaler skipped does not count
        trainer.add_event_handler(AmpEvents.OPTIMIZER_STEPPED, lambda _: scheduler.step())

    sampler = train_loader.sampler
    if hasattr(sampler, "set_epoch"):  # each epoch's order follows from its number, also after a resume
        trainer.add_event_handler(Events.EPOCH_STARTED, lambda engine: sampler.set_epoch(engine.state.epoch))

    to_save = {"model": model, "optimizer": optimizer, "amp_step": trainer.amp_step, "trainer": trainer}
    if scheduler is not None:
        to_save["scheduler"] = scheduler
    run = Run(cfg, trainer, evaluator, model, optimizer, scheduler, train_loader, val_loader, to_save, print_fn,
              files)
    run.command, run.batch_search = command, batch_search
    run.facts = config_facts(cfg, train_loader, batch_size_searched=searched)
    if cfg["handlers"]["non_finite"]["enabled"]:  # first: its epoch-end check runs before evaluation and saving
        NonFiniteGuard(cfg["handlers"]["non_finite"]["max_consecutive"]).attach(trainer)
    summary = EpochSummary(evaluator, run.history, run.print)
    summary.attach(trainer)  # at each epoch's end: the training figures (one host sync),
    Validation(evaluator, run.val_loader).attach(trainer)  # then the evaluation (checkpoints, TensorBoard),
    summary.attach_report(trainer)  # then the epoch's line
    _attach_handlers(run)
    if state is not None:
        _resume(run, resume_path, state, changes, epoch_length)
    if progress:
        from ignite.handlers import ProgressBar

        # No loss in the bar: showing it would sync the host with the device every iteration.
        ProgressBar(persist=False).attach(trainer)
    if main:
        save_config(cfg, RunLayout(cfg["output_dir"]).config_path)
        _warn_if_disk_is_short(cfg, model)
    return run


def _choose_resume(cfg: dict, main: bool, say: Callable) -> Tuple[Optional[str], Optional[dict]]:
    """Rank 0 picks the checkpoint to resume (or moves an earlier run aside); every rank loads it."""
    resume = cfg["handlers"]["checkpoint"]["resume"]
    path, state = None, None
    if main:
        if resume == "auto":
            path, state = BestCheckpoint.find_resumable(RunLayout(cfg["output_dir"]).checkpoint_dir)
        elif resume:
            path = os.path.expanduser(resume)
            state = load_checkpoint(path)  # a missing or unreadable file is a one-line error
        if path is None:
            moved = move_previous_run(cfg["output_dir"])
            if moved:
                why = "resume: never" if not resume else "nothing to resume"
                say(f"starting over in {cfg['output_dir']} ({why}): moved the previous run's files to {moved}")
    if is_distributed():  # every rank resumes from rank 0's choice (output_dir must be shared)
        path = idist.broadcast(path or "", src=0) or None
        if not main and path:
            state = load_checkpoint(path)
    return path, state


def _stored_config(state: dict, path: str) -> dict:
    stored = state.get("config")
    value = stored.get("value") if isinstance(stored, dict) else None
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint {path}: not a checkpoint of an ignite-amp config run (no stored config)")
    return value


def _resume(run: Run, path: str, state: dict, changes: list, epoch_length: int) -> None:
    """Load ``state`` into the run, then apply what the config changed and say so in one line."""
    cfg, trainer = run.cfg, run.trainer
    run.resumed_from = run.checkpoint.resume(path, state)
    # The epoch length is the loader's in use now (a changed data.train_size or batch_size).
    trainer.state.epoch_length = epoch_length
    trainer.state.iteration = trainer.state.epoch * epoch_length
    keys = {c.key for c in changes}
    # The optimizer's state brought back its old settings; the new config's are the defaults of the
    # optimizer built from it (a kwarg the config no longer sets is back at the optimizer's default).
    defaults = run.optimizer.defaults
    for group in run.optimizer.param_groups:
        if "optimizer.lr" in keys:
            group["lr"] = defaults["lr"]
        if "optimizer.kwargs" in keys:
            for name, value in defaults.items():
                if name not in ("params", "lr") and name in group:
                    group[name] = value
    if "amp.micro_batches" in keys:
        trainer.amp_step.micro_batches = cfg["amp"]["micro_batches"]
    kept = "weights, optimizer, scaler, " + ("schedule, " if run.scheduler is not None else "") + "RNG and data order"
    changed = f"; now in effect: {', '.join(map(str, changes))}" if changes else ""
    run.print(f"resumed from {path} at epoch {trainer.state.epoch} (keeps {kept}{changed})")


def _warn_if_disk_is_short(cfg: dict, model: torch.nn.Module) -> None:
    """A checkpoint holds the weights and about twice their size of optimizer state; up to n_saved best
    files and a last one are kept, plus one being written."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    need = 3 * weights * (cfg["handlers"]["checkpoint"]["n_saved"] + 2)
    free = free_bytes(RunLayout(cfg["output_dir"]).checkpoint_dir)
    if free is not None and free < need:
        logger.warning("only %.0f MB free under %s; this run's checkpoints may need about %.0f MB: a save that "
                       "runs out of space stops the run and keeps the previous checkpoint", free / 2**20,
                       RunLayout(cfg["output_dir"]).checkpoint_dir, need / 2**20)


def _check_backoff_mode(cfg: dict) -> None:
    backoff = cfg["handlers"]["oom_backoff"]
    if not (backoff["enabled"] and backoff["mode"] == "batch"):
        return
    if cfg["scheduler"]["name"] != "none":
        raise ConfigError(f"handlers.oom_backoff.mode: batch changes the steps per epoch, which a "
                          f"{cfg['scheduler']['name']} schedule cannot follow; use micro_batch")
    if cfg["train"]["epoch_length"] is not None:
        raise ConfigError("handlers.oom_backoff.mode: batch changes the epoch length; leave train.epoch_length null")


def _attach_handlers(run: Run) -> None:
    """Build the handlers of the config's ``handlers:`` section (NonFiniteGuard is attached earlier)."""
    cfg, trainer, evaluator = run.cfg["handlers"], run.trainer, run.evaluator
    backoff = cfg["oom_backoff"]
    if backoff["enabled"]:
        train_backoff = OOMBackoff(backoff["min_batch_size"], mode=backoff["mode"], grow_after=backoff["grow_after"])
        train_backoff.attach(trainer)
        run.to_save["oom_backoff"] = train_backoff
        OOMBackoff(backoff["min_batch_size"]).attach(evaluator)
    clip = cfg["clipping"]
    if clip["max_norm"] is not None and clip["clip_value"] is not None:
        raise ConfigError("handlers.clipping: set max_norm or clip_value, not both")
    clipping = None
    if clip["max_norm"] is not None or clip["clip_value"] is not None:
        clipping = GradientClipping(max_norm=clip["max_norm"], norm_type=clip["norm_type"],
                                    clip_value=clip["clip_value"])
        clipping.attach(trainer)
    if cfg["tensorboard"]["enabled"]:
        texts = {"run/batch_size_search": run.batch_search.table} if run.batch_search is not None else None
        tb = TensorBoardMetrics(run.tensorboard_dir, log_every=cfg["tensorboard"]["log_every"], facts=run.facts,
                                clipping=clipping, texts=texts)
        tb.attach(trainer, evaluator=evaluator, optimizer=run.optimizer)
        run.closers.append(tb.close)
    prof = cfg["profiler"]
    if prof["enabled"]:
        profiler = ProfilerCapture(run.profiler_dir, wait=prof["wait"], warmup=prof["warmup"],
                                   active=prof["active"], repeat=prof["repeat"])
        profiler.attach(trainer)
        run.closers.append(profiler.stop)
    ckpt = cfg["checkpoint"]
    run.checkpoint = BestCheckpoint(run.checkpoint_dir, run.to_save, metric=ckpt["metric"],
                                    n_saved=ckpt["n_saved"], config=run.cfg)
    run.checkpoint.attach(trainer, evaluator)


def _train(cfg: dict, progress: bool, print_fn: Callable, command: str) -> dict:
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
