"""The next batch copied to the device while the current one computes (issue 51): a loader whose batches arrive
on the GPU.

On CUDA, :class:`DevicePrefetcher` issues batch i+1's host-to-device copy (non-blocking, from the loader's pinned
memory) on a side stream before it hands batch i over, so the copy overlaps batch i's compute: NVIDIA apex's
``data_prefetcher`` and Lightning's ``CudaDataPrefetcher`` pattern. Before a batch is handed over, the consumer's
stream waits for the side stream (``wait_stream``), and every tensor of the batch is recorded on the consumer's
stream (``record_stream``), so the caching allocator does not give its memory to another tensor while the consumer
may still read it. Off CUDA the loader's batches pass through unchanged: no copy, no stream.

The stream operations go through :class:`SideStream` (three methods), so the order of copies, waits and records
is tested on a CPU with a recording stand-in. Everything else of the loader (``len``, ``sampler``,
``batch_size``, ``dataset``) is the wrapped loader's, read through the wrapper.
"""
from functools import partial
from typing import Any, Callable, ContextManager, Iterator, Optional, Union

import torch

from ignite_amp.core.nested import map_tensors, to_device
from ignite_amp.data.device_batches import DeviceBatches

__all__ = ["SideStream", "DevicePrefetcher", "side_stream", "device_loader"]

_END = object()


class SideStream:
    """CUDA's side stream that copies batches, and the consumer's (current) stream that waits on it.

    A stand-in with the same three methods (``copying``, ``wait``, ``record``) drives
    :class:`DevicePrefetcher` off CUDA in the tests."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copying(self) -> ContextManager:
        """A context in which the copies issued run on the side stream."""
        return torch.cuda.stream(self.stream)

    def wait(self) -> None:
        """The consumer's stream waits for every copy issued so far on the side stream (no host sync)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def record(self, tensor: torch.Tensor) -> None:
        """``tensor`` (allocated on the side stream) is in use on the consumer's stream until the work queued there
        now has run: the caching allocator keeps its memory until then."""
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))


def side_stream(device: Union[str, torch.device]) -> Optional[SideStream]:
    """A :class:`SideStream` on a CUDA ``device``; None elsewhere (batches then pass through unchanged)."""
    device = torch.device(device)
    return SideStream(device) if device.type == "cuda" else None


class DevicePrefetcher:
    """``loader``'s batches, each already on ``device``; on CUDA the next batch's copy runs on a side stream
    while the current one computes.

    A drop-in for the loader wherever it is read: an Ignite ``Engine`` (each ``iter()`` a new pass, an
    ``epoch_length`` shorter than the loader, resume), ``len()``, and every other attribute of the loader
    (``sampler``, ``batch_size``, ``dataset``, ...), which are the wrapped loader's. :meth:`with_loader` wraps
    another loader the same way (OOM backoff's smaller batches keep being prefetched).

    Args:
        loader: any iterable of batches (a ``DataLoader`` with ``pin_memory=True`` makes the copies asynchronous).
        device: where the batches go.
        prepare: ``fn(batch) -> batch`` that moves one batch to ``device``; default: every tensor at any nesting
            (tuples, lists, dicts, namedtuples) with ``.to(device, non_blocking=True)``
            (:func:`ignite_amp.core.nested.to_device`).
        streams: the stream operations; default :func:`side_stream` of ``device`` (None off CUDA: no copy, no
            stream, the loader's batches as they are).

    Only tensors the batch holds in tuples, lists, dicts and namedtuples are recorded on the consumer's stream:
    the tensors inside an object that moves itself (its own ``.to``) are not reachable here, so for such batches
    leave the loader unwrapped (the step's ``prepare_batch`` then moves them on the consumer's stream).

    Example:
        >>> batches = DevicePrefetcher([(torch.ones(2), torch.zeros(2))] * 3, "cpu")
        >>> len(batches), [x.sum().item() for x, _ in batches]
        (3, [2.0, 2.0, 2.0])
    """

    def __init__(self, loader: Any, device: Union[str, torch.device], prepare: Optional[Callable] = None,
                 streams: Optional[Any] = None):
        self.loader = loader
        self.device = torch.device(device)
        self.prepare = prepare if prepare is not None else partial(to_device, device=self.device, non_blocking=True)
        self.streams = streams if streams is not None else side_stream(self.device)

    @property
    def prefetches(self) -> bool:
        """Whether batches are copied ahead on a side stream (on CUDA, or with a given ``streams``)."""
        return self.streams is not None

    def with_loader(self, loader: Any) -> "DevicePrefetcher":
        """``loader`` prefetched as this one is (same device, ``prepare`` and side stream)."""
        return DevicePrefetcher(loader, self.device, self.prepare, self.streams)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator:
        streams = self.streams
        if streams is None:
            yield from self.loader
            return
        batches = iter(self.loader)
        upcoming = self._copy_next(batches, streams)
        while upcoming is not _END:
            batch = upcoming
            streams.wait()  # before the next copy is queued: wait only for this batch's
            map_tensors(batch, streams.record)
            upcoming = self._copy_next(batches, streams)  # batch i+1's copy is issued before batch i is handed over
            yield batch

    def _copy_next(self, batches: Iterator, streams: Any) -> Any:
        """The next batch of ``batches``, its copy to the device issued on the side ``streams``; ``_END`` after the
        last."""
        batch = next(batches, _END)
        if batch is _END:
            return _END
        with streams.copying():
            return self.prepare(batch)


def device_loader(loader: Any, device: Union[str, torch.device]) -> Any:
    """``loader`` as a config run reads it: a :class:`DevicePrefetcher` on CUDA, ``loader`` itself elsewhere and
    for batches already cut on the device (``data.on_device``: nothing to copy)."""
    if isinstance(loader, DeviceBatches):
        return loader
    streams = side_stream(device)
    return loader if streams is None else DevicePrefetcher(loader, device, streams=streams)
