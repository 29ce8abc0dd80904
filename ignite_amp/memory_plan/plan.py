"""Memory before the run: the peak memory of one training step, traced under fake tensors, by kind.

:func:`estimate_memory` runs the run's own :class:`~ignite_amp.AmpStep` (autocast dtype, GradScaler,
micro-batches, accumulation, activation checkpointing, float8, channels_last) on a copy of the model whose
tensors are ``torch._subclasses.fake_tensor.FakeTensor`` s (shapes and devices, no storage), with the
optimizer's state as after its first step, and counts what it allocates with torch's own
``torch.distributed._tools.mem_tracker.MemTracker``: parameters, buffers, gradients, optimizer state,
activations, temporaries (the backward's) and the batch. The user's model and optimizer are not touched:
their parameters are stood in for by fake tensors of the same shape, dtype and strides.

What the trace does not count is :data:`~ignite_amp.memory_plan.plan.NOT_COUNTED`; the plan keeps a share of the
memory free for it (``margin``). A model that cannot run on fake tensors (shapes that depend on values) gets a plan
of what is known without running it: weights, gradients and optimizer state.
"""
import dataclasses
import logging
import math
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ignite_amp.core.device import resolve_device
from ignite_amp.errors import first_line
from ignite_amp.memory_plan.cuda_extras import LIBRARIES, library_workspace_bytes
from ignite_amp.memory_plan.fake_step import KINDS, FakeStep

__all__ = ["estimate_memory", "MemoryPlan", "StepPeak", "KINDS", "NOT_COUNTED", "DEFAULT_MARGIN", "parse_bytes",
           "format_bytes"]

logger = logging.getLogger("ignite_amp")

#: What a plan does not count; :data:`~ignite_amp.memory_plan.plan.DEFAULT_MARGIN` of the memory is kept free for it.
#: (cuBLAS's workspaces are counted on a GPU: measured there, ``ignite_amp.memory_plan.cuda_extras``.)
NOT_COUNTED = ("the CUDA caching allocator's fragmentation, cuDNN's convolution workspaces (chosen at run time), "
               "NCCL buffers, the CUDA context, torch.compile's changes to the step")
#: The share of the memory a plan keeps free for what it does not count
#: (:data:`~ignite_amp.memory_plan.plan.NOT_COUNTED`).
DEFAULT_MARGIN = 0.15
_MAX_SIZE = 2 ** 24  # the largest batch the fit search tries
_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: Union[str, int, float]) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"`` or a number of bytes, as bytes (a ValueError names the forms).

    >>> parse_bytes("80GiB") == 80 * 2 ** 30, parse_bytes("1.5 GB")
    (True, 1500000000)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        found = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)([a-z]*)", str(text).strip().lower().replace(" ", ""))
        value, unit = (float(found[1]), found[2]) if found else (math.nan, "")
    if unit not in _UNITS or not value > 0 or math.isinf(value) or value * _UNITS[unit] < 1:
        raise ValueError(f"memory: expected a size such as 80GiB, 24GB or 512MiB (at least a byte), got {text!r}")
    return int(value * _UNITS[unit])


def format_bytes(n: Optional[float]) -> str:
    """Bytes in MiB or GiB, for tables: ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    if n is None:
        return "-"
    return f"{n / 2 ** 30:.2f} GiB" if abs(n) >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


#: A kind's column heading in the plan's table (short, so that the table fits 80 columns): ``inputs`` is the
#: batch's own tensors, apart from the ``batch`` (size) column.
HEADINGS = {"parameters": "params", "gradients": "grads", "optimizer state": "optimizer", "temporaries": "temps",
            "batch": "inputs", LIBRARIES: "cuBLAS"}


def _table(kinds: List[str], rows: List[Tuple[str, Optional[int], Dict[str, int]]], fixed: int) -> List[str]:
    """The peaks by kind as aligned columns in one unit (MiB, or GiB from 100 GiB on): a row per batch size; a
    kind that is 0.0 in every row is left out (the JSON has every kind)."""
    largest = max([peak or fixed for _, peak, _ in rows] + [fixed])
    unit, scale = ("GiB", 2 ** 30) if largest >= 100 * 2 ** 30 else ("MiB", 2 ** 20)
    kinds = [k for k in kinds if any(at.get(k, 0) >= scale / 20 for _, _, at in rows)]  # not all 0.0
    cells = [["batch", "peak", *(HEADINGS.get(k, k) for k in kinds)]]
    for size, peak, at in rows:
        cells.append([size, f"{peak / scale:.1f}" if peak is not None else f">={fixed / scale:.1f}",
                      *(f"{at.get(k, 0) / scale:.1f}" for k in kinds)])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [f"{unit} at the step's peak, by kind (inputs: the batch's tensors):"] + [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in cells]


@dataclasses.dataclass
class StepPeak:
    """The peak of one planned step: its batch size, the peak in bytes, and the bytes of each kind at the peak."""

    batch_size: int  #: samples per batch
    peak: int  #: bytes at the step's peak
    kinds: Dict[str, int]  #: bytes of each of :data:`~ignite_amp.memory_plan.plan.KINDS` at that moment
    flops: Optional[int] = None  #: FLOPs of the step (``ignite_amp.memory_plan.flops``)


@dataclasses.dataclass
class MemoryPlan:
    """What :func:`estimate_memory` found: a :class:`~ignite_amp.memory_plan.plan.StepPeak` per batch size, and the
    largest batch that fits."""

    device: str  #: the device the step was traced for
    peaks: List[StepPeak]  #: one per batch size traced, in increasing size (empty when not traced)
    fixed: Dict[str, int]  #: parameters, buffers, gradients and optimizer state: known even without a trace
    margin: float  #: the share of ``memory`` kept free for what the plan does not count
    memory: Optional[int] = None  #: the memory planned for, in bytes (None: none given)
    largest_fit: Optional[int] = None  #: the largest batch whose peak is within (1 - margin) x memory
    untraced: Optional[str] = None  #: why the step could not be traced fake (None: it was)
    checkpointed: List[str] = dataclasses.field(default_factory=list)  #: blocks checkpointed in the plan
    auto_checkpointing: Optional[str] = None  #: what ``activation_checkpointing: auto`` chose, in a line
    #: the peak of a cut batch that also runs the split check (the first few cut batches do), ``(batch size,
    #: bytes)`` (None: no check runs); the peaks above are the steady step's
    split_check: Optional[tuple] = None
    #: the training samples a process has (None: unknown): a larger batch than that is capped by the data set
    data_samples: Optional[int] = None

    @property
    def budget(self) -> Optional[float]:
        """The bytes a step may peak at: ``(1 - margin) * memory``."""
        return None if self.memory is None else (1 - self.margin) * self.memory

    def peak_at(self, batch_size: int) -> Optional[int]:
        """The planned peak at ``batch_size`` (traced, or on the line through the nearest traced sizes)."""
        known = {p.batch_size: p.peak for p in self.peaks}
        if batch_size in known or len(known) < 2:
            return known.get(batch_size)
        sizes = sorted(known)
        lo = max([s for s in sizes if s < batch_size], default=sizes[0])
        hi = min([s for s in sizes if s > lo and s >= batch_size], default=None)
        if hi is None:
            lo, hi = sizes[-2], sizes[-1]
        slope = (known[hi] - known[lo]) / (hi - lo)
        return int(known[lo] + slope * (batch_size - lo))

    def lines(self) -> List[str]:
        """The plan as text: a table of the peaks by kind, what fits, and what it does not count."""
        out = [f"memory plan of one training step on {self.device} (fake tensors: nothing allocated)"]
        if self.untraced:
            out.append(f"the step could not be traced fake ({self.untraced}); known without running it:")
        if self.auto_checkpointing:
            out.append(self.auto_checkpointing)
        elif self.checkpointed:
            out.append(f"activation checkpointing: {len(self.checkpointed)} blocks")
        kinds = [k for k in (*KINDS, LIBRARIES) if any(p.kinds.get(k) for p in self.peaks)] or list(self.fixed)
        rows: List[Tuple[str, Optional[int], Dict[str, int]]] = [(str(p.batch_size), p.peak, p.kinds)
                                                                 for p in self.peaks]
        out += _table(kinds, rows or [("any", None, self.fixed)], sum(self.fixed.values()))
        if self.memory is not None:
            fit = ("unknown (not traced)" if self.largest_fit is None else "no batch size" if self.largest_fit == 0
                   else f"batch {self.largest_fit} or more (the search stops there)" if self.largest_fit >= _MAX_SIZE
                   else f"batch {self.largest_fit}")
            if self.largest_fit and self.data_samples and self.largest_fit > self.data_samples:  # capped by the data
                fit = f"all the data set's {self.data_samples:,} training samples; the memory would fit {fit}"
            out.append(f"largest batch that fits {format_bytes(self.memory)} less {self.margin:.0%}: {fit}")
            if self.device == "cpu":
                out.append("traced on the CPU: for a GPU, plan where it is (autocast's operator lists and the "
                           "optimizer's step, foreach or fused, differ a little on CUDA)")
        if self.split_check is not None:
            size, peak = self.split_check
            out.append(f"the first cut batches also run the split check: peak {format_bytes(peak)} at batch {size} "
                       f"(an out-of-memory error in it is retried on a smaller part of a later batch, then the loss "
                       f"is left unchecked with a warning; the peaks above are the steady step's)")
        out.append(f"not counted: {NOT_COUNTED}; the plan keeps {self.margin:.0%} of the memory free for them")
        return out

    def to_dict(self) -> dict:
        """The plan as JSON-ready data (``ignite-amp plan --json``)."""
        data = dataclasses.asdict(self)
        data.update(budget=self.budget, not_counted=NOT_COUNTED)
        return data


def estimate_memory(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                    batch: Any, batch_sizes: Sequence[int] = (1, 8, 32), memory: Union[None, int, float, str] = None,
                    margin: float = DEFAULT_MARGIN, device: Union[str, torch.device] = "auto",
                    fit: bool = True, progress: Optional[Callable[[StepPeak], None]] = None,
                    checkpoint: Union[Sequence[str], Dict[str, str]] = (),
                    **step_kwargs: Any) -> MemoryPlan:
    """The peak memory of one training step of this model, optimizer and step settings, per batch size.

    Nothing is allocated and the model and optimizer are left as they are: the step runs on fake copies.

    Args:
        model: the model (unwrapped: not DDP, not sharded).
        optimizer: its optimizer; a fresh one is planned with its state as after its first step.
        loss_fn: the step's ``loss_fn``.
        batch: ``batch(n) -> a batch of n samples`` (as the loader yields it, e.g.
            ``lambda n: (torch.randn(n, 3, 224, 224), torch.randint(0, 1000, (n,)))``; called under fake
            tensors, so it allocates nothing), or one example batch whose per-sample tensors are resized.
        batch_sizes: the sizes to trace.
        memory: bytes (or ``"80GiB"``) to fit; ``None``: the GPU's free memory when the device is a GPU.
        margin: the share of ``memory`` kept free for what the plan does not count
            (:data:`~ignite_amp.memory_plan.plan.NOT_COUNTED`).
        device: the device the run uses (a plan for a GPU needs one: without a CUDA device torch's fake
            backward fails).
        fit: with a memory, trace further sizes to find :attr:`~ignite_amp.memory_plan.plan.MemoryPlan.largest_fit`.
        progress: called with each :class:`~ignite_amp.memory_plan.plan.StepPeak` as it is traced.
        checkpoint: module paths of blocks planned as checkpointed, or ``{path: "full" | "selective"}`` (on the
            copy; see :func:`~ignite_amp.memory_plan.auto_checkpoint.checkpoint_to_fit`).
        step_kwargs: :func:`~ignite_amp.create_amp_trainer`'s arguments (``dtype``, ``accumulation_steps``,
            ``micro_batches``, ``activation_checkpointing``, ``channels_last``, ``fp32_modules``, ``float8_recipe``,
            ``prepare_batch``, ``model_fn``, ...); ``compile`` is planned as off.

    Example:
        >>> import torch
        >>> from ignite_amp.memory_plan.plan import estimate_memory
        >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> plan = estimate_memory(model, opt, torch.nn.functional.cross_entropy,
        ...                        lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        ...                        batch_sizes=[4, 8], device="cpu", dtype="bfloat16", memory="1GiB")
        >>> plan.peaks[0].batch_size, plan.peaks[0].kinds["parameters"], plan.largest_fit > 1000
        (4, 122920, True)
    """
    sizes = sorted({int(n) for n in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"Argument batch_sizes should hold positive integers, got {list(batch_sizes)!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"Argument margin should be in [0, 1), got {margin!r}")
    device = resolve_device(device)
    if memory is None and device.type == "cuda":
        memory = torch.cuda.mem_get_info(device)[0]
    memory = None if memory is None else parse_bytes(memory)
    tracer = FakeStep(model, optimizer, loss_fn, batch, device, step_kwargs, checkpoint)
    plan = MemoryPlan(str(device), [], tracer.fixed(), margin, memory)
    traced: Dict[int, StepPeak] = {}
    libraries = library_workspace_bytes(device)  # on a GPU: held from the first matmul on, at every peak

    def trace(n: int) -> StepPeak:
        if n not in traced:
            try:
                peak, kinds, flops = tracer.trace(n)
            except ValueError as exc:  # BatchNorm in training: nothing to normalise over
                if n == 1 and "more than 1 value per channel" in str(exc):
                    raise _OneSample(f"batch 1: {type(model).__name__} cannot train on one sample "
                                     f"({first_line(exc)}); plan batch sizes of 2 or more") from None
                raise
            if libraries:
                peak, kinds = peak + libraries, {**kinds, LIBRARIES: libraries}
            traced[n] = StepPeak(n, peak, kinds, flops)
            if progress is not None:
                progress(traced[n])
        return traced[n]

    try:
        for n in sizes:
            trace(n)
        if plan.budget is not None and fit:  # a budget: a memory was given or read
            plan.largest_fit = _largest_fit(trace, plan.budget, sizes)
        if fit and tracer.checks_split:  # planned apart: a one-time cost, not the step's
            size = max(2, sizes[0])
            plan.split_check = (size, tracer.trace(size, check=True)[0] + libraries)
    except _OneSample:
        raise
    except Exception as exc:  # shapes that depend on values, an operator with no fake kernel
        if not traced:
            plan.untraced = f"{type(exc).__name__}: {first_line(exc)}"
            logger.info("memory plan: %s cannot be traced with fake tensors (%s); the plan counts weights, "
                        "gradients and optimizer state only", type(model).__name__, plan.untraced)
        else:
            raise
    shown = set(sizes) | ({plan.largest_fit} if plan.largest_fit else set())
    plan.peaks = [traced[n] for n in sorted(traced) if n in shown]
    plan.checkpointed = tracer.checkpointed
    return plan


class _OneSample(ValueError):
    """Batch 1 cannot train the model (BatchNorm in training needs more than one value per channel)."""


def _largest_fit(trace: Callable[[int], StepPeak], budget: float, sizes: List[int], max_traces: int = 8,
                 tolerance: float = 0.01, max_size: int = _MAX_SIZE) -> int:
    """The largest batch whose traced peak is within ``budget`` (to ``tolerance``; 0: not even the smallest batch
    that trains, 1, or 2 with BatchNorm): the line through the two largest traced sizes aims until a size
    misses, then the secant between the largest fit and the smallest miss (the peak is close to a line in the
    batch size above the optimizer step's)."""
    points = {n: trace(n).peak for n in sizes}
    smallest = 1
    for _ in range(max_traces):
        lo = max((n for n, p in points.items() if p <= budget), default=0)
        hi = min((n for n, p in points.items() if p > budget), default=None)
        if hi is not None and (hi - lo <= max(1, math.floor(lo * tolerance)) or hi <= smallest) or lo >= max_size:
            return lo
        if lo == 0 and smallest not in points:
            target = smallest
        elif lo == 0 and hi is not None:  # nothing fits, so every traced size misses: hi is the smallest of them
            target = max(smallest, hi // 2)
        elif hi is None:  # (lo > 0: with lo 0 the smallest batch was traced and missed, so hi is set)
            (n0, p0), (n1, p1) = sorted(points.items())[-2:] if len(points) >= 2 else ((0, 0.0), (lo, points[lo]))
            slope = (p1 - p0) / (n1 - n0)
            target = n1 * 64 if slope <= 0 else math.floor(n1 + (budget - p1) / slope)
            target = min(max(target, lo + 1), n1 * 64, max_size)
        else:
            target = math.floor(lo + (budget - points[lo]) * (hi - lo) / (points[hi] - points[lo]))
            step = max(1, math.floor(lo * tolerance))
            target = min(max(target, lo + step), hi - 1)  # a fit at the line's size: one step above it brackets
        try:
            points[target] = trace(target).peak
        except _OneSample:  # BatchNorm: the smallest batch that trains is 2
            smallest = 2
    return max((n for n, p in points.items() if p <= budget), default=0)
