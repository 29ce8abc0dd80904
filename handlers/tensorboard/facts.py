"""What ran, as TensorBoard shows it: the run facts as text and as HParams, and the extra text entries.

:class:`RunFacts` writes, at each start of the trainer (after a resume too), the facts (the step's own,
``ignite_amp.step.facts.step_facts``, then the caller's) as a text entry (:data:`FACTS_TAG`) and as an HParams
session (:func:`hparams_summaries`: the facts as columns, the validation metrics and the median samples/s as
metric columns, whose values :func:`write_session_values` copies into the session's own run), and adds the facts
known only later (the FLOPs per sample) with :meth:`RunFacts.add`.
:func:`write_text` writes any text entry (the health summary's too); :func:`session_end_summary` closes the
HParams session at the end. Written once per run (and once at the first log): no per-iteration cost.
"""
import os
import time
from typing import Any, Dict, Optional

from ignite.engine import Engine
from ignite.handlers import TensorboardLogger

from ignite_amp.handlers.tensorboard.event import file_writer
from ignite_amp.step.facts import format_facts, step_facts

__all__ = ["FACTS_TAG", "HPARAMS", "FACT_TYPES", "hparams_summaries", "session_end_summary", "write_text", "RunFacts",
           "trial_name", "write_session_values"]

FACTS_TAG = "run/facts"  # the facts' text entry (the run's own TensorBoard run)

# HParams columns, in this order (TensorBoard ticks the first ones); strings only with a closed set of
# values, so every run's value is in the filter's list. The rest of the facts are in the text tab.
HPARAMS = ("dtype", "device_type", "grad_scaler", "batch_size", "lr", "accumulation_steps", "micro_batches",
           "world_size", "strategy", "channels_last", "compile", "scheduler", "epochs", "seed", "batch_size_search")
_DOMAINS = {"dtype": ("float32", "float16", "bfloat16"), "device_type": ("cpu", "cuda", "mps", "xpu"),
            "scheduler": ("none", "cosine", "onecycle"), "strategy": ("none", "ddp", "fsdp")}
# Whole numbers, as written ("64"): TensorBoard's HParams table writes every number with 5 significant digits
# ("64.000"). Strings without a domain: sorted as text, no filter in the HParams pane (its console warns once each).
_WHOLE = ("batch_size", "accumulation_steps", "micro_batches", "world_size", "epochs", "seed")

FACT_TYPES = (bool, int, float, str, type(None))  # what a fact's value may be


def trial_name(logdir: str, when: float) -> str:
    """The HParams row's name ("Trial ID") of a run in ``logdir`` started at ``when``: its folder's name, the
    start and 4 hex digits of the folder's absolute path, ``quickstart 2026-11-26 10:31:02 #3f2a``. Without it the
    row is named after the session's TensorBoard run, ``.`` under ``tensorboard --logdir <the run>``; TensorBoard
    makes one row of the sessions that share a name (the first one's facts, the mean of their metrics), so the
    start tells a run from the earlier ones moved aside beside it (``quickstart.replaced-<time>``) and the path
    tells apart the runs of a sweep that share a folder name (``lr0.01/seed0``, ``lr0.1/seed0``) and a start."""
    import hashlib

    path = os.path.normpath(os.path.abspath(logdir))
    digest = hashlib.sha1(path.encode("utf-8", "surrogateescape")).hexdigest()[:4]
    return f"{os.path.basename(path)} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))} #{digest}"


def hparams_summaries(facts: Dict[str, Any], metrics: Dict[str, str], trial_id: str = "",
                      start_time: Optional[float] = None) -> list:
    """The HParams plugin's experiment (columns) and session-start summaries for one run.

    Written directly (not ``SummaryWriter.add_hparams``): no ``hparam/*`` scalar tags, booleans stay
    booleans, strings have their closed set of values as a discrete domain (filterable, no console
    warnings), whole numbers (:data:`_WHOLE`: the batch size, the seed...) are strings as written, other numbers
    are numbers. Columns follow :data:`HPARAMS` (the name sorts, the display name is the fact's). ``metrics``:
    tag -> title of the metric columns, scalar tags of the session's own run (group ""), which TensorBoard reads
    under ``--logdir <the run>`` (the session ``.``) and ``--logdir <its parent>`` alike; a tag in a subdirectory
    run (group ``val``) is read at ``<session>/val``, which ``./val`` is not. ``trial_id``: the row's name
    (:func:`trial_name`).
    """
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2, summary_v2

    infos, values = [], {}
    for i, name in enumerate(n for n in HPARAMS if n in facts):
        value, key = facts[name], f"{i:02d} {name}"
        info = api_pb2.HParamInfo(name=key, display_name=name)
        if isinstance(value, bool):
            info.type = api_pb2.DATA_TYPE_BOOL
            info.domain_discrete.extend([False, True])
        elif name in _WHOLE:
            info.type = api_pb2.DATA_TYPE_STRING
            value = None if value is None else str(value)
        elif isinstance(value, str):
            if value not in _DOMAINS.get(name, ()):
                continue
            info.type = api_pb2.DATA_TYPE_STRING
            info.domain_discrete.extend(_DOMAINS[name])
        else:
            info.type = api_pb2.DATA_TYPE_FLOAT64
        infos.append(info)
        if value is not None:
            values[key] = value
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
        api_pb2.MetricInfo(name=api_pb2.MetricName(group="", tag=tag), display_name=title)
        for tag, title in metrics.items()])
    config = Summary()
    config.value.add(tag=metadata.EXPERIMENT_TAG, tensor=metadata.NULL_TENSOR,
                     metadata=metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(experiment=experiment)))
    return [config, summary_v2.hparams_pb(values, trial_id=trial_id, start_time_secs=start_time)]


def write_session_values(logger: TensorboardLogger, values: Dict[str, float], iteration: int) -> None:
    """The HParams metric columns' values (tag -> value) as one event of ``logger``'s run (the session's own),
    written each time their source is (a validation, a log window): a column shows its tag's last value."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    if values:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        file_writer(logger.writer).add_summary(summary, iteration, time.time())
        logger.writer.flush()


def session_end_summary() -> Any:
    """The HParams session's end (status success, the time now), written when the trainer completes."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())
    summary = Summary()
    summary.value.add(tag=metadata.SESSION_END_INFO_TAG, tensor=metadata.NULL_TENSOR,
                      metadata=metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(session_end_info=end)))
    return summary


def write_text(logger: TensorboardLogger, tag: str, text: str, iteration: int) -> None:
    """A text entry ``tag`` (markdown) at ``iteration`` in ``logger``'s run."""
    from tensorboard.plugins.text.summary_v2 import text_pb

    file_writer(logger.writer).add_summary(text_pb(tag, text), iteration)


class RunFacts:
    """What ran, at each start (after a resume, too): the facts as text (``FACTS_TAG``) and as HParams, the
    extra ``texts``. ``metrics``: the HParams metric columns, tag -> title; ``logdir`` names the row."""

    def __init__(self, facts: Dict[str, Any], texts: Dict[str, str], metrics: Dict[str, str], step: Any,
                 logdir: str = ""):
        self.facts, self.texts, self.metrics, self.step, self.logdir = facts, texts, metrics, step, logdir
        self.written: Dict[str, Any] = {}

    def __call__(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        writer, iteration = logger.writer, engine.state.iteration
        facts = self.written = {**step_facts(self.step), **self.facts}
        write_text(logger, FACTS_TAG, format_facts(facts), iteration)
        for tag, text in self.texts.items():  # preformatted: markdown keeps indented lines as they are
            write_text(logger, tag, "    " + text.replace("\n", "\n    "), iteration)
        now = time.time()  # a resumed run's later starts: TensorBoard keeps the first start's name and facts
        for summary in hparams_summaries({**facts, "device_type": self.step.device.type}, self.metrics,
                                         trial_name(self.logdir, now), now):
            file_writer(writer).add_summary(summary, iteration)
        writer.flush()

    def add(self, logger: TensorboardLogger, iteration: int, **facts: Any) -> None:
        """Facts known later (the FLOPs per sample, after the first iteration): the text again, with them."""
        self.written.update(facts)
        write_text(logger, FACTS_TAG, format_facts(self.written), iteration)
