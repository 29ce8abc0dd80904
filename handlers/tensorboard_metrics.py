"""TensorBoard logging of what matters in a mixed-precision run, one host sync per log."""
import os
import time
from typing import Any, Dict, Optional

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import TensorboardLogger

from ignite_amp.events import AmpEvents
from ignite_amp.step import amp_step_of

__all__ = ["TensorBoardMetrics", "TAGS"]

TAGS = {
    "train/loss": "mean training loss over the last log_every iterations",
    "train/lr": "learning rate (train/lr/group_N when the optimizer has several param groups)",
    "train/grad_norm": "mean pre-clip total gradient norm (L2) over the optimizer steps of the window",
    "amp/loss_scale": "GradScaler scale (float16 only)",
    "amp/skipped_steps": "optimizer steps skipped for inf/NaN gradients since the start (float16 only)",
    "perf/samples_per_sec": "training samples per second over the window",
    "perf/data_wait_fraction": "share of the window's wall time spent waiting for the data loader",
    "memory/max_allocated_mb": "peak memory allocated by tensors during the window (CUDA)",
    "memory/reserved_mb": "memory held by the caching allocator (CUDA)",
    "memory/rss_mb": "resident memory of the process (CPU runs)",
    "batch/size": "size of the last batch",
    "batch/micro_batches": "chunks each batch is split into (raised by OOM backoff)",
    "oom/events": "out-of-memory errors caught since the start",
    "val/<metric>": "validation metrics after each evaluation (x axis: training iteration)",
}


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TensorBoardMetrics:
    """Log loss, lr, grad norm, loss scale, skipped steps, throughput, memory, batch and OOM figures.

    Built on Ignite's ``TensorboardLogger``. Every ``log_every`` iterations it writes the means
    over the window, kept on the device until then and read with one host sync; validation
    metrics after each evaluation; and at the end ``hparams`` with the final and best
    validation metrics. Rank 0 only. The tags are listed in ``TAGS``.

    Args:
        logdir: TensorBoard directory.
        log_every: iterations between two logs.
        hparams: a flat mapping of numbers and strings (e.g. ``ignite_amp.config.flatten_config(cfg)``)
            logged as TensorBoard hparams at the end.
    """

    def __init__(self, logdir: str, log_every: int = 50, hparams: Optional[Dict[str, Any]] = None):
        if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1:
            raise ValueError(f"Argument log_every should be a positive integer, got {log_every!r}.")
        self.logdir, self.log_every, self.hparams = str(logdir), log_every, hparams
        self.tb: Optional[TensorboardLogger] = None
        self.skipped = 0
        self.final: Dict[str, float] = {}
        self.best: Dict[str, float] = {}
        self._reset()

    def _reset(self) -> None:
        self.loss_sum: Optional[torch.Tensor] = None
        self.norm_sum: Optional[torch.Tensor] = None
        self.iters = self.steps = self.samples = 0
        self.data_wait = 0.0
        self.window_start = time.perf_counter()

    def attach(self, trainer: Engine, evaluator: Optional[Engine] = None,
               optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        if idist.get_rank() != 0:
            return
        self.step = amp_step_of(trainer)
        self.step.track_grad_norm()
        self.optimizer = optimizer if optimizer is not None else self.step.optimizer
        self.tb = TensorboardLogger(log_dir=self.logdir)
        trainer.add_event_handler(Events.STARTED, lambda _: self._reset())
        trainer.add_event_handler(Events.GET_BATCH_STARTED, self._batch_started)
        trainer.add_event_handler(Events.GET_BATCH_COMPLETED, self._batch_completed)
        trainer.add_event_handler(AmpEvents.GRADS_READY, self._grads_ready)
        trainer.add_event_handler(AmpEvents.STEP_SKIPPED, self._step_skipped)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        trainer.add_event_handler(Events.COMPLETED, self._completed)
        # No EXCEPTION_RAISED handler: Ignite does not re-raise when one exists. Each log is
        # flushed instead, so a crashed run keeps what it logged; close() is safe to call twice.
        if evaluator is not None:
            self.tb.attach_output_handler(evaluator, event_name=Events.COMPLETED, tag="val", metric_names="all",
                                          global_step_transform=lambda *_: trainer.state.iteration)
            evaluator.add_event_handler(Events.COMPLETED, self._track_validation)

    def _batch_started(self, engine: Engine) -> None:
        self._fetch_start = time.perf_counter()

    def _batch_completed(self, engine: Engine) -> None:
        self.data_wait += time.perf_counter() - self._fetch_start

    def _grads_ready(self, engine: Engine) -> None:
        norm = self.step.grad_norm
        if norm is None:
            return
        self.norm_sum = norm if self.norm_sum is None else self.norm_sum + norm
        self.steps += 1

    def _step_skipped(self, engine: Engine) -> None:
        self.skipped += 1

    def _iteration_completed(self, engine: Engine) -> None:
        out = engine.state.output
        self.loss_sum = out["loss"] if self.loss_sum is None else self.loss_sum + out["loss"]
        self.iters += 1
        self.samples += out["batch_size"]
        if engine.state.iteration % self.log_every == 0 and self.tb is not None:
            self._log(engine)

    def _log(self, engine: Engine) -> None:
        step, writer, amp = engine.state.iteration, self.tb.writer, self.step
        means = [self.loss_sum / self.iters]
        if self.norm_sum is not None:
            means.append(self.norm_sum.to(means[0].device) / self.steps)
        values = torch.stack(means).tolist()  # the one host sync of this log
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        writer.add_scalar("train/loss", values[0], step)
        if len(values) > 1:
            writer.add_scalar("train/grad_norm", values[1], step)
        groups = self.optimizer.param_groups
        for i, group in enumerate(groups):
            writer.add_scalar("train/lr" if len(groups) == 1 else f"train/lr/group_{i}", group["lr"], step)
        if amp.scaler.is_enabled():
            writer.add_scalar("amp/loss_scale", amp.scaler.get_scale(), step)
            writer.add_scalar("amp/skipped_steps", self.skipped, step)
        writer.add_scalar("perf/samples_per_sec", self.samples / elapsed, step)
        writer.add_scalar("perf/data_wait_fraction", min(self.data_wait / elapsed, 1.0), step)
        if amp.device.type == "cuda":
            writer.add_scalar("memory/max_allocated_mb", torch.cuda.max_memory_allocated(amp.device) / 2**20, step)
            writer.add_scalar("memory/reserved_mb", torch.cuda.memory_reserved(amp.device) / 2**20, step)
            torch.cuda.reset_peak_memory_stats(amp.device)
        else:
            writer.add_scalar("memory/rss_mb", _rss_mb(), step)
        writer.add_scalar("batch/size", engine.state.output["batch_size"], step)
        writer.add_scalar("batch/micro_batches", amp.micro_batches, step)
        writer.add_scalar("oom/events", amp.oom_count, step)
        writer.flush()
        self._reset()

    def _track_validation(self, evaluator: Engine) -> None:
        for name, value in evaluator.state.metrics.items():
            if not isinstance(value, (int, float)) and not (torch.is_tensor(value) and value.numel() == 1):
                continue
            value = float(value)
            self.final[name] = value
            better = min if "loss" in name.lower() else max
            self.best[name] = better(self.best.get(name, value), value)
        if self.tb is not None:
            self.tb.writer.flush()

    def _completed(self, engine: Engine) -> None:
        # Flush, not close: the same trainer may run again (more epochs). close() ends the logger.
        if self.tb is None:
            return
        if self.hparams is not None:
            metrics = {f"hparam/final_{k}": v for k, v in self.final.items()}
            metrics.update({f"hparam/best_{k}": v for k, v in self.best.items()})
            self.tb.writer.add_hparams(dict(self.hparams), metrics, run_name=".")
        self.tb.writer.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
