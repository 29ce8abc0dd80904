"""Which batch sizes the search tries: the trials so far and the bounds they give, and the three strategies.

Each strategy calls :meth:`Search.run` for the trials it wants and leaves the verified fits in the
:class:`Search`; :func:`ignite_amp.batch_search.policy.search_batch_size` picks one and keeps one of them.

- ``"plan"`` (when a memory plan is given, :mod:`ignite_amp.memory_plan.plan`): the plan's peak per batch size,
  traced under fake tensors, misses only the allocator's overhead (``max_overhead``: at most 25% more). The
  first trial is the largest batch the plan puts under the budget with that overhead; its reading gives the
  overhead on this device, and the second trial is the largest batch under the budget with it (a third,
  aimed lower, when the second's reading was over). Readings that do not follow the plan hand over to
  the memory model.

- ``"model"``: peak memory is close to a line in the batch size,
  ``peak = a + b * batch`` (weights, gradients, optimizer state and workspace; activations per
  sample). Two probes give the line; the search jumps to the largest batch whose predicted
  peak is under ``(1 - margin) * capacity`` and verifies it with real steps; each verification
  adds a far point, which sharpens the line, until the verified size is within ``tolerance`` of
  the prediction. A jump the readings cannot pin down yet goes only as far as their ``noise``
  surely allows; a jump that runs out of memory bounds the slope from below (its peak passed
  the capacity) and the next one goes halfway. When three or more peaks miss their best line
  by more than ``fit_tolerance``, or no size is within ``tolerance`` after ``max_jumps`` jumps,
  the line is not trusted (:class:`Untrusted`): doubling and bisection take over.
- ``"bisect"``: what the search did before the memory model (doubling from ``start``, bisection
  between the last fit and the first failure to ``tolerance``, a confirmation); kept for
  comparison and as the fallback.

A trial *fits* when it ran without running out of memory and its peak is within the budget
(``(1 - margin) * capacity``; without a capacity, any size that runs fits).
"""
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ignite_amp.batch_search.results import Trial

__all__ = ["Search", "Untrusted", "plan_search", "model_search", "bisect_search", "fit_line", "VERIFY_STAGES"]

# Stages whose trial also runs the longer verification (evaluation pass, steps after it).
VERIFY_STAGES = ("jump", "verify", "confirm")


class Search:
    """Trials so far and the bounds they give: ``lo`` the largest fit, ``hi`` the smallest failure."""

    def __init__(self, trial: Callable[[int, str], Trial], capacity: Optional[float], margin: float,
                 max_size: int):
        self.trial, self.capacity, self.max_size = trial, capacity, max_size
        self.budget = None if capacity is None else (1 - margin) * capacity
        self.trials: List[Trial] = []
        self.outcome: Dict[int, bool] = {}  # size -> fits (the latest trial at that size)
        self.points: Dict[int, float] = {}  # size -> peak, of trials that ran (no out-of-memory error)
        self.verified: set = set()

    def fits(self, t: Trial) -> bool:
        """Whether trial ``t`` ran without running out of memory and within the budget."""
        return t.fits and (self.budget is None or t.peak_bytes is None or t.peak_bytes <= self.budget)

    def run(self, size: int, stage: str) -> bool:
        """Run a trial at ``size`` for ``stage`` and record it; whether it fits."""
        t = self.trial(size, stage)
        if not isinstance(t, Trial):
            raise TypeError(f"Argument trial should return a Trial, got {type(t).__name__}.")
        self.trials.append(t)
        ok = self.fits(t)
        self.outcome[size] = ok
        if t.fits and t.peak_bytes is not None:
            self.points[size] = float(t.peak_bytes)
        if ok and stage in VERIFY_STAGES:
            self.verified.add(size)
        elif not ok:
            self.verified.discard(size)
        return ok

    @property
    def hi(self) -> Optional[int]:
        """The smallest size that failed (None: none did)."""
        failed = [s for s, ok in self.outcome.items() if not ok]
        return min(failed) if failed else None

    @property
    def lo(self) -> int:
        """The largest size that fitted below every failure (0: none)."""
        hi = self.hi
        fitted = [s for s, ok in self.outcome.items() if ok and (hi is None or s < hi)]
        return max(fitted, default=0)


class Untrusted(Exception):
    """The plan or the memory model cannot be trusted here: the next strategy takes over."""

def fit_line(points: Dict[int, float]) -> Tuple[float, float, float]:
    """Least-squares line through ``{size: peak}``: ``(a, b, misfit)``, misfit the largest
    distance of a point from the line as a share of the largest peak (the scale that matters
    near the budget; a small probe's few bytes of jitter do not make a bend).

    >>> a, b, misfit = fit_line({16: 1100.0, 64: 1400.0, 512: 4200.0})
    >>> round(a), round(b, 2), misfit < 0.01
    (1000, 6.25, True)
    """
    if len(points) < 2:
        raise ValueError(f"Argument points should hold at least 2 sizes, got {len(points)}.")
    xs, ys = list(points), list(points.values())
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    scale = max(max(abs(y) for y in ys), 1e-12)
    misfit = max(abs(y - (a + b * x)) for x, y in zip(xs, ys, strict=True)) / scale
    return a, b, misfit


def _largest_planned(planned: Callable[[int], float], limit: float, max_size: int) -> int:
    """The largest size whose planned peak is within ``limit`` (0: none; the plan grows with the size)."""
    lo, hi = 0, max_size + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if planned(mid) <= limit else (lo, mid)
    return lo


def plan_search(search: Search, planned: Callable[[int], float], noise: float, max_overhead: float) -> None:
    """The ``"plan"`` strategy: trials aimed by ``planned(size)``, the memory plan's peak, times the overhead the
    readings show (raises :class:`Untrusted` when they do not follow the plan)."""
    budget, max_size = search.budget, search.max_size
    if budget is None:
        raise Untrusted("no capacity to aim at")
    first = max(1, _largest_planned(planned, budget / (max_overhead * (1 + noise)), max_size))
    _first_fit(search, first, "jump")
    for aim in (1 - noise / 2, 1 - noise):  # a second trial; a third, aimed lower, when it was over budget
        if not search.points:
            raise Untrusted("no peak-memory readings")
        overhead = max(peak / planned(n) for n, peak in search.points.items())
        if not 0.5 <= overhead <= 2 * max_overhead:
            raise Untrusted(f"the readings are {overhead:.2f}x the plan")
        target = _largest_planned(planned, budget * aim / overhead, max_size)
        if search.hi is not None:
            target = min(target, search.hi - 1)
        if target <= search.lo or search.run(target, "jump"):
            return


def model_search(search: Search, start: int, tolerance: float, noise: float, fit_tolerance: float,
                 max_jumps: int) -> None:
    """The ``"model"`` strategy: two probes, then jumps to the line's prediction, each verified, until the verified
    size is within ``tolerance`` of it (raises :class:`Untrusted` when the peaks are not a line)."""
    capacity, budget, max_size = search.capacity, search.budget, search.max_size
    if capacity is None or budget is None:  # (both or neither)
        raise Untrusted("no capacity to aim at")
    # 1. A first probe that fits.
    size = _first_fit(search, start, "probe")
    if size >= max_size:
        search.run(size, "verify")
        return
    if size not in search.points:
        raise Untrusted("no peak-memory readings")
    # 2. A second probe as far out as surely fits even if all memory grew with the batch
    #    (peak = b * batch, the steepest line through the first point), at least twice the first.
    grow = 0.9 * budget / search.points[size]
    second = min(max(math.floor(size * grow), 2 * size), 256 * size, max_size)
    if search.hi is not None:
        second = min(second, search.hi - 1)
    if second > size:
        search.run(second, "probe")
    # 3. Jump to the line's prediction, verify, refit; stop when the verified size is within tolerance.
    failed = False  # the last trial ran out of memory: no point to learn from, only a bound
    jumps = 0
    while True:
        failure = search.hi  # (set whenever lo is 0: a size fitted in step 1, so only a failure below it hides it)
        if search.lo == 0 and failure is not None:  # a verification failed below every other fit: start below it
            _first_fit(search, failure - 1, "jump")
        lo, hi, points = search.lo, search.hi, search.points
        bound = _upper_bound(search, capacity, budget, noise)
        ceiling = min(max_size, hi - 1 if hi is not None else max_size, bound)
        predicted = math.inf
        if len(points) >= 2:
            a, b, misfit = fit_line(points)
            if len(points) >= 3 and misfit > fit_tolerance:
                raise Untrusted(f"the peaks are {misfit:.1%} off a line")
            if b > 0:  # aimed half the readings' noise under the budget
                predicted = (budget * (1 - noise / 2) - a) / b
        if lo >= ceiling or lo >= (1 - tolerance) * min(predicted, ceiling):
            if lo in search.verified:
                return
            target, stage = lo, "verify"  # close enough, but so far only probed
        else:
            if failed or len(points) < 2:  # halfway to the ceiling
                aim = (lo + ceiling + 1) / 2
            elif max(points) >= predicted / 2:  # a short extrapolation: trust the line
                aim = predicted
            else:  # a long one: no further than the readings' noise surely allows
                aim = min(predicted, _lower_bound(search, budget, noise))
            if hi is not None:  # below a failure by the tolerance: a fit there ends the search
                aim = min(aim, hi * (1 - tolerance))
            target, stage = max(lo + 1, math.floor(min(aim, ceiling))), "jump"
        if jumps == max_jumps:
            raise Untrusted(f"no size within {tolerance:.0%} of the prediction after {max_jumps} jumps")
        jumps += 1
        before = len(search.points)
        failed = not search.run(target, stage) and len(search.points) == before


def _first_fit(search: Search, size: int, stage: str) -> int:
    """Try ``size``, then smaller ones until one fits: scaled down by the peak when the trial ran
    (over the budget), halved when it ran out of memory."""
    while not search.run(size, stage):
        if size == 1:
            raise torch.OutOfMemoryError("out of memory even at batch size 1 during the batch-size search")
        peak, budget = search.points.get(size), search.budget  # (the plan and model strategies': a budget)
        scaled = math.floor(size * 0.9 * budget / peak) if peak and budget is not None else size // 2
        size = max(1, min(size - 1, scaled))
    return size


def _upper_bound(search: Search, capacity: float, budget: float, noise: float) -> float:
    """The largest size that could fit the budget given an out-of-memory failure at ``h``: the
    peak rose from a reading ``m`` at ``p < h`` past the capacity, so the slope is at least
    ``(capacity - m) / (h - p)`` (the model strategy's, which needs a capacity)."""
    bound = math.inf
    for h, ok in search.outcome.items():
        if ok or h in search.points:
            continue
        for p, m in search.points.items():
            rise = capacity - m * (1 + noise)
            if p < h and rise > 0:
                bound = min(bound, p + (budget - m * (1 - noise)) * (h - p) / rise)
    return bound


def _lower_bound(search: Search, budget: float, noise: float) -> float:
    """The largest size that surely fits the budget whatever the readings' ``noise``: the steepest
    line through the two outermost readings (each moved by ``noise``), and ``peak = b * batch``."""
    points = search.points
    bound = max((s * budget * (1 - noise) / m for s, m in points.items() if m <= budget), default=0.0)
    small, large = min(points), max(points)
    if large > small:
        m_small, m_large = points[small] * (1 - noise), points[large] * (1 + noise)
        steep = (m_large - m_small) / (large - small)
        if steep > 0:
            bound = max(bound, large + (budget - m_large) / steep)
    return bound


def bisect_search(search: Search, start: int, tolerance: float, batch_margin: float) -> None:
    """Doubling from ``start`` (until a failure is known), bisection to ``tolerance``, the margin
    off the batch size, and a confirmation (shrinking by 10% while it fails)."""
    max_size = search.max_size
    if search.hi is None and search.lo < max_size:
        size = min(2 * search.lo if search.lo else start, max_size)  # a fallback doubles from the largest fit
        while search.run(size, "double") and size < max_size:
            size = min(size * 2, max_size)
    high = search.hi
    if search.lo == 0 and high is not None:  # even the first size failed (the doubling ran): look below it
        low = 0
        while high - low > 1:
            mid = (low + high) // 2
            if search.run(mid, "bisect"):
                break
            high = mid
        if search.lo == 0:
            raise torch.OutOfMemoryError("out of memory even at batch size 1 during the batch-size search")
    while search.hi is not None and search.hi - search.lo > max(1, math.floor(search.lo * tolerance)):
        search.run((search.lo + search.hi) // 2, "bisect")
    chosen = max(1, math.floor(search.lo * (1 - batch_margin)))
    if chosen in search.verified:
        return
    while not search.run(chosen, "confirm"):
        if chosen == 1:
            raise torch.OutOfMemoryError("out of memory at batch size 1 while confirming the batch-size search")
        chosen = max(1, math.floor(chosen * (1 - max(batch_margin, 0.1))))
