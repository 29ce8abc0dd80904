"""Out-of-memory backoff: retry the same batch in smaller micro-batches, losing no sample."""
import dataclasses
import logging
import math
from collections import OrderedDict
from typing import Any, Dict, Mapping, Optional

import ignite.distributed as idist
from ignite.base.mixins import Serializable
from ignite.engine import Engine, Events
from torch.utils.data import DataLoader

from ignite_amp.core.config_keys import POSITIVE_INT, Boolean, Choice, Integer, argument, setting
from ignite_amp.core.config_values import Section
from ignite_amp.data.prefetch import DevicePrefetcher
from ignite_amp.engine import amp_step_of
from ignite_amp.errors import BatchSizeFloorError
from ignite_amp.step.base import StepBase
from ignite_amp.step.events import AmpEvents
from ignite_amp.step.train import AmpStep
from ignite_amp.transforms.sharding import is_sharded

__all__ = ["OOMBackoffConfig", "OOMBackoff", "BatchSizeFloorError", "backoff_micro_batches", "micro_batch_size"]


@dataclasses.dataclass(frozen=True, eq=False)
class OOMBackoffConfig(Section):
    """handlers.oom_backoff: on out of memory, retry the same batch in smaller micro-batches (OOMBackoff)."""

    enabled: bool = setting(True, Boolean(), "attach the backoff (trainer and evaluator)")
    min_batch_size: int = setting(1, POSITIVE_INT, "smallest micro-batch to try before the run stops")
    mode: str = setting("micro_batch", Choice("micro_batch", "batch"),
                        "micro_batch keeps the loader's batch; batch also makes the loader's batch smaller")
    grow_after: Optional[int] = setting(
        None, Integer(1, nullable=True),
        "clean iterations after which the larger micro-batch is tried again; null: never")

logger = logging.getLogger("ignite_amp")


def micro_batch_size(batch_size: int, micro_batches: int) -> int:
    """Largest chunk when ``batch_size`` is split into ``micro_batches`` near-equal chunks."""
    return math.ceil(batch_size / min(micro_batches, batch_size))


def backoff_micro_batches(batch_size: int, micro_batches: int) -> Optional[int]:
    """The chunk count that halves the micro-batch size (the chunk count rounded up for odd sizes), or None at
    size 1.

    >>> [backoff_micro_batches(12, k) for k in (1, 2, 4, 12)]
    [2, 4, 12, None]
    >>> backoff_micro_batches(7, 1), micro_batch_size(7, 3)  # odd: chunks of 3, 2 and 2
    (3, 3)
    """
    size = micro_batch_size(batch_size, micro_batches)
    if size <= 1:
        return None
    return math.ceil(batch_size / (size // 2))


def _resizable(loader: Any) -> bool:
    """A torch DataLoader, or a loader that offers ``with_batch_size(n)`` (``ignite_amp.data.device_batches``),
    with a batch size."""
    return (isinstance(loader, DataLoader) or hasattr(loader, "with_batch_size")) and bool(
        getattr(loader, "batch_size", None))


def _with_batch_size(loader: DataLoader, batch_size: int) -> DataLoader:
    """``loader`` yielding batches of ``batch_size``: its own ``with_batch_size`` where it has one, else a
    DataLoader built from its attributes."""
    if hasattr(loader, "with_batch_size"):
        return loader.with_batch_size(batch_size)
    extra: Dict[str, Any] = {"prefetch_factor": loader.prefetch_factor} if loader.num_workers > 0 else {}
    return DataLoader(loader.dataset, batch_size=batch_size, sampler=loader.sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
                      persistent_workers=loader.persistent_workers, **extra)


class OOMBackoff(Serializable):
    """On ``AmpEvents.OUT_OF_MEMORY``, halve the micro-batch size so the step retries the same batch.

    The effective batch, the gradient and the learning rate stay the same: the batch is split
    into more micro-batches whose gradients add up to the full batch's, and no sample is dropped
    or seen twice. Below ``min_batch_size`` the run stops with :class:`BatchSizeFloorError`
    (checkpoints already on disk were written atomically and stay intact).

    Attach one to the trainer and, if you like, another to the evaluator (which splits its
    batches the same way). Under DDP every rank backs off together: with this handler attached
    the step asks all ranks (one small all-reduce per iteration, on the CPU) whether any ran out
    of memory before it all-reduces the gradients, so no rank is left waiting in a collective.
    Stateful: put it in the checkpoint so a resumed run starts at the size that worked.

    Args:
        min_batch_size: smallest micro-batch to try.
        mode: ``"micro_batch"`` keeps the loader's batch; ``"batch"`` also makes the loader yield
            the smaller batch from the next epoch on (the effective batch then changes; the
            current epoch finishes in micro-batches). That is decided at the next epoch's start,
            from this handler's state, so a resume from the checkpoint of this epoch decides the same.
        grow_after: after this many clean iterations, try the previous (larger) micro-batch again.
    """

    _state_dict_all_req_keys = ("events", "loader_batch_size", "history", "clean")

    def __init__(self, min_batch_size: int = 1, mode: str = "micro_batch", grow_after: Optional[int] = None):
        self.min_batch_size = argument(OOMBackoffConfig, "min_batch_size", min_batch_size)
        self.mode = argument(OOMBackoffConfig, "mode", mode)
        self.grow_after = argument(OOMBackoffConfig, "grow_after", grow_after)
        self.events = 0
        self.loader_batch_size: Optional[int] = None
        self.history: list = []  # micro_batches before each backoff, for grow_after
        self.clean = 0
        self._step: Optional[StepBase] = None  # the engine's, found by attach

    def attach(self, engine: Engine) -> None:
        """Back off at each ``AmpEvents.OUT_OF_MEMORY`` of ``engine`` and switch on the step's out-of-memory
        agreement (under DDP: on every rank alike). A sharded (FSDP2) model on several processes is refused."""
        self._step = step = amp_step_of(engine)
        if is_sharded(step.model) and idist.get_world_size() > 1:
            raise ValueError("OOMBackoff cannot retry a sharded (FSDP2) model's batch: an out-of-memory error inside "
                             "a sharded forward leaves the other ranks waiting in a collective")
        if isinstance(step, AmpStep):  # every rank attaches it: every rank agrees on out of memory
            step.oom_agreement = True
        engine.add_event_handler(AmpEvents.OUT_OF_MEMORY, self)
        if self.grow_after is not None:
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._grow, step)
        if self.mode == "batch":
            engine.add_event_handler(Events.EPOCH_STARTED, self._shrink_loader, step)

    @property
    def step(self) -> Optional[StepBase]:
        """The engine's step, once attached (None before)."""
        return self._step

    def __call__(self, engine: Engine) -> None:
        step = self._step
        if step is None:
            raise RuntimeError("OOMBackoff: call backoff.attach(trainer) first (it finds the step and turns on its "
                               "out-of-memory agreement; trainer.add_event_handler(..., backoff) alone does not)")
        size = micro_batch_size(step.batch_size, step.micro_batches)
        chunks = backoff_micro_batches(step.batch_size, step.micro_batches)
        if chunks is None or micro_batch_size(step.batch_size, chunks) < self.min_batch_size:
            raise BatchSizeFloorError(f"out of memory even at micro-batch size {size} on {step.device}"
                                      f" (min_batch_size {self.min_batch_size})")
        self.history.append(step.micro_batches)
        step.micro_batches = chunks
        self.events += 1
        self.clean = 0
        where = f"{step.device} (or another rank's)" if idist.get_world_size() > 1 else str(step.device)
        logger.warning("out of memory at micro-batch size %d on %s: retrying the same batch of %d in %d "
                       "micro-batches of at most %d", size, where, step.batch_size, chunks,
                       micro_batch_size(step.batch_size, chunks))

    def _grow(self, engine: Engine, step: StepBase) -> None:
        self.clean += 1
        if self.history and self.clean >= self.grow_after:
            step.micro_batches = self.history.pop()
            self.clean = 0

    def _shrink_loader(self, engine: Engine, step: StepBase) -> None:
        """At each epoch's start (not at the previous one's end: the checkpoint saved there must hold what the
        next epoch starts from, so a resume makes the same choice): after backoffs, the loader yields the
        micro-batch size that worked, in one micro-batch."""
        data = engine.state.dataloader
        loader: Any  # a DataLoader, DeviceBatches, or an iterable without a batch size (then never resized)
        # A loader prefetched to the device: its DataLoader is rebuilt, then wrapped the same way again.
        loader = data.loader if isinstance(data, DevicePrefetcher) else data
        # The loader's batch, not the epoch's last (often partial) one.
        full = loader.batch_size if _resizable(loader) else step.batch_size
        if self.history and step.micro_batches > 1 and full and full > 1:
            self.loader_batch_size = micro_batch_size(full, step.micro_batches)
            step.micro_batches = 1
            self.history.clear()
            logger.warning("the loader yields batches of %d from epoch %d on", self.loader_batch_size,
                           engine.state.epoch)
        if self.loader_batch_size is None or not _resizable(loader):
            return
        if loader.batch_size == self.loader_batch_size:
            return
        new = _with_batch_size(loader, self.loader_batch_size)
        engine.set_data(data.with_loader(new) if isinstance(data, DevicePrefetcher) else new)  # (new: resizable)
        # Ignite keeps epoch_length across set_data: make it the new loader's, and keep the
        # iteration a whole number of epochs so resume and the end-of-run check stay right.
        engine.state.epoch_length = len(new)
        engine.state.iteration = (engine.state.epoch - 1) * len(new)

    def state_dict(self) -> "OrderedDict[str, Any]":
        """The backoffs so far (count, history, the loader's batch size) for a checkpoint."""
        return OrderedDict(events=self.events, loader_batch_size=self.loader_batch_size, history=list(self.history),
                           clean=self.clean)

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore :meth:`state_dict`'s values on resume."""
        super().load_state_dict(state_dict)
        self.events = int(state_dict["events"])
        self.loader_batch_size = state_dict["loader_batch_size"]
        self.history = list(state_dict["history"])
        self.clean = int(state_dict["clean"])
