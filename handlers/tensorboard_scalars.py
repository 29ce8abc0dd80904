"""The small handlers :class:`~ignite_amp.handlers.TensorBoardMetrics` attaches to one Ignite ``TensorboardLogger``.

Each is an Ignite log handler, ``handler(engine, logger, event_name)``, attached with
``logger.attach(trainer, handler, event)``; those that need every iteration's values also
``attach`` a plain trainer handler that keeps them on the device until the log.
"""
import os
import time
from typing import Any, Callable, Dict, List, Optional

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import TensorboardLogger

from ignite_amp.events import AmpEvents
from ignite_amp.metric_modes import better, metric_mode
from ignite_amp.scaler import scale_tensor
from ignite_amp.step import AmpStep

__all__ = ["TrainWindow", "DeviceMemory", "BatchShape", "BestValidation", "rss_mb"]


def rss_mb() -> float:
    """Resident memory of this process in MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TrainWindow:
    """The window's training scalars (loss, grad norm, clip share, loss scale, skipped steps, speed) with
    one host sync per log: the values stay on the device as the step made them until the log reads
    them in one stack.

    ``clipping``: a ``GradientClipping`` whose pre-clip norms are compared with its ``max_norm`` at the log.
    """

    def __init__(self, step: AmpStep, clipping: Optional[Any] = None):
        self.step, self.clipping = step, clipping
        self.skipped = 0
        self._last_clip_norm: Optional[torch.Tensor] = None
        self.reset()

    def reset(self) -> None:
        self.losses: List[torch.Tensor] = []
        self.norms: List[torch.Tensor] = []
        self.clip_norms: List[torch.Tensor] = []  # the clipping's pre-clip norms: compared at the log, not per step
        self.samples = self.largest_batch = 0
        self.data_wait = 0.0
        self.window_start = time.perf_counter()

    def attach(self, trainer: Engine) -> None:
        """The per-iteration bookkeeping (register before the log's handlers)."""
        trainer.add_event_handler(Events.STARTED, lambda _: self.reset())
        trainer.add_event_handler(Events.GET_BATCH_STARTED, self._batch_started)
        trainer.add_event_handler(Events.GET_BATCH_COMPLETED, self._batch_completed)
        trainer.add_event_handler(AmpEvents.STEP_SKIPPED, self._step_skipped)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)

    def _batch_started(self, engine: Engine) -> None:
        self._fetch_start = time.perf_counter()

    def _batch_completed(self, engine: Engine) -> None:
        self.data_wait += time.perf_counter() - self._fetch_start

    def _step_skipped(self, engine: Engine) -> None:
        self.skipped += 1

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
        self.losses.append(step.loss)
        self.samples += step.batch_size
        self.largest_batch = max(self.largest_batch, step.batch_size)

    def __call__(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        if not self.losses:
            return
        iteration, writer, amp = engine.state.iteration, logger.writer, self.step
        device = self.losses[0].device
        reads = {"train/loss": torch.stack(self.losses).mean()}
        if self.norms:
            reads["train/grad_norm"] = torch.stack([n.to(device, torch.float32) for n in self.norms]).mean()
        clip = self.clipping
        if self.clip_norms:
            bound = torch.stack([n.to(device) for n in self.clip_norms]) > clip.max_norm
            reads["train/clip_fraction"] = bound.float().mean()
        scale = scale_tensor(amp.scaler) if amp.scaler.is_enabled() else None
        if scale is not None:
            reads["amp/loss_scale"] = scale
        # The one host sync of this log.
        values = dict(zip(reads, torch.stack([v.to(device, torch.float32) for v in reads.values()]).tolist()))
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        for tag, value in values.items():
            writer.add_scalar(tag, value, iteration)
        if clip is not None and clip.max_norm is not None and clip.norm_type == 2.0 and clip.parameters is None:
            writer.add_scalar("train/clip_max_norm", clip.max_norm, iteration)
        if amp.scaler.is_enabled():
            if scale is None:  # before the scaler's first step: its init_scale, no sync
                writer.add_scalar("amp/loss_scale", amp.scaler.get_scale(), iteration)
            writer.add_scalar("amp/skipped_steps", self.skipped, iteration)
        writer.add_scalar("perf/samples_per_sec", self.samples / elapsed, iteration)
        writer.add_scalar("perf/data_wait_fraction", min(self.data_wait / elapsed, 1.0), iteration)
        writer.add_scalar("perf/step_time_ms", elapsed / len(self.losses) * 1e3, iteration)
        self.reset()


class DeviceMemory:
    """Device memory at the log (CUDA: allocated, reserved, the window's peak), or the process's RSS."""

    def __init__(self, device: torch.device):
        self.device = device

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.STARTED, self._started)

    def _started(self, engine: Engine) -> None:
        if self.device.type == "cuda":  # the first window's peak is the training's, not a search's before it
            torch.cuda.reset_peak_memory_stats(self.device)

    def __call__(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        writer, iteration, device = logger.writer, engine.state.iteration, self.device
        if device.type == "cuda":
            writer.add_scalar("memory/allocated_mb", torch.cuda.memory_allocated(device) / 2**20, iteration)
            writer.add_scalar("memory/max_allocated_mb", torch.cuda.max_memory_allocated(device) / 2**20, iteration)
            writer.add_scalar("memory/reserved_mb", torch.cuda.memory_reserved(device) / 2**20, iteration)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            writer.add_scalar("memory/rss_mb", rss_mb(), iteration)


class BatchShape:
    """Global batch size and micro-batches when they differ from the run facts or change (OOM backoff), and
    out-of-memory errors caught. Log it before the :class:`TrainWindow` (which starts a new window)."""

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
            self.last = {"batch/size": facts.get("batch_size"), "batch/micro_batches": facts.get("micro_batches")}
        # Constant in most runs: the run facts hold them; a scalar only when they change.
        for tag, value in (("batch/size", self.window.largest_batch * idist.get_world_size()),
                           ("batch/micro_batches", self.step.micro_batches)):
            if value != self.last.get(tag):
                writer.add_scalar(tag, value, iteration)
                self.last[tag] = value
        writer.add_scalar("oom/events", self.step.oom_count, iteration)


class BestValidation:
    """``val/best_<metric>`` after each evaluation (min for a loss or an error, else max; or as ``modes`` says).

    Attach to the evaluator; the x axis is the trainer's iteration. ``final`` and ``best`` hold the values.
    """

    def __init__(self, trainer: Engine, modes: Optional[Dict[str, str]] = None):
        self.trainer = trainer
        self.modes = dict(modes or {})
        self.final: Dict[str, float] = {}
        self.best: Dict[str, float] = {}

    def __call__(self, evaluator: Engine, logger: Optional[TensorboardLogger], event_name: Any = None) -> None:
        for name, value in evaluator.state.metrics.items():
            if not isinstance(value, (int, float)) and not (torch.is_tensor(value) and value.numel() == 1):
                continue
            value = float(value)
            self.final[name] = value
            pick = better(self.modes.get(name) or metric_mode(name))
            self.best[name] = pick(self.best.get(name, value), value)
            if logger is not None:
                logger.writer.add_scalar(f"val/best_{name}", self.best[name], self.trainer.state.iteration)
