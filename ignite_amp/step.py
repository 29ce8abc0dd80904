"""The AMP step: the one place that knows the autocast + GradScaler order.

``AmpStep`` is an Ignite process function. Per batch it runs::

    zero_grad(set_to_none)            # first iteration of an accumulation cycle
    for each micro-batch:
        autocast: forward + loss
        scaler.scale(loss * share).backward()
    on stepping iterations (the last of a cycle, and the last of an epoch):
        scaler.unscale_(optimizer)     # float16: read the inf/NaN flag once (one host sync)
        grad_norm                      # when a handler asked for it: pre-clip L2 norm, on device
        fire GRADS_READY               # only when the gradients are finite
        optimizer.step()               # only when the gradients are finite
        scaler.update()
        fire OPTIMIZER_STEPPED or STEP_SKIPPED

While a ``torch.profiler`` records, the forward (with the loss), the backward and the optimizer
part (unscale, ``GRADS_READY`` handlers, step, update) are labelled ``ignite_amp.forward``,
``ignite_amp.backward`` and ``ignite_amp.optimizer`` (:func:`phase_label`); otherwise they cost nothing.

An out-of-memory error in the forward or backward (or in a ``GRADS_READY`` handler) is
caught, the memory freed outside the ``except`` block, and ``OUT_OF_MEMORY`` fired; a handler
that raises ``micro_batches`` makes the step retry the same batch, otherwise the original error
is re-raised. One inside ``optimizer.step()`` is never retried (the update may be half applied,
and smaller micro-batches would not shrink it): :class:`OptimizerOutOfMemoryError`.

With a ``DistributedDataParallel`` model, every backward but the last of an optimizer step
runs under ``no_sync``. With out-of-memory agreement switched on (:attr:`AmpStep.oom_agreement`,
which ``OOMBackoff`` sets on every rank) all backward passes run under ``no_sync``; the ranks
then agree whether any ran out of memory (``any_rank``), and only when none did are the
gradients all-reduced and the optimizer stepped, so a retry never leaves another rank waiting
in a collective.
"""
import contextlib
import functools
import gc
import logging
import traceback
from typing import Any, Callable, Iterable, List, Optional, Sequence, Union

import torch
from ignite.base.mixins import Serializable
from ignite.engine import Engine, Events, EventsList
from ignite.engine import _prepare_batch as ignite_prepare_batch
from ignite.utils import apply_to_type
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ignite_amp.collectives import all_reduce_gradients, any_rank, broadcast_buffers, is_distributed, unwrap
from ignite_amp.errors import RUN_STOPPED, OptimizerOutOfMemoryError
from ignite_amp.events import AmpEvents

__all__ = [
    "AmpStep",
    "EvalStep",
    "create_amp_trainer",
    "create_amp_evaluator",
    "amp_step_of",
    "resolve_device",
    "resolve_dtype",
    "describe_device",
    "is_oom_error",
    "split_batch",
    "batch_size_of",
    "free_memory",
    "found_inf",
    "phase_label",
]

logger = logging.getLogger("ignite_amp")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(device: Union[str, torch.device, None] = "auto") -> torch.device:
    """``"auto"`` (or None) is CUDA when available, else CPU; anything else goes to ``torch.device``.

    A CUDA device always gets its index (``cuda`` -> ``cuda:<current>``): some CUDA calls (the
    per-process memory fraction) refuse a device without one. A device that is not there (no CUDA,
    ``cuda:1`` on a one-GPU machine, no MPS/XPU) is a ValueError naming it.
    """
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {str(device)!r} was asked for but this machine has {count} CUDA "
                             f"device{'s' if count != 1 else ''} (cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
        return _indexed(device)
    backend = getattr(torch.backends, device.type, None) if device.type == "mps" else getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but {device.type} is not available here")
    return device


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index (``cuda`` -> ``cuda:<current>``); other devices as they are."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu``: the device with its index and, for a GPU, its model."""
    device = _indexed(torch.device(device))
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device.index)})"


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bfloat16 instructions (AVX512-BF16 or AMX); False when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.lru_cache(maxsize=None)
def _warn_slow_cpu_bf16() -> None:
    logger.warning("this CPU has no native bfloat16 instructions: bfloat16 autocast will work, but slowly")


def resolve_dtype(dtype: Union[str, torch.dtype] = "auto", device: Union[str, torch.device] = "cpu") -> torch.dtype:
    """Turn ``auto | float16 | bfloat16 | float32`` (or a torch dtype) into a torch dtype.

    ``auto``: bfloat16 where the device has it natively (Ampere and newer GPUs), else float16
    on CUDA (pre-Ampere GPUs only emulate bfloat16, slowly); bfloat16 on CPU (with one log line
    when the CPU lacks native bfloat16 and it will be slow).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype should be one of auto, {', '.join(DTYPES)}; got {dtype}")
        return dtype
    device = torch.device(device)
    if dtype == "auto":
        if device.type == "cuda":
            native = torch.cuda.is_bf16_supported(including_emulation=False)
            return torch.bfloat16 if native else torch.float16
        if device.type == "cpu":
            if not cpu_has_native_bf16():
                _warn_slow_cpu_bf16()
            return torch.bfloat16
        return torch.float16
    if dtype not in DTYPES:
        raise ValueError(f"dtype should be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def is_oom_error(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and a RuntimeError whose text says memory ran out.

    Illegal memory accesses and every other error are not out-of-memory errors.
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, RUN_STOPPED):  # ours say "out of memory" too
        return False
    text = str(exc).lower()
    return "out of memory" in text or "alloc_failed" in text


def free_memory(device: torch.device) -> None:
    """Collect garbage and give cached blocks of the device's allocator back."""
    gc.collect()
    backend = getattr(torch, torch.device(device).type, None)
    if torch.device(device).type != "cpu" and hasattr(backend, "empty_cache"):
        backend.empty_cache()


def batch_size_of(batch: Any) -> int:
    """Length of the first tensor found in a (nested) batch."""
    if torch.is_tensor(batch):
        return batch.shape[0]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            try:
                return batch_size_of(item)
            except TypeError:
                continue
    raise TypeError(f"cannot find a tensor in the batch (got {type(batch).__name__})")


def split_batch(batch: Any, chunks: int) -> List[Any]:
    """Split every tensor of a (nested) batch along dim 0 into ``chunks`` near-equal parts.

    Chunks are views (no copy), so a pinned batch stays pinned.
    """
    if chunks == 1:
        return [batch]
    if torch.is_tensor(batch):
        return list(torch.tensor_split(batch, chunks))
    if isinstance(batch, dict):
        parts = {k: split_batch(v, chunks) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(chunks)]
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(v, chunks) for v in batch]
        return [type(batch)(p[i] for p in parts) if isinstance(batch, list) else tuple(p[i] for p in parts)
                for i in range(chunks)]
    return [batch] * chunks


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The inf/NaN flag that ``scaler.unscale_(optimizer)`` recorded, summed over devices (a device tensor).

    torch has no public accessor for it; ``GradScaler.step`` reads the same private state. This
    is the one place that does, and ``tests/test_step.py`` fails loudly if a torch upgrade
    changes it.
    """
    flags = scaler._found_inf_per_device(optimizer)  # private: {device: 1-element float tensor}
    if not flags:
        raise RuntimeError("GradScaler recorded no inf/NaN check for this optimizer: call unscale_ first "
                           "(or torch changed GradScaler's internals)")
    values = list(flags.values())
    return values[0] if len(values) == 1 else torch.stack([v.to(values[0].device) for v in values]).sum()


_NO_LABEL = contextlib.nullcontext()


def _no_label(name: str) -> contextlib.nullcontext:
    return _NO_LABEL


def phase_label() -> Callable[[str], Any]:
    """``torch.profiler.record_function`` while a profiler records, else a no-op label.

    A ``record_function`` range costs microseconds even with no profiler running; the check
    (``torch.autograd._profiler_enabled``, what torch's own fast paths read) costs about 0.1 us.
    ``tests/test_step.py`` fails loudly if a torch upgrade changes it.
    """
    return torch.profiler.record_function if torch.autograd._profiler_enabled() else _no_label


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
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"micro_batches should be a positive integer, got {value!r}")
    return value


class _RetryingStep:
    """Batch splitting, device transfer and the out-of-memory retry shared by both steps.

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
        prepare_batch: Callable = ignite_prepare_batch,
    ):
        self._micro_batches = _check_micro_batches(micro_batches)
        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, self._device)
        self.non_blocking = non_blocking
        self.channels_last = channels_last
        self.prepare_batch = prepare_batch
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
        self._batch_size = 0
        self._oom_count = 0

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

    # -- the step ----------------------------------------------------------------------------
    def _inputs(self, chunk: Any):
        x, y = self.prepare_batch(chunk, self._device, self.non_blocking)
        if self.channels_last and torch.is_tensor(x) and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def _size_of(self, engine: Engine, batch: Any) -> int:
        # Fast path for the usual (x, y) batch; batch_size_of walks any nesting.
        first = batch[0] if type(batch) in (tuple, list) and batch else batch
        n = first.shape[0] if torch.is_tensor(first) else batch_size_of(batch)
        if n == 0:
            raise ValueError(f"batch: an empty batch (0 samples) at iteration {engine.state.iteration}")
        return n

    def __call__(self, engine: Engine, batch: Any) -> Any:
        self._batch_size = self._size_of(engine, batch)
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


class AmpStep(_RetryingStep, Serializable):
    """Ignite process function for a mixed-precision training step.

    Args:
        model: the model; moved to ``device``.
        optimizer: its optimizer (at least one of its parameters must be the model's).
        loss_fn: ``loss_fn(y_pred, y)`` returning a mean-reduced scalar (micro-batches and
            accumulation weight each chunk's mean by its share of the samples).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``.
        dtype: ``auto | float16 | bfloat16 | float32``. A ``GradScaler`` is enabled only for float16.
        accumulation_steps: iterations whose gradients add up before one optimizer step. A cycle
            never crosses an epoch boundary: the epoch's last iteration steps.
        micro_batches: equal chunks each batch is split into; the gradient equals the full batch's.
        non_blocking: asynchronous host-to-device copies (pair with a pinned-memory loader).
        channels_last: model and 4-d inputs in channels-last memory format.
        compile: run the forward through ``torch.compile``.
        fp32_modules: names of submodules run outside autocast with float32 inputs.
        prepare_batch: ``prepare_batch(batch, device, non_blocking) -> (x, y)``.
        scaler_kwargs: extra arguments for ``torch.amp.GradScaler`` (e.g. ``init_scale``).
        scaler: force the scaler on or off (default: on for float16 only); ``ignite-amp compare``
            uses it to show float16 without a scaler.

    ``engine.state.output`` is ``{"loss": <detached 0-d tensor>, "batch_size": int}``.

    Besides the properties of every step, handlers may read ``optimizer``, ``scaler``,
    ``accumulation_steps``, ``grad_norm`` (after :meth:`track_grad_norm`) and set
    ``oom_agreement``.
    """

    _state_dict_all_req_keys = ("scaler", "micro_batches")

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        device: Union[str, torch.device] = "auto",
        dtype: Union[str, torch.dtype] = "auto",
        accumulation_steps: int = 1,
        micro_batches: int = 1,
        non_blocking: bool = True,
        channels_last: bool = False,
        compile: bool = False,
        fp32_modules: Sequence[str] = (),
        prepare_batch: Callable = ignite_prepare_batch,
        scaler_kwargs: Optional[dict] = None,
        scaler: Optional[bool] = None,
    ):
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps should be a positive integer, got {accumulation_steps!r}")
        _check_optimizer(optimizer, model)
        _check_mean_reduction(loss_fn)
        super().__init__(model, device, dtype, micro_batches, non_blocking, channels_last, compile,
                         fp32_modules, prepare_batch)
        self._optimizer = optimizer
        self._params = list(self._model.parameters())  # a list: walking the module tree per step costs
        self.loss_fn = loss_fn
        self._accumulation_steps = accumulation_steps
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        if self.ddp is not None:
            _no_buffer_sync_in_forward(self.ddp)
        self._scaler = torch.amp.GradScaler(
            self._device.type, enabled=self._dtype == torch.float16 if scaler is None else scaler,
            **(scaler_kwargs or {}),
        )
        self.oom_agreement = False
        self._track_norm = False
        self._grad_norm: Optional[torch.Tensor] = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The ``GradScaler`` (enabled for float16 only; a disabled one is a no-op)."""
        return self._scaler

    @property
    def accumulation_steps(self) -> int:
        return self._accumulation_steps

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """Pre-clip total L2 norm of the unscaled gradients at this iteration's ``GRADS_READY``
        (a device tensor, no host sync); None before it, on iterations that do not step, and
        unless :meth:`track_grad_norm` was called."""
        return self._grad_norm

    def track_grad_norm(self) -> None:
        """Compute :attr:`grad_norm` at each ``GRADS_READY``, before any handler changes the gradients."""
        self._track_norm = True

    def _agrees_on_oom(self) -> bool:
        # Only a DDP model communicates inside the step, and only when a handler asked for
        # retries (OOMBackoff sets oom_agreement on every rank) is a retry worth agreeing on.
        return self.oom_agreement and self.ddp is not None and is_distributed()

    def _stepping(self, engine: Engine) -> tuple:
        """(first iteration of a cycle, last iteration of a cycle, iterations in this cycle)."""
        acc, state = self._accumulation_steps, engine.state
        if acc == 1:
            return True, True, 1
        length = state.epoch_length
        if not length:  # an iterator of unknown length: cycles follow the global iteration
            pos, length = (state.iteration - 1) % acc, None
            return pos == 0, pos == acc - 1, acc
        pos = (state.iteration - 1) % length  # position in the epoch; cycles restart each epoch
        start = pos - pos % acc
        size = min(acc, length - start)
        return pos == start, pos == start + size - 1, size

    def _run(self, engine: Engine, batch: Any, defer: bool = False) -> dict:
        n = self._batch_size
        chunks = min(self._micro_batches, n)
        first, stepping, cycle = self._stepping(engine)
        # The module's flag, not a DDP wrapper's: the evaluator runs (and .eval()s) the unwrapped module.
        # Checked rather than set each step: train() walks every submodule, and a submodule the user
        # froze in eval mode stays so.
        if not self._module.training:
            self._model.train()
        if first:
            self._optimizer.zero_grad(set_to_none=True)
        self._grad_norm = None
        label = phase_label()
        if chunks == 1:
            x, y = self._inputs(batch)
            with self._no_sync(defer or not stepping):
                with label("ignite_amp.forward"), self.autocast():
                    loss = self.loss_fn(self.forward(x), y)
                _check_scalar(loss)
                with label("ignite_amp.backward"):
                    self._scaler.scale(loss / cycle if cycle != 1 else loss).backward()
            total = loss.detach()
        else:
            total = None
            parts = split_batch(batch, chunks)
            for i, chunk in enumerate(parts):
                x, y = self._inputs(chunk)
                # DDP all-reduces the gradients in the backward of the last chunk of a stepping
                # iteration only: once per optimizer step. Deferred: after all ranks agreed.
                with self._no_sync(defer or not (stepping and i == len(parts) - 1)):
                    with label("ignite_amp.forward"), self.autocast():
                        loss = self.loss_fn(self.forward(x), y)
                    _check_scalar(loss)
                    # Each chunk's share of the full batch's mean loss, and of the accumulation cycle.
                    share = batch_size_of(chunk) / n
                    with label("ignite_amp.backward"):
                        self._scaler.scale(loss * (share / cycle)).backward()
                part = loss.detach() * share
                total = part if total is None else total + part
        output = {"loss": total.float(), "batch_size": n}
        if stepping and not defer:
            self._optimizer_step(engine)
        return output

    def _complete(self, engine: Engine, output: dict) -> dict:
        if self._stepping(engine)[1]:
            all_reduce_gradients(self._model.parameters())
            self._optimizer_step(engine)
        return output

    def _no_sync(self, skip: bool):
        return self.ddp.no_sync() if skip and self.ddp is not None else contextlib.nullcontext()

    def _optimizer_step(self, engine: Engine) -> None:
        with phase_label()("ignite_amp.optimizer"):
            self._unscale_and_step(engine)

    def _unscale_and_step(self, engine: Engine) -> None:
        scaler = self._scaler
        skip = False
        if scaler.is_enabled():
            scaler.unscale_(self._optimizer)
            # The one host sync of a float16 step: GradScaler.step would make the same read
            # (after the clipping kernels, and once more); here it is made once, before them.
            skip = bool(found_inf(scaler, self._optimizer).item())
        if not skip:
            if self._track_norm:
                grads = [p.grad for p in self._params if p.grad is not None]
                self._grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else None
            _fire(engine, AmpEvents.GRADS_READY)
            try:
                self._optimizer.step()
            except RuntimeError as exc:
                if not is_oom_error(exc):
                    raise
                raise OptimizerOutOfMemoryError(
                    f"out of memory inside optimizer.step() ({type(self._optimizer).__name__}) on {self._device} "
                    f"at iteration {engine.state.iteration}: the update may be half applied, so the batch is not "
                    f"retried (smaller micro-batches would not shrink the optimizer's memory)") from exc
        scaler.update()
        _fire(engine, AmpEvents.STEP_SKIPPED if skip else AmpEvents.OPTIMIZER_STEPPED)

    def _recover(self, engine: Engine) -> None:
        if not self._stepping(engine)[0]:
            logger.warning(
                "out of memory inside an accumulation cycle: the gradients of its earlier "
                "iterations are dropped (micro_batches keeps every sample; prefer it to accumulation_steps)"
            )
        self._optimizer.zero_grad(set_to_none=True)
        self._grad_norm = None
        if self._scaler.is_enabled():
            # Forget a half-done unscale_ so the retry starts clean: update() with the current
            # scale (read on the device, no sync) resets the per-optimizer state, scale unchanged.
            self._scaler.update(new_scale=self._scaler.scale(torch.ones((), device=self._device)))

    def state_dict(self) -> dict:
        return {"scaler": self._scaler.state_dict(), "micro_batches": self._micro_batches,
                "oom_count": self._oom_count}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self._scaler.is_enabled() and state_dict["scaler"]:  # a float16 run resumed in float16
            self._scaler.load_state_dict(state_dict["scaler"])
        self.micro_batches = int(state_dict["micro_batches"])
        self._oom_count = int(state_dict.get("oom_count", 0))


class EvalStep(_RetryingStep):
    """Ignite process function for evaluation: autocast, no grad, no scaler.

    Takes ``model`` and the keyword arguments of :class:`AmpStep` that concern the forward
    (``device``, ``dtype``, ``micro_batches``, ``non_blocking``, ``channels_last``, ``compile``,
    ``fp32_modules``, ``prepare_batch``).

    Returns ``(y_pred, y)`` with ``y_pred`` in float32, what Ignite metrics expect.
    """

    def _run(self, engine: Engine, batch: Any, defer: bool = False) -> Any:
        if self._module.training:
            self._model.eval()
        chunks = min(self._micro_batches, self._batch_size)
        with torch.no_grad():
            if chunks == 1:
                x, y = self._inputs(batch)
                with self.autocast():
                    y_pred = self.forward(x)
                return (y_pred.float() if torch.is_tensor(y_pred) else y_pred), y
            preds, targets = [], []
            for chunk in split_batch(batch, chunks):
                x, y = self._inputs(chunk)
                with self.autocast():
                    y_pred = self.forward(x)
                preds.append(y_pred.float() if torch.is_tensor(y_pred) else y_pred)
                targets.append(y)
        return torch.cat(preds), torch.cat(targets)


def _check_scalar(loss: Any) -> None:
    if not torch.is_tensor(loss) or loss.ndim != 0:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"loss_fn should return a scalar (0-d) tensor, got {shape}: reduce it (mean) "
                         f"over the batch")


def _check_optimizer(optimizer: Any, model: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer should be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    ids = {id(p) for p in model.parameters()}
    if ids and not any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("optimizer: none of its parameters belong to the model (was it built for another "
                         "model, or before the model was copied?)")


def _check_mean_reduction(loss_fn: Callable) -> None:
    """Micro-batches and accumulation weight each chunk's loss by its share: they need a mean."""
    reduction = getattr(loss_fn, "reduction", None)
    if reduction is None and isinstance(loss_fn, functools.partial):
        reduction = loss_fn.keywords.get("reduction")
    if reduction is not None and reduction != "mean":
        raise ValueError(f"loss_fn: reduction={reduction!r}; the step needs a mean-reduced loss (micro-batches "
                         f"and accumulation weight each chunk's mean by its share of the samples)")


def _no_buffer_sync_in_forward(ddp: DistributedDataParallel) -> None:
    """Turn off DDP's broadcast of rank 0's buffers at each forward.

    That broadcast is a collective inside the step: a rank retrying after an out-of-memory error
    would call it once more than the others and hang. Rank 0's buffers (BatchNorm running
    statistics) evolve from its own batches either way, and the evaluator made by
    :func:`create_amp_evaluator` sends them to every rank before each evaluation.
    """
    if hasattr(ddp, "forward_sync_buffers"):  # torch >= 2.13
        ddp.forward_sync_buffers = False
    else:
        ddp.broadcast_buffers = False


class AmpEngine(Engine):
    """An Ignite ``Engine`` that knows which :class:`AmpEvents` have handlers, so the step fires only those.

    ``Engine.fire_event`` costs about 15 us of host time even when nothing listens (it checks
    the event against every registered one); twice per iteration that is a visible share of a
    small model's step. :meth:`fire_amp_event` skips events no handler was ever added to.
    """

    def __init__(self, process_function: Callable):
        super().__init__(process_function)
        # Filters count iterations: AmpEvents.GRADS_READY(every=10) fires on every 10th iteration that steps.
        self.register_events(*AmpEvents, event_to_attr={event: "iteration" for event in AmpEvents})
        self._listened: set = set()  # names of AmpEvents with a handler (never shrinks: always safe)

    def add_event_handler(self, event_name: Any, handler: Callable, *args: Any, **kwargs: Any):
        handle = super().add_event_handler(event_name, handler, *args, **kwargs)
        for event in (event_name if isinstance(event_name, EventsList) else (event_name,)):
            self._listened.add(getattr(event, "name", event))  # a filtered event keeps its name
        return handle

    def fire_amp_event(self, event: AmpEvents) -> None:
        """Run the handlers of ``event`` (registered by this engine), if it has any."""
        if event.name in self._listened:
            self._fire_event(event)


def _fire(engine: Engine, event: AmpEvents) -> None:
    fire = getattr(engine, "fire_amp_event", None)
    if fire is not None:
        fire(event)
    else:  # the step run by a plain Engine (e.g. Engine(AmpStep(...))) that registered AmpEvents itself
        engine.fire_event(event)


def _engine(step: _RetryingStep) -> Engine:
    engine = AmpEngine(step)
    engine.amp_step = step
    return engine


def amp_step_of(engine: Engine) -> _RetryingStep:
    """The step of an engine made by :func:`create_amp_trainer` or :func:`create_amp_evaluator`.

    Handlers call it once, in ``attach``; a plain Ignite engine is a TypeError naming the fix.
    """
    step = getattr(engine, "amp_step", None)
    if not isinstance(step, _RetryingStep):
        raise TypeError("expected an engine made by ignite_amp.create_amp_trainer (or create_amp_evaluator), "
                        "got a plain Ignite Engine")
    return step


def create_amp_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable,
    device: Union[str, torch.device] = "auto",
    dtype: Union[str, torch.dtype] = "auto",
    accumulation_steps: int = 1,
    **kwargs: Any,
) -> Engine:
    """An Ignite ``Engine`` whose process function is an :class:`AmpStep` (``trainer.amp_step``).

    Keyword arguments go to :class:`AmpStep` (``micro_batches``, ``non_blocking``,
    ``channels_last``, ``compile``, ``fp32_modules``, ``prepare_batch``, ``scaler_kwargs``).

    Example:
        >>> import torch
        >>> from ignite_amp import create_amp_trainer
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> trainer = create_amp_trainer(model, opt, torch.nn.functional.cross_entropy, device="cpu")
        >>> data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 3
        >>> state = trainer.run(data, max_epochs=2)
        >>> state.iteration, trainer.amp_step.dtype
        (6, torch.bfloat16)
    """
    step = AmpStep(model, optimizer, loss_fn, device=device, dtype=dtype,
                   accumulation_steps=accumulation_steps, **kwargs)
    return _engine(step)


def create_amp_evaluator(
    model: nn.Module,
    metrics: Optional[dict] = None,
    device: Union[str, torch.device] = "auto",
    dtype: Union[str, torch.dtype] = "auto",
    **kwargs: Any,
) -> Engine:
    """An Ignite ``Engine`` evaluating ``model`` under autocast with no grad, with ``metrics`` attached.

    Metrics whose constructor takes a ``device`` keep their state there (pass them built with
    ``device=...``; :func:`ignite_amp.run.build_run` does), so evaluation does not sync the
    host per batch. A DDP-wrapped model is evaluated through its module. Under data-parallel
    training every rank runs the evaluator on its shard (Ignite's metrics add the ranks up),
    after receiving rank 0's buffers.

    Keyword arguments go to :class:`EvalStep` (``micro_batches``, ``non_blocking``,
    ``channels_last``, ``compile``, ``fp32_modules``, ``prepare_batch``).
    """
    model = unwrap(model)  # evaluation never communicates: no DDP forward
    evaluator = _engine(EvalStep(model, device=device, dtype=dtype, **kwargs))
    if is_distributed():  # every rank evaluates its shard with rank 0's buffers (see AmpStep)
        evaluator.add_event_handler(Events.STARTED, lambda _: broadcast_buffers(model))
    for name, metric in (metrics or {}).items():
        metric.attach(evaluator, name)
    return evaluator
