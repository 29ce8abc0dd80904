"""What a batch-size search records: one :class:`Trial` per size tried, the :class:`BatchSizeResult`,
and the trial table the CLI prints and a run logs."""
from typing import List, NamedTuple, Optional

__all__ = ["Trial", "BatchSizeResult", "format_trial", "format_trials", "TABLE_HEADER", "GIB"]

GIB = 2.0 ** 30


class Trial(NamedTuple):
    """One trial: ``steps`` real training steps (and an evaluation pass) at one batch size."""

    size: int
    fits: bool  # ran without running out of memory (the budget is the policy's business)
    peak_bytes: Optional[float]  # peak device memory of the trial; None without a meter
    seconds: float  # wall time of the whole trial
    stage: str  # probe, jump, verify, speed; double, bisect, confirm
    ms_per_step: Optional[float] = None  # timed steps after warmup, device-synchronized

    @property
    def samples_per_s(self) -> Optional[float]:
        if not self.fits or not self.ms_per_step:
            return None
        return self.size * 1000.0 / self.ms_per_step


class BatchSizeResult(NamedTuple):
    """What the search found: the size to train with, every trial, and why that size."""

    batch_size: int
    trials: List[Trial]
    largest_fit: int
    reason: str = ""
    objective: str = "largest"
    strategy: str = "bisect"  # what ran: "model", "bisect", or "model, then bisect"
    capacity_bytes: Optional[float] = None
    margin: float = 0.05

    @property
    def budget_bytes(self) -> Optional[float]:
        return None if self.capacity_bytes is None else (1 - self.margin) * self.capacity_bytes

    @property
    def table(self) -> str:
        """``format_trials`` of this result: what the CLI prints and a run logs as text."""
        return format_trials(self)


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def format_trial(t: Trial, budget: Optional[float] = None) -> str:
    """One row of the trial table (what the CLI prints as each trial finishes)."""
    result = "OOM" if not t.fits else ("over" if budget is not None and t.peak_bytes is not None
                                       and t.peak_bytes > budget else "fits")
    ms = "-" if t.ms_per_step is None or not t.fits else f"{t.ms_per_step:.{2 if t.ms_per_step < 10 else 1}f}"
    sps = "-" if t.samples_per_s is None else f"{t.samples_per_s:.0f}"
    return f"{t.size:>7}  {result:<6}  {_mib(t.peak_bytes):>9}  {ms:>9}  {sps:>9}  {t.seconds:>7.2f}  {t.stage}"


TABLE_HEADER = f"{'batch':>7}  {'result':<6}  {'peak MiB':>9}  {'ms/step':>9}  {'samples/s':>9}  {'seconds':>7}  stage"


def format_trials(result: BatchSizeResult) -> str:
    """The trial table as text, one row per trial, then the chosen size and why.

    "over": the trial ran but its peak is above the budget ((1 - margin) x capacity).
    """
    rows = [TABLE_HEADER] + [format_trial(t, result.budget_bytes) for t in result.trials]
    seconds = sum(t.seconds for t in result.trials)
    rows.append(f"{len(result.trials)} trials, {seconds:.1f} s ({result.strategy}); largest fit "
                f"{result.largest_fit}; chosen batch size {result.batch_size}: {result.reason}")
    return "\n".join(rows)
