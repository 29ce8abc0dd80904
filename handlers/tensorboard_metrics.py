"""TensorBoard logging of what matters in a mixed-precision run, one host sync per log."""
import dataclasses
import time
from typing import Any, Dict, Optional, Sequence

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import TensorboardLogger
from ignite.handlers.tensorboard_logger import OptimizerParamsHandler

from ignite_amp.engine import amp_step_of
from ignite_amp.facts import format_facts, step_facts
from ignite_amp.fields import POSITIVE_INT, Boolean, argument, setting
from ignite_amp.handlers.gradient_clipping import GradientClipping
from ignite_amp.handlers.tensorboard_scalars import BatchShape, BestValidation, DeviceMemory, TrainWindow
from ignite_amp.metric_modes import metric_mode

__all__ = ["TensorBoardConfig", "TensorBoardMetrics", "TAGS", "LAYOUT", "FACTS_TAG"]


@dataclasses.dataclass
class TensorBoardConfig:
    """handlers.tensorboard: what TensorBoardMetrics logs under output_dir/tb."""

    enabled: bool = setting(True, Boolean(), "attach TensorBoardMetrics")
    log_every: int = setting(50, POSITIVE_INT, "iterations per training scalar point (one host sync each)")


TAGS = {
    "train/loss": "mean training loss over the last log_every iterations",
    "train/lr/group_<N>": "learning rate of each param group (Ignite's OptimizerParamsHandler)",
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
        "learning rate": ["Multiline", [r"train/lr/group_\d+$"]],
        "batch size, micro-batches (logged on change)": ["Multiline", ["batch/size", "batch/micro_batches"]],
        "out-of-memory errors caught": ["Multiline", ["oom/events"]],
    },
}

_FACT_TYPES = (bool, int, float, str, type(None))


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

    One Ignite ``TensorboardLogger`` with small handlers attached (:mod:`.tensorboard_scalars`:
    ``TrainWindow``, ``DeviceMemory``, ``BatchShape``, ``BestValidation``; Ignite's
    ``OptimizerParamsHandler`` for the learning rate and ``OutputHandler`` for the validation
    metrics; :class:`RunFacts` for what ran). At the start of a run it writes a Custom Scalars
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
        argument(TensorBoardConfig, "log_every", log_every)
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
        self.window: Optional[TrainWindow] = None
        self.validation = BestValidation(None, self.modes)
        self.run_facts: Optional[RunFacts] = None

    @property
    def facts_written(self) -> Dict[str, Any]:
        """The run facts as written at the start: the step's, then ``facts``."""
        return self.run_facts.written if self.run_facts is not None else {}

    @property
    def final(self) -> Dict[str, float]:
        return self.validation.final

    @property
    def best(self) -> Dict[str, float]:
        return self.validation.best

    @property
    def samples(self) -> int:
        """Training samples in the current window."""
        return self.window.samples if self.window is not None else 0

    def attach(self, trainer: Engine, evaluator: Optional[Engine] = None,
               optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        if idist.get_rank() != 0:
            return
        step = amp_step_of(trainer)
        step.track_grad_norm()
        optimizer = optimizer if optimizer is not None else step.optimizer
        self.tb = tb = TensorboardLogger(log_dir=self.logdir)
        self.window = TrainWindow(step, self.clipping)
        self.window.attach(trainer)  # before the log's handlers: the log's iteration is in its window
        memory = DeviceMemory(step.device)
        memory.attach(trainer)
        metrics = {}
        if evaluator is not None:
            for name in self.hparam_metrics:
                metrics[f"val/{name}"] = f"val {name} (final)"
                metrics[f"val/best_{name}"] = f"val {name} (best)"
        metrics["perf/samples_per_sec"] = "samples/s (last window)"
        self.run_facts = RunFacts({**self.facts}, self.texts, metrics, step)
        tb.attach(trainer, self.run_facts, Events.STARTED)
        tb.attach(trainer, self.run_facts.end, Events.COMPLETED)
        log = Events.ITERATION_COMPLETED(every=self.log_every)
        shape = BatchShape(step, self.window, lambda: self.facts_written)
        shape.attach(trainer)
        tb.attach(trainer, shape, log)  # reads the window before it starts the next
        tb.attach(trainer, self.window, log)
        tb.attach(trainer, OptimizerParamsHandler(optimizer, "lr", tag="train"), log)
        tb.attach(trainer, memory, log)
        # Each log is flushed: a crashed run keeps what it logged. (No EXCEPTION_RAISED handler: Ignite
        # does not re-raise when one exists.) close() is safe to call twice.
        tb.attach(trainer, _flush, log)
        if evaluator is not None:
            self.validation.trainer = trainer
            tb.attach_output_handler(evaluator, event_name=Events.COMPLETED, tag="val", metric_names="all",
                                     global_step_transform=lambda *_: trainer.state.iteration)
            tb.attach(evaluator, self.validation, Events.COMPLETED)
            tb.attach(evaluator, _flush, Events.COMPLETED)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _flush(engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
    logger.writer.flush()


class RunFacts:
    """What ran, at each start (after a resume, too): the Custom Scalars layout (once), the facts as text
    (``FACTS_TAG``) and as HParams, the extra ``texts``; at the end, the HParams session's end."""

    def __init__(self, facts: Dict[str, Any], texts: Dict[str, str], metrics: Dict[str, str], step: Any):
        self.facts, self.texts, self.metrics, self.step = facts, texts, metrics, step
        self.written: Dict[str, Any] = {}
        self._layout_written = False

    def __call__(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        writer, iteration = logger.writer, engine.state.iteration
        facts = self.written = {**step_facts(self.step), **self.facts}
        if not self._layout_written:
            writer.add_custom_scalars(LAYOUT)
            self._layout_written = True
        from tensorboard.plugins.text.summary_v2 import text_pb

        writer.file_writer.add_summary(text_pb(FACTS_TAG, format_facts(facts)), iteration)
        for tag, text in self.texts.items():  # preformatted: markdown keeps indented lines as they are
            writer.file_writer.add_summary(text_pb(tag, "    " + text.replace("\n", "\n    ")), iteration)
        for summary in hparams_summaries(facts, self.metrics):
            writer.file_writer.add_summary(summary, iteration)
        writer.flush()

    def end(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        # Flush, not close: the same trainer may run again (more epochs). close() ends the logger.
        logger.writer.file_writer.add_summary(_session_end_summary(), engine.state.iteration)
        logger.writer.flush()
