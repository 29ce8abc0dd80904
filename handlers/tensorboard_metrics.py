"""TensorBoard logging of what matters in a mixed-precision run, one host sync per log."""
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import TensorboardLogger

from ignite_amp.events import AmpEvents
from ignite_amp.facts import format_facts, step_facts
from ignite_amp.handlers.gradient_clipping import GradientClipping
from ignite_amp.engine import amp_step_of
from ignite_amp.metric_modes import better, metric_mode
from ignite_amp.scaler import scale_tensor

__all__ = ["TensorBoardMetrics", "TAGS", "LAYOUT", "FACTS_TAG"]

TAGS = {
    "train/loss": "mean training loss over the last log_every iterations",
    "train/lr": "learning rate (train/lr/group_N when the optimizer has several param groups)",
    "train/grad_norm": "mean pre-clip total gradient norm (L2) over the optimizer steps of the window",
    "train/clip_max_norm": "the clipping threshold (GradientClipping's max_norm, L2 over all the model's gradients)",
    "train/clip_fraction": "share of the window's optimizer steps whose pre-clip norm was above max_norm",
    "amp/loss_scale": "GradScaler scale (float16 only)",
    "amp/skipped_steps": "optimizer steps skipped for inf/NaN gradients since the start (float16 only)",
    "perf/samples_per_sec": "training samples per second over the window",
    "perf/data_wait_fraction": "share of the window's wall time spent waiting for the data loader",
    "perf/step_time_ms": "mean wall time per iteration over the window (data wait and handlers included)",
    "memory/allocated_mb": "memory allocated by tensors at the log (CUDA)",
    "memory/max_allocated_mb": "peak memory allocated by tensors during the window (CUDA)",
    "memory/reserved_mb": "memory held by the caching allocator (CUDA)",
    "memory/rss_mb": "resident memory of the process (CPU runs)",
    "batch/size": "global batch size (the window's largest batch x processes), logged when it changes",
    "batch/micro_batches": "chunks each batch is split into, logged when it changes (raised by OOM backoff)",
    "oom/events": "out-of-memory errors caught since the start",
    "val/<metric>": "validation metrics after each evaluation (x axis: training iteration)",
    "val/best_<metric>": "best validation value so far (min for a loss or an error, else max; or as modes= says)",
}

FACTS_TAG = "run/facts"

# Custom Scalars tab: the first category is what tells whether an AMP run is healthy. The layout
# does not depend on the run, so `tensorboard --logdir runs` merges the runs' layouts into one.
LAYOUT = {
    "AMP health": {
        "loss: train, val": ["Multiline", ["train/loss", "val/loss"]],
        "val accuracy (and best)": ["Multiline", ["val/accuracy", "val/best_accuracy"]],
        "loss scale, skipped steps (float16 only)": ["Multiline", ["amp/loss_scale", "amp/skipped_steps"]],
        "grad norm, clip threshold": ["Multiline", ["train/grad_norm", "train/clip_max_norm"]],
        "samples/s, data-wait fraction": ["Multiline", ["perf/samples_per_sec", "perf/data_wait_fraction"]],
        "device memory MB: allocated, reserved, peak (CPU: RSS)": [
            "Multiline", ["memory/allocated_mb", "memory/reserved_mb", "memory/max_allocated_mb", "memory/rss_mb"]],
    },
    "AMP details": {
        "clipping bound (fraction of optimizer steps)": ["Multiline", ["train/clip_fraction"]],
        "step time ms": ["Multiline", ["perf/step_time_ms"]],
        "learning rate": ["Multiline", [r"train/lr(/group_\d+)?$"]],
        "batch size, micro-batches (logged on change)": ["Multiline", ["batch/size", "batch/micro_batches"]],
        "out-of-memory errors caught": ["Multiline", ["oom/events"]],
    },
}

_FACT_TYPES = (bool, int, float, str, type(None))


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def hparams_summaries(facts: Dict[str, Any], metrics: Dict[str, str]) -> list:
    """The HParams plugin's experiment (columns) and session-start summaries for one run.

    Written directly (not ``SummaryWriter.add_hparams``): no ``hparam/*`` scalar tags, booleans
    stay booleans (shown true/false), and each metric column reads an existing scalar tag
    (``metrics``: tag -> column title). Each run is its own session group.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2, summary_v2

    infos = []
    for name, value in facts.items():
        info = api_pb2.HParamInfo(name=name, type=api_pb2.DATA_TYPE_FLOAT64)  # numbers, and None (unknown)
        if isinstance(value, bool):
            info.type = api_pb2.DATA_TYPE_BOOL
            info.domain_discrete.extend([False, True])
        elif isinstance(value, str):
            info.type = api_pb2.DATA_TYPE_STRING
        infos.append(info)
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=title) for tag, title in metrics.items()])
    config = Summary()
    config.value.add(tag=metadata.EXPERIMENT_TAG, tensor=metadata.NULL_TENSOR,
                     metadata=metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(experiment=experiment)))
    start = summary_v2.hparams_pb({k: v for k, v in facts.items() if v is not None}, trial_id="")
    return [config, start]


def _session_end_summary():
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())
    summary = Summary()
    summary.value.add(tag=metadata.SESSION_END_INFO_TAG, tensor=metadata.NULL_TENSOR,
                      metadata=metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(session_end_info=end)))
    return summary


class TensorBoardMetrics:
    """Log what tells whether a mixed-precision run is healthy, and what actually ran.

    Built on Ignite's ``TensorboardLogger``. At the start of a run it writes a Custom Scalars
    layout (``LAYOUT``: loss, accuracy, loss scale with skipped steps, grad norm with the clip
    threshold, throughput with the data-wait fraction, memory), the run facts as a text entry
    (``FACTS_TAG``) and as HParams (the facts as columns, and the final and best validation
    metrics and samples/s as metric columns read from the scalar tags). Every ``log_every``
    iterations it writes the means over the window, kept on the device until then and read with
    one host sync; validation metrics after each evaluation. Rank 0 only. The tags are in ``TAGS``.

    Args:
        logdir: directory of the event files: one TensorBoard run (``tensorboard --logdir`` its parent).
        log_every: iterations between two logs.
        facts: what the step cannot tell, e.g. ``ignite_amp.facts.config_facts(cfg, loader)``
            (batch size, model, optimizer...): a flat mapping to bool, int, float, str or None,
            added to the step's own facts (dtype, scaler, device, processes, micro-batches,
            accumulation, versions; :func:`ignite_amp.facts.step_facts`), over which it wins.
        clipping: the run's ``GradientClipping`` by norm, for the clip threshold and the fraction of
            optimizer steps where clipping bound (its ``last_norm`` above ``max_norm``, counted at the log).
        hparam_metrics: validation metrics shown as HParams columns (final and best).
        texts: more text entries written at the start, tag -> text shown as preformatted (e.g. the
            batch-size search's trial table, which ``train_from_config`` logs as ``run/batch_size_search``).
        modes: metric name -> ``"min"`` or ``"max"`` for ``val/best_*``, as given to ``BestCheckpoint``;
            other metrics follow :func:`ignite_amp.metric_modes.metric_mode` (the checkpoint's default).

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
    """

    def __init__(self, logdir: str, log_every: int = 50, facts: Optional[Dict[str, Any]] = None,
                 clipping: Optional[GradientClipping] = None, hparam_metrics: Sequence[str] = ("accuracy", "loss"),
                 texts: Optional[Dict[str, str]] = None, modes: Optional[Dict[str, str]] = None):
        if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1:
            raise ValueError(f"Argument log_every should be a positive integer, got {log_every!r}.")
        if facts is not None:
            if not isinstance(facts, dict):
                raise TypeError(f"Argument facts should be a dict, got {type(facts).__name__}.")
            for name, value in facts.items():
                if not isinstance(name, str) or not isinstance(value, _FACT_TYPES):
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
        self.hparam_metrics = tuple(hparam_metrics)
        self.tb: Optional[TensorboardLogger] = None
        self.evaluator: Optional[Engine] = None
        self.facts_written: Dict[str, Any] = {}
        self.skipped = 0
        self.final: Dict[str, float] = {}
        self.best: Dict[str, float] = {}
        self._last: Dict[str, Any] = {}
        self._last_clip_norm: Optional[torch.Tensor] = None
        self._layout_written = False
        self._reset()

    def _reset(self) -> None:
        # The window's values, kept as the step made them: no kernel or allocation per iteration,
        # one stack and one host read at the log.
        self.losses: List[torch.Tensor] = []
        self.norms: List[torch.Tensor] = []
        self.clip_norms: List[torch.Tensor] = []  # the clipping's pre-clip norms: compared at the log, not per step
        self.samples = self.largest_batch = 0
        self.data_wait = 0.0
        self.window_start = time.perf_counter()

    def attach(self, trainer: Engine, evaluator: Optional[Engine] = None,
               optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        if idist.get_rank() != 0:
            return
        self.step = amp_step_of(trainer)
        self.step.track_grad_norm()
        self.trainer, self.evaluator = trainer, evaluator
        self.optimizer = optimizer if optimizer is not None else self.step.optimizer
        self.tb = TensorboardLogger(log_dir=self.logdir)
        trainer.add_event_handler(Events.STARTED, self._started)
        trainer.add_event_handler(Events.GET_BATCH_STARTED, self._batch_started)
        trainer.add_event_handler(Events.GET_BATCH_COMPLETED, self._batch_completed)
        trainer.add_event_handler(AmpEvents.STEP_SKIPPED, self._step_skipped)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        trainer.add_event_handler(Events.COMPLETED, self._completed)
        # No EXCEPTION_RAISED handler: Ignite does not re-raise when one exists. Each log is
        # flushed instead, so a crashed run keeps what it logged; close() is safe to call twice.
        if evaluator is not None:
            self.tb.attach_output_handler(evaluator, event_name=Events.COMPLETED, tag="val", metric_names="all",
                                          global_step_transform=lambda *_: trainer.state.iteration)
            evaluator.add_event_handler(Events.COMPLETED, self._track_validation)

    def _started(self, engine: Engine) -> None:
        """Dashboard layout, run facts (text and HParams), resolved now: after a resume, too."""
        self._reset()
        if self.step.device.type == "cuda":  # the first window's peak is the training's, not a search's before it
            torch.cuda.reset_peak_memory_stats(self.step.device)
        if self.tb is None:
            return
        writer, iteration = self.tb.writer, engine.state.iteration
        facts = {**step_facts(self.step), **self.facts}
        self.facts_written = facts
        self._last = {"batch/size": facts.get("batch_size"), "batch/micro_batches": facts.get("micro_batches")}
        if not self._layout_written:
            writer.add_custom_scalars(LAYOUT)
            self._layout_written = True
        from tensorboard.plugins.text.summary_v2 import text_pb

        writer.file_writer.add_summary(text_pb(FACTS_TAG, format_facts(facts)), iteration)
        for tag, text in self.texts.items():  # preformatted: markdown keeps indented lines as they are
            writer.file_writer.add_summary(text_pb(tag, "    " + text.replace("\n", "\n    ")), iteration)
        metrics = {}
        if self.evaluator is not None:
            for name in self.hparam_metrics:
                metrics[f"val/{name}"] = f"val {name} (final)"
                metrics[f"val/best_{name}"] = f"val {name} (best)"
        metrics["perf/samples_per_sec"] = "samples/s (last window)"
        for summary in hparams_summaries(facts, metrics):
            writer.file_writer.add_summary(summary, iteration)
        writer.flush()

    def _batch_started(self, engine: Engine) -> None:
        self._fetch_start = time.perf_counter()

    def _batch_completed(self, engine: Engine) -> None:
        self.data_wait += time.perf_counter() - self._fetch_start

    def _step_skipped(self, engine: Engine) -> None:
        self.skipped += 1

    def _iteration_completed(self, engine: Engine) -> None:
        # The step's pre-clip norm stays readable until its next iteration starts; None when this
        # iteration did not step (accumulating, or the scaler skipped).
        norm = self.step.grad_norm
        if norm is not None:
            self.norms.append(norm)
            clip_norm = self.clipping.last_norm if self.clipping is not None else None
            if clip_norm is not None and clip_norm is not self._last_clip_norm:
                self.clip_norms.append(clip_norm)
                self._last_clip_norm = clip_norm
        step = self.step
        self.losses.append(step.loss)
        self.samples += step.batch_size
        self.largest_batch = max(self.largest_batch, step.batch_size)
        if engine.state.iteration % self.log_every == 0 and self.tb is not None:
            self._log(engine)

    def _log(self, engine: Engine) -> None:
        step, writer, amp = engine.state.iteration, self.tb.writer, self.step
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
            writer.add_scalar(tag, value, step)
        if clip is not None and clip.max_norm is not None and clip.norm_type == 2.0 and clip.parameters is None:
            writer.add_scalar("train/clip_max_norm", clip.max_norm, step)
        groups = self.optimizer.param_groups
        for i, group in enumerate(groups):
            writer.add_scalar("train/lr" if len(groups) == 1 else f"train/lr/group_{i}", group["lr"], step)
        if amp.scaler.is_enabled():
            if scale is None:  # before the scaler's first step: its init_scale, no sync
                writer.add_scalar("amp/loss_scale", amp.scaler.get_scale(), step)
            writer.add_scalar("amp/skipped_steps", self.skipped, step)
        writer.add_scalar("perf/samples_per_sec", self.samples / elapsed, step)
        writer.add_scalar("perf/data_wait_fraction", min(self.data_wait / elapsed, 1.0), step)
        writer.add_scalar("perf/step_time_ms", elapsed / len(self.losses) * 1e3, step)
        if amp.device.type == "cuda":
            writer.add_scalar("memory/allocated_mb", torch.cuda.memory_allocated(amp.device) / 2**20, step)
            writer.add_scalar("memory/max_allocated_mb", torch.cuda.max_memory_allocated(amp.device) / 2**20, step)
            writer.add_scalar("memory/reserved_mb", torch.cuda.memory_reserved(amp.device) / 2**20, step)
            torch.cuda.reset_peak_memory_stats(amp.device)
        else:
            writer.add_scalar("memory/rss_mb", _rss_mb(), step)
        # Constant in most runs: the run facts hold them; a scalar only when they change.
        for tag, value in (("batch/size", self.largest_batch * idist.get_world_size()),
                           ("batch/micro_batches", amp.micro_batches)):
            if value != self._last.get(tag):
                writer.add_scalar(tag, value, step)
                self._last[tag] = value
        writer.add_scalar("oom/events", amp.oom_count, step)
        writer.flush()
        self._reset()

    def _track_validation(self, evaluator: Engine) -> None:
        for name, value in evaluator.state.metrics.items():
            if not isinstance(value, (int, float)) and not (torch.is_tensor(value) and value.numel() == 1):
                continue
            value = float(value)
            self.final[name] = value
            pick = better(self.modes.get(name) or metric_mode(name))
            self.best[name] = pick(self.best.get(name, value), value)
            if self.tb is not None:
                self.tb.writer.add_scalar(f"val/best_{name}", self.best[name], self.trainer.state.iteration)
        if self.tb is not None:
            self.tb.writer.flush()

    def _completed(self, engine: Engine) -> None:
        # Flush, not close: the same trainer may run again (more epochs). close() ends the logger.
        if self.tb is None:
            return
        self.tb.writer.file_writer.add_summary(_session_end_summary(), engine.state.iteration)
        self.tb.writer.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
