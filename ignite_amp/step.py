"""The AMP step: the one place that knows the autocast + GradScaler order.

``AmpStep`` is an Ignite process function. Per batch it runs::

    zero_grad(set_to_none)            # first iteration of an accumulation cycle
    for each micro-batch:
        autocast: forward + loss
        scaler.scale(loss * share).backward()
    on stepping iterations:
        scaler.unscale_(optimizer)
        fire GRADS_READY               # only when the gradients are finite
        scaler.step(optimizer); scaler.update()
        fire STEP_SKIPPED              # when the scaler skipped the step

An out-of-memory error is caught, the memory freed outside the ``except`` block, and
``OUT_OF_MEMORY`` fired; a handler that raises ``micro_batches`` makes the step retry the
same batch, otherwise the original error is re-raised.

With a ``DistributedDataParallel`` model, every backward but the last of an optimizer step
runs under ``no_sync``. When something handles ``OUT_OF_MEMORY`` (and there are several
ranks), all backward passes run under ``no_sync``; the ranks then agree whether any ran out
of memory (``any_rank``), and only when none did are the gradients all-reduced and the
optimizer stepped, so a retry never leaves another rank waiting in a collective.
"""
import contextlib
import functools
import gc
import logging
import traceback
from collections import defaultdict
from typing import Any, Callable, Iterable, List, Optional, Sequence, Union

import torch
from ignite.base.mixins import Serializable
from ignite.engine import Engine, Events
from ignite.engine import _prepare_batch as ignite_prepare_batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ignite_amp.distributed import all_reduce_gradients, any_rank, broadcast_buffers, is_distributed, unwrap
from ignite_amp.events import AmpEvents

__all__ = [
    "AmpStep",
    "EvalStep",
    "create_amp_trainer",
    "create_amp_evaluator",
    "resolve_device",
    "resolve_dtype",
    "is_oom_error",
    "split_batch",
    "batch_size_of",
    "free_memory",
]

logger = logging.getLogger("ignite_amp")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(device: Union[str, torch.device, None] = "auto") -> torch.device:
    """``"auto"`` (or None) is CUDA when available, else CPU; anything else goes to ``torch.device``."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available")
    return device


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

    ``auto``: bfloat16 where the device supports it, else float16 on CUDA; bfloat16 on CPU
    (with one log line when the CPU lacks native bfloat16 and it will be slow).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype should be one of auto, {', '.join(DTYPES)}; got {dtype}")
        return dtype
    device = torch.device(device)
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
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
    if not isinstance(exc, RuntimeError):
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


def _to_float32(value: Any) -> Any:
    if torch.is_tensor(value) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_float32(v) for k, v in value.items()}
    return value


def _fp32_forward(forward: Callable, device_type: str, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(device_type=device_type, enabled=False):
        return forward(*_to_float32(args), **_to_float32(kwargs))


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


class _RetryingStep:
    """Batch splitting, device transfer and the out-of-memory retry shared by both steps."""

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
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches should be a positive integer, got {micro_batches!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.micro_batches = micro_batches
        self.non_blocking = non_blocking
        self.channels_last = channels_last
        self.prepare_batch = prepare_batch
        self.model = model.to(self.device)
        if channels_last:
            self.model.to(memory_format=torch.channels_last)
        keep_in_fp32(self.model, fp32_modules, self.device.type)
        self.forward = torch.compile(self.model) if compile else self.model
        if self.dtype == torch.float32:
            self.autocast = contextlib.nullcontext
        else:
            self.autocast = functools.partial(torch.autocast, device_type=self.device.type, dtype=self.dtype)
        self.batch_size = 0  # size of the batch in progress, for handlers reacting to OUT_OF_MEMORY
        self.oom_count = 0

    def _inputs(self, chunk: Any):
        x, y = self.prepare_batch(chunk, self.device, self.non_blocking)
        if self.channels_last and torch.is_tensor(x) and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def __call__(self, engine: Engine, batch: Any) -> Any:
        self.batch_size = batch_size_of(batch)
        while True:
            agree = self._agrees_on_oom(engine)
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
            free_memory(self.device)
            self.oom_count += 1
            before = min(self.micro_batches, self.batch_size)
            engine.fire_event(AmpEvents.OUT_OF_MEMORY)
            if min(self.micro_batches, self.batch_size) <= before:
                raise error  # nothing made the chunks smaller: retrying would fail the same way
            del error

    def _agrees_on_oom(self, engine: Engine) -> bool:
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
        optimizer: its optimizer.
        loss_fn: ``loss_fn(y_pred, y)`` returning a mean-reduced scalar.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``.
        dtype: ``auto | float16 | bfloat16 | float32``. A ``GradScaler`` is enabled only for float16.
        accumulation_steps: iterations whose gradients add up before one optimizer step.
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
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps should be a positive integer, got {accumulation_steps!r}")
        super().__init__(model, device, dtype, micro_batches, non_blocking, channels_last, compile,
                         fp32_modules, prepare_batch)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.accumulation_steps = accumulation_steps
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        if self.ddp is not None:
            _no_buffer_sync_in_forward(self.ddp)
        self.scaler = torch.amp.GradScaler(
            self.device.type, enabled=self.dtype == torch.float16 if scaler is None else scaler,
            **(scaler_kwargs or {}),
        )

    def _agrees_on_oom(self, engine: Engine) -> bool:
        # Only a DDP model communicates inside the step, and only a handler of OUT_OF_MEMORY
        # (OOMBackoff) makes a retry worth agreeing on; otherwise the error simply propagates.
        return self.ddp is not None and is_distributed() and bool(engine._event_handlers.get(AmpEvents.OUT_OF_MEMORY))

    def _run(self, engine: Engine, batch: Any, defer: bool = False) -> dict:
        n = self.batch_size
        chunks = min(self.micro_batches, n)
        iteration = engine.state.iteration
        stepping = iteration % self.accumulation_steps == 0
        self.model.train()
        if (iteration - 1) % self.accumulation_steps == 0:
            self.optimizer.zero_grad(set_to_none=True)
        total = None
        parts = split_batch(batch, chunks)
        for i, chunk in enumerate(parts):
            x, y = self._inputs(chunk)
            # DDP all-reduces the gradients in the backward of the last chunk of a stepping
            # iteration only: once per optimizer step. Deferred: after all ranks agreed.
            with self._no_sync(defer or not (stepping and i == len(parts) - 1)):
                with self.autocast():
                    loss = self.loss_fn(self.forward(x), y)
                # Each chunk's share of the full batch's mean loss, and of the accumulation cycle.
                share = batch_size_of(chunk) / n
                scale = share / self.accumulation_steps
                self.scaler.scale(loss * scale if scale != 1 else loss).backward()
            part = loss.detach().float()
            total = part * share if total is None else total + part * share
        output = {"loss": total, "batch_size": n}
        return output if defer else self._complete(engine, output, reduce=False)

    def _complete(self, engine: Engine, output: dict, reduce: bool = True) -> dict:
        if engine.state.iteration % self.accumulation_steps == 0:
            if reduce:
                all_reduce_gradients(self.model.parameters())
            self._optimizer_step(engine)
        return output

    def _no_sync(self, skip: bool):
        return self.ddp.no_sync() if skip and self.ddp is not None else contextlib.nullcontext()

    def _optimizer_step(self, engine: Engine) -> None:
        found_inf = False
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
            # Host sync: scaler.step() makes the same one (.item() on found_inf) to decide
            # whether to skip, so reading the flag here costs no extra wait.
            found_inf = any(v.item() for v in self.scaler._found_inf_per_device(self.optimizer).values())
        if not found_inf:
            engine.fire_event(AmpEvents.GRADS_READY)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if found_inf:
            engine.fire_event(AmpEvents.STEP_SKIPPED)

    def _recover(self, engine: Engine) -> None:
        if (engine.state.iteration - 1) % self.accumulation_steps != 0:
            logger.warning(
                "out of memory inside an accumulation cycle: the gradients of its earlier "
                "iterations are dropped (micro_batches keeps every sample; prefer it to accumulation_steps)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler.is_enabled():
            # Forget a half-done unscale_/step so the retry starts clean (what update() does).
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "micro_batches": self.micro_batches}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.scaler.load_state_dict(state_dict["scaler"])
        self.micro_batches = int(state_dict["micro_batches"])


class EvalStep(_RetryingStep):
    """Ignite process function for evaluation: autocast, no grad, no scaler.

    Takes ``model`` and the keyword arguments of :class:`AmpStep` that concern the forward
    (``device``, ``dtype``, ``micro_batches``, ``non_blocking``, ``channels_last``, ``compile``,
    ``fp32_modules``, ``prepare_batch``).

    Returns ``(y_pred, y)`` with ``y_pred`` in float32, what Ignite metrics expect.
    """

    def _run(self, engine: Engine, batch: Any, defer: bool = False) -> Any:
        self.model.eval()
        preds, targets = [], []
        with torch.no_grad():
            for chunk in split_batch(batch, min(self.micro_batches, self.batch_size)):
                x, y = self._inputs(chunk)
                with self.autocast():
                    y_pred = self.forward(x)
                preds.append(y_pred.float() if torch.is_tensor(y_pred) else y_pred)
                targets.append(y)
        if len(preds) == 1:
            return preds[0], targets[0]
        return torch.cat(preds), torch.cat(targets)


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


def _engine(step: _RetryingStep) -> Engine:
    engine = Engine(step)
    engine.register_events(*AmpEvents)
    engine.amp_step = step
    return engine


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

    A DDP-wrapped model is evaluated through its module. Under data-parallel training every
    rank runs the evaluator on its shard (Ignite's metrics add the ranks up), after receiving
    rank 0's buffers.

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
