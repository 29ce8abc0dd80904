"""What the training and the evaluation step share: device and autocast, Ignite's hooks
(``prepare_batch``, ``model_fn``, ``model_transform``, ``output_transform``), batch chunks, and the
out-of-memory retry.
"""
import contextlib
import functools
import traceback
from typing import Any, Callable, ContextManager, Iterable, NamedTuple, Optional, Sequence, Union, cast

import torch
from ignite.engine import Engine
from torch import nn

from ignite_amp.batching import batch_size_of, chunk_sizes, prepare_batch, split_batch, split_pairs
from ignite_amp.core.collectives import any_rank, unwrap
from ignite_amp.core.config_keys import POSITIVE_INT
from ignite_amp.core.device import free_memory, is_oom_error, resolve_device, resolve_dtype
from ignite_amp.core.nested import join_chunks, to_channels_last, to_float32
from ignite_amp.errors import BatchError
from ignite_amp.step.events import AmpEvents
from ignite_amp.transforms.cuda_graphs import REDUCE_OVERHEAD, GraphGuard, check_compile
from ignite_amp.transforms.float8 import Float8Report
from ignite_amp.transforms.memory_format import choose_channels_last

__all__ = ["StepBase", "Cycle", "keep_in_fp32", "call_model", "identity", "fire_amp_event"]


def call_model(model: Callable, x: Any) -> Any:
    return model(x)


def identity(output: Any) -> Any:
    return output


def fire_amp_event(engine: Engine, event: AmpEvents) -> None:
    """Fire ``event`` on an :class:`~ignite_amp.engine.AmpEngine` (only when a handler listens), or on a plain
    Engine (e.g. ``Engine(AmpStep(...))``) that registered AmpEvents itself."""
    fire = getattr(engine, "fire_amp_event", None)
    if fire is not None:
        fire(event)
    else:
        engine.fire_event(event)


def _fp32_forward(forward: Callable, device_type: str, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(device_type=device_type, enabled=False):
        return forward(*to_float32(args), **to_float32(kwargs))


def keep_in_fp32(model: nn.Module, names: Iterable[str], device_type: str) -> None:
    """Run the named submodules with autocast disabled and float32 inputs (names of the unwrapped model)."""
    for name in names:
        try:
            module = unwrap(model).get_submodule(name)
        except AttributeError:
            raise ValueError(f"fp32_modules: the model has no submodule {name!r}") from None
        if getattr(module, "_ignite_amp_fp32", False):
            continue
        module.forward = functools.partial(_fp32_forward, module.forward, device_type)
        module._ignite_amp_fp32 = True  # type: ignore[assignment]  # torch types Module attributes as tensors/modules


def _check_micro_batches(value: Any) -> int:
    return POSITIVE_INT.argument(value, "micro_batches")


class StepBase:
    """What both steps share: device and autocast, Ignite's hooks, batch splitting, the out-of-memory retry.

    The interface handlers may use (see the architecture guide, "The step's interface"): the read-only
    properties ``model``, ``device``, ``dtype``, ``batch_size`` (of the batch in progress),
    ``oom_count``, and ``micro_batches``, the one value a handler may set. The split check reads a step through
    :class:`~ignite_amp.split_check.protocol.CheckedStep`: these, the hooks, ``module``, :meth:`count_samples`,
    :meth:`split` and :meth:`note_extra_pass`.
    """

    def __init__(
        self,
        model: nn.Module,
        device: Union[str, torch.device] = "auto",
        dtype: Union[str, torch.dtype] = "auto",
        micro_batches: int = 1,
        non_blocking: bool = True,
        channels_last: Union[bool, str] = "auto",
        compile: Union[bool, str] = False,
        fp32_modules: Sequence[str] = (),
        prepare_batch: Callable = prepare_batch,
        model_fn: Callable[[nn.Module, Any], Any] = call_model,
        model_transform: Callable[[Any], Any] = identity,
        output_transform: Optional[Callable] = None,
        batch_size: Callable[[Any, Any], int] = batch_size_of,
        split_batch: Callable[[Any, Any, int], list] = split_batch,
    ):
        self._micro_batches = _check_micro_batches(micro_batches)
        compile = check_compile(compile)  # before the model moves: a wrong value changes nothing
        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, self._device)
        for name, fn in (("prepare_batch", prepare_batch), ("model_fn", model_fn),
                         ("model_transform", model_transform), ("output_transform", output_transform),
                         ("batch_size", batch_size), ("split_batch", split_batch)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} should be a function, got {type(fn).__name__}")
        self.non_blocking = non_blocking
        self.prepare_batch = prepare_batch
        self.model_fn = model_fn
        self.model_transform = model_transform
        self.output_transform = output_transform
        self.batch_size_fn = batch_size
        self.split_batch = split_batch
        self._model = model.to(self._device)
        self._module = unwrap(self._model)
        # "auto": on CUDA for a convolutional model (ignite_amp.transforms.memory_format); why: what auto chose
        self.channels_last, self.channels_last_why = choose_channels_last(channels_last, self._module, self._device)
        if self.channels_last:
            self._model.to(memory_format=torch.channels_last)
        keep_in_fp32(self._model, fp32_modules, self._device.type)
        self._compiled: nn.Module = self._model  # the forward: the model, or torch.compile's of it
        self.graphs: Optional[GraphGuard] = None
        if compile:  # torch.compile of a module is a module (an OptimizedModule; torch types it as a callable)
            mode = REDUCE_OVERHEAD if compile == REDUCE_OVERHEAD else None
            self._compiled = cast(nn.Module, torch.compile(self._model, mode=mode))
            if mode is not None:  # CUDA graphs, falling back to the eager model (ignite_amp.transforms.cuda_graphs)
                self.graphs = GraphGuard(self._model, self._compiled)
        self.autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext
        if self._dtype != torch.float32:
            self.autocast = functools.partial(torch.autocast, device_type=self._device.type, dtype=self._dtype)
        self.float8: Optional[Float8Report] = None  # dtype="float8": the factory's report (layers converted, skipped)
        self._batch_size = 0
        self._oom_count = 0
        self._count_flops = False
        self._extra_passes = 0  # forward/backward passes run beside the step's own (the split check's): not FLOPs of it
        self._flops_per_sample: Optional[float] = None

    # -- the documented interface ------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The model the step runs (as given: DDP-wrapped under data-parallel training)."""
        return self._model

    @property
    def device(self) -> torch.device:
        """The device the model runs on and batches are moved to."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (``torch.float32``: autocast off)."""
        return self._dtype

    @property
    def module(self) -> nn.Module:
        """The model without its ``DistributedDataParallel`` wrapper (the model itself otherwise): its training
        flag and its parameters as the split check differentiates them."""
        return self._module

    @property
    def forward(self) -> nn.Module:
        """What the step's forward calls: the model, or its ``torch.compile``'d form (with
        ``compile="reduce-overhead"``, the model again once the CUDA graphs fell back)."""
        return self.graphs.forward if self.graphs is not None else self._compiled

    @property
    def batch_size(self) -> int:
        """Samples in the batch in progress (the last one, between iterations)."""
        return self._batch_size

    @property
    def oom_count(self) -> int:
        """Out-of-memory errors caught since the start (kept in checkpoints by :class:`AmpStep`)."""
        return self._oom_count

    @property
    def micro_batches(self) -> int:
        """Chunks each batch is split into; an ``OUT_OF_MEMORY`` handler raises it to retry smaller."""
        return self._micro_batches

    @micro_batches.setter
    def micro_batches(self, value: int) -> None:
        self._micro_batches = _check_micro_batches(value)

    def count_flops(self) -> None:
        """Count the next iteration's FLOPs (``torch.utils.flop_counter``: forward and backward of every
        chunk); :attr:`flops_per_sample` then holds them per sample. That one iteration runs slower
        (the counter sees every operator); an iteration retried after out of memory is counted again."""
        self._count_flops = True

    @property
    def flops_per_sample(self) -> Optional[float]:
        """FLOPs per sample of a training iteration, once :meth:`count_flops` has counted one; else None."""
        return self._flops_per_sample

    # -- the batch as the step counts and cuts it (the split check's protocol, with module) ---
    def count_samples(self, x: Any, y: Any) -> int:
        """The samples of a prepared ``(x, y)``, by the step's ``batch_size`` hook (checked: an int >= 0)."""
        if self.batch_size_fn is batch_size_of:
            first = x if torch.is_tensor(x) else None  # the usual (tensor, tensor) batch: no walk
            if first is not None and first.dim() and (y is None or (torch.is_tensor(y) and y.dim() and
                                                                    y.shape[0] == first.shape[0])):
                return first.shape[0]
            return batch_size_of(x, y)
        n = self.batch_size_fn(x, y)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise BatchError(f"batch_size should return the number of samples as an int, got {n!r}")
        return n

    def split(self, x: Any, y: Any, n: int, chunks: int) -> list:
        """``(x, y)`` of ``n`` samples cut into ``chunks`` ``(x, y)`` pieces by the step's ``split_batch`` hook."""
        if self.split_batch is split_batch:
            return split_pairs(x, y, n, chunks)
        return [tuple(p) for p in self.split_batch(x, y, chunks)]

    def note_extra_pass(self) -> None:
        """A forward and backward ran beside the step's own in this iteration (the split check's): a FLOP count
        of the iteration would include it, so :meth:`count_flops` counts the next one instead."""
        self._extra_passes += 1

    # -- the step ----------------------------------------------------------------------------
    def _prepare(self, batch: Any) -> tuple:
        prepared = self.prepare_batch(batch, self._device, self.non_blocking)
        if not isinstance(prepared, (tuple, list)) or len(prepared) != 2:
            got = f"a {type(prepared).__name__} of {len(prepared)}" if isinstance(prepared, (tuple, list)) \
                else type(prepared).__name__
            raise BatchError(f"prepare_batch should return an (x, y) pair (y may be None), got {got}")
        x, y = prepared
        if self.channels_last:
            x = to_channels_last(x)
        return x, y

    def _forward(self, x: Any) -> Any:
        """``model_transform(model_fn(model, x))`` (the caller enters autocast)."""
        if self.graphs is not None:
            self.graphs.saw(x)
        return self.model_transform(self.model_fn(self.forward, x))

    def _chunks(self, batch: tuple) -> tuple:
        """The prepared batch's ``(x, y)`` chunks and their sizes (one chunk: the batch itself)."""
        n = self._batch_size
        chunks = min(self._micro_batches, n)
        if chunks == 1:
            return [batch], (n,)
        x, y = batch
        if self.split_batch is split_batch:  # the default: n is known, the sizes follow
            return split_pairs(x, y, n, chunks), chunk_sizes(n, chunks)
        parts = self.split_batch(x, y, chunks)
        if not isinstance(parts, (list, tuple)) or not parts or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 for p in parts):
            raise BatchError(f"split_batch should return a list of (x, y) pairs, got {type(parts).__name__}")
        sizes = [self.count_samples(*p) for p in parts]
        if sum(sizes) != n:
            raise BatchError(f"split_batch: its {len(parts)} chunks hold {sum(sizes)} samples ({sizes}) by "
                             f"batch_size, the batch {n}: each sample must be in exactly one chunk")
        return list(parts), sizes

    def _joined(self, batch: tuple, parts: list, sizes: Sequence[int]) -> tuple:
        """The batch's ``(x, y)`` as its chunks hold them, in the chunks' order: a custom ``split_batch`` may
        reorder rows, and outputs joined from the chunks must meet their own targets (the default keeps the order)."""
        if len(parts) == 1 or self.split_batch is split_batch:
            return batch
        return join_chunks([p[0] for p in parts], sizes), join_chunks([p[1] for p in parts], sizes)

    def _size_of(self, engine: Engine, batch: tuple) -> int:
        n = self.count_samples(*batch)
        if n == 0:
            raise BatchError(f"batch: an empty batch (0 samples) at iteration {engine.state.iteration}")
        return n

    def __call__(self, engine: Engine, batch: Any) -> Any:
        batch = self._prepare(batch)  # sized and cut after prepare_batch, from what it returned
        self._batch_size = self._size_of(engine, batch)
        if self._count_flops and self.forward is self._model:  # a compiled forward hides its operators
            from torch.utils.flop_counter import FlopCounterMode

            self._count_flops, ooms, extra = False, self._oom_count, self._extra_passes
            counter = FlopCounterMode(display=False)
            with counter:
                output = self._attempts(engine, batch)
            if self._oom_count != ooms or self._extra_passes != extra:
                self._count_flops = True  # a retry or the split check was counted too: count the next iteration
            elif counter.get_total_flops():  # 0: no operator the counter knows (matmul, convolution...)
                self._flops_per_sample = counter.get_total_flops() / self._batch_size
            return output
        return self._attempts(engine, batch)

    def _attempts(self, engine: Engine, batch: Any) -> Any:
        while True:
            agree = self._agrees_on_oom()
            output, error = None, None
            try:
                output = self._run(engine, batch, defer=agree)
            except RuntimeError as exc:
                if not is_oom_error(exc):
                    raise
                error = exc
            if agree and any_rank(error is not None) and error is None:
                error = torch.OutOfMemoryError("out of memory on another rank: every rank retries together")
            if error is None:
                return self._complete(engine, output) if agree else output
            # Outside the except block. The traceback's frames still hold the failed step's
            # activations: clear their locals (the lines stay for the re-raise), then free.
            traceback.clear_frames(error.__traceback__)
            output = None
            self._recover(engine)
            if self.graphs is not None:
                self.graphs.fall_back("out of memory: the graphs' memory pools hold what the retry needs")
            free_memory(self._device)
            self._oom_count += 1
            before = min(self._micro_batches, self._batch_size)
            engine.fire_event(AmpEvents.OUT_OF_MEMORY)
            if min(self._micro_batches, self._batch_size) <= before:
                raise error  # nothing made the chunks smaller: retrying would fail the same way
            del error

    def _agrees_on_oom(self) -> bool:
        """Whether this step must agree with the other ranks before communicating (see AmpStep)."""
        return False

    def _run(self, engine: Engine, batch: Any, defer: bool = False) -> Any:
        raise NotImplementedError

    def _complete(self, engine: Engine, output: Any) -> Any:
        return output

    def _recover(self, engine: Engine) -> None:
        pass


class Cycle(NamedTuple):
    """Where an iteration stands in its accumulation cycle."""

    first: bool  # the cycle's first iteration: gradients are zeroed
    last: bool  # the cycle's last iteration: the optimizer steps
    length: int  # iterations in this cycle (fewer than accumulation_steps at an epoch's end)
