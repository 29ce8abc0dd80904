"""What the training and the evaluation step share: device and autocast, Ignite's hooks
(``prepare_batch``, ``model_fn``, ``model_transform``, ``output_transform``), batch chunks, and the
out-of-memory retry.
"""
import contextlib
import functools
import traceback
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence, Union

import torch
from ignite.engine import Engine
from ignite.utils import apply_to_type
from torch import nn

from ignite_amp.batching import batch_size_of, chunk_sizes, prepare_batch, split_batch, to_channels_last
from ignite_amp.collectives import any_rank, unwrap
from ignite_amp.device import free_memory, is_oom_error, resolve_device, resolve_dtype
from ignite_amp.events import AmpEvents
from ignite_amp.fields import POSITIVE_INT

__all__ = ["StepBase", "Cycle", "keep_in_fp32", "call_model", "identity"]


def call_model(model: Callable, x: Any) -> Any:
    return model(x)


def identity(output: Any) -> Any:
    return output


def _fp32_forward(forward: Callable, device_type: str, *args: Any, **kwargs: Any) -> Any:
    def to_float32(value: torch.Tensor) -> torch.Tensor:
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value

    with torch.autocast(device_type=device_type, enabled=False):
        return forward(*apply_to_type(args, torch.Tensor, to_float32), **apply_to_type(kwargs, torch.Tensor, to_float32))


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
        module._ignite_amp_fp32 = True


def _check_micro_batches(value: Any) -> int:
    return POSITIVE_INT.argument(value, "micro_batches")


class StepBase:
    """What both steps share: device and autocast, Ignite's hooks, batch splitting, the out-of-memory retry.

    The interface handlers may use (see the README, "The step's interface"): the read-only
    properties ``model``, ``device``, ``dtype``, ``batch_size`` (of the batch in progress),
    ``oom_count``, and ``micro_batches``, the one value a handler may set.
    """

    def __init__(
        self,
        model: nn.Module,
        device: Union[str, torch.device] = "auto",
        dtype: Union[str, torch.dtype] = "auto",
        micro_batches: int = 1,
        non_blocking: bool = True,
        channels_last: bool = False,
        compile: bool = False,
        fp32_modules: Sequence[str] = (),
        prepare_batch: Callable = prepare_batch,
        model_fn: Callable[[nn.Module, Any], Any] = call_model,
        model_transform: Callable[[Any], Any] = identity,
        output_transform: Optional[Callable] = None,
    ):
        self._micro_batches = _check_micro_batches(micro_batches)
        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, self._device)
        for name, fn in (("prepare_batch", prepare_batch), ("model_fn", model_fn),
                         ("model_transform", model_transform), ("output_transform", output_transform)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} should be a function, got {type(fn).__name__}")
        self.non_blocking = non_blocking
        self.channels_last = channels_last
        self.prepare_batch = prepare_batch
        self.model_fn = model_fn
        self.model_transform = model_transform
        self.output_transform = output_transform
        self._model = model.to(self._device)
        self._module = unwrap(self._model)
        if channels_last:
            self._model.to(memory_format=torch.channels_last)
        keep_in_fp32(self._model, fp32_modules, self._device.type)
        self.forward = torch.compile(self._model) if compile else self._model
        if self._dtype == torch.float32:
            self.autocast = contextlib.nullcontext
        else:
            self.autocast = functools.partial(torch.autocast, device_type=self._device.type, dtype=self._dtype)
        self.float8 = None  # dtype="float8": the factory's Float8Report (layers converted and skipped)
        self._batch_size = 0
        self._oom_count = 0
        self._count_flops = False
        self._flops_per_sample: Optional[float] = None

    # -- the documented interface ------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The model the step runs (as given: DDP-wrapped under data-parallel training)."""
        return self._model

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (``torch.float32``: autocast off)."""
        return self._dtype

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

    # -- the step ----------------------------------------------------------------------------
    def _inputs(self, chunk: Any):
        x, y = self.prepare_batch(chunk, self._device, self.non_blocking)
        if self.channels_last:
            x = to_channels_last(x)
        return x, y

    def _forward(self, x: Any) -> Any:
        """``model_transform(model_fn(model, x))`` (the caller enters autocast)."""
        return self.model_transform(self.model_fn(self.forward, x))

    def _chunks(self, batch: Any) -> tuple:
        """The batch's chunks and their sizes."""
        n = self._batch_size
        chunks = min(self._micro_batches, n)
        return split_batch(batch, chunks), (chunk_sizes(n, chunks) if chunks > 1 else (n,))

    def _size_of(self, engine: Engine, batch: Any) -> int:
        # Fast path for the usual (x, y) batch; batch_size_of walks any nesting.
        first = batch[0] if type(batch) in (tuple, list) and batch else batch
        n = first.shape[0] if torch.is_tensor(first) and first.dim() else batch_size_of(batch)
        if n == 0:
            raise ValueError(f"batch: an empty batch (0 samples) at iteration {engine.state.iteration}")
        return n

    def __call__(self, engine: Engine, batch: Any) -> Any:
        self._batch_size = self._size_of(engine, batch)
        if self._count_flops and self.forward is self._model:  # a compiled forward hides its operators
            from torch.utils.flop_counter import FlopCounterMode

            self._count_flops, ooms = False, self._oom_count
            counter = FlopCounterMode(display=False)
            with counter:
                output = self._attempts(engine, batch)
            if self._oom_count != ooms:
                self._count_flops = True  # a retry was counted too: count the next iteration
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
