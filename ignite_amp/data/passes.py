"""The training data as one stream of passes over the loader: epochs of ``train.epoch_length`` batches that
resume where an uninterrupted run would be.

When an epoch is not one pass over the loader (``epoch_length`` shorter or longer than it), Ignite does not
restart the loader at an epoch's end: the next epoch continues the pass in progress. A resumed run used to start
a fresh pass (in another order) at the epoch where the uninterrupted run was in the middle of one, and trained on
other batches. Here the position in the stream is the number of batches trained (the trainer's iteration): pass
``p`` runs in the order of ``sampler.set_epoch(p + 1)`` (the order an epoch-long pass would have), and a stream
that starts inside a pass leaves out, in the sampler, the batches of it already trained, without loading them.
"""
from typing import Any, Callable, Iterator, Optional

from ignite.engine import Engine, Events
from torch.utils.data import DataLoader

__all__ = ["PassStream", "training_data"]


def training_data(trainer: Engine, loader: DataLoader, epoch_length: Optional[int]) -> Any:
    """What ``trainer.run`` trains on: ``loader``, its sampler's order drawn from each epoch's number (an epoch is a
    pass, restarted by Ignite); with an ``epoch_length``, a :class:`PassStream` that starts at the trainer's
    iteration (the passes' order drawn from their numbers)."""
    if epoch_length is not None:
        return PassStream(loader, lambda: trainer.state.iteration)
    sampler = loader.sampler
    if hasattr(sampler, "set_epoch"):
        trainer.add_event_handler(Events.EPOCH_STARTED, lambda engine: sampler.set_epoch(engine.state.epoch))
    return loader


class PassStream:
    """Endless batches of ``loader``, pass after pass, from position ``position()`` (batches already trained,
    read when iterating starts). The loader's sampler takes ``set_epoch(epoch, start)`` (the training samplers of
    :mod:`ignite_amp.data.datasets` do). Give the trainer ``epoch_length``: the stream has no end."""

    def __init__(self, loader: DataLoader, position: Callable[[], int]):
        if not hasattr(loader.sampler, "set_epoch") or loader.batch_size is None:
            raise TypeError("PassStream needs a loader with a batch_size and a sampler with set_epoch(epoch, start)")
        self.loader, self.position = loader, position
        self._batch_size: int = loader.batch_size  # (a DataLoader's is fixed once it is made)

    def __iter__(self) -> Iterator:
        passes, batches = divmod(self.position(), len(self.loader))
        sampler: Any = self.loader.sampler  # (its set_epoch and the batch size: checked in __init__)
        size = self._batch_size
        while True:
            sampler.set_epoch(passes + 1, start=batches * size)
            yield from self.loader
            passes, batches = passes + 1, 0
