"""``data.num_workers: auto``: how many loader processes feed the model, from the device, the cores and the data.

Off a GPU the cores train the model, and a worker would take one from it: 0 (the CPU quickstart as before). On a
GPU the main process only launches kernels and copies batches; the other cores may prepare batches. The machine's
workers (shared out over its processes, as ``data.num_workers`` is) are its cores less one per process (its main
thread), at most :data:`MAX_IN_MEMORY` per process for a data set held in memory (a batch is an index into a tensor
and a normalisation: a few workers keep up) and :data:`MAX_FROM_FILES` for one read from files (each image decoded
and resized). Never more workers than cores; 0 stays possible.
Measured on one H100: the quickstart with ``num_workers: 0`` waited for batches 26% of its time (issue 51).
"""
import os
from typing import NamedTuple, Union

__all__ = ["MAX_IN_MEMORY", "MAX_FROM_FILES", "WorkersChoice", "usable_cores", "choose_num_workers"]

MAX_IN_MEMORY = 4
MAX_FROM_FILES = 8


class WorkersChoice(NamedTuple):
    """The loader's worker processes and why (empty when the config gave a number)."""

    workers: int
    why: str


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system says, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def choose_num_workers(requested: Union[int, str], device_type: str, in_memory: bool, cores: int,
                       processes: int = 1) -> WorkersChoice:
    """``requested`` (a number, or "auto") resolved by the module's rule: the workers of a machine whose
    ``processes`` share ``cores``.

    Example:
        >>> choose_num_workers("auto", "cpu", True, cores=16)
        WorkersChoice(workers=0, why='auto: 0 off a GPU')
        >>> choose_num_workers("auto", "cuda", False, cores=16).workers
        8
        >>> choose_num_workers("auto", "cuda", True, cores=2).workers
        1
    """
    if requested != "auto":
        return WorkersChoice(int(requested), "")
    if device_type != "cuda":
        return WorkersChoice(0, "auto: 0 off a GPU")
    processes = max(1, processes)
    cap, what = (MAX_IN_MEMORY, "for data in memory") if in_memory else (MAX_FROM_FILES, "for files")
    # For the machine: each process keeps a core for its main thread; the loaders share the rest out.
    workers = max(0, min(cores - processes, cap * processes))
    each = f" ({processes} processes)" if processes > 1 else ""
    return WorkersChoice(workers, f"auto: {cores} cores{each} less one per process, at most {cap} per process "
                                  f"{what}")
