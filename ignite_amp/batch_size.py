"""Automatic batch-size search: the largest batch the device holds, less a safety margin.

:func:`search_batch_size` is the policy (pure: it only calls ``fits(size)``); :func:`find_batch_size`
runs it with the real AMP step (autocast forward, scaled backward, optimizer step, so the
optimizer state is allocated) and leaves model, optimizer, scaler and RNG as they were.
"""
import copy
import math
import time
from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import torch
from ignite_amp.collectives import is_distributed, min_across_ranks, unwrap
from ignite_amp.rng import get_rng_state, set_rng_state
from ignite_amp.step import create_amp_trainer, free_memory, is_oom_error

__all__ = ["Trial", "BatchSizeResult", "search_batch_size", "find_batch_size", "format_trials"]


class Trial(NamedTuple):
    size: int
    fits: bool
    peak_mb: Optional[float]
    seconds: float
    stage: str  # "double", "bisect" or "confirm"


class BatchSizeResult(NamedTuple):
    batch_size: int
    trials: List[Trial]
    largest_fit: int


def search_batch_size(fits: Callable[[int, str], Trial], start: int = 32, max_size: int = 8192,
                      margin: float = 0.1, tolerance: float = 0.03) -> BatchSizeResult:
    """Double from ``start`` until a size fails or ``max_size``; bisect between the last fit and the
    first failure until they are within ``tolerance``; take ``margin`` off; confirm (shrinking by
    ``margin`` again while the confirmation fails).

    ``fits(size, stage)`` runs a trial and returns its :class:`Trial`.

    >>> result = search_batch_size(lambda n, s: Trial(n, n <= 100, None, 0.0, s), start=8, margin=0.1)
    >>> result.largest_fit, result.batch_size, [t.size for t in result.trials][:6]
    (100, 90, [8, 16, 32, 64, 128, 96])
    """
    if not (isinstance(start, int) and start >= 1):
        raise ValueError(f"Argument start should be a positive integer, got {start!r}.")
    if not (isinstance(max_size, int) and max_size >= start):
        raise ValueError(f"Argument max_size should be an integer >= start, got {max_size!r}.")
    if not 0 <= margin < 1:
        raise ValueError(f"Argument margin should be in [0, 1), got {margin!r}.")
    trials: List[Trial] = []

    def run(size: int, stage: str) -> bool:
        trials.append(fits(size, stage))
        return trials[-1].fits

    low, high = 0, None  # largest fit, smallest failure
    size = start
    while True:
        if run(size, "double"):
            low = size
            if size >= max_size:
                break
            size = min(size * 2, max_size)
        else:
            high = size
            break
    if low == 0:  # even the start failed: bisect below it
        low_bound = 0
        while high - low_bound > 1:
            mid = (low_bound + high) // 2
            if run(mid, "bisect"):
                low_bound = mid
                break
            high = mid
        low = low_bound
        if low == 0:
            raise torch.OutOfMemoryError("out of memory even at batch size 1 during the batch-size search")
    while high is not None and high - low > max(1, math.floor(low * tolerance)):
        mid = (low + high) // 2
        if run(mid, "bisect"):
            low = mid
        else:
            high = mid
    chosen = max(1, math.floor(low * (1 - margin)))
    while not run(chosen, "confirm"):
        if chosen == 1:
            raise torch.OutOfMemoryError("out of memory at batch size 1 while confirming the batch-size search")
        chosen = max(1, math.floor(chosen * (1 - max(margin, 0.1))))
    return BatchSizeResult(chosen, trials, low)


def format_trials(result: BatchSizeResult) -> str:
    """The trial table as text, one row per trial, then the chosen size."""
    rows = [f"{'size':>7}  {'result':<6}  {'peak MB':>9}  {'seconds':>7}  stage"]
    for t in result.trials:
        peak = "-" if t.peak_mb is None else f"{t.peak_mb:.0f}"
        rows.append(f"{t.size:>7}  {'fits' if t.fits else 'OOM':<6}  {peak:>9}  {t.seconds:>7.2f}  {t.stage}")
    rows.append(f"largest fit {result.largest_fit}; chosen batch size {result.batch_size}")
    return "\n".join(rows)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "rng": get_rng_state(),
    }


def _restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])


def find_batch_size(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable,
    make_batch: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
    device: Union[str, torch.device] = "auto",
    dtype: Union[str, torch.dtype] = "auto",
    start: int = 32,
    max_size: int = 8192,
    margin: float = 0.1,
    tolerance: float = 0.03,
    steps: int = 2,
    confirm_steps: int = 3,
    **step_kwargs,
) -> BatchSizeResult:
    """Find the largest batch the device holds for this model, optimizer and dtype, less ``margin``.

    Each trial runs ``steps`` real AMP steps on ``make_batch(size)`` (the confirmation
    ``confirm_steps``). Model weights and buffers, optimizer state, RNG states are restored
    afterwards and cached memory is released; the scaler is the trial step's own.

    Args:
        make_batch: ``make_batch(n) -> (x, y)`` with the real input shape (on the device, ideally).
        start, max_size: the doubling's first and largest size.
        margin: share taken off the largest fit (0.1: 10%).
        tolerance: bisection stops when the bounds are within this share of the fit.
        step_kwargs: more :class:`~ignite_amp.step.AmpStep` arguments (``channels_last``, ``fp32_modules``...).
    """
    model = unwrap(model)  # trials must not communicate: a rank out of memory would leave the others waiting
    engine = create_amp_trainer(model, optimizer, loss_fn, device=device, dtype=dtype, **step_kwargs)
    step = engine.amp_step
    saved = _snapshot(model, optimizer)
    cuda = step.device.type == "cuda"

    def fits(size: int, stage: str) -> Trial:
        free_memory(step.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(step.device)
        begin = time.perf_counter()
        ok = True
        try:
            batch = make_batch(size)
            for i in range(confirm_steps if stage == "confirm" else steps):
                engine.state.iteration = i + 1
                step(engine, batch)
            if cuda:
                torch.cuda.synchronize(step.device)
        except RuntimeError as exc:
            if not is_oom_error(exc):
                raise
            ok = False
        batch = None
        peak = torch.cuda.max_memory_allocated(step.device) / 2**20 if cuda else None
        seconds = time.perf_counter() - begin
        optimizer.zero_grad(set_to_none=True)
        free_memory(step.device)
        return Trial(size, ok, peak, seconds, stage)

    try:
        result = search_batch_size(fits, start=start, max_size=max_size, margin=margin, tolerance=tolerance)
    finally:
        _restore(model, optimizer, saved)
        optimizer.zero_grad(set_to_none=True)
        free_memory(step.device)
    if is_distributed():  # each rank searched its own device: every rank takes the smallest answer
        result = result._replace(batch_size=min_across_ranks(result.batch_size),
                                 largest_fit=min_across_ranks(result.largest_fit))
    return result
