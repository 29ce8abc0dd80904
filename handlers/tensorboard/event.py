"""One TensorBoard event per log: the scalars :class:`~ignite_amp.handlers.TensorBoardMetrics` writes at a log,
gathered into one ``Summary`` of many values.

``SummaryWriter.add_scalar`` builds a summary and an event and queues it for each value (about 15 us each on a
small CPU); a log writes ten and more. TensorBoard reads every value of an event's summary, at the event's step,
as ``add_scalar``'s own events: the same tags, steps and float32 values (``tests/handlers/test_handler_cost.py``).
"""
import time
from typing import Any, List, Optional

import torch
from ignite.engine import Engine

__all__ = ["ScalarEvent", "LearningRates", "file_writer"]


def file_writer(writer: Any) -> Any:
    """The event file writer of ``writer`` (a ``SummaryWriter``), opened again after ``close()`` as the writer's own
    ``add_scalar`` opens it: a trainer run again after :meth:`~ignite_amp.handlers.TensorBoardMetrics.close` logs
    into new event files. The one use of the writer's private ``_get_file_writer`` (its ``file_writer`` attribute
    is None once closed); ``tests/cli/test_adversarial_commands.py`` breaks if torch changes it."""
    return writer._get_file_writer()


class ScalarEvent:
    """Stands for an Ignite ``TensorboardLogger`` in a log handler (``handler(engine, logger, event_name)``):
    its ``writer.add_scalar`` gathers; :meth:`write` writes them as one event to a real writer."""

    def __init__(self) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # imported on use, as the package's others

        self.writer = self  # handlers call logger.writer.add_scalar
        self.values: List[Any] = []
        self._summary = Summary

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.values.append(self._summary.Value(tag=tag, simple_value=float(value)))  # add_scalar's float32 too

    def get(self, tag: str) -> Optional[float]:
        """The value gathered for ``tag`` (the last), or None."""
        found = [v.simple_value for v in self.values if v.tag == tag]
        return found[-1] if found else None

    def write(self, writer: Any, step: int) -> None:
        """The gathered scalars as one event of ``writer`` (a ``SummaryWriter``) at ``step``."""
        if self.values:
            file_writer(writer).add_summary(self._summary(value=self.values), step, time.time())
            self.values = []


class LearningRates:
    """``optimizer/lr/group_<N>``, each param group's learning rate at the log (Ignite's
    ``OptimizerParamsHandler(optimizer, "lr", tag="optimizer")``'s tags and values)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def __call__(self, engine: Engine, logger: Any, event_name: Any) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            logger.writer.add_scalar(f"optimizer/lr/group_{i}", float(group["lr"]), engine.state.iteration)
