"""The small handlers :class:`~ignite_amp.handlers.TensorBoardMetrics` attaches to one Ignite ``TensorboardLogger``.

Each is an Ignite log handler, ``handler(engine, logger, event_name)``, which ``TensorBoardMetrics`` calls at
each log (or ``logger.attach(trainer, handler, event)`` attaches); those that need every iteration's values also
``attach`` a plain trainer handler that keeps them on the device until the log (the memory handlers are in
:mod:`.memory`). Each keeps what
it logged in ``history`` for the end-of-run health summary (:mod:`.health`). :func:`layout`
is the Custom Scalars layout of the charts they fill.
"""
import bisect
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import TensorboardLogger

from ignite_amp.core.device import peak_tflops
from ignite_amp.core.metric_modes import better, metric_mode
from ignite_amp.files.run_directory import TENSORBOARD_SPLITS
from ignite_amp.step.events import AmpEvents
from ignite_amp.step.scaler import scale_tensor
from ignite_amp.step.train import AmpStep

__all__ = ["TrainWindow", "BatchShape", "Validation", "TrainerMetrics", "layout", "SPLITS"]


SPLITS = TENSORBOARD_SPLITS  # one TensorBoard run per split, in the run's log directory
RSS_CHART = "process memory MB: RSS (line), its growth since the first log (the band's lower edge)"


def layout(metrics: Sequence[str] = ("accuracy",), scaler: bool = True, clipping: bool = True, cuda: bool = True,
           flops: bool = True, mfu: bool = True, ranks: bool = False, lr_groups: int = 1) -> dict:
    """The Custom Scalars layout of a run: one scale per chart, only the charts the run fills, and one
    quantity per run in each chart (TensorBoard colours a line by its run, so the lines of one chart
    differ by run: ``train`` and ``val`` hold the same tag names, as Keras's runs do; the best so far,
    ``<metric>/best``, has its own chart, where it cannot hide the val line it equals while it improves).

    ``tensorboard --logdir runs`` merges the runs' layouts (same categories, charts unioned)."""
    health = {"loss: train (window mean), val": ["Multiline", [r"^loss$"]]}
    for name in metrics:
        if name != "loss":
            health[f"{name}: train (when measured), val"] = ["Multiline", [rf"^{name}$"]]
    for name in metrics:
        health[f"best val {name} so far"] = ["Multiline", [rf"^{name}/best$"]]
    if scaler:
        health["loss scale (float16)"] = ["Multiline", [r"^precision/loss_scale$"]]
        health["skipped optimizer steps (float16, since the start)"] = ["Multiline", [r"^precision/skipped_steps$"]]
    if clipping:
        health["share of optimizer steps clipped (1.0: every step)"] = ["Multiline", [r"^optimizer/clip_share$"]]
    health["samples/s of each window"] = ["Multiline", [r"^throughput/samples_per_sec$"]]
    health["samples/s: the median of the windows so far"] = ["Multiline", [r"^throughput/median_samples_per_sec$"]]
    details = {"grad norm (pre-clip, L2)": ["Multiline", [r"^optimizer/grad_norm$"]]}
    for group in range(lr_groups):
        title = "learning rate" + (f" (param group {group})" if lr_groups > 1 else "")
        details[title] = ["Multiline", [rf"^optimizer/lr/group_{group}$"]]
    details["share of wall time waiting for data"] = ["Multiline", [r"^throughput/data_wait_share$"]]
    details["ms per iteration"] = ["Multiline", [r"^throughput/step_time_ms$"]]
    if flops:
        details["achieved TFLOP/s"] = ["Multiline", [r"^throughput/tflops$"]]
    if mfu:
        details["MFU (share of the dense peak)"] = ["Multiline", [r"^throughput/mfu(_float8)?$"]]
    if cuda:
        for kind in ("allocated", "reserved", "peak"):
            details[f"device memory MB: {kind}"] = ["Multiline", [rf"^memory/{kind}_mb$"]]
    else:
        # A margin chart: the RSS line over a band down to its growth since the first log (near 0), so the axis
        # spans from about 0 and its 3-significant-digit ticks differ; a multiline chart of a flat RSS reads "976"
        # at every tick.
        details[RSS_CHART] = ["Margin", ["memory/rss_mb", "memory/rss_growth_mb", "memory/rss_mb"]]
    if ranks:
        details["the largest rank's memory MB"] = ["Multiline", [r"^memory/max_rank_(peak|rss)_mb$"]]
    return {"AMP health": health, "AMP details": details}


def _median(ordered: Sequence[float]) -> float:
    """``statistics.median`` of an already sorted sequence."""
    i = len(ordered) // 2
    return ordered[i] if len(ordered) % 2 else (ordered[i - 1] + ordered[i]) / 2


class TrainWindow:
    """The window's training scalars (loss, grad norm, clip share, loss scale, skipped steps, speed,
    achieved TFLOP/s and MFU) with one host sync per log: the values stay on the device as the step
    made them until the log reads them in one stack.

    ``clipping``: a ``GradientClipping`` whose pre-clip norms are compared with its ``max_norm`` at the log.
    """

    def __init__(self, step: AmpStep, clipping: Optional[Any] = None):
        self.step, self.clipping = step, clipping
        self.skipped = self.stepped = 0
        self.start_iteration: Optional[int] = None
        self.history: List[Dict[str, float]] = []  # one record per window read
        self.peak = peak_tflops(step.device, step.dtype)
        # dtype float8: MFU against the float8 dense peak too (both labelled: neither alone is the truth)
        self.peak_float8 = peak_tflops(step.device, step.dtype, float8=True) if step.float8 is not None else None
        self._last_clip_norm: Optional[torch.Tensor] = None
        self._speeds: List[float] = []  # every window's samples/s, sorted
        self.reset()

    def reset(self) -> None:
        self.losses: List[torch.Tensor] = []
        self.empty: List[Any] = []  # per iteration: False, or True / a device flag when num_items counted 0
        self.norms: List[torch.Tensor] = []
        self.clip_norms: List[torch.Tensor] = []  # the clipping's pre-clip norms: compared at the log, not per step
        self.samples = self.largest_batch = 0
        self.data_wait = self.busy = 0.0  # seconds fetching batches; in iterations (fetch, step, handlers)

    def attach(self, trainer: Engine, every: int = 0, log: Optional[Callable[[Engine], None]] = None) -> None:
        """The per-iteration bookkeeping; ``log(trainer)`` right after it on every ``every``-th iteration (one
        trainer handler per iteration, where a filtered handler per log handler would each run per iteration)."""
        self._every, self._log = every, log
        trainer.add_event_handler(Events.STARTED, self._started)
        trainer.add_event_handler(Events.GET_BATCH_STARTED, self._batch_started)
        trainer.add_event_handler(Events.GET_BATCH_COMPLETED, self._batch_completed)
        trainer.add_event_handler(AmpEvents.STEP_SKIPPED, self._step_skipped)
        trainer.add_event_handler(AmpEvents.OPTIMIZER_STEPPED, self._optimizer_stepped)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)

    def _started(self, engine: Engine) -> None:
        self.reset()
        if self.start_iteration is None:
            self.start_iteration = engine.state.iteration  # where this process's counts begin (a resume: not 0)
        if self.step.flops_per_sample is None:
            self.step.count_flops()  # the first iteration: FLOPs per sample, for TFLOP/s and MFU

    def _batch_started(self, engine: Engine) -> None:
        self._fetch_start = time.perf_counter()

    def _batch_completed(self, engine: Engine) -> None:
        self.data_wait += time.perf_counter() - self._fetch_start

    def _step_skipped(self, engine: Engine) -> None:
        self.skipped += 1

    def _optimizer_stepped(self, engine: Engine) -> None:
        self.stepped += 1

    def _iteration_completed(self, engine: Engine) -> None:
        # The step's pre-clip norm stays readable until its next iteration starts; None when this
        # iteration did not step (accumulating, or the scaler skipped).
        step = self.step
        norm = step.grad_norm
        if norm is not None:
            self.norms.append(norm)
            clip_norm = self.clipping.last_norm if self.clipping is not None else None
            if clip_norm is not None and clip_norm is not self._last_clip_norm:
                self.clip_norms.append(clip_norm)
                self._last_clip_norm = clip_norm
        if step.loss is None:  # the trainer's process function did not run its step (an AmpEngine built by hand)
            raise RuntimeError("TensorBoardMetrics: the trainer's iteration ended without a loss from its AMP step: "
                               "its process function should run the step (as create_amp_trainer's does)")
        self.losses.append(step.loss)
        self.empty.append(step.items == 0)  # num_items counted nothing (padding only): no loss to average
        n = step.batch_size
        self.samples += n
        if n > self.largest_batch:
            self.largest_batch = n
        # From the batch's fetch to now: evaluation, checkpoints and other epoch-end work are not training time.
        self.busy += time.perf_counter() - self._fetch_start
        if self._log is not None and not engine.state.iteration % self._every:
            self._log(engine)

    def read(self, iteration: int) -> Dict[str, float]:
        """The window's values by tag (one host sync), kept in ``history``; then a new window starts."""
        amp, device = self.step, self.losses[0].device
        losses = torch.stack(self.losses)
        if any(e is not False for e in self.empty):  # leave out batches of padding only (their loss is 0/0)
            kept = ~torch.stack([torch.as_tensor(e, device=device) for e in self.empty])
            losses = torch.where(kept, losses, torch.zeros_like(losses)).sum() / kept.sum()
        reads = {"loss": losses.mean()}
        if self.norms:
            # One stack, then one cast (exact, whatever the norms' dtype): not a cast per step at each log.
            reads["optimizer/grad_norm"] = torch.stack(self.norms).to(device, torch.float32).mean()
        # clip norms come from a clipping by norm (one by value keeps none); one run's norms share a dtype: stacked
        # as they are, compared in it
        max_norm = self.clipping.max_norm if self.clipping is not None else None
        if self.clip_norms and max_norm is not None:
            bound = torch.stack(self.clip_norms).to(device) > max_norm
            reads["optimizer/clip_share"] = bound.float().mean()
        scale = scale_tensor(amp.scaler) if amp.scaler.is_enabled() else None
        if scale is not None:
            reads["precision/loss_scale"] = scale
        # The one host sync of this log.
        read = torch.stack([v.to(device, torch.float32) for v in reads.values()]).tolist()
        values = dict(zip(reads, read, strict=True))
        if amp.scaler.is_enabled():
            if scale is None:  # before the scaler's first step: its init_scale, no sync
                values["precision/loss_scale"] = amp.scaler.get_scale()
            values["precision/skipped_steps"] = self.skipped
        elapsed = max(self.busy, 1e-9)
        values["throughput/samples_per_sec"] = self.samples / elapsed
        bisect.insort(self._speeds, values["throughput/samples_per_sec"])  # sorted: no walk of the history per log
        values["throughput/median_samples_per_sec"] = _median(self._speeds)  # the run's, so far
        values["throughput/step_time_ms"] = elapsed / len(self.losses) * 1e3
        values["throughput/data_wait_share"] = min(self.data_wait / elapsed, 1.0)
        if amp.flops_per_sample:  # per process: this rank's samples on this rank's device
            values["throughput/tflops"] = amp.flops_per_sample * values["throughput/samples_per_sec"] / 1e12
            if self.peak is not None:
                values["throughput/mfu"] = values["throughput/tflops"] / self.peak[0]
            if self.peak_float8 is not None:
                values["throughput/mfu_float8"] = values["throughput/tflops"] / self.peak_float8[0]
        self.history.append({**values, "iteration": iteration, "clip_steps": len(self.clip_norms),
                             "iterations": len(self.losses)})
        self.reset()
        return values

    def flush(self, iteration: int) -> None:
        """Read the window in progress into ``history`` without logging it (the run's end)."""
        if self.losses:
            self.read(iteration)

    def __call__(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        if not self.losses:
            return
        for tag, value in self.read(engine.state.iteration).items():
            logger.writer.add_scalar(tag, value, engine.state.iteration)


class BatchShape:
    """Global batch size and micro-batches when they differ from the run facts or change (OOM backoff), and
    out-of-memory retries once there is one: nothing in a run where they stay as configured. Log it
    before the :class:`TrainWindow` (which starts a new window)."""

    def __init__(self, step: AmpStep, window: TrainWindow, facts: Callable[[], Dict[str, Any]]):
        self.step, self.window, self.facts = step, window, facts
        self.last: Optional[Dict[str, Any]] = None

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.STARTED, self._started)

    def _started(self, engine: Engine) -> None:
        self.last = None  # compared with the facts written at this start

    def __call__(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        writer, iteration = logger.writer, engine.state.iteration
        if self.last is None:
            facts = self.facts()
            self.last = {"step/batch_size": facts.get("batch_size"),
                         "step/micro_batches": facts.get("micro_batches", self.step.micro_batches),
                         "step/oom_retries": 0}
        for tag, value in (("step/batch_size", self.window.largest_batch * idist.get_world_size()),
                           ("step/micro_batches", self.step.micro_batches),
                           ("step/oom_retries", self.step.oom_count)):
            if value != self.last.get(tag):
                writer.add_scalar(tag, value, iteration)
                self.last[tag] = value


class Validation:
    """Each evaluation's metrics as ``<metric>`` and the best so far as ``<metric>/best`` (min for a loss or an
    error, else max; or as ``modes`` says) in the ``val`` run, at the trainer's iteration: one chart overlays
    a metric's train and val lines, each in its run's colour. Attach to the evaluator with the ``val`` run's
    logger; ``final`` and ``best`` hold the values."""

    def __init__(self, trainer: Optional[Engine], modes: Optional[Dict[str, str]] = None):
        self.trainer = trainer
        self.modes = dict(modes or {})
        self.final: Dict[str, float] = {}
        self.best: Dict[str, float] = {}
        self.evaluations = 0

    def __call__(self, evaluator: Engine, logger: Optional[TensorboardLogger], event_name: Any = None) -> None:
        self.evaluations += 1
        for name, value in scalar_metrics(evaluator.state.metrics).items():
            self.final[name] = value
            pick = better(self.modes.get(name) or metric_mode(name))
            self.best[name] = pick(self.best.get(name, value), value)
            if logger is not None and self.trainer is not None:
                iteration = self.trainer.state.iteration
                logger.writer.add_scalar(name, value, iteration)
                logger.writer.add_scalar(f"{name}/best", self.best[name], iteration)


def scalar_metrics(metrics: Dict[str, Any]) -> Dict[str, float]:
    """The metrics that are one number (a number or a one-element tensor), as floats."""
    return {name: float(value) for name, value in metrics.items()
            if isinstance(value, (int, float)) or (torch.is_tensor(value) and value.numel() == 1)}


class TrainerMetrics:
    """Metrics attached to the trainer (``Accuracy(output_transform=...).attach(trainer, "accuracy")``), logged
    at each epoch's end in the ``train`` run under their own names, beside the ``val`` run's same-named metric.
    A name the ``train`` run already writes (``loss``: the window mean) is logged as ``<name>_epoch``.

    :meth:`attach` registers the epoch-end log when the trainer starts: after every metric attached before
    ``run()``, whose epoch-end computation must come first."""

    def __init__(self, logger: TensorboardLogger, taken: Sequence[str] = ("loss",)):
        self.logger, self.taken = logger, set(taken)
        self.logged: Dict[str, Dict[int, float]] = {}  # tag -> {iteration: value}

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.STARTED, self._started)

    def _started(self, engine: Engine) -> None:
        if not engine.has_event_handler(self, Events.EPOCH_COMPLETED):
            engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        iteration = engine.state.iteration
        for name, value in scalar_metrics(engine.state.metrics).items():
            tag = f"{name}_epoch" if name in self.taken else name
            self.logger.writer.add_scalar(tag, value, iteration)
            self.logged.setdefault(tag, {})[iteration] = value
        self.logger.writer.flush()
