"""The batch-size search policy: which sizes to try and which one to keep.

Pure: it only calls ``trial(size, stage) -> Trial`` (a few real steps at that size, reporting
whether it ran out of memory, its peak memory and its time per step), so it is tested and
benchmarked without a device. :func:`ignite_amp.batch_search.runner.find_batch_size` supplies real trials.

Which sizes to try is a strategy's (:mod:`ignite_amp.batch_search.strategies`): ``"plan"`` (when a memory plan is
given: the plan's peaks, corrected by one reading), ``"model"`` (the default: peak memory as a line in the batch
size, two probes and verified jumps) and ``"bisect"`` (doubling and bisection, the fallback of the other two).

A trial *fits* when it ran without running out of memory and its peak is within the budget
(``(1 - margin) * capacity``; without a capacity, any size that runs fits and the margin is
taken off the largest fit's batch size instead, as the search always did).

Objectives: ``"largest"`` keeps the largest verified fit; ``"fastest"`` then also times sizes
halving down from it and keeps the smallest batch within ``speed_tolerance`` of the best
samples/s seen.
"""
from typing import Callable, Dict, Optional, Tuple

import torch

from ignite_amp.batch_search.results import GIB, BatchSizeResult, Trial
from ignite_amp.batch_search.strategies import (
    VERIFY_STAGES,
    Search,
    Untrusted,
    bisect_search,
    fit_line,
    model_search,
    plan_search,
)
from ignite_amp.core.config_keys import POSITIVE_INT

__all__ = ["search_batch_size", "fit_line", "STRATEGIES", "OBJECTIVES", "VERIFY_STAGES"]

STRATEGIES = ("plan", "model", "bisect")
OBJECTIVES = ("largest", "fastest")


def _check(start: int, max_size: int, margin: float, tolerance: float, strategy: str, objective: str,
           capacity: Optional[float]) -> None:
    POSITIVE_INT.argument(start, "start")
    if not (isinstance(max_size, int) and max_size >= start):
        raise ValueError(f"Argument max_size should be an integer >= start, got {max_size!r}.")
    if not 0 <= margin < 1:
        raise ValueError(f"Argument margin should be in [0, 1), got {margin!r}.")
    if not 0 < tolerance < 1:
        raise ValueError(f"Argument tolerance should be in (0, 1), got {tolerance!r}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"Argument strategy should be one of {', '.join(STRATEGIES)}, got {strategy!r}.")
    if objective not in OBJECTIVES:
        raise ValueError(f"Argument objective should be one of {', '.join(OBJECTIVES)}, got {objective!r}.")
    if capacity is not None and not capacity > 0:
        raise ValueError(f"Argument capacity should be a positive number of bytes or None, got {capacity!r}.")


def search_batch_size(trial: Callable[[int, str], Trial], capacity: Optional[float] = None, margin: float = 0.05,
                      strategy: str = "model", objective: str = "largest", start: int = 16, max_size: int = 65536,
                      tolerance: float = 0.03, noise: float = 0.02, fit_tolerance: float = 0.05,
                      speed_tolerance: float = 0.03, max_jumps: int = 6,
                      planned: Optional[Callable[[int], float]] = None, max_overhead: float = 1.25) -> BatchSizeResult:
    """Find the batch size to train with, calling ``trial(size, stage)`` for each real trial.

    Args:
        trial: runs real steps at ``size`` and returns a :class:`Trial`; ``stage`` in
            ``VERIFY_STAGES`` (jump, verify, confirm) asks for the longer verification.
        capacity: device memory in bytes the trials may use (None: no meter, no budget).
        margin: share of ``capacity`` kept free (without a capacity: share of the batch size).
        strategy: ``"plan"`` (needs ``planned``), ``"model"`` (memory model) or ``"bisect"`` (doubling and
            bisection).
        objective: ``"largest"`` or ``"fastest"`` (smallest batch within ``speed_tolerance`` of
            the best samples/s seen).
        start: first size tried; max_size: the largest size tried.
        tolerance: stop when the size kept is within this share of the best the search can tell.
        noise: how far (a share) a peak reading may stray from the line; bounds the first jumps.
        fit_tolerance: a peak further than this share from the best line means "not a line".
        max_jumps: jumps before the memory model gives way to bisection.
        planned: ``planned(size) -> bytes``, the memory plan's peak
            (:meth:`ignite_amp.memory_plan.plan.MemoryPlan.peak_at`).
        max_overhead: the most the device's peak exceeds the plan by (the allocator's rounding, workspaces).

    Example (a 16 GiB device; 2 GiB for the model, 40 MiB per sample):

    >>> GiB, MiB = 2**30, 2**20
    >>> def trial(n, stage):
    ...     peak = 2 * GiB + 40 * MiB * n
    ...     return Trial(n, peak <= 16 * GiB, peak, 0.0, stage)
    >>> result = search_batch_size(trial, capacity=16 * GiB, margin=0.05)
    >>> result.batch_size, [(t.size, t.stage) for t in result.trials]
    (334, [(16, 'probe'), (83, 'probe'), (320, 'jump'), (334, 'jump')])
    >>> print(result.reason)
    largest fit under 95% of 16.0 GiB
    """
    _check(start, max_size, margin, tolerance, strategy, objective, capacity)
    budget = None if capacity is None else (1 - margin) * capacity
    search = Search(trial, capacity, margin, max_size)
    used = strategy
    note = ""
    if strategy == "plan":
        if planned is None:
            raise ValueError("Argument planned should be given with strategy 'plan' (a memory plan's peak_at).")
        try:
            plan_search(search, planned, noise, max_overhead)
        except Untrusted as why:
            used, strategy, note = "plan, then model", "model", f" (plan: {why}; the memory model took over)"
    if strategy == "model":
        try:
            model_search(search, start, tolerance, noise, fit_tolerance, max_jumps)
        except Untrusted as why:
            used, strategy = f"{used}, then bisect", "bisect"
            note += f" (memory model: {why}; doubling and bisection took over)"
    if strategy == "bisect":
        batch_margin = margin if budget is None else 0.0
        bisect_search(search, start, tolerance, batch_margin)
    largest = search.lo
    chosen = _kept(search)
    if capacity is None:  # (no budget)
        reason = f"largest fit less {margin:.0%}"
    else:
        reason = f"largest fit under {1 - margin:.0%} of {capacity / GIB:.1f} GiB"
    if objective == "fastest":
        chosen, reason = _fastest(search, chosen, speed_tolerance)
    return BatchSizeResult(chosen, search.trials, largest, reason + note, objective, used, capacity, margin)

def _kept(search: Search) -> int:
    """The largest verified fit below every failure."""
    hi = search.hi
    kept = [s for s in search.verified if hi is None or s < hi]
    if not kept:
        raise torch.OutOfMemoryError("out of memory even at batch size 1 during the batch-size search")
    return max(kept)


def _fastest(search: Search, largest: int, speed_tolerance: float) -> Tuple[int, str]:
    """Time sizes halving down from ``largest`` while they stay within ``speed_tolerance`` of the
    best samples/s seen; keep the smallest that does."""

    def speeds() -> Dict[int, float]:
        seen: Dict[int, float] = {}
        for t in search.trials:
            if t.size <= largest and search.fits(t) and t.samples_per_s is not None:
                seen[t.size] = max(seen.get(t.size, 0.0), t.samples_per_s)
        return seen

    seen = speeds()
    if not seen:
        return largest, "largest fit (no step times to pick the fastest)"
    size = largest // 2
    while size >= 1 and size not in seen:
        best = max(seen.values())
        search.run(size, "speed")
        seen = speeds()
        below = [s for s in seen if s < size]
        if seen.get(size, 0.0) < (1 - speed_tolerance) * best or (below and size // 2 <= max(below)):
            break  # slower already, or the next size down was timed already
        size //= 2
    best_size = max(seen, key=lambda s: seen[s])
    best = seen[best_size]
    chosen = min(s for s, v in seen.items() if v >= (1 - speed_tolerance) * best)
    return chosen, (f"fastest: the smallest batch within {speed_tolerance:.0%} of the best samples/s "
                    f"({best:.0f} at batch {best_size})")
