"""CUDA's memory counters, read without changing what the user reads.

CUDA's caching allocator has two numbers: what tensors hold (*allocated*) and what the allocator keeps from the
driver (*reserved*: the tensors, the cache of freed blocks, the rounding of blocks and segments). Under a
per-process cap, or on a card shared with another process, the reserve grows to whatever is free (freed
blocks stay cached; cuDNN's workspaces take what there is), so it says little about what a step *needs*.
Decisions about what fits rest on the allocated peak plus the allocator's measured slack.

Each number has one peak counter per process, and the only way to read the peak of a window (a trial, a
run) is to reset it, which a user who reads ``torch.cuda.max_memory_allocated()`` after a run relies on.
:class:`PeakWindow` reads window peaks and, when closed, leaves the counter as it would read had nobody
reset it. Everything here takes an *allocator*: an object with torch.cuda's counter functions (the default,
:data:`CUDA`), or a stand-in of the caching allocator in tests.
"""
import logging
from typing import Any, Optional, Union

import torch

__all__ = ["CudaAllocator", "CUDA", "PeakWindow"]

logger = logging.getLogger("ignite_amp")


class CudaAllocator:
    """torch.cuda's counters, and :meth:`hold` to raise the allocated peak: the interface every user of an
    allocator here calls (a stand-in implements the same methods)."""

    def memory_allocated(self, device: Any) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: Any) -> int:
        return torch.cuda.max_memory_allocated(device)

    def memory_reserved(self, device: Any) -> int:
        return torch.cuda.memory_reserved(device)

    def max_memory_reserved(self, device: Any) -> int:
        return torch.cuda.max_memory_reserved(device)

    def reset_peak_memory_stats(self, device: Any) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def empty_cache(self, device: Any) -> None:
        torch.cuda.empty_cache()

    def capacity(self, device: Any) -> float:
        """What this process may reserve in all: the free memory plus what it holds already, and no more than a
        ``torch.cuda.set_per_process_memory_fraction`` cap."""
        free, total = torch.cuda.mem_get_info(device)
        usable = free + torch.cuda.memory_reserved(device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
        return float(min(usable, total * fraction(device))) if fraction else float(usable)

    def hold(self, device: Any, nbytes: int) -> None:
        """Allocate ``nbytes`` for a moment (the allocated peak then reads at least what is allocated now plus
        ``nbytes``)."""
        block = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
        del block


#: torch.cuda's counters.
CUDA = CudaAllocator()


class PeakWindow:
    """Peaks of allocated and reserved memory over windows, without losing the process's own peak.

    :meth:`start` begins a window (CUDA's peak counters reset), :meth:`allocated_peak` and
    :meth:`reserved_peak` read it. :meth:`close` (or leaving the ``with`` block) leaves the allocated peak
    counter at what it would read had it never been reset: the most of its value at the first start and
    every peak read since (held for a moment to get there). The reserved peak is not
    restored (it measures the cache, which the search empties anyway).

    Args:
        device: a CUDA device with its index (or what the allocator takes).
        allocator: torch.cuda's counters (default) or a stand-in with the same methods.

    Example (on a stand-in; on a GPU the default allocator is torch.cuda's):

    >>> class Counter:  # the allocated counter of an allocator, nothing else
    ...     def __init__(self): self.now, self.peak = 0, 0
    ...     def memory_allocated(self, d): return self.now
    ...     def max_memory_allocated(self, d): return self.peak
    ...     def max_memory_reserved(self, d): return self.peak
    ...     def reset_peak_memory_stats(self, d): self.peak = self.now
    ...     def hold(self, d, n): self.peak = max(self.peak, self.now + n)
    >>> c = Counter(); c.peak = 900          # the user's run peaked at 900
    >>> with PeakWindow("cuda:0", c) as w:
    ...     w.start(); c.now = c.peak = 300  # a window that peaks at 300
    ...     w.allocated_peak()
    300
    >>> c.max_memory_allocated("cuda:0")    # as if nothing had been reset
    900
    """

    def __init__(self, device: Union[str, torch.device], allocator: Optional[Any] = None):
        self.device = device
        self.allocator = CUDA if allocator is None else allocator
        self.highest: Optional[int] = None  # read at the first start: making a window touches no counter
        self.closed = False

    def __enter__(self) -> "PeakWindow":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def start(self) -> None:
        """A new window: the peaks go back to what is held now (the last window's peak is kept for :meth:`close`)."""
        self.closed = False
        self.allocated_peak()
        self.allocator.reset_peak_memory_stats(self.device)

    def allocated_peak(self) -> int:
        """The most memory tensors held since :meth:`start`."""
        value = self.allocator.max_memory_allocated(self.device)
        self.highest = value if self.highest is None else max(self.highest, value)
        return value

    def reserved_peak(self) -> int:
        """The most memory the allocator reserved since :meth:`start`."""
        return self.allocator.max_memory_reserved(self.device)

    def close(self) -> None:
        """Leave the allocated peak counter as if no window had reset it (once; later calls do nothing)."""
        if self.closed or self.highest is None:  # closed already, or never started
            return
        self.closed = True
        self.allocated_peak()
        allocator, device = self.allocator, self.device
        allocator.reset_peak_memory_stats(device)
        missing = self.highest - allocator.memory_allocated(device)
        if missing > 0:
            try:
                allocator.hold(device, missing)
            except torch.OutOfMemoryError:  # the memory went to another process meanwhile
                logger.info("could not restore CUDA's allocated peak counter to %d bytes: it reads the peak "
                            "since the memory measurement ended", self.highest)
