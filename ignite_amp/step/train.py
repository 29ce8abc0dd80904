"""The AMP step: the one place that knows the autocast + GradScaler order.

``AmpStep`` is an Ignite process function. Per batch it runs::

    zero_grad(set_to_none)            # first iteration of an accumulation cycle
    for each micro-batch (one chunk unless micro_batches > 1):
        autocast: y_pred = model_transform(model_fn(model, x)); loss = loss_fn(y_pred, y)
        scaler.scale(loss * weight).backward()
    on stepping iterations (the last of a cycle, and the last of an epoch):
        scaler.unscale_(optimizer)     # float16: read the inf/NaN flag once (one host sync)
        grad_norm                      # when a handler asked for it: pre-clip L2 norm, on device
        fire GRADS_READY               # only when the gradients are finite
        optimizer.step()               # only when the gradients are finite
        scaler.update()
        fire OPTIMIZER_STEPPED or STEP_SKIPPED

The weight makes the optimizer see the gradient of one mean over the whole cycle (:mod:`ignite_amp.step.chunks`
weighs the chunks and joins their losses and outputs). While a ``torch.profiler`` records, the phases carry the
labels of :mod:`ignite_amp.core.phases`.

An out-of-memory error in the forward or backward (or in a ``GRADS_READY`` handler) is caught, the memory freed
outside the ``except`` block, and ``OUT_OF_MEMORY`` fired; a handler that raises ``micro_batches`` makes the step
retry the same batch, otherwise the original error is re-raised. One inside ``optimizer.step()`` is never retried
(the update may be half applied, and smaller micro-batches would not shrink it): :class:`OptimizerOutOfMemoryError`.

With a ``DistributedDataParallel`` model, every backward but the last of an optimizer step runs under ``no_sync``.
With out-of-memory agreement switched on (:attr:`AmpStep.oom_agreement`, which ``OOMBackoff`` sets on every rank)
all backward passes run under ``no_sync``; the ranks then agree whether any ran out of memory (``any_rank``), and
only when none did are the gradients all-reduced and the optimizer stepped: a retry leaves no rank in a collective.
"""
import contextlib
import logging
from collections import OrderedDict
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence, Union

import torch
from ignite.base.mixins import Serializable
from ignite.engine import Engine
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ignite_amp.batching import batch_size_of, prepare_batch, split_batch
from ignite_amp.core.collectives import all_reduce_gradients, is_distributed, no_buffer_sync_in_forward
from ignite_amp.core.config_keys import POSITIVE_INT
from ignite_amp.core.device import dtype_name, is_oom_error
from ignite_amp.core.phases import BACKWARD, FORWARD, OPTIMIZER, phase_label
from ignite_amp.errors import OptimizerOutOfMemoryError
from ignite_amp.split_check.check import SplitCheck
from ignite_amp.step.base import StepBase, call_model, identity
from ignite_amp.step.base import fire_amp_event as _fire
from ignite_amp.step.chunks import ChunkWeights, cycle_at
from ignite_amp.step.contracts import (
    check_mean_reduction,
    check_optimizer,
    check_requires_grad,
    check_scalar,
    output_hint,
    refuse_a_sum,
)
from ignite_amp.step.events import AmpEvents
from ignite_amp.step.grad_norm import GradNorm
from ignite_amp.step.scaler import agree_found_inf, build_scaler, found_inf
from ignite_amp.transforms.cuda_graphs import off_cuda
from ignite_amp.transforms.float8 import float8_change

__all__ = ["AmpStep", "dtype_change"]

logger = logging.getLogger("ignite_amp")
_SYNC = contextlib.nullcontext()  # a chunk with nothing to hold back: one reusable instance, not one per chunk


def dtype_change(saved: Any, now: str) -> Optional[str]:
    """The line a step says when it loads a checkpoint trained in another dtype (None: the same, or not recorded);
    a config run names the same change in its resume line, as ``amp.dtype bfloat16 -> float32``.

    Example:
        >>> dtype_change("bfloat16", "float32").split(" (")[0]
        'resumed a checkpoint trained in bfloat16 into a float32 step: dtype bfloat16 -> float32'
        >>> dtype_change("bfloat16", "bfloat16") is None and dtype_change(None, "float32") is None
        True
    """
    if not isinstance(saved, str) or saved == now:
        return None
    return (f"resumed a checkpoint trained in {saved} into a {now} step: dtype {saved} -> {now} (the weights load as "
            f"they are; expect the loss to move a little in the first steps)")


class AmpStep(StepBase, Serializable):
    """Ignite process function for a mixed-precision training step.

    Args:
        model: the model; moved to ``device``.
        optimizer: its optimizer (at least one of its parameters must be the model's).
        loss_fn: ``loss_fn(y_pred, y)`` returning a scalar that is a mean: over the samples, or
            over the items ``num_items`` counts. A sum is refused (see the any-model guide).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``.
        dtype: ``auto | float16 | bfloat16 | float32``. A ``GradScaler`` is enabled only for float16.
        accumulation_steps: iterations whose gradients add up before one optimizer step. A cycle
            never crosses an epoch boundary: the epoch's last iteration steps.
        micro_batches: chunks each batch is split into; the gradient is the full batch's.
        non_blocking: asynchronous host-to-device copies (pair with a pinned-memory loader).
        channels_last: model and every 4-d floating-point input tensor in channels-last format; ``"auto"`` (the
            default): on CUDA for a model whose 2-d convolutions hold most of its weights
            (``ignite_amp.transforms.memory_format``); ``channels_last`` and ``channels_last_why`` say what it chose.
        compile: run the forward through ``torch.compile``; ``"reduce-overhead"``: with CUDA graphs, checked
            against the eager forward on the first step and given up for it where the graphs cannot follow
            (``ignite_amp.transforms.cuda_graphs``).
        fp32_modules: names of submodules run outside autocast with float32 inputs.
        prepare_batch: ``prepare_batch(batch, device, non_blocking) -> (x, y)``; the default takes
            ``(x, y)`` pairs and mappings (x: the mapping, y: None), see :func:`ignite_amp.batching.prepare_batch`.
            The batch is counted and cut after it, from the ``(x, y)`` it returned.
        model_fn: ``model_fn(model, x) -> output`` (Ignite's name; default ``model(x)``), e.g.
            ``lambda model, x: model(**x)`` for a model taking keyword arguments.
        model_transform: ``model_transform(output) -> y_pred`` (Ignite's name; default: the output).
        output_transform: ``output_transform(x, y, y_pred, loss) -> engine.state.output`` (Ignite's
            name and signature; the full batch's x, y and y_pred, detached, floats in float32, and the
            detached loss). Default: the loss, a detached 0-d float32 tensor: Ignite's float without its
            host sync (``f"{output:.3f}"``, ``RunningAverage`` and ``ProgressBar`` take it as they take a float).
        num_items: ``num_items(x, y) -> int or 0-d tensor``: the items the chunk's mean loss averages
            over (e.g. ``(y != -100).sum()`` for a padded token mean). With it, micro-batches,
            accumulation and DDP give the gradient of the mean over every item of the cycle on
            every rank. Without it every sample of a batch weighs the same.
        scaler_kwargs: extra arguments for ``torch.amp.GradScaler`` (e.g. ``init_scale``).
        scaler: a ``torch.amp.GradScaler`` to use as given (Ignite's meaning), or True/False to force
            one on or off (default: on for float16 only; ``ignite-amp compare`` shows float16 without).
        batch_size: ``batch_size(x, y) -> int``, the samples of a prepared batch (default
            :func:`ignite_amp.batching.batch_size_of`: the rows its tensors share, or a per-sample list's length).
        split_batch: ``split_batch(x, y, chunks) -> [(x, y), ...]``, a prepared batch cut into micro-batches
            (default :func:`ignite_amp.batching.split_batch`); each sample in exactly one chunk.
        check_split: check on the first real batches that their weighted chunks give their gradient, where a batch
            is cut or combined, then spot checks through the run within 2% of the step time (a fraction in (0, 1]:
            within that share) (``ignite_amp.split_check.check``); False accepts a loss that fails it knowingly.

    Besides the properties of every step, handlers may read ``optimizer``, ``scaler``,
    ``accumulation_steps``, ``loss``, ``items``, ``grad_norm`` (after :meth:`track_grad_norm`), ``split_check``, call
    :meth:`clip_grad_norm_` and set ``oom_agreement``.
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
        channels_last: Union[bool, str] = "auto",
        compile: Union[bool, str] = False,
        fp32_modules: Sequence[str] = (),
        prepare_batch: Callable = prepare_batch,
        model_fn: Callable[[nn.Module, Any], Any] = call_model,
        model_transform: Callable[[Any], Any] = identity,
        output_transform: Optional[Callable] = None,
        num_items: Optional[Callable[[Any, Any], Any]] = None,
        scaler_kwargs: Optional[dict] = None,
        scaler: Union[bool, torch.amp.GradScaler, None] = None,
        batch_size: Callable[[Any, Any], int] = batch_size_of,
        split_batch: Callable[[Any, Any, int], list] = split_batch,
        check_split: Union[bool, float] = True,
    ):
        POSITIVE_INT.argument(accumulation_steps, "accumulation_steps")
        if num_items is not None and not callable(num_items):
            raise TypeError(f"num_items should be a function (x, y) -> int or 0-d tensor, "
                            f"got {type(num_items).__name__}")
        check_optimizer(optimizer, model)
        check_mean_reduction(loss_fn)
        super().__init__(model, device, dtype, micro_batches, non_blocking, channels_last, compile,
                         fp32_modules, prepare_batch, model_fn, model_transform, output_transform, batch_size,
                         split_batch)
        if self.graphs is not None and self._device.type != "cuda":  # the trainer says it; its evaluator follows
            logger.warning(off_cuda(self._device))
        self._optimizer = optimizer
        self._params = list(self._model.parameters())  # a list: walking the module tree per step costs
        self.loss_fn = loss_fn
        self.num_items = num_items
        self._accumulation_steps = accumulation_steps
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        # A model sharded with FSDP2 (torch.distributed.fsdp.fully_shard): its gradients are reduce-scattered
        # only on the backward that ends an optimizer step, as DDP's no_sync does for all-reduces.
        self.fsdp: Any = model if hasattr(model, "set_requires_gradient_sync") else None  # (an FSDPModule)
        if self.ddp is not None:
            no_buffer_sync_in_forward(self.ddp)
        self._scaler = build_scaler(scaler, self._device, self._dtype == torch.float16, scaler_kwargs)
        self.oom_agreement = False
        self._norm = GradNorm(self._params)  # the pre-clip norm, once per step, and clipping to it
        self._loss: Optional[torch.Tensor] = None
        self._items: Any = 0
        self._weights = ChunkWeights(self._device)
        self._reduction_checked = False  # said once
        self._split_check = SplitCheck(check_split)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the step steps (it holds the model's parameters)."""
        return self._optimizer

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The ``GradScaler`` (enabled for float16 only; a disabled one is a no-op)."""
        return self._scaler

    @property
    def accumulation_steps(self) -> int:
        """Iterations whose gradients add up before one optimizer step."""
        return self._accumulation_steps

    @property
    def loss(self) -> Optional[torch.Tensor]:
        """The last batch's loss as a detached float32 device tensor (the mean over its samples, or its
        items with ``num_items``, whatever the micro-batches). Handlers read it, not ``state.output``."""
        return self._loss

    @property
    def items(self) -> Any:
        """What the last batch's loss averaged over (its samples, an int, or its items with ``num_items``)."""
        return self._items

    @property
    def split_check(self) -> SplitCheck:
        """The split check (read it: ``summary()``, ``batches`` checked, ``inconclusive``, ``interval`` between spot
        checks; see ``ignite_amp.split_check.check``)."""
        return self._split_check

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """Pre-clip total L2 norm of the unscaled gradients at this iteration's ``GRADS_READY``
        (a device tensor, no host sync); None before it, on iterations that do not step, and
        unless :meth:`track_grad_norm` was called."""
        return self._norm.value

    def track_grad_norm(self) -> None:
        """Compute :attr:`grad_norm` at each ``GRADS_READY``, before any handler changes the gradients."""
        self._norm.tracked = True

    def clip_grad_norm_(self, max_norm: float) -> None:
        """In a ``GRADS_READY`` handler: the model's gradients times ``min(max_norm / (grad_norm + 1e-6), 1)``,
        as ``clip_grads_with_norm_`` scales them, without listing and grouping them again; nothing without a norm."""
        self._norm.clip_(max_norm)

    def _agrees_on_oom(self) -> bool:
        # Only a DDP model communicates inside the step, and only when a handler asked for
        # retries (OOMBackoff sets oom_agreement on every rank) is a retry worth agreeing on.
        return self.oom_agreement and self.ddp is not None and is_distributed()

    def _run(self, engine: Engine, batch: Any, defer: bool = False) -> Any:
        cycle = cycle_at(self._accumulation_steps, engine.state)
        parts, sizes = self._chunks(batch)
        # The module's flag, not a DDP wrapper's: the evaluator runs (and .eval()s) the unwrapped module.
        # Checked rather than set each step: train() walks every submodule, and a submodule the user
        # froze in eval mode stays so.
        if not self._module.training:
            self._model.train()
        if cycle.first:
            self._optimizer.zero_grad(set_to_none=True)
        if self.graphs is not None and not self.graphs.checked:  # compile reduce-overhead: against eager, once
            x0, y0 = parts[0]
            self.graphs.check_parity(lambda forward: self._loss_through(forward, x0, y0), self._device, self._dtype,
                                     sharded=self.fsdp is not None)
        self._norm.clear()
        label = phase_label()
        keep = self.output_transform is not None
        chunks = self._weights.start(self, self._split_check, batch, sizes, cycle)
        last = len(parts) - 1
        for i, (x, y) in enumerate(parts):
            count = None if self.num_items is None else self._weights.count(
                self.num_items(x, y), f"chunk {i + 1} of iteration {engine.state.iteration}")
            # DDP all-reduces the gradients in the backward of the last chunk of a stepping
            # iteration only: once per optimizer step. Deferred: after all ranks agreed.
            with self._no_sync(defer or not (cycle.last and i == last)):
                with label(FORWARD), self.autocast():
                    y_pred = self._forward(x)
                    try:
                        loss = self.loss_fn(y_pred, y)
                    except (TypeError, AttributeError) as exc:  # a dict or tuple given to a loss of tensors
                        hint = output_hint(exc, y_pred, y, self.loss_fn)
                        if hint is None:
                            raise
                        raise TypeError(hint) from exc  # (the hook named)
                check_scalar(loss)
                if not loss.requires_grad:
                    check_requires_grad(loss, self.model)
                if not self._reduction_checked:  # the first batch: one host sync
                    self._reduction_checked = True
                    refuse_a_sum(self.loss_fn, loss, y_pred, y, self.autocast)
                weight = chunks.weigh(loss, i, count)
                with label(BACKWARD):
                    # (a tensor weight is never compared: that would wait for the device)
                    self._scaler.scale(loss * weight if torch.is_tensor(weight) or weight != 1 else loss).backward()
            if keep:
                chunks.keep(y_pred, count)
        self._loss, self._items = chunks.loss()
        if cycle.last and not defer:
            self._optimizer_step(engine)
        if self.output_transform is None:  # (not keep)
            return self._loss
        x, y = self._joined(batch, parts, sizes)  # a custom split_batch may reorder rows: the chunks' own x, y
        return self.output_transform(x, y, chunks.outputs(), self._loss)

    def _loss_through(self, forward: nn.Module, x: Any, y: Any) -> torch.Tensor:
        """The loss of ``(x, y)`` through ``forward`` in the step's autocast (the CUDA graphs' parity check)."""
        with self.autocast():
            return self.loss_fn(self.model_transform(self.model_fn(forward, x)), y)

    def _complete(self, engine: Engine, output: Any) -> Any:
        if cycle_at(self._accumulation_steps, engine.state).last:
            all_reduce_gradients(self._model.parameters())
            self._optimizer_step(engine)
        return output

    def _no_sync(self, skip: bool) -> ContextManager[Any]:
        if self.ddp is not None:
            return self.ddp.no_sync() if skip else _SYNC
        if self.fsdp is not None:
            self.fsdp.set_requires_gradient_sync(not skip)
        return _SYNC

    def _optimizer_step(self, engine: Engine) -> None:
        with phase_label()(OPTIMIZER):
            if self._weights.by_items:
                self._weights.divide_by_cycle_items(self._params)
            self._unscale_and_step(engine)

    def _unscale_and_step(self, engine: Engine) -> None:
        scaler = self._scaler
        skip = False
        if scaler.is_enabled():
            scaler.unscale_(self._optimizer)
            if self.fsdp is not None and is_distributed():  # each rank checked its shards: skip together
                agree_found_inf(scaler, self._optimizer)
            # The one host sync of a float16 step: GradScaler.step would make the same read
            # (after the clipping kernels, and once more); here it is made once, before them.
            skip = bool(found_inf(scaler, self._optimizer).item())
        if not skip:
            self._norm.compute()  # when tracked: get_total_norm's value at its kernels' host cost
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
        if not cycle_at(self._accumulation_steps, engine.state).first:
            logger.warning(
                "out of memory inside an accumulation cycle: the gradients of its earlier "
                "iterations are dropped (micro_batches keeps every sample; prefer it to accumulation_steps)"
            )
            self._weights.cycle_items = 0
        self._optimizer.zero_grad(set_to_none=True)
        self._norm.clear()
        if self._scaler.is_enabled():
            # Forget a half-done unscale_ so the retry starts clean: update() with the current
            # scale (read on the device, no sync) resets the per-optimizer state, scale unchanged.
            self._scaler.update(new_scale=self._scaler.scale(torch.ones((), device=self._device)))

    def state_dict(self) -> "OrderedDict[str, Any]":
        """What a checkpoint keeps: the scaler, the micro-batch and out-of-memory counts, the float8 recipe, and the
        dtype it trained in (a resume with ``dtype: auto`` keeps it)."""
        return OrderedDict(scaler=self._scaler.state_dict(), micro_batches=self._micro_batches,
                           oom_count=self._oom_count, float8=self.float8.recipe if self.float8 is not None else None,
                           dtype=dtype_name(self._dtype))

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore :meth:`state_dict`'s values (the scaler's only when both runs use float16); a checkpoint of
        another dtype (or float8 recipe) is said in one line."""
        super().load_state_dict(state_dict)
        if self._scaler.is_enabled() and state_dict["scaler"]:  # a float16 run resumed in float16
            self._scaler.load_state_dict(state_dict["scaler"])
        self.micro_batches = int(state_dict["micro_batches"])
        self._oom_count = int(state_dict.get("oom_count", 0))
        if change := float8_change(state_dict.get("float8"), self.float8):
            logger.warning(change)
        if change := dtype_change(state_dict.get("dtype"), dtype_name(self._dtype)):
            logger.warning(change)
