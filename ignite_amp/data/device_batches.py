"""``data.on_device``: a small in-memory data set kept on the device, its batches cut there (issue 51).

The built-in sets (``shapes``, ``fake``, CIFAR once read) are uint8 tensors in host memory. The host path
normalises (and augments) each sample in Python, collates, pins and copies every batch: on a GPU the model
then waits for its data. Here the uint8 images and labels are copied to the device once, and
:class:`DeviceBatches` yields whole batches by indexing them with the training samplers of
:mod:`ignite_amp.data.samplers` (the same samples in the same order, the last batch left out or not as the
host path's), normalised on the device and, with ``augment``, cropped and flipped there batch-wise. No
worker processes, no pinning, no copy per batch.

``auto`` (:func:`choose_on_device`) is on for an in-memory set on CUDA whose images (training and validation,
uint8) take at most :data:`MAX_SHARE` of the device's memory and at most :data:`MAX_BYTES`: the model, its
activations and the optimizer keep nearly all of it (the batch-size search and the memory plan do not count
the data set), and the one copy at the start stays short. CIFAR-10/100 (180 MB) and the quickstart's shapes
(30 MB) are far below both on any current GPU. Off a GPU it is off: a CPU pays the same for either path, and
the CPU quickstart stays as it was. ``true`` on a CPU is allowed (batch-wise indexing in host memory).

Augmentation draws differ from the host path's (which draws per sample from the global RNG in the loader):
each sample's crop offset and flip come from a generator seeded from the run's seed and the sampler's epoch
(:func:`augment_draws`, drawn on the CPU for every sample of the set), so a run is reproducible, a resumed
run draws what the uninterrupted one drew, and the draws do not depend on the device or the process count.
"""
from typing import Any, Iterator, NamedTuple, Optional, Protocol, Tuple, Union

import torch
from torch.utils.data import SequentialSampler

from ignite_amp.core.config_keys import POSITIVE_INT

__all__ = ["MAX_SHARE", "MAX_BYTES", "OnDeviceChoice", "choose_on_device", "device_memory", "augment_draws",
           "DeviceBatches"]

MAX_SHARE = 0.05
MAX_BYTES = 2 * 2**30
#: Added to ``seed + epoch`` for the augmentation's generator, apart from the shuffle's ``seed + epoch``.
AUGMENT_SEED_OFFSET = 2**32
PAD = 4  # the CIFAR recipe's padding: crops at 9 x 9 offsets


class OnDeviceChoice(NamedTuple):
    """Whether the data lives on the device, and why (empty when the config said)."""

    on: bool
    why: str


def choose_on_device(requested: Union[bool, str], device_type: str, in_memory: bool, data_bytes: int,
                     device_bytes: int) -> OnDeviceChoice:
    """``requested`` (true, false or "auto") resolved by the module's rule for a data set of ``data_bytes`` and a
    device of ``device_bytes`` in all.

    Example:
        >>> choose_on_device("auto", "cpu", True, 30 * 2**20, 0)
        OnDeviceChoice(on=False, why='auto: CUDA only')
        >>> choose_on_device("auto", "cuda", True, 184 * 2**20, 80 * 2**30).on
        True
        >>> choose_on_device(False, "cuda", True, 1, 80 * 2**30)
        OnDeviceChoice(on=False, why='')
    """
    if requested != "auto":
        return OnDeviceChoice(bool(requested), "")
    if device_type != "cuda":
        return OnDeviceChoice(False, "auto: CUDA only")
    if not in_memory:
        return OnDeviceChoice(False, "auto: read from files")
    bound = min(int(MAX_SHARE * device_bytes), MAX_BYTES)
    mb = f"{data_bytes / 2**20:.0f} MB"
    if data_bytes > bound:
        return OnDeviceChoice(False, f"auto: {mb} of images, over {bound / 2**20:.0f} MB")
    return OnDeviceChoice(True, f"auto: {mb} of images")


def device_memory(device: torch.device) -> int:
    """The device's total memory in bytes (0 off CUDA)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def augment_draws(n: int, seed: int, epoch: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each of ``n`` samples' crop offset (top, left in 0..8) and flip for ``epoch``, drawn on the CPU."""
    generator = torch.Generator().manual_seed(seed + epoch + AUGMENT_SEED_OFFSET)
    offsets = torch.randint(0, 2 * PAD + 1, (n, 2), generator=generator)
    return offsets, torch.rand(n, generator=generator) < 0.5


def crop_and_flip(images: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """uint8 ``images`` (B, C, H, W) zero-padded by 4 pixels, each cropped at its ``offsets`` and flipped
    horizontally where ``flips``: the host path's recipe, vectorised (one gather)."""
    b, c, h, w = images.shape
    padded = torch.nn.functional.pad(images, (PAD, PAD, PAD, PAD))
    rows = offsets[:, :1] + torch.arange(h, device=images.device)  # (B, H)
    across = torch.arange(w, device=images.device)
    cols = offsets[:, 1:] + torch.where(flips[:, None], w - 1 - across, across)  # (B, W)
    return padded[torch.arange(b, device=images.device)[:, None, None, None],
                  torch.arange(c, device=images.device)[None, :, None, None], rows[:, None, :, None],
                  cols[:, None, None, :]]


class TensorImages(Protocol):
    """What :class:`DeviceBatches` reads of its data set (a ``TensorImageDataset``)."""

    images: torch.Tensor  #: uint8, (N, C, H, W)
    labels: torch.Tensor
    mean: torch.Tensor  #: (C, 1, 1), in 0-255 units
    std: torch.Tensor

    def __len__(self) -> int: ...


class DeviceBatches:
    """Batches of an in-memory image set (``images``, ``labels``, ``mean``, ``std``, ``augment``: a
    :class:`~ignite_amp.data.datasets.TensorImageDataset`) cut on ``device``: a drop-in for its DataLoader.

    It has what the engine and the handlers read of a loader (``len()``, ``dataset``, ``sampler``,
    ``batch_sampler``, ``batch_size``, ``drop_last``, ``num_workers`` 0, ``pin_memory`` False) and restarts at
    each ``iter()``. The order is the ``sampler``'s (its ``set_epoch``, ``start`` included) or the
    ``batch_sampler``'s; ``seed`` and the sampler's ``epoch`` draw the augmentation (:func:`augment_draws`).
    :meth:`with_batch_size` is a copy at another batch size (OOM backoff, ``mode: batch``).

    Example:
        >>> from ignite_amp.data.datasets import TensorImageDataset
        >>> images = torch.arange(5 * 3 * 2 * 2, dtype=torch.uint8).view(5, 3, 2, 2)
        >>> loader = DeviceBatches(TensorImageDataset(images, torch.arange(5), (0.5,) * 3, (0.25,) * 3), 2)
        >>> len(loader), [tuple(y.tolist()) for _, y in loader]
        (3, [(0, 1), (2, 3), (4,)])
    """

    num_workers = 0
    pin_memory = False

    def __init__(self, dataset: TensorImages, batch_size: Optional[int] = None, sampler: Any = None,
                 batch_sampler: Any = None,
                 drop_last: bool = False, device: Union[str, torch.device] = "cpu", seed: int = 0,
                 _tensors: Optional[tuple] = None):
        if (batch_size is None) == (batch_sampler is None):
            raise ValueError("DeviceBatches takes a batch_size or a batch_sampler, one of them")
        if batch_sampler is not None and (sampler is not None or drop_last):
            raise ValueError("DeviceBatches: a batch_sampler takes no sampler and no drop_last")
        if batch_size is not None:  # (0 was ZeroDivisionError in len(), as late as the first epoch)
            POSITIVE_INT.argument(batch_size, "batch_size")
        self.dataset, self.batch_size, self.batch_sampler = dataset, batch_size, batch_sampler
        self.sampler = sampler if sampler is not None or batch_sampler is not None else SequentialSampler(dataset)
        self.drop_last, self.device, self.seed = drop_last, torch.device(device), seed
        if _tensors is None:  # copied once; a copy at another batch size shares them
            _tensors = (dataset.images.to(self.device), dataset.labels.to(self.device),
                        dataset.mean.to(self.device), dataset.std.to(self.device))
        self._tensors = _tensors

    def with_batch_size(self, batch_size: int) -> "DeviceBatches":
        """This loader (its data on the device, its sampler) yielding batches of ``batch_size``."""
        if self.batch_sampler is not None:
            raise ValueError("DeviceBatches.with_batch_size: its batches come from a batch_sampler")
        return DeviceBatches(self.dataset, batch_size, self.sampler, drop_last=self.drop_last, device=self.device,
                             seed=self.seed, _tensors=self._tensors)

    def __len__(self) -> int:
        size = self.batch_size
        if size is None:  # then a batch_sampler (one of the two, checked in __init__)
            return len(self.batch_sampler)
        whole, part = divmod(len(self.sampler), size)
        return whole + (1 if part and not self.drop_last else 0)

    def _batches(self) -> Iterator[torch.Tensor]:
        size = self.batch_size
        if size is None:  # then a batch_sampler (one of the two, checked in __init__)
            for indices in self.batch_sampler:
                yield torch.as_tensor(indices, dtype=torch.long).to(self.device, non_blocking=True)
            return
        order = torch.as_tensor(list(self.sampler), dtype=torch.long).to(self.device, non_blocking=True)
        end = len(order) - len(order) % size if self.drop_last else len(order)
        for begin in range(0, end, size):
            yield order[begin:begin + size]

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        images, labels, mean, std = self._tensors
        augment = getattr(self.dataset, "augment", False)
        if augment:  # this epoch's draws for every sample: the same whatever the order, the start or the rank
            offsets, flips = augment_draws(len(labels), self.seed, getattr(self.sampler, "epoch", 0))
            offsets, flips = offsets.to(self.device), flips.to(self.device)
        for index in self._batches():
            x = images[index]
            if augment:
                x = crop_and_flip(x, offsets[index], flips[index])
            yield (x.float() - mean) / std, labels[index]
