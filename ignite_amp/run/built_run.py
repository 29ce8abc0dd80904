"""The built run: what a config built, and how it trains, reports its health and ends.

:class:`Run` holds everything :func:`ignite_amp.run.compose.build_run` built (engines, model, optimizer,
loaders, the checkpoint handler, the run directory's files). :meth:`Run.train` trains to ``train.epochs``
(or says the checkpoint already has them, with the command that trains more), then runs the closers
(profiler, TensorBoard, progress bar), prints the end-of-run health summary and releases the run directory,
also after an exception. It builds nothing: the composition root (:mod:`ignite_amp.run.compose`) does.
"""
import dataclasses
from typing import Any, Callable, List, Optional

from ignite.engine import Engine

from ignite_amp.config.tree import Config
from ignite_amp.engine import AmpEngine
from ignite_amp.files.run_directory import RunFiles, RunLayout
from ignite_amp.handlers.best_checkpoint import BestCheckpoint
from ignite_amp.run.console import fitted
from ignite_amp.run.dtype_probe import brief_why
from ignite_amp.run.fast_path import speed_words, start_speed_words
from ignite_amp.run.plan import RunPlan
from ignite_amp.step.facts import start_words

__all__ = ["Run", "Log"]


class Log:
    """A line of the run: printed (``print_fn``; rank 0's, silent on the others) and kept in ``train.log``."""

    def __init__(self, print_fn: Callable, files: RunFiles):
        self.print_fn, self.files = print_fn, files

    def __call__(self, line: str) -> None:
        self.print_fn(line)
        self.files.log.line(line)


@dataclasses.dataclass
class Run:
    """Everything a config builds, built once (:func:`ignite_amp.run.compose.build_run`); ``run.train()`` trains it,
    then ``run.close()`` ends it.

    On rank 0 the run holds ``output_dir``'s lock and writes ``train.log`` from the moment it
    is built until :meth:`close` (which :meth:`train` calls at its end).
    """

    plan: RunPlan  #: the config resolved for this run, every "auto" settled (``run.cfg`` is its config)
    trainer: AmpEngine
    evaluator: Engine
    model: Any
    optimizer: Any
    scheduler: Any
    train_loader: Any
    val_loader: Any
    train_data: Any  #: what the trainer runs on (the loader, or a PassStream with train.epoch_length)
    to_save: dict
    log: Log
    files: RunFiles
    checkpoint: BestCheckpoint
    history: List[dict]  #: a record per epoch (EpochSummary's)
    closers: List[Callable[[], None]]  #: run at the end: the progress bar, TensorBoard, the profiler
    health: Callable[[], list]  #: the end-of-run health summary (TensorBoardMetrics.health)
    traces: list  #: the profiler's files
    command: str = "ignite-amp train CONFIG"
    batch_search: Any = None  #: the batch-size search's result when data.batch_size was auto
    resumed_from: Optional[str] = None
    health_lines: list = dataclasses.field(default_factory=list)

    @property
    def cfg(self) -> Config:
        """The run's config (with ``data.batch_size: auto`` settled by the search or the resumed run)."""
        return self.plan.config

    @property
    def facts(self) -> dict:
        """What the config resolved to, for TensorBoard's run facts (:meth:`RunPlan.facts`)."""
        return self.plan.facts()

    @property
    def dtype_why(self) -> str:
        """Why ``dtype: auto`` chose the dtype ("" where the config named it)."""
        dtype = self.plan.choice("dtype")
        return dtype.why if dtype is not None else ""

    def print(self, line: str) -> None:
        self.log(line)

    @property
    def output_dir(self) -> str:
        return self.cfg.output_dir

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.cfg.output_dir)

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
            if self.resumed_from and state.epoch >= cfg.train.epochs:
                fewer = (f", more than the {cfg.train.epochs} train.epochs asks for"
                         if state.epoch > cfg.train.epochs else "")
                self.print(f"already trained {state.epoch} epoch{'' if state.epoch == 1 else 's'} "
                           f"(checkpoint {self.resumed_from}{fewer}); nothing to train; to train more: "
                           f"{self._more_epochs_hint(state.epoch)}")
            else:
                step = self.trainer.amp_step
                if step.float8 is not None:
                    self.print(step.float8.line())
                where, precision = start_words(step, cfg.amp.dtype == "auto", brief_why(self.dtype_why))
                optimizer, batch = cfg.optimizer.name, self.facts.get("batch_size", cfg.data.batch_size)
                speed = start_speed_words(self.facts, optimizer, step.device.type == "cuda") \
                    if "num_workers" in self.facts else ""
                # At most two rows of 80 columns: the reasons in full go to train.log and the run facts.
                self.print(f"training {cfg.name} on {where} with {precision}, batch {batch}; "
                           f"output in {self.output_dir}{'; ' if speed else ''}{speed}")
                self.files.log.line("why: " + "; ".join(
                    ([f"dtype auto: {self.dtype_why}"] if self.dtype_why else [])
                    + ([speed_words(self.facts, optimizer)] if "num_workers" in self.facts else [])))
                try:
                    self.trainer.run(self.train_data, max_epochs=cfg.train.epochs,
                                     epoch_length=cfg.train.epoch_length)
                finally:  # also after an exception: stop the profiler, flush TensorBoard, say how it went
                    for close in self.closers:
                        close()
                    self._report_health()
        except BaseException as exc:
            self.files.log.traceback(f"the run stopped: {exc.__class__.__name__}: {exc}")
            raise
        finally:
            self.close()
        return {"history": self.history, "final": self.history[-1] if self.history else {}, "health": self.health_lines,
                "output_dir": self.output_dir,
                "best_checkpoint": self.checkpoint.best_path,
                "tensorboard_dir": self.tensorboard_dir if self.writes_tensorboard else None}

    def _report_health(self) -> None:
        try:
            self.health_lines = self.health()
        except Exception as exc:  # after a device fault the figures may be unreadable: the run's own error wins
            self.files.log.line(f"no health summary: {exc.__class__.__name__}: {exc}")
            return
        if self.health_lines:
            self.print("health of the run:")
            for line in self.health_lines:
                self.print(fitted(f"  {line}", indent="    "))
        for trace in (t for t in self.traces if t.endswith(".json")):
            self.print(f"profiler trace: {trace}: open it in https://ui.perfetto.dev (Open trace file)")

    def _more_epochs_hint(self, epoch: int) -> str:
        schedule = self.cfg.scheduler.name
        if schedule == "none":
            return f"{self.command} --set train.epochs={epoch + self.cfg.train.epochs}"
        return (f"its {schedule} schedule ended with epoch {epoch} and cannot be stretched, so start over: "
                f"{self.command} --set train.epochs=N --set handlers.checkpoint.resume=never (this run is moved "
                f"aside)")

    def close(self) -> None:
        """Release the run directory (lock, log file) and the global switches the run set."""
        self.files.close()

    @property
    def writes_tensorboard(self) -> bool:
        handlers = self.cfg.handlers
        return handlers.tensorboard.enabled or handlers.profiler.enabled
