"""The fake step: a training step of a model run on fake copies of it (no storage), tracked by ``MemTracker``.

:mod:`ignite_amp.memory_plan.plan` plans with it. The copies: every parameter, buffer and optimizer state tensor
stood in for by a ``FakeTensor`` of the same shape, dtype and strides (on the planned device), the module
tree and the optimizer deep-copied around them; the step is the run's own :class:`~ignite_amp.AmpStep`,
built by :func:`~ignite_amp.create_amp_trainer` with the run's arguments.
"""
import contextlib
import copy
import logging
import warnings
from typing import Any, Callable, Dict, List, Mapping, Sequence, Union

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from ignite_amp.batching import batch_size_of
from ignite_amp.core.nested import map_tensors
from ignite_amp.engine import create_amp_trainer
from ignite_amp.memory_plan.flops import count_flops
from ignite_amp.transforms.activation_checkpointing import POLICIES, checkpoint_modules, checkpointed_blocks
from ignite_amp.transforms.memory_format import choose_channels_last

__all__ = ["StepTracker", "step_tracker", "warm_optimizer", "FakeStep", "KINDS", "quiet_trace"]

logger = logging.getLogger("ignite_amp")

#: The kinds of memory a plan counts, in the order it lists them.
KINDS = ("parameters", "buffers", "gradients", "optimizer state", "activations", "temporaries", "batch")
_TRACKER_KINDS = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients",
                  "Optstate": "optimizer state", "Activation": "activations", "Temp": "temporaries", "Other": "batch"}


class StepTracker(MemTracker):
    """torch's ``MemTracker`` for a whole training step: the model may run several forwards in it (micro-batches,
    accumulation), each one's module statistics replacing the last (the peak and the kinds are kept).

    ``MemTracker`` refuses a second top-level forward; the tests measure the real step with this tracker too.
    """

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # the model's next top-level forward: a new set of module statistics
            self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)


def step_tracker() -> StepTracker:
    """A new :class:`StepTracker`."""
    return StepTracker()


class _NoHostReads(TorchDispatchMode):
    """A fake tensor has no value to read: ``.item()`` on one (the first step's loss check, the scaler's inf/NaN
    flag) reads 0, so the planned step takes the path of a finite, stepping iteration."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException

        if func is torch.ops.aten._local_scalar_dense.default:
            try:
                return func(*args, **(kwargs or {}))  # a constant the fake mode knows (Adam's step count)
            except DataDependentOutputException:
                return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


def _fake_like(t: torch.Tensor, mode: Any, device: torch.device, channels_last: bool = False) -> torch.Tensor:
    with mode:
        if channels_last and t.dim() == 4:
            fake = torch.empty(t.shape, dtype=t.dtype, device=device).contiguous(memory_format=torch.channels_last)
        else:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake


def _fake_copies(model: nn.Module, optimizer: torch.optim.Optimizer, mode: Any, device: torch.device,
                 channels_last: bool) -> tuple:
    """The model and optimizer deep-copied with every tensor (parameters, buffers, optimizer state) fake."""
    memo: Dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        memo[id(t)] = _fake_like(t, mode, device, channels_last)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in memo:
                memo[id(p)] = _fake_like(p, mode, device, channels_last)
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and id(value) not in memo:
                memo[id(value)] = _fake_like(value, mode, value.device if value.device.type == "cpu" and value.dim()
                                             == 0 else device)
    fake_model = copy.deepcopy(model, memo)
    # Fake parameters cannot be moved or swapped (module.to): the copy is already where the step puts it.
    fake_model.to = lambda *args, **kwargs: fake_model  # type: ignore[method-assign]  # this copy's own .to
    fake_optimizer = copy.deepcopy(optimizer, memo)
    vars(fake_optimizer).pop("step", None)  # an LR scheduler's wrapper of the user's optimizer.step: not the copy's
    return fake_model, fake_optimizer


def warm_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state as after its first step (a step on zero gradients), gradients then dropped."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not any(optimizer.state.get(p) for p in params):
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _fake_batch(batch: Any, n: int, mode: Any, device: torch.device) -> Any:
    """``batch(n)`` called under the fake mode, or an example batch with its per-sample tensors resized to
    ``n`` rows."""
    if callable(batch):
        with mode:
            made = batch(n)
        return map_tensors(made, lambda t: t.to(device) if t.device != device else t)
    rows = batch_size_of(*batch) if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch_size_of(batch)

    def resize(t: torch.Tensor) -> torch.Tensor:
        shape = (n, *t.shape[1:]) if t.dim() and t.shape[0] == rows else t.shape
        with mode:
            return torch.empty(shape, dtype=t.dtype, device=device)

    return map_tensors(batch, resize)


def _kinds(snapshot: Dict[Any, Dict[Any, int]]) -> Dict[str, int]:
    kinds = dict.fromkeys(KINDS, 0)
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = _TRACKER_KINDS.get(getattr(key, "value", key))
            if name is not None:
                kinds[name] += value
    return kinds


def _tensors_of(value: Any) -> List[torch.Tensor]:
    found: List[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


@contextlib.contextmanager
def quiet_trace() -> Any:
    """The step's one-time warnings (BatchNorm with micro-batches, padding) belong to the real run, not the plan;
    torch's log of a fake kernel's failure (a traceback per failed operator) to the plan's one line about it."""
    loggers = [logger, logging.getLogger("torch._subclasses.fake_tensor")]
    levels = [one.level for one in loggers]
    for one, level in zip(loggers, (logging.ERROR, logging.CRITICAL), strict=True):
        one.setLevel(level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for one, level in zip(loggers, levels, strict=True):
            one.setLevel(level)


class FakeStep:
    """Traces the step at one batch size at a time, each on fresh fake copies of the model and optimizer.

    Args: those of :func:`ignite_amp.memory_plan.plan.estimate_memory` (``step_kwargs``: the trainer's arguments).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, batch: Any,
                 device: torch.device, step_kwargs: dict, checkpoint: Union[Sequence[str], Mapping[str, str]] = ()):
        self.model, self.optimizer, self.loss_fn, self.batch = model, optimizer, loss_fn, batch
        self.device, self.kwargs = device, step_kwargs
        self.checkpoint = dict(checkpoint) if isinstance(checkpoint, Mapping) else dict.fromkeys(checkpoint, "full")
        self.checkpointed: List[str] = []

    def _build(self, mode: Any, check: bool = False) -> tuple:
        layout = choose_channels_last(self.kwargs.get("channels_last", "auto"), self.model, self.device)  # as the step
        model, optimizer = _fake_copies(self.model, self.optimizer, mode, self.device, layout.on)
        for policy in POLICIES:  # blocks chosen for the plan (activation_checkpointing auto), with their policy
            checkpoint_modules(model, [name for name, p in self.checkpoint.items() if p == policy], policy)
        with mode, _NoHostReads():
            trainer = create_amp_trainer(model, optimizer, self.loss_fn, device=self.device,
                                         **{**self.kwargs, "compile": False, "check_split": check})
            warm_optimizer(optimizer)
        self.checkpointed = checkpointed_blocks(model)
        return model, optimizer, trainer

    def fixed(self) -> Dict[str, int]:
        """Parameters, buffers, gradients and optimizer state (no forward needed)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        with quiet_trace():
            model, optimizer, _ = self._build(mode)

        def size(tensors: Any) -> int:
            return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())

        params = list(model.parameters())
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {"parameters": size(params), "buffers": size(model.buffers()),
                "gradients": size(p for p in params if p.requires_grad), "optimizer state": size(state)}

    @property
    def checks_split(self) -> bool:
        """Whether the run's first cut or combined batch runs the one-time split check (``check_split``)."""
        cut = self.kwargs.get("micro_batches", 1) > 1 or self.kwargs.get("accumulation_steps", 1) > 1
        return cut and self.kwargs.get("check_split", True) is not False

    def trace(self, n: int, check: bool = False) -> tuple:
        """``(peak bytes, {kind: bytes at the peak}, FLOPs of one iteration)`` of the step at batch size ``n``: the
        steady step, or with ``check`` the first one, which also runs the one-time split check (its gradients beside
        the step's)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        with quiet_trace():
            model, optimizer, trainer = self._build(mode, check)
            batch = _fake_batch(self.batch, n, mode, self.device)
            tracker = step_tracker()
            tracker.track_external(model, optimizer, *_tensors_of(batch))
            acc = self.kwargs.get("accumulation_steps", 1)
            trainer.state.epoch_length = acc
            iterations = range(max(1, acc - 1), acc + 1)
            with mode, _NoHostReads(), count_flops() as flops, tracker:  # the tracker sees the ops first
                # accumulation: the cycle's last two iterations (the last holds the earlier one's gradients)
                for iteration in iterations:
                    trainer.state.iteration = iteration
                    trainer.amp_step(trainer, batch)
        kinds = _kinds(tracker.get_tracker_snapshot("peak"))
        return sum(kinds.values()), kinds, flops() // len(iterations)
