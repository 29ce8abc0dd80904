"""Automatic batch-size search with real steps: the trials, the memory meter and the clock.

The policy (which sizes to try, which to keep) is :func:`ignite_amp.batch_search.policy.search_batch_size`,
a pure function. :func:`find_batch_size` gives it real trials: the AMP step (autocast forward,
scaled backward, optimizer step, so the optimizer state is allocated inside the measurement)
on the real model, dtype and input shape, an evaluation pass, peak memory read from a
:class:`MemoryMeter` and step times from a device-synchronized clock. Model, optimizer and RNG
are left as they were.
"""
import copy
import sys
import time
import traceback
from typing import Any, Callable, Optional, Protocol, Tuple, Union

import ignite.distributed as idist
import torch
from ignite.utils import apply_to_type

from ignite_amp.batch_search.policy import VERIFY_STAGES, search_batch_size
from ignite_amp.batch_search.results import GIB, TABLE_HEADER, BatchSizeResult, Trial, format_trial
from ignite_amp.batch_search.strategies import Untrusted
from ignite_amp.core.collectives import is_distributed, min_across_ranks, unwrap
from ignite_amp.core.device import free_memory, is_oom_error, resolve_device
from ignite_amp.core.memory import CUDA, PeakWindow
from ignite_amp.core.rng import get_rng_state, set_rng_state
from ignite_amp.engine import create_amp_evaluator, create_amp_trainer
from ignite_amp.errors import OptimizerOutOfMemoryError

__all__ = ["MemoryMeter", "CudaMemoryMeter", "memory_meter", "device_clock", "TrialRunner", "find_batch_size",
           "print_progress"]


class Allocator(Protocol):
    """What :class:`CudaMemoryMeter` calls on its allocator besides :class:`~ignite_amp.core.memory.PeakWindow`'s
    counters (:class:`~ignite_amp.core.memory.CudaAllocator` has them all)."""

    def empty_cache(self, device: Any) -> None: ...

    def capacity(self, device: Any) -> float: ...


class MemoryMeter:
    """What the search reads from a device: what a trial needs at its peak, and the capacity.

    Subclass it for another device, or for a stand-in in tests.
    """

    def reset(self) -> None:
        """Start measuring a trial (after its warm-up steps)."""
        raise NotImplementedError

    def peak_bytes(self) -> float:
        """The memory the trial needed at its peak since :meth:`reset` (read after a trial that ran)."""
        raise NotImplementedError

    def capacity_bytes(self) -> float:
        """The memory this process may hold in all (what its trials are measured against)."""
        raise NotImplementedError

    def release(self) -> None:
        """Give the device's cached memory back before a trial (nothing to do by default)."""

    def close(self) -> None:
        """The search is over: leave the device's counters as they were (nothing to do by default)."""


class CudaMemoryMeter(MemoryMeter):
    """What a trial needs on a CUDA device, from the caching allocator's counters.

    A trial needs its *allocated* peak (what its tensors held, cuBLAS's and cuDNN's workspaces included),
    measured after the warm-up steps (cuDNN's autotuning tries workspaces as large as what is free), plus
    the allocator's *slack*: the reserve's excess over the allocated peak (rounding, fragmentation),
    measured as a share on every trial whose reserve stayed clear of the capacity and kept at the largest
    seen, plus what CUDA's libraries took outside the allocator since the search began (the capacity's
    fall). The reserve itself is not the need: under a per-process cap or beside another process it grows
    to whatever is free, whatever the batch (a trial that trained read 99.8% of a cap on an H100), and a
    search that read it chose half the largest fit.

    The capacity is what this process can reserve: the free memory plus what it holds already, and no more
    than a ``torch.cuda.set_per_process_memory_fraction`` cap. CUDA's peak counters are reset for each
    trial and left, by :meth:`close`, as if they never were (:class:`~ignite_amp.core.memory.PeakWindow`).

    Args:
        device: the CUDA device.
        allocator: torch.cuda's counters (default), or a stand-in with the same methods
            (:class:`~ignite_amp.core.memory.CudaAllocator`'s), for tests.
        pressed: a reserve within this share of the capacity is pressed against it: its slack is not measured.
    """

    def __init__(self, device: Union[str, torch.device], allocator: Optional[Allocator] = None, pressed: float = 0.02):
        # with its index: the memory fraction calls refuse "cuda" without one
        self.device = resolve_device(device) if allocator is None else device
        self.allocator: Allocator = CUDA if allocator is None else allocator
        self.window = PeakWindow(self.device, self.allocator)
        self.pressed = pressed
        self.slack = 0.0  #: the largest measured share of the reserve over the allocated peak
        self.start_capacity: Optional[float] = None

    def reset(self) -> None:
        self.allocator.empty_cache(self.device)  # the warm-up's cached blocks (autotuning's) are not the trial's
        self.window.start()

    def peak_bytes(self) -> float:
        allocated, reserved = self.window.allocated_peak(), self.window.reserved_peak()
        capacity = self.capacity_bytes()
        if allocated > 0 and reserved < (1 - self.pressed) * capacity:
            self.slack = max(self.slack, reserved / allocated - 1)
        outside = max(0.0, (self.start_capacity or capacity) - capacity)  # libraries' memory, outside the allocator
        return allocated * (1 + self.slack) + outside

    def capacity_bytes(self) -> float:
        capacity = self.allocator.capacity(self.device)
        if self.start_capacity is None:
            self.start_capacity = capacity
        return capacity

    def release(self) -> None:
        self.allocator.empty_cache(self.device)

    def close(self) -> None:
        self.window.close()


def memory_meter(device: torch.device) -> Optional[MemoryMeter]:
    """The meter for ``device`` (CUDA), or None where torch has no peak-memory counters (CPU)."""
    return CudaMemoryMeter(device) if torch.device(device).type == "cuda" else None


def device_clock(device: torch.device) -> Callable[[], float]:
    """A clock for timing steps: ``time.perf_counter()`` read after the device's queued work is done.

    >>> clock = device_clock(torch.device("cpu"))
    >>> clock() <= clock()
    True
    """
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter  # CPU kernels run as they are called

    def clock() -> float:
        torch.cuda.synchronize(device)  # a host-device sync: only between timed steps
        return time.perf_counter()

    return clock


def print_progress(line: str) -> None:
    """Progress of a search on stderr, one line at a time (picklable, for spawned ranks)."""
    print(line, file=sys.stderr, flush=True)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Weights, optimizer state and RNG, on the CPU: a copy on the device would take the memory measured."""

    def to_cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    opt = optimizer.state_dict()
    return {
        "model": {k: to_cpu(v) for k, v in model.state_dict().items()},
        "optimizer": {"state": apply_to_type(opt["state"], torch.Tensor, to_cpu),
                      "param_groups": copy.deepcopy(opt["param_groups"])},
        "rng": get_rng_state(),
        "training": model.training,
    }


def _restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    # A copy: the optimizer keeps tensors already on the right device (Adam's CPU "step") and
    # updates them in place.
    optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))


class TrialRunner:
    """Real trials for the search: ``runner(size, stage) -> Trial``; a context manager that
    leaves the model and optimizer as they were.

    A trial starts from the model's and optimizer's state as given, runs ``warmup`` + ``steps``
    real AMP steps on ``make_batch(size)`` (the ``steps`` timed with ``clock``), then an
    evaluation forward on ``make_batch(eval_batch_size or size)`` with the gradients still held,
    as at the end of an epoch; a verification (a stage in ``VERIFY_STAGES``) runs
    ``verify_steps`` more steps after it, so that fragmentation shows in the peak. On leaving,
    weights, buffers, optimizer state, train/eval mode and RNG states are restored and cached
    memory is released. Arguments as for :func:`find_batch_size`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 make_batch: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
                 device: Union[str, torch.device] = "auto", dtype: Union[str, torch.dtype] = "auto",
                 warmup: int = 1, steps: int = 3, verify_steps: int = 5, eval_batch_size: Optional[int] = None,
                 meter: Optional[MemoryMeter] = None, clock: Optional[Callable[[], float]] = None, **step_kwargs):
        for name, value, least in (("warmup", warmup, 1), ("steps", steps, 1), ("verify_steps", verify_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Argument {name} should be an integer >= {least}, got {value!r}.")
        self.model = unwrap(model)  # trials must not communicate: a rank out of memory would leave the others waiting
        self.optimizer, self.make_batch = optimizer, make_batch
        self.warmup, self.steps, self.verify_steps, self.eval_batch_size = warmup, steps, verify_steps, eval_batch_size
        # Memory does not depend on the loss scale; a float16 step skipped for inf/NaN would not allocate
        # the optimizer state, which the first step must (GradScaler starts at 65536 and often overflows).
        step_kwargs.setdefault("scaler_kwargs", {"init_scale": 1.0})
        self.engine = create_amp_trainer(self.model, optimizer, loss_fn, device=device, dtype=dtype, **step_kwargs)
        self.device = self.engine.amp_step.device
        forward = {k: v for k, v in step_kwargs.items() if k in ("channels_last", "fp32_modules", "non_blocking")}
        self.evaluator = create_amp_evaluator(self.model, device=self.device, dtype=self.engine.amp_step.dtype,
                                              **forward)
        self.meter = memory_meter(self.device) if meter is None else meter
        self.clock = device_clock(self.device) if clock is None else clock
        self.saved = _snapshot(self.model, optimizer)
        free_memory(self.device)
        self.capacity = self.meter.capacity_bytes() if self.meter is not None else None

    def __enter__(self) -> "TrialRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        _restore(self.model, self.optimizer, self.saved)
        set_rng_state(self.saved["rng"])
        self.model.train(self.saved["training"])
        self.optimizer.zero_grad(set_to_none=True)
        free_memory(self.device)
        if self.meter is not None:
            self.meter.close()

    def _train(self, batch, count: int) -> None:
        engine = self.engine
        for _ in range(count):
            engine.state.iteration += 1
            engine.amp_step(engine, batch)

    def __call__(self, size: int, stage: str) -> Trial:
        model, optimizer, meter, clock = self.model, self.optimizer, self.meter, self.clock
        optimizer.zero_grad(set_to_none=True)
        _restore(model, optimizer, self.saved)  # each trial starts from the same weights and optimizer state
        free_memory(self.device)  # the one garbage collection of a trial (a third of a second in a large process)
        if meter is not None:
            meter.release()  # every trial starts from an empty cache, whatever the last one left fragmented
        begin = time.perf_counter()
        ms, error, failed = None, None, False
        batch: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        try:
            batch = self.make_batch(size)
            self._train(batch, self.warmup)  # the first step allocates the optimizer state; cuDNN autotunes
            if meter is not None:  # measured from here: the steady steps, the evaluation, the verification
                meter.reset()
            t0 = clock()
            self._train(batch, self.steps)
            ms = (clock() - t0) * 1000 / self.steps
            self.evaluator.amp_step(self.evaluator, self.make_batch(self.eval_batch_size or size))
            if stage in VERIFY_STAGES:
                self._train(batch, self.verify_steps)
            clock()
        except RuntimeError as exc:  # OptimizerOutOfMemoryError too: the next trial restores the optimizer
            if not (is_oom_error(exc) or isinstance(exc, OptimizerOutOfMemoryError)):
                raise
            error, failed = exc, True
        batch = None
        if error is not None:  # outside the except block; its frames hold the failed step's tensors
            traceback.clear_frames(error.__traceback__)
            error = None
        peak = meter.peak_bytes() if meter is not None and not failed else None
        optimizer.zero_grad(set_to_none=True)
        return Trial(size, not failed, peak, time.perf_counter() - begin, stage, None if failed else ms)


def find_batch_size(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable,
    make_batch: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
    device: Union[str, torch.device] = "auto",
    dtype: Union[str, torch.dtype] = "auto",
    objective: str = "largest",
    strategy: str = "plan",
    start: int = 16,
    max_size: int = 65536,
    margin: float = 0.05,
    tolerance: float = 0.03,
    warmup: int = 1,
    steps: int = 3,
    verify_steps: int = 5,
    eval_batch_size: Optional[int] = None,
    meter: Optional[MemoryMeter] = None,
    clock: Optional[Callable[[], float]] = None,
    progress: Optional[Callable[[str], None]] = None,
    plan: Optional[bool] = None,
    **step_kwargs,
) -> BatchSizeResult:
    """Find the batch size to train this model, optimizer and dtype with on ``device``.

    Runs :func:`~ignite_amp.batch_search.search_batch_size` with real trials (``TrialRunner``):
    real AMP steps, timed, an evaluation pass, and a longer verification of the size kept.
    Model, optimizer, train/eval mode and RNG states are left as they were.

    Args:
        make_batch: ``make_batch(n) -> (x, y)`` with the real input shape (on the device, ideally).
        objective: ``"largest"`` fit, or ``"fastest"`` (the smallest batch within 3% of the best samples/s).
        strategy: ``"plan"`` (start from the memory plan, :func:`~ignite_amp.estimate_memory`; the memory
            model where the step cannot be traced fake or there is no memory meter), ``"model"`` (memory
            model) or ``"bisect"`` (doubling and bisection).
        start, max_size: the first and the largest size tried.
        margin: share of the device memory kept free.
        tolerance: how close to the best size the search must come (a share).
        warmup, steps, verify_steps: untimed and timed steps per trial; steps after the
            evaluation in a verification.
        eval_batch_size: the evaluation batch (default: the size tried).
        meter: peak-memory readings (default: CUDA's counters; none on a CPU, where the search
            falls back to doubling and bisection and takes ``margin`` off the batch size).
        clock: seconds after the device's queued work is done (default ``device_clock``).
        progress: called with a header, the table's header, then each trial's row as it finishes.
        plan: whether strategy ``"plan"`` traces the memory plan (None: with CUDA's own meter only; a
            stand-in meter measures something a plan of CUDA memory does not predict).
        step_kwargs: more :class:`~ignite_amp.step.train.AmpStep` arguments (``channels_last``, ``fp32_modules``...).

    Under data-parallel training every rank searches its own device and every rank keeps the
    smallest answer.

    Example (on a CPU: no memory meter, so doubling up to ``max_size`` and 5% off):

    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> make_batch = lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,)))
    >>> result = find_batch_size(model, opt, torch.nn.functional.cross_entropy, make_batch, device="cpu",
    ...                          dtype="float32", max_size=64)
    >>> result.batch_size, [t.size for t in result.trials], result.strategy
    (60, [16, 32, 64, 60], 'model, then bisect')
    """
    with TrialRunner(model, optimizer, loss_fn, make_batch, device=device, dtype=dtype, warmup=warmup, steps=steps,
                     verify_steps=verify_steps, eval_batch_size=eval_batch_size, meter=meter, clock=clock,
                     **step_kwargs) as runner:
        capacity = runner.capacity
        budget = None if capacity is None else (1 - margin) * capacity
        if plan is None:
            plan = meter is None and runner.device.type == "cuda"
        planned = _planned(runner, loss_fn, start, margin, step_kwargs) if strategy == "plan" and capacity and \
            plan else None
        if strategy == "plan" and planned is None:
            strategy = "model"
        trial: Callable[[int, str], Trial] = runner
        if progress is not None:
            where = f"{runner.device}" + (f", {capacity / GIB:.1f} GiB usable, {1 - margin:.0%} budget"
                                          if capacity else "")
            progress(f"batch-size search on {where} ({objective}, {strategy}):")
            progress(TABLE_HEADER)

            def shown(size: int, stage: str) -> Trial:
                result = runner(size, stage)
                progress(format_trial(result, budget))
                return result

            trial = shown

        result = search_batch_size(trial, capacity=capacity, margin=margin, strategy=strategy, objective=objective,
                                   start=start, max_size=max_size, tolerance=tolerance, planned=planned)
    if is_distributed():  # each rank searched its own device: every rank takes the smallest answer
        result = result._replace(batch_size=min_across_ranks(result.batch_size),
                                 largest_fit=min_across_ranks(result.largest_fit),
                                 reason=f"{result.reason}; the smallest of {idist.get_world_size()} processes")
    return result


def _planned(runner: TrialRunner, loss_fn: Callable, start: int, margin: float,
             step_kwargs: dict) -> Optional[Callable[[int], float]]:
    """The memory plan's peak per batch size on the runner's model and settings (traced around the largest size
    it puts under the budget), or None where the step cannot be traced fake."""
    from ignite_amp.memory_plan.plan import estimate_memory

    step = runner.engine.amp_step
    kwargs = {k: v for k, v in step_kwargs.items() if k not in ("float8_recipe", "float8_filter")}
    # the runner converted a float8 model in place already: its fake copy keeps the float8 layers
    plan = estimate_memory(runner.model, runner.optimizer, loss_fn, runner.make_batch, [start],
                           memory=runner.capacity, margin=margin, device=step.device, dtype=step.dtype, **kwargs)
    if plan.untraced or not plan.peaks:
        return None

    def planned(size: int) -> float:
        peak = plan.peak_at(size)
        if peak is None:  # one size traced (the largest fit is it, or none fits): no line to read other sizes on
            raise Untrusted(f"the plan traced batch {plan.peaks[0].batch_size} only")
        return peak

    return planned
