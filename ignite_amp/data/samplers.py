"""Which samples each process takes, in which order: the training order drawn from ``seed + epoch`` in one
process (:class:`EpochShuffleSampler`) as over several (:class:`ShuffleShardSampler`), so a resumed run sees the
batches an uninterrupted one would; validation sharded without padding (:class:`EvenShardSampler`), and as many
batches on every rank for a sharded model (:class:`LockstepBatches`). ``ignite_amp.data`` re-exports them.
"""
from typing import Iterator, Optional, Sized

import torch
from torch.utils.data import DistributedSampler, Sampler

__all__ = ["EpochShuffleSampler", "ShuffleShardSampler", "EvenShardSampler", "LockstepBatches"]


class EpochShuffleSampler(Sampler):
    """Random order drawn from ``seed + epoch``: an epoch's order depends on its number alone.

    So a resumed run sees the same batches as an uninterrupted one. ``set_epoch`` is called
    at each ``EPOCH_STARTED``, like ``DistributedSampler.set_epoch``; ``start`` leaves out the
    first samples of that order (a resume in the middle of a pass, :mod:`ignite_amp.data.passes`).
    """

    def __init__(self, length: int, seed: int = 0):
        self.length, self.seed, self.epoch, self.start = length, seed, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The pass's order (``seed + epoch``), less its first ``start`` samples."""
        self.epoch, self.start = epoch, start

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator)[self.start:].tolist())

    def __len__(self) -> int:
        return self.length


class ShuffleShardSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled from ``seed + epoch``) whose ``set_epoch`` also takes ``start``: the
    first samples of this rank's shard to leave out, as :class:`EpochShuffleSampler`'s."""

    #: Samples of this rank's shard left out of the next pass (set by :meth:`set_epoch`).
    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The pass's order (``seed + epoch``), less its first ``start`` samples."""
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])


class EvenShardSampler(DistributedSampler):
    """Validation sharding without padding: rank ``r`` takes samples ``r, r + world, ...``.

    ``DistributedSampler`` pads the data set to a multiple of the world size by repeating
    samples, which would count them twice in the metrics; here each sample is evaluated once
    and Ignite's metrics add the ranks' counts up.
    """

    def __init__(self, dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.total = len(dataset)
        self.num_samples = len(range(self.rank, self.total, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


class LockstepBatches:
    """One rank's validation batches (its :class:`EvenShardSampler` shard, in order), as many on every rank.

    A sharded model's forward is a collective, so every rank must run as many of them: the shards
    differ by one sample at most, and the last batch takes what is left (up to ``batch_size + 1``).
    """

    def __init__(self, dataset: Sized, batch_size: int, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None):
        shard = EvenShardSampler(dataset, num_replicas=num_replicas, rank=rank)
        self.indices = list(shard)
        self.batch_size = batch_size
        self.count = max(1, -(-(len(dataset) // shard.num_replicas) // batch_size))

    def __iter__(self):
        b, last = self.batch_size, self.count - 1
        for i in range(last):
            yield self.indices[i * b:(i + 1) * b]
        yield self.indices[last * b:]

    def __len__(self) -> int:
        return self.count
