"""What ran, as TensorBoard shows it: the run facts as text and as HParams, and the extra text entries.

:class:`RunFacts` writes, at each start of the trainer (after a resume too), the facts (the step's own,
``ignite_amp.step.facts.step_facts``, then the caller's) as a text entry (:data:`FACTS_TAG`) and as an HParams
session (:func:`hparams_summaries`: the facts as columns, the validation metrics and the median samples/s as
metric columns), and adds the facts known only later (the FLOPs per sample) with :meth:`RunFacts.add`.
:func:`write_text` writes any text entry (the health summary's too); :func:`session_end_summary` closes the
HParams session at the end. Written once per run (and once at the first log): no per-iteration cost.
"""
import time
from typing import Any, Dict, Tuple

from ignite.engine import Engine
from ignite.handlers import TensorboardLogger

from ignite_amp.handlers.tensorboard.event import file_writer
from ignite_amp.step.facts import format_facts, step_facts

__all__ = ["FACTS_TAG", "HPARAMS", "FACT_TYPES", "hparams_summaries", "session_end_summary", "write_text", "RunFacts"]

FACTS_TAG = "run/facts"  # the facts' text entry (the run's own TensorBoard run)

# HParams columns, in this order (TensorBoard ticks the first ones); strings only with a closed set of
# values, so every run's value is in the filter's list. The rest of the facts are in the text tab.
HPARAMS = ("dtype", "device_type", "grad_scaler", "batch_size", "lr", "accumulation_steps", "micro_batches",
           "world_size", "strategy", "channels_last", "compile", "scheduler", "epochs", "seed", "batch_size_search")
_DOMAINS = {"dtype": ("float32", "float16", "bfloat16"), "device_type": ("cpu", "cuda", "mps", "xpu"),
            "scheduler": ("none", "cosine", "onecycle"), "strategy": ("none", "ddp", "fsdp")}

FACT_TYPES = (bool, int, float, str, type(None))  # what a fact's value may be


def hparams_summaries(facts: Dict[str, Any], metrics: Dict[Tuple[str, str], str]) -> list:
    """The HParams plugin's experiment (columns) and session-start summaries for one run.

    Written directly (not ``SummaryWriter.add_hparams``): no ``hparam/*`` scalar tags, booleans stay
    booleans, strings have their closed set of values as a discrete domain (filterable, no console
    warnings), numbers are numbers. Columns follow :data:`HPARAMS` (the name sorts, the display name
    is the fact's); each metric column reads a scalar tag of one split's run (``metrics``: (split, tag) -> title,
    the split's run being the session's subdirectory, as Keras's hparams callback has it).
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
        api_pb2.MetricInfo(name=api_pb2.MetricName(group=group, tag=tag), display_name=title)
        for (group, tag), title in metrics.items()])
    config = Summary()
    config.value.add(tag=metadata.EXPERIMENT_TAG, tensor=metadata.NULL_TENSOR,
                     metadata=metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(experiment=experiment)))
    return [config, summary_v2.hparams_pb(values, trial_id="")]


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
    extra ``texts``."""

    def __init__(self, facts: Dict[str, Any], texts: Dict[str, str], metrics: Dict[Tuple[str, str], str],
                 step: Any):
        self.facts, self.texts, self.metrics, self.step = facts, texts, metrics, step
        self.written: Dict[str, Any] = {}

    def __call__(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        writer, iteration = logger.writer, engine.state.iteration
        facts = self.written = {**step_facts(self.step), **self.facts}
        write_text(logger, FACTS_TAG, format_facts(facts), iteration)
        for tag, text in self.texts.items():  # preformatted: markdown keeps indented lines as they are
            write_text(logger, tag, "    " + text.replace("\n", "\n    "), iteration)
        for summary in hparams_summaries({**facts, "device_type": self.step.device.type}, self.metrics):
            file_writer(writer).add_summary(summary, iteration)
        writer.flush()

    def add(self, logger: TensorboardLogger, iteration: int, **facts: Any) -> None:
        """Facts known later (the FLOPs per sample, after the first iteration): the text again, with them."""
        self.written.update(facts)
        write_text(logger, FACTS_TAG, format_facts(self.written), iteration)
