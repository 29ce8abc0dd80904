"""TensorBoard for a mixed-precision run: the first screen answers "is this run healthy?".

One TensorBoard run per split, as Keras writes them: ``<logdir>/train`` and ``<logdir>/val`` hold the
same tag names (``loss``, ``accuracy``...), so one chart overlays a metric's train and val lines, told
apart by colour and legend (the best so far, ``<metric>/best``, has its own); ``<logdir>`` itself holds
the text (facts, health), the HParams session (with its metric columns' values, ``run/...``) and the Custom
Scalars layout. Time Series (which sorts groups by name) opens on the metrics (``accuracy``, ``loss``), then
``memory/``, ``optimizer/`` (grad norm, clip share, lr), ``precision/`` (loss scale, skipped steps), ``run/``
(the run's own), ``step/`` (only when a batch or micro-batch count changes, or memory ran out) and
``throughput/``, the rest in the ``train`` run. Each chart
of the Custom Scalars "AMP health" dashboard has one scale, one quantity per run, and only what the
run logs.
"""
import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import TensorboardLogger

from ignite_amp.core.config_keys import POSITIVE_INT, Boolean, argument, setting
from ignite_amp.core.config_values import Section
from ignite_amp.core.device import dtype_name
from ignite_amp.core.metric_modes import metric_mode
from ignite_amp.engine import amp_step_of, trainer_step_of
from ignite_amp.handlers.gradient_clipping import GradientClipping
from ignite_amp.handlers.tensorboard.event import LearningRates, ScalarEvent, file_writer
from ignite_amp.handlers.tensorboard.facts import (
    FACT_TYPES,
    FACTS_TAG,
    HPARAMS,
    RunFacts,
    hparams_summaries,
    session_end_summary,
    write_session_values,
    write_text,
)
from ignite_amp.handlers.tensorboard.health import Health, health_lines
from ignite_amp.handlers.tensorboard.memory import DeviceMemory, RanksMemory
from ignite_amp.handlers.tensorboard.scalars import SPLITS, BatchShape, TrainerMetrics, TrainWindow, Validation, layout
from ignite_amp.step.train import AmpStep

__all__ = ["TensorBoardConfig", "TensorBoardMetrics", "TAGS", "LAYOUT", "FACTS_TAG", "HEALTH_TAG", "layout",
           "hparams_summaries", "HPARAMS"]


@dataclasses.dataclass(frozen=True, eq=False)
class TensorBoardConfig(Section):
    """handlers.tensorboard: what TensorBoardMetrics logs in output_dir."""

    enabled: bool = setting(True, Boolean(), "attach TensorBoardMetrics")
    log_every: int = setting(50, POSITIVE_INT, "iterations per training scalar point (one host sync each)")


# Tag -> meaning; "val/..." are tags of the val run, "run/..." the run's own (the HParams columns' values), every
# other tag is the train run's.
TAGS = {
    "run/val_<metric>": "the last validation's metric, for its HParams column (final)",
    "run/val_<metric>_best": "the best validation value so far, for its HParams column (best)",
    "run/median_samples_per_sec": "throughput/median_samples_per_sec, for its HParams column",
    "val/<metric>": "validation metric after each evaluation, e.g. accuracy, loss (x axis: training iteration)",
    "val/<metric>/best": "best validation value so far (min for a loss or an error, else max; or as modes= says)",
    "loss": "mean training loss over the last log_every iterations",
    "<metric>": "a metric attached to the trainer, at each epoch's end (<metric>_epoch for a name the train run "
                "already writes, i.e. loss)",
    "memory/allocated_mb": "memory allocated by tensors at the log (CUDA)",
    "memory/peak_mb": "peak memory allocated by tensors during the window (CUDA)",
    "memory/reserved_mb": "memory held by the caching allocator (CUDA)",
    "memory/rss_mb": "resident memory of the process (CPU runs)",
    "memory/rss_growth_mb": "memory/rss_mb less its value at the process's first log (CPU runs)",
    "memory/max_rank_peak_mb": "the largest rank's peak allocated in the window (CUDA; ranks_memory)",
    "memory/max_rank_rss_mb": "the largest rank's resident memory (CPU runs; ranks_memory)",
    "optimizer/grad_norm": "mean pre-clip total gradient norm (L2) over the optimizer steps of the window",
    "optimizer/clip_share": "share of the window's optimizer steps whose pre-clip norm was above max_norm",
    "optimizer/lr/group_<N>": "learning rate of each param group (as Ignite's OptimizerParamsHandler logs it)",
    "precision/loss_scale": "GradScaler scale (float16 only)",
    "precision/skipped_steps": "optimizer steps skipped for inf/NaN gradients since the start (float16 only)",
    "step/batch_size": "global batch size, logged only when it differs from the run facts (OOM backoff, batch mode)",
    "step/micro_batches": "chunks each batch is split into, logged only when it changes (OOM backoff)",
    "step/oom_retries": "out-of-memory errors caught since the start, logged from the first one",
    "throughput/samples_per_sec": "training samples per second of the window's iterations (this process; "
                                  "evaluation and other epoch-end work excluded)",
    "throughput/median_samples_per_sec": "the run's median of the windows' samples/s so far (an HParams column)",
    "throughput/step_time_ms": "mean time per iteration over the window, from fetching its batch to its end",
    "throughput/data_wait_share": "share of the window's wall time spent waiting for the data loader",
    "throughput/tflops": "achieved TFLOP/s: FLOPs per sample (counted once, forward + backward) x samples/s",
    "throughput/mfu": "model FLOPs utilisation: achieved TFLOP/s over the GPU's dense peak for the dtype",
    "throughput/mfu_float8": "dtype float8: achieved TFLOP/s over the GPU's float8 dense peak (beside mfu: bfloat16's)",
}

HEALTH_TAG = "run/health"
MEDIAN_TAG = "run/median_samples_per_sec"  # the HParams column's copy of throughput/median_samples_per_sec


def column_tags(metric: str) -> Tuple[str, str]:
    """The tags of a validation metric's HParams columns in the run's own run: (final, best)."""
    return f"run/val_{metric}", f"run/val_{metric}_best"


LAYOUT = layout()  # every chart a run can have (a CPU run has the RSS chart instead of device memory)


class TensorBoardMetrics:
    """Log what tells whether a mixed-precision run is healthy, and what actually ran.

    One Ignite ``TensorboardLogger`` per TensorBoard run (the run's own, ``train``, ``val``) and small
    handlers (``ignite_amp.handlers.tensorboard.scalars``: ``TrainWindow``, ``BatchShape``, ``memory.DeviceMemory``,
    ``Validation``, ``TrainerMetrics`` for metrics attached to the trainer; ``event.LearningRates``
    for the learning rate; ``facts.RunFacts`` for what ran). At the start
    it writes the run facts as text (``FACTS_TAG``) and as HParams (the facts as columns; the final
    and best validation metrics and the median samples/s as metric columns). Every ``log_every``
    iterations it writes the window's means, kept on the device until then and read with one host
    sync, and at the first log the Custom Scalars layout (``scalars.layout``). At the end (also of a
    failed run, through :meth:`close`) it writes the health summary (``HEALTH_TAG``,
    ``health.health_lines``), which :meth:`health` returns too.
    Rank 0 writes (with ``ranks_memory``, every rank attaches it). The tags are in ``TAGS``.

    Args:
        logdir: directory of the event files: the run, with its ``train`` and ``val`` runs in
            subdirectories (``tensorboard --logdir`` it, or its parent to compare runs).
        log_every: iterations between two logs.
        facts: what the step cannot tell, e.g. ``ignite_amp.step.facts.config_facts(cfg, loader)``
            (batch size, model, optimizer...): a flat mapping to bool, int, float, str or None,
            added to the step's own facts (dtype, scaler, device, processes, micro-batches,
            accumulation, versions; ``ignite_amp.step.facts.step_facts``), over which it wins.
        clipping: the run's ``GradientClipping`` by norm, for the share of optimizer steps where
            clipping bound (its ``last_norm`` above ``max_norm``, counted at the log).
        hparam_metrics: validation metrics shown as HParams columns (final and best) and charts.
        texts: more text entries written at the start, tag -> text shown as preformatted (e.g. the
            batch-size search's trial table, which ``train_from_config`` logs as ``run/batch_size_search``).
        modes: metric name -> ``"min"`` or ``"max"`` for ``<metric>/best``, as given to ``BestCheckpoint``;
            other metrics follow ``ignite_amp.core.metric_modes.metric_mode`` (the checkpoint's default).
        ranks_memory: in a process group, also log the largest rank's memory (``memory/max_rank_*``,
            one all-reduce per log): then attach on every rank, not on rank 0 only.
        from_config: the health advice names config keys, not Python arguments (``train_from_config`` sets it).

    Example:
        >>> import tempfile, torch
        >>> from ignite_amp import create_amp_trainer
        >>> from ignite_amp.handlers import GradientClipping, TensorBoardMetrics
        >>> model = torch.nn.Linear(4, 2)
        >>> trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                              torch.nn.functional.cross_entropy, device="cpu", dtype="bfloat16")
        >>> clip = GradientClipping(max_norm=1.0)
        >>> clip.attach(trainer)
        >>> tb = TensorBoardMetrics(tempfile.mkdtemp(), log_every=2, facts={"batch_size": 8}, clipping=clip)
        >>> tb.attach(trainer)
        >>> _ = trainer.run([(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 4)
        >>> tb.close()
        >>> tb.facts_written["dtype"], tb.facts_written["grad_scaler"], tb.facts_written["batch_size"]
        ('bfloat16', False, 8)
        >>> tb.health()[:2]  # doctest: +NORMALIZE_WHITESPACE
        ['verdict: healthy (clipping and data wait within bounds)',
         'precision: bfloat16 autocast (no GradScaler needed), 4 optimizer steps']
    """

    def __init__(self, logdir: str, log_every: int = 50, facts: Optional[Dict[str, Any]] = None,
                 clipping: Optional[GradientClipping] = None, hparam_metrics: Sequence[str] = ("accuracy", "loss"),
                 texts: Optional[Dict[str, str]] = None, modes: Optional[Dict[str, str]] = None,
                 ranks_memory: bool = False, from_config: bool = False):
        argument(TensorBoardConfig, "log_every", log_every)
        if facts is not None:
            if not isinstance(facts, dict):
                raise TypeError(f"Argument facts should be a dict, got {type(facts).__name__}.")
            for name, value in facts.items():
                if not isinstance(name, str) or not isinstance(value, FACT_TYPES):
                    raise TypeError(f"Argument facts should map names to bool, int, float, str or None, "
                                    f"got {name!r}: {type(value).__name__}.")
        if clipping is not None and not isinstance(clipping, GradientClipping):
            raise TypeError(f"Argument clipping should be a GradientClipping, got {type(clipping).__name__}.")
        if isinstance(hparam_metrics, str) or not all(isinstance(m, str) for m in hparam_metrics):
            raise TypeError(f"Argument hparam_metrics should be a sequence of metric names, got {hparam_metrics!r}.")
        if texts is not None and not (isinstance(texts, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in texts.items())):
            raise TypeError(f"Argument texts should map tags to strings, got {texts!r}.")
        self.modes = {name: metric_mode(name, mode) for name, mode in (modes or {}).items()}
        self.texts = dict(texts or {})
        self.logdir, self.log_every = str(logdir), log_every
        self.facts = dict(facts or {})
        self.clipping = clipping
        self.ranks_memory, self.from_config = bool(ranks_memory), bool(from_config)
        self.hparam_metrics = tuple(hparam_metrics)
        self.validation = Validation(None, self.modes)
        self._attached: Optional[_Attached] = None  # made by attach on rank 0: what the handlers after it read
        self._ended = True  # the trainer's run completed (or never started): close() has nothing to add
        self._layout_written = False

    @property
    def step(self) -> Optional[AmpStep]:
        """The trainer's step, once attached (None before, and on ranks other than 0)."""
        return self._attached.step if self._attached is not None else None

    @property
    def window(self) -> Optional[TrainWindow]:
        """The training scalars' window (``scalars.TrainWindow``), once attached (None before, and on other ranks)."""
        return self._attached.window if self._attached is not None else None

    @property
    def facts_written(self) -> Dict[str, Any]:
        """The run facts written at the start (the step's, then ``facts``)."""
        return self._attached.run_facts.written if self._attached is not None else {}

    @property
    def final(self) -> Dict[str, float]:
        """The last validation's metrics, by name."""
        return self.validation.final

    @property
    def best(self) -> Dict[str, float]:
        """The best value of each validation metric so far (by its mode: min for losses, else max)."""
        return self.validation.best

    @property
    def samples(self) -> int:
        """Training samples in the current window."""
        return self._attached.window.samples if self._attached is not None else 0

    def attach(self, trainer: Engine, evaluator: Optional[Engine] = None,
               optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Log ``trainer`` (and ``evaluator``'s metrics after each of its runs) on rank 0; ``optimizer``
        defaults to the step's. Starts the step's gradient-norm tracking."""
        ranks = None
        if self.ranks_memory and idist.get_world_size() > 1:  # every rank takes part, before DeviceMemory
            ranks = RanksMemory(amp_step_of(trainer).device, self.log_every)
            ranks.attach(trainer)
        if idist.get_rank() != 0:
            return
        step = trainer_step_of(trainer, type(self).__name__)
        step.track_grad_norm()
        optimizer = optimizer if optimizer is not None else step.optimizer
        tb = TensorboardLogger(log_dir=self.logdir)
        splits = {split: TensorboardLogger(log_dir=os.path.join(self.logdir, split))
                  for split in (SPLITS if evaluator is not None else SPLITS[:1])}
        window, memory = TrainWindow(step, self.clipping), DeviceMemory(step.device, ranks)
        # The HParams metric columns (tag of the run's own -> title): TensorBoard reads a column in the session's
        # run (facts.hparams_summaries), so each value is copied there when its source is written.
        metrics: Dict[str, str] = {}
        if evaluator is not None:
            for name in self.hparam_metrics:
                final, best = column_tags(name)
                metrics[final], metrics[best] = f"val {name} (final)", f"val {name} (best)"
        metrics[MEDIAN_TAG] = "samples/s (median)"
        run_facts = RunFacts(self.facts, self.texts, metrics, step, self.logdir)
        shape = BatchShape(step, window, lambda: run_facts.written)
        self._attached = on = _Attached(trainer, step, tb, splits, window, memory, run_facts, ranks,
                                        (shape, window, LearningRates(optimizer), memory), len(optimizer.param_groups))
        window.attach(trainer, self.log_every, lambda engine: self._log(engine, on))  # the log's iteration: its window
        memory.attach(trainer, close=False)  # closed after _completed's last read (below)
        tb.attach(trainer, run_facts, Events.STARTED)
        trainer.add_event_handler(Events.STARTED, self._started, on)
        trainer.add_event_handler(Events.COMPLETED, self._completed, on)
        for event in (Events.COMPLETED, Events.TERMINATE):  # after the last window's read and the health summary
            trainer.add_event_handler(event, memory.close)
        shape.attach(trainer)
        # shape reads the window before it starts the next; _log flushes: a crashed run keeps what it logged.
        # (No EXCEPTION_RAISED handler: Ignite does not re-raise when one exists.) close() is safe to call twice.
        TrainerMetrics(splits["train"]).attach(trainer)
        if evaluator is not None:
            self.validation.trainer = trainer
            splits["val"].attach(evaluator, self.validation, Events.COMPLETED)
            tb.attach(evaluator, self._validated, Events.COMPLETED)
            splits["val"].attach(evaluator, _flush, Events.COMPLETED)

    def _started(self, engine: Engine, on: "_Attached") -> None:
        """At each start: a run resumed at iteration N logs the steps after N again; TensorBoard hides what an
        earlier process logged from N + 1 on (the session restart that ``SummaryWriter(purge_step=)`` writes), so
        each step is one point."""
        self._ended = False
        if engine.state.iteration:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            restart = Event(step=engine.state.iteration + 1, session_log=SessionLog(status=SessionLog.START))
            for logger in (on.tb, *on.splits.values()):
                file_writer(logger.writer).add_event(restart)

    def _log(self, engine: Engine, on: "_Attached") -> None:
        """Every ``log_every`` iterations and at the end: the log's handlers in order, their scalars one event."""
        scalars, writer = ScalarEvent(), on.splits["train"].writer
        for handler in on.log_handlers:
            handler(engine, scalars, Events.ITERATION_COMPLETED)
        median = scalars.get("throughput/median_samples_per_sec")
        scalars.write(writer, engine.state.iteration)
        writer.flush()
        if median is not None:
            write_session_values(on.tb, {MEDIAN_TAG: median}, engine.state.iteration)
        self._logged_once(engine, on)

    def _validated(self, evaluator: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        """After each validation: the HParams columns' values (final and best) in the run's own run."""
        validation, values = self.validation, {}
        for name in self.hparam_metrics:
            if name in validation.final:
                final, best = column_tags(name)
                values[final], values[best] = validation.final[name], validation.best[name]
        if validation.trainer is not None:
            write_session_values(logger, values, validation.trainer.state.iteration)

    def _logged_once(self, engine: Engine, on: "_Attached") -> None:
        if not self._layout_written:  # at the first log: the FLOP count and what is logged are known
            step, peak, writer = on.step, on.window.peak, on.tb.writer
            if step.flops_per_sample:
                on.run_facts.add(on.tb, engine.state.iteration, gflops_per_sample=step.flops_per_sample / 1e9,
                                 peak_tflops=peak[0] if peak else None)
            writer.add_custom_scalars(layout(
                [m for m in self.hparam_metrics if self.validation.trainer is not None], step.scaler.is_enabled(),
                self.clipping is not None and self.clipping.max_norm is not None, step.device.type == "cuda",
                bool(step.flops_per_sample), bool(step.flops_per_sample) and peak is not None,
                on.ranks is not None, on.lr_groups))
            self._layout_written = True
            writer.flush()

    def health(self) -> List[str]:
        """The health summary of the run so far (see ``ignite_amp.handlers.tensorboard.health``); [] on other ranks."""
        on = self._attached
        if on is None:
            return []
        step, window, memory, ranks = on.step, on.window, on.memory, on.ranks
        scaler = step.scaler.is_enabled()
        micro = min(step.micro_batches, step.batch_size) if step.batch_size else None
        return health_lines(Health(
            dtype=dtype_name(step.dtype), scaler=scaler, windows=window.history, optimizer_steps=window.stepped,
            skipped_steps=window.skipped, loss_scale=step.scaler.get_scale() if scaler else None,
            max_norm=self.clipping.max_norm if self.clipping is not None else None,
            peak_memory_mb=memory.peak_mb or None,
            max_rank_memory_mb=max(ranks.peak_mb, memory.peak_mb) if ranks is not None else None,
            planned_memory_mb=self.facts_written.get("planned_peak_mb"),  # a config run's plan (ignite-amp plan)
            memory_kind="allocated" if step.device.type == "cuda" else "RSS",
            oom_retries=step.oom_count, micro_batches=step.micro_batches,
            micro_batch_size=-(-step.batch_size // micro) if micro else None,
            flops_per_sample=step.flops_per_sample, peak_name=window.peak[1] if window.peak else None,
            since=f" since the resume at iteration {window.start_iteration}" if window.start_iteration else "",
            processes=idist.get_world_size(), from_config=self.from_config,
            **_split_check_of(step)))

    def _write_health(self, iteration: int, on: "_Attached") -> None:
        on.memory.read()
        lines = self.health()
        write_text(on.tb, HEALTH_TAG, "\n".join(f"- {line}" for line in lines), iteration)
        on.tb.writer.flush()

    def _completed(self, engine: Engine, on: "_Attached") -> None:
        # Flush, not close: the same trainer may run again (more epochs). close() ends the logger.
        if on.window.losses:  # the last iterations since the last log (all of a run shorter than log_every)
            self._log(engine, on)
        self._write_health(engine.state.iteration, on)
        self._ended = True
        file_writer(on.tb.writer).add_summary(session_end_summary(), engine.state.iteration)
        on.tb.writer.flush()

    def close(self) -> None:
        """Write the health summary if the run did not complete (a failure, a stop) after it trained (a finished
        run resumed, with nothing to train, keeps the health it had), then close the logger (a later run of the
        trainer opens new event files)."""
        on = self._attached
        if on is None:  # not attached, or another rank's: nothing written
            return
        window = on.window
        try:
            if not self._ended and (window.stepped or window.skipped or window.losses or window.history):
                self._ended = True
                self._write_health(on.trainer.state.iteration, on)
        finally:
            on.memory.close()  # CUDA's peak counter as if never reset, after a failure too
            for logger in (on.tb, *on.splits.values()):
                logger.close()


@dataclasses.dataclass(frozen=True)
class _Attached:
    """What :meth:`TensorBoardMetrics.attach` made on rank 0, given to the handlers it registers: none is None."""

    trainer: Engine
    step: AmpStep
    tb: TensorboardLogger  # the run's own: text, HParams, layout
    splits: Dict[str, TensorboardLogger]  # train, val: the scalars
    window: TrainWindow
    memory: DeviceMemory
    run_facts: RunFacts
    ranks: Optional[RanksMemory]  # only with ranks_memory in a process group
    # called at each log, in order, as (engine, logger, event): the logger a ScalarEvent that gathers their scalars
    log_handlers: Tuple[Callable[..., None], ...]
    lr_groups: int


def _split_check_of(step: Any) -> dict:
    """The split check's line for the health summary (a training step's ``split_check``; none on other steps)."""
    check = getattr(step, "split_check", None)
    if check is None or not (summary := check.summary()):
        return {}
    return {"split_check": summary, "split_checked": bool(check.batches)}


def _flush(engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
    logger.writer.flush()
