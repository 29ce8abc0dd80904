"""Memory at each log, for :class:`~ignite_amp.handlers.TensorBoardMetrics`: the device's (CUDA: allocated,
reserved, the window's peak) or the process's resident memory (:func:`rss_mb`, read from one open file), and,
in a run of several processes, the largest rank's (one all-reduce of one number per log). Each handler keeps
the run's peak for the end-of-run health summary.

CUDA has one peak counter per process, which a user reads after a run (``torch.cuda.max_memory_allocated()``):
the windows' peaks are read through :class:`~ignite_amp.core.memory.PeakWindow`, which resets the counter for
each window and, when the run completes or is terminated, leaves it as if it never was.
"""
import os
from typing import Any, Dict, Optional

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import TensorboardLogger

from ignite_amp.core.collectives import max_across_ranks
from ignite_amp.core.memory import PeakWindow

__all__ = ["DeviceMemory", "RanksMemory", "rss_mb"]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm = (-1, -1)  # (pid, fd of its /proc/<pid>/statm): kept open, read again at offset 0 by each rss_mb()


def rss_mb() -> float:
    """Resident memory of this process in MiB (``/proc/self/statm``, opened once per process: opening it
    costs ten times the read)."""
    global _statm
    try:
        pid, fd = _statm
        if pid != os.getpid():  # the first read, or a forked child (its fd would read the parent's)
            fd = os.open(f"/proc/{os.getpid()}/statm", os.O_RDONLY)
            _statm = (os.getpid(), fd)
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class DeviceMemory:
    """Device memory at the log (CUDA: allocated, reserved, the window's peak), or the process's RSS;
    ``peak_mb`` is the run's peak so far. ``allocator``: torch.cuda's counters (default) or a stand-in."""

    def __init__(self, device: torch.device, ranks: Optional["RanksMemory"] = None, allocator: Any = None):
        self.device, self.ranks = device, ranks
        self.window = PeakWindow(device, allocator) if device.type == "cuda" else None
        self.peak_mb = 0.0
        self.first_rss_mb: Optional[float] = None  # the first read's RSS: memory/rss_growth_mb is the rise over it

    def attach(self, trainer: Engine, close: bool = True) -> None:
        """Windows from each run's start; ``close``: also leave CUDA's counter as found at the run's end (a caller
        whose last read comes later, at COMPLETED, calls :meth:`close` after it)."""
        trainer.add_event_handler(Events.STARTED, self._started)
        if close:
            for event in (Events.COMPLETED, Events.TERMINATE):
                trainer.add_event_handler(event, self.close)

    def _started(self, engine: Engine) -> None:
        if self.window is not None:  # the first window's peak is the training's, not a search's before it
            self.window.start()

    def close(self, engine: Optional[Engine] = None) -> None:
        """The run is over: CUDA's peak counter as if no window had reset it."""
        if self.window is not None:
            self.window.close()

    def read(self) -> Dict[str, float]:
        window = self.window
        if window is not None:
            allocator = window.allocator
            values = {"memory/allocated_mb": allocator.memory_allocated(self.device) / 2**20,
                      "memory/reserved_mb": allocator.memory_reserved(self.device) / 2**20}
            if not window.closed:  # after the run's end the counter is the process's again, not the run's
                values["memory/peak_mb"] = window.allocated_peak() / 2**20
                window.start()
                self.peak_mb = max(self.peak_mb, values["memory/peak_mb"])
        else:
            rss = rss_mb()
            if self.first_rss_mb is None:
                self.first_rss_mb = rss
            # the growth too: the dashboard's RSS chart shades the band down to it, so its axis starts near 0 and
            # its ticks differ (TensorBoard labels them with 3 significant digits: 975.4 to 976.0 MB read "976")
            values = {"memory/rss_mb": rss, "memory/rss_growth_mb": rss - self.first_rss_mb}
            self.peak_mb = max(self.peak_mb, rss)
        return values

    def __call__(self, engine: Engine, logger: TensorboardLogger, event_name: Any) -> None:
        values = self.read()
        for tag, value in values.items():
            logger.writer.add_scalar(tag, value, engine.state.iteration)
        if self.ranks is not None and self.ranks.last is not None:  # rank 0's own, read a moment later, included
            own = values.get("memory/peak_mb", values.get("memory/rss_mb", 0.0))
            logger.writer.add_scalar(self.ranks.tag, max(self.ranks.last, own), engine.state.iteration)


class RanksMemory:
    """The largest rank's memory at each log, for runs whose ranks differ (a sharded model's, say): every
    rank reads its own (CUDA: the window's peak allocated; CPU: RSS) and the ranks take the maximum, one
    all-reduce of one number per log. Attach it on every rank, before :class:`DeviceMemory`."""

    def __init__(self, device: torch.device, every: int, allocator: Any = None):
        self.device, self.every = device, every
        # rank 0's DeviceMemory reads and starts its own windows; the other ranks', here
        own = device.type == "cuda" and idist.get_rank() != 0
        self.window = PeakWindow(device, allocator) if own else None
        self.last: Optional[float] = None  # MB, the maximum over the ranks at the last log
        self.peak_mb = 0.0

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=self.every), self._gather)
        trainer.add_event_handler(Events.COMPLETED, self._last)
        if self.window is not None:
            window = self.window
            trainer.add_event_handler(Events.STARTED, lambda _: window.start())
            for event in (Events.COMPLETED, Events.TERMINATE):
                trainer.add_event_handler(event, lambda _: window.close())

    def _last(self, engine: Engine) -> None:  # the run's last window (all of a run shorter than a window)
        if engine.state.iteration % self.every:
            self._gather(engine)

    def _gather(self, engine: Engine) -> None:
        if self.window is not None:
            value = self.window.allocated_peak() / 2**20
            self.window.start()
        elif self.device.type == "cuda":  # rank 0: its DeviceMemory's window
            value = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            value = rss_mb()
        self.last = max_across_ranks(value)
        self.peak_mb = max(self.peak_mb, self.last)

    @property
    def tag(self) -> str:
        return "memory/max_rank_peak_mb" if self.device.type == "cuda" else "memory/max_rank_rss_mb"
