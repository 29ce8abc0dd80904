"""What a run does at each epoch's end, as two explicit handlers: the validation, and the epoch's line."""
import time
from typing import Any, Callable, Iterable, List, Optional, cast

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from ignite_amp.config.run_keys import TrainConfig  # noqa: F401  (its old home)
from ignite_amp.engine import trainer_step_of

__all__ = ["TrainConfig", "Validation", "EpochSummary"]


class Validation:
    """Run ``evaluator`` over ``loader`` at each epoch's end (its handlers then checkpoint and log)."""

    def __init__(self, evaluator: Engine, loader: Iterable):
        self.evaluator, self.loader = evaluator, loader

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, trainer: Engine) -> None:
        self.evaluator.run(self.loader)


class EpochSummary:
    """Each epoch's record (train loss, samples/s, the evaluator's metrics) and its line, which fits 80 columns:
    the train loss, the validation accuracy and loss, and the epoch's seconds (the speed is the health summary's,
    the median of the logging windows, and each epoch's samples/s stays in the record).

    The train loss is the mean over every rank's samples (or ``num_items`` items), summed on the
    device and read with one host sync per epoch. :meth:`attach` measures at ``EPOCH_COMPLETED``;
    :meth:`attach_report`, called after the validation is attached, records and prints.
    """

    def __init__(self, evaluator: Engine, history: List[dict], print_fn: Callable[[str], None]):
        self.evaluator, self.history, self.print = evaluator, history, print_fn
        self.loss_sum: Optional[torch.Tensor] = None
        self.items: Any = 0  # what the losses averaged over: samples, or num_items' items
        self.samples = 0
        self.start = 0.0
        self.measured: dict = {}

    def attach(self, trainer: Engine) -> None:
        self.step = trainer_step_of(trainer, "EpochSummary")
        trainer.add_event_handler(Events.EPOCH_STARTED, self.started)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self.iteration)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self.measure)

    def attach_report(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self.report)

    def started(self, engine: Engine) -> None:
        self.loss_sum, self.items, self.samples, self.start = None, 0, 0, time.perf_counter()

    def iteration(self, engine: Engine) -> None:
        step = self.step
        weighted = step.loss * step.items
        self.loss_sum = weighted if self.loss_sum is None else self.loss_sum + weighted
        self.items = self.items + step.items
        self.samples += step.batch_size

    def measure(self, engine: Engine) -> None:
        samples = self.samples
        if self.loss_sum is None:
            train_loss = float("nan")
        else:  # over every rank's samples (all_reduce returns the tensor as it is in one process)
            device = self.loss_sum.device
            totals = torch.stack([self.loss_sum.double(), torch.as_tensor(self.items, dtype=torch.float64).to(device),
                                  torch.tensor(samples, dtype=torch.float64, device=device)])
            # ignite's all_reduce gives back the type it was given (its annotation: a tensor or a float)
            loss_sum, items, samples = cast(torch.Tensor, idist.all_reduce(totals)).tolist()
            train_loss = loss_sum / max(items, 1)
        seconds = time.perf_counter() - self.start  # after the .tolist() sync above, before the validation
        self.measured = {"train_loss": train_loss, "samples_per_sec": samples / max(seconds, 1e-9), "seconds": seconds}

    def report(self, engine: Engine) -> None:
        metrics = dict(self.evaluator.state.metrics)
        epoch, epochs = engine.state.epoch, engine.state.max_epochs
        m = self.measured
        self.history.append({"epoch": epoch, "train_loss": m["train_loss"], "samples_per_sec": m["samples_per_sec"],
                             **{f"val_{k}": float(v) for k, v in metrics.items()}})
        width = len(str(epochs))
        self.print(f"epoch {epoch:>{width}}/{epochs}  train loss {m['train_loss']:.4f}  "
                   f"val accuracy {metrics.get('accuracy', float('nan')):.4f}  "
                   f"val loss {metrics.get('loss', float('nan')):.4f}  "
                   f"{m['seconds']:.{1 if m['seconds'] < 100 else 0}f}s")
