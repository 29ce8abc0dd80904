"""The engines: an Ignite ``Engine`` around a step, and the two factories users call.

:func:`create_amp_trainer` and :func:`create_amp_evaluator` take Ignite's
``create_supervised_trainer`` / ``create_supervised_evaluator`` arguments, in Ignite's order and with
Ignite's meaning (``ignite_amp.step.factory_args``), and ignite_amp's own by keyword; this module also answers
to Ignite's names, so ``from ignite_amp.engine import Events, create_supervised_trainer,
create_supervised_evaluator`` ports an Ignite script (the "Coming from Ignite" guide). Handlers find
the step of an engine with :func:`amp_step_of`.
"""
import dataclasses
import inspect
import logging
import weakref
from typing import Any, Callable, Generic, List, Literal, Optional, TypeVar, Union

import torch
from ignite.engine import Engine, Events, EventsList
from ignite.engine.deterministic import DeterministicEngine
from ignite.engine.events import RemovableEventHandle
from torch import nn

from ignite_amp.batching import prepare_batch as default_prepare_batch
from ignite_amp.core.collectives import broadcast_buffers, is_distributed, is_sharded, unwrap
from ignite_amp.core.config_keys import (
    FIXED,
    POSITIVE_INT,
    Boolean,
    BooleanOrFraction,
    Choice,
    Names,
    argument,
    setting,
)
from ignite_amp.core.config_values import Section
from ignite_amp.core.device import resolve_device
from ignite_amp.step.base import StepBase, call_model, identity
from ignite_amp.step.evaluate import EvalStep
from ignite_amp.step.events import AmpEvents
from ignite_amp.step.factory_args import accumulation, amp_dtype, check_flags, check_keywords, model_device, score_hint
from ignite_amp.step.train import AmpStep
from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks, checkpointed_blocks
from ignite_amp.transforms.cuda_graphs import COMPILE, check_compile
from ignite_amp.transforms.float8 import (
    DEFAULT_RECIPE,
    RECIPES,
    Float8Report,
    convert_to_float8,
    precompute_float8_scales,
)
from ignite_amp.transforms.memory_format import CHANNELS_LAST

__all__ = ["AmpConfig", "AmpEngine", "StepT", "DeterministicAmpEngine", "amp_step_of", "trainer_step_of",
           "create_amp_trainer", "create_amp_evaluator"]

logger = logging.getLogger("ignite_amp")

#: The type of an :class:`AmpEngine`'s step: :class:`~ignite_amp.AmpStep` for a trainer, :class:`~ignite_amp.EvalStep`
#: for an evaluator (``AmpEngine[AmpStep]``), so a type checker knows ``trainer.amp_step.scaler``.
StepT = TypeVar("StepT", bound=StepBase)


@dataclasses.dataclass(frozen=True, eq=False)
class AmpConfig(Section):
    """amp: the step's precision and how a batch is cut (create_amp_trainer's arguments)."""

    dtype: str = setting("auto", Choice("auto", "float16", "bfloat16", "float32", "float8"),
                         "auto: bfloat16 on recent GPUs and AMX CPUs, float16 on older GPUs; on another CPU float32, "
                         "or bfloat16 where a config run's timed probe finds it faster; "
                         "float8: eligible Linear layers in float8 (torchao), the rest in bfloat16 autocast")
    float8_recipe: str = setting(DEFAULT_RECIPE, Choice(*RECIPES), "dtype float8: torchao's scaling recipe")
    accumulation_steps: int = setting(1, POSITIVE_INT, "batches whose gradients add up to one optimizer step", FIXED)
    micro_batches: int = setting(1, POSITIVE_INT, "chunks each batch is split into (same gradient, less memory)")
    fp32_modules: List[str] = setting([], Names(), "names of submodules kept out of autocast")
    channels_last: Union[bool, Literal["auto"]] = setting(
        "auto", CHANNELS_LAST, "channels-last memory format for model and images; auto: "
        "on CUDA when 2-d convolutions hold at least half of the model's weights")
    compile: Union[None, bool, Literal["reduce-overhead"]] = setting(
        None, COMPILE,
        "torch.compile the forward (null: on for float8 on a GPU, else off); reduce-overhead: "
        "with CUDA graphs, checked against the eager step first, eager again where shapes change "
        "too often or memory runs out")
    activation_checkpointing: Union[bool, Literal["auto", "selective"]] = setting(
        False, Boolean(also=("auto", "selective")), "the model's repeated blocks (distributed.blocks, or the rule "
        "FSDP2 shards by) keep only their inputs and run their forward again in the backward: less activation memory, "
        "same gradients, about one more forward of compute; selective: they keep the outputs of their matmuls, "
        "convolutions and attention too and recompute only the rest (less recompute, less memory saved); auto: the "
        "cheapest of none, selective and full on some or all blocks that makes the planned step fit the GPU's "
        "memory at data.batch_size (ignite-amp plan); may change on resume")
    cudnn_benchmark: bool = setting(True, Boolean(), "CUDA: autotune convolutions once for the fixed image shapes")
    check_split: Union[bool, float] = setting(
        True, BooleanOrFraction(), "check on the first batches cut or combined (micro-batches, accumulation, an "
        "out-of-memory retry, DDP) that their weighted chunks give their gradient, then spot checks through the run "
        "within a share of the step time (true: 0.02; a fraction: that share); false accepts a loss that fails the "
        "check knowingly")


class AmpEngine(Engine, Generic[StepT]):
    """An Ignite ``Engine`` that knows which :class:`~ignite_amp.AmpEvents` have handlers, so the step fires only those.

    Typed by its step: :func:`create_amp_trainer` makes an ``AmpEngine[AmpStep]``, :func:`create_amp_evaluator` an
    ``AmpEngine[EvalStep]`` (``trainer.amp_step.scaler`` type-checks).

    ``Engine.fire_event`` costs about 15 us of host time even when nothing listens (it checks
    the event against every registered one); twice per iteration that is a visible share of a
    small model's step. :meth:`fire_amp_event` skips events no handler was ever added to.
    """

    amp_step: StepT  #: the process function (:func:`amp_step_of` reads it)

    def __init__(self, process_function: Callable):
        super().__init__(process_function)
        # Filters count iterations: AmpEvents.GRADS_READY(every=10) fires on every 10th iteration that steps.
        self.register_events(*AmpEvents, event_to_attr={event: "iteration" for event in AmpEvents})
        self._listened: set = set()  # names of AmpEvents with a handler (never shrinks: always safe)

    def add_event_handler(self, event_name: Any, handler: Callable, *args: Any, **kwargs: Any) -> RemovableEventHandle:
        handle = super().add_event_handler(event_name, handler, *args, **kwargs)
        for event in (event_name if isinstance(event_name, EventsList) else (event_name,)):
            self._listened.add(getattr(event, "name", event))  # a filtered event keeps its name
        return handle

    def fire_amp_event(self, event: AmpEvents) -> None:
        """Run the handlers of ``event`` (registered by this engine), if it has any."""
        if event.name in self._listened:
            self._fire_event(event)

    def _fire_event(self, event_name: Any, *event_args: Any, **event_kwargs: Any) -> None:
        # Ignite's loop without its per-event debug line, whose f-string (the state and the event formatted)
        # costs about a microsecond per event even with debug logging off: four events and more per iteration.
        # Ignite has no public way around that line. The copy's canary: tests/step/test_engine.py (Ignite's
        # body, hashed, is one this copy was read against; the same calls as Ignite's), on every tested Ignite.
        if self.logger.isEnabledFor(logging.DEBUG):
            return super()._fire_event(event_name, *event_args, **event_kwargs)
        self.last_event_name = event_name
        for func, args, kwargs in self._event_handlers[event_name]:
            if event_kwargs:
                kwargs.update(event_kwargs)
            if args and isinstance(args[0], weakref.ref):  # Ignite 0.5.3 on: the engine as a weak reference
                engine = args[0]()
                if engine is None:
                    raise RuntimeError("Engine reference not resolved. Cannot execute event handler.")
                func(engine, *event_args, *args[1:], **kwargs)
            elif args and args[0] is self:  # Ignite 0.5.0 to 0.5.2: the engine itself
                func(self, *event_args, *args[1:], **kwargs)
            else:  # metrics do not take the engine
                func(*event_args, *args, **kwargs)

    def _handle_exception(self, e: BaseException) -> None:
        # Ignite's only hook between a handler's error and the user (EXCEPTION_RAISED handlers, else a re-raise):
        # its "score_function should be a number" gets the fix for a score over the 0-d tensor output.
        super()._handle_exception(score_hint(e))


class DeterministicAmpEngine(DeterministicEngine, AmpEngine[StepT]):
    """``deterministic=True``: an :class:`AmpEngine` with Ignite's ``DeterministicEngine`` behaviour
    (the dataloader's sampling and random states restored per epoch, so a resumed run sees the same batches)."""


def _engine(step: StepT, deterministic: bool = False) -> AmpEngine[StepT]:
    engine: AmpEngine[StepT] = (DeterministicAmpEngine if deterministic else AmpEngine)(step)
    engine.amp_step = step
    return engine


def _check_keywords(factory: Callable, step: type, kwargs: dict) -> None:
    """Every keyword left for the step is one the step (or the float8 conversion) takes; the closest name otherwise.
    ``compile`` is checked here too, before float8 converts the model in place."""
    accepted = {*inspect.signature(factory).parameters, *inspect.signature(step).parameters,
                "float8_recipe", "float8_filter"} - {"self", "kwargs"}
    check_keywords(factory.__name__, kwargs, accepted)
    if "compile" in kwargs:
        check_compile(kwargs["compile"])


def amp_step_of(engine: Engine) -> StepBase:
    """The step of an engine made by :func:`create_amp_trainer` or :func:`create_amp_evaluator`.

    Handlers call it once, in ``attach``; a plain Ignite engine is a TypeError naming the fix.
    """
    step = getattr(engine, "amp_step", None)
    if not isinstance(step, StepBase):
        raise TypeError("expected an engine made by ignite_amp.create_amp_trainer (or create_amp_evaluator), "
                        "got a plain Ignite Engine")
    return step


def trainer_step_of(engine: Engine, handler: str) -> AmpStep:
    """:func:`amp_step_of` for a handler that needs the training step (its scaler, gradients, optimizer):
    an evaluator is a TypeError naming ``handler`` and the engine it attaches to."""
    step = amp_step_of(engine)
    if not isinstance(step, AmpStep):
        raise TypeError(f"{handler} attaches to a trainer (made by ignite_amp.create_amp_trainer), got an evaluator "
                        f"(its step has no gradients)")
    return step


def _float8(model: nn.Module, device: Any, dtype: Any, kwargs: dict, say: bool = True) -> tuple:
    """``dtype="float8"``: the model's eligible Linear layers converted (the first transform, see
    ``ignite_amp.transforms.float8``), and the autocast dtype (bfloat16) and report the step keeps.

    On a GPU it turns ``compile`` on unless the caller set it: torchao's float8 casts and scales are
    separate kernels that only torch.compile fuses; without it float8 runs slower than bfloat16.
    """
    recipe, module_filter = kwargs.pop("float8_recipe", DEFAULT_RECIPE), kwargs.pop("float8_filter", None)
    if dtype != "float8":
        return dtype, None
    device = resolve_device(device)
    report = convert_to_float8(unwrap(model), recipe, device, kwargs.get("fp32_modules", ()), module_filter)
    if not report.emulated and kwargs.get("compile") is None:
        kwargs["compile"] = True
        if say:  # the trainer says it; its evaluator follows silently
            logger.warning("float8: compile turned on (torchao's float8 casts are only fast fused by torch.compile; "
                           "compile=False turns it off)")
    return "bfloat16", report


def _with_float8(step: StepT, report: Optional[Float8Report]) -> StepT:
    step.float8 = report
    return step


def create_amp_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable,
    device: Union[str, torch.device, None] = "auto",
    non_blocking: bool = True,
    prepare_batch: Callable = default_prepare_batch,
    model_transform: Callable[[Any], Any] = identity,
    output_transform: Optional[Callable] = None,
    deterministic: bool = False,
    amp_mode: Optional[str] = None,
    scaler: Union[bool, torch.amp.GradScaler, None] = None,
    gradient_accumulation_steps: int = 1,
    model_fn: Callable[[nn.Module, Any], Any] = call_model,
    *,
    dtype: Union[str, torch.dtype] = "auto",
    accumulation_steps: int = 1,
    num_items: Optional[Callable[[Any, Any], Any]] = None,
    activation_checkpointing: Union[bool, str] = False,
    **kwargs: Any,
) -> AmpEngine[AmpStep]:
    """An Ignite ``Engine`` whose process function is an :class:`AmpStep` (``trainer.amp_step``).

    The arguments up to ``model_fn`` are Ignite's ``create_supervised_trainer``'s, in its order and with
    its meaning (the differences, each with its reason, are in the "Coming from Ignite" guide):
    ``device=None`` is the model's device, ``amp_mode="amp"`` is ``dtype="float16"``, ``scaler`` a
    ``GradScaler`` used as given (or True/False: one forced on or off; None: on for float16 only),
    ``deterministic=True`` an Ignite ``DeterministicEngine``, ``gradient_accumulation_steps`` the alias of
    ``accumulation_steps``. ``trainer.state.scaler`` is the step's scaler, as in Ignite (checkpoint it as
    ``to_save["scaler"]``). The rest are keyword-only.

    ``model_fn(model, x)``, ``model_transform(output)`` and ``output_transform(x, y, y_pred, loss)``
    are Ignite's hooks with Ignite's names; ``num_items(x, y)`` counts what a mean loss averages
    over. ``activation_checkpointing=True`` checkpoints the model's repeated blocks in place before the
    step compiles it (``"selective"``: they keep their matmuls', convolutions' and attention's outputs)
    (:func:`ignite_amp.transforms.activation_checkpointing.checkpoint_blocks`; a model sharded with FSDP2
    has them checkpointed by ``shard_model(..., activation_checkpointing=True)``). Other keyword
    arguments go to :class:`AmpStep` (``micro_batches``, ``channels_last``, ``compile``, ``fp32_modules``,
    ``scaler_kwargs``, ``batch_size``, ``split_batch``); an unknown one is a TypeError naming the closest
    accepted name. ``compile`` left unset (None) is on for float8 on a GPU and off otherwise; True or False is kept.

    ``dtype="float8"`` converts the model's eligible ``nn.Linear`` layers to torchao's float8 training
    (``float8_recipe``: tensorwise | rowwise | rowwise_with_gw_hp; ``float8_filter(module, name) -> bool``
    replaces the default choice) and runs the rest in bfloat16 autocast, with no GradScaler; the step's
    ``float8`` says which layers were converted and why the others were not
    (``ignite_amp.transforms.float8``; see the precision guide).

    Example:
        >>> import torch
        >>> from ignite_amp import create_amp_trainer
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> trainer = create_amp_trainer(model, opt, torch.nn.functional.cross_entropy, device="cpu", dtype="bfloat16")
        >>> data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 3
        >>> state = trainer.run(data, max_epochs=2)
        >>> state.iteration, trainer.amp_step.dtype
        (6, torch.bfloat16)
    """
    _check_keywords(create_amp_trainer, AmpStep, kwargs)
    check_flags(non_blocking=non_blocking, deterministic=deterministic)
    device = model_device(model) if device is None else device
    # The model transforms in their fixed order: float8 first, then activation checkpointing (the precision guide,
    # docs/guides/precision.md).
    dtype, float8 = _float8(model, device, amp_dtype(amp_mode, dtype), kwargs)
    if argument(AmpConfig, "activation_checkpointing", activation_checkpointing) == "auto":
        raise ValueError("Argument activation_checkpointing='auto' needs a batch and a memory to plan for: call "
                         "ignite_amp.memory_plan.auto_checkpoint.checkpoint_to_fit(model, optimizer, loss_fn, batch, "
                         "batch_size) first")
    if activation_checkpointing:
        _checkpoint_activations(unwrap(model), "selective" if activation_checkpointing == "selective" else "full")
    step = AmpStep(model, optimizer, loss_fn, device=device, dtype=dtype,
                   accumulation_steps=accumulation(accumulation_steps, gradient_accumulation_steps),
                   non_blocking=non_blocking, prepare_batch=prepare_batch, model_fn=model_fn,
                   model_transform=model_transform, output_transform=output_transform, num_items=num_items,
                   scaler=scaler, **kwargs)
    engine = _engine(_with_float8(step, float8), deterministic)
    # Ignite's place for it (its docs checkpoint it as to_save["scaler"]); State takes any attribute
    engine.state.scaler = step.scaler  # type: ignore[attr-defined]
    if float8 is None:  # an evaluator's float8 would convert the layers this trainer trains (see create_amp_evaluator)
        unwrap(model)._ignite_amp_trained_in = step.dtype  # type: ignore[assignment]  # (torch: tensors/modules only)
    engine.add_event_handler(Events.COMPLETED, _say_if_never_checked, step)
    if float8 is not None and float8.fsdp_all_gather and step.fsdp is not None:
        # float8 all-gather: the weights' scales for the next forward, once per optimizer step
        engine.add_event_handler(AmpEvents.OPTIMIZER_STEPPED, lambda _: precompute_float8_scales(step.model))
    return engine


def _say_if_never_checked(engine: Engine, step: AmpStep) -> None:
    """A run that cut or combined batches and ended with its split check never conclusive says so (a short run
    ends before the check's own warning after its tries)."""
    check = step.split_check
    if check.inconclusive and not check.batches:
        logger.warning(check.summary())


def _checkpoint_activations(model: nn.Module, policy: str) -> None:
    """The factory's activation checkpointing: blocks checkpointed already (by the user or shard_model) stay."""
    if checkpointed_blocks(model):
        return
    if is_sharded(model):
        raise ValueError("Argument activation_checkpointing: the model is sharded already, and checkpointing must "
                         "come before sharding; pass activation_checkpointing=True to shard_model instead")
    checkpoint_blocks(model, policy=policy)


def create_amp_evaluator(
    model: nn.Module,
    metrics: Optional[dict] = None,
    device: Union[str, torch.device, None] = "auto",
    non_blocking: bool = True,
    prepare_batch: Callable = default_prepare_batch,
    model_transform: Callable[[Any], Any] = identity,
    output_transform: Optional[Callable] = None,
    amp_mode: Optional[str] = None,
    model_fn: Callable[[nn.Module, Any], Any] = call_model,
    *,
    dtype: Union[str, torch.dtype] = "auto",
    **kwargs: Any,
) -> AmpEngine[EvalStep]:
    """An Ignite ``Engine`` evaluating ``model`` under autocast with no grad, with ``metrics`` attached.

    The arguments up to ``model_fn`` are Ignite's ``create_supervised_evaluator``'s, in its order and with
    its meaning (``device=None``: the model's device; ``amp_mode="amp"``: ``dtype="float16"``); ``dtype``
    and the rest are keyword-only.

    Metrics whose constructor takes a ``device`` keep their state there (pass them built with
    ``device=...``; a config run does), so evaluation does not sync the
    host per batch. A DDP-wrapped model is evaluated through its module. Under data-parallel
    training every rank runs the evaluator on its shard (Ignite's metrics add the ranks up),
    after receiving rank 0's buffers.

    ``model_fn``, ``model_transform`` and ``output_transform(x, y, y_pred)`` (default ``(y_pred, y)``)
    are Ignite's hooks; ``y_pred`` holds float32 tensors at any nesting, the full batch's whatever the
    micro-batches. Other keyword arguments go to :class:`EvalStep` (``micro_batches``,
    ``channels_last``, ``compile``, ``fp32_modules``, ``batch_size``, ``split_batch``).
    ``dtype="float8"`` converts the model's Linear layers in place: refused when the model's trainer
    runs another dtype (it would train them in float8 too).
    """
    _check_keywords(create_amp_evaluator, EvalStep, kwargs)
    check_flags(non_blocking=non_blocking)
    model = unwrap(model)  # evaluation never communicates: no DDP forward
    trained_in = getattr(model, "_ignite_amp_trained_in", None)
    if dtype == "float8" and trained_in is not None and getattr(model, "_ignite_amp_float8", None) is None:
        raise ValueError(f"Argument dtype: float8 converts the model's Linear layers in place, and its trainer runs "
                         f"{trained_in}: that trainer would then train them in float8; evaluate in the trainer's "
                         f"dtype, or give the trainer dtype=\"float8\" too")
    device = model_device(model) if device is None else device
    dtype, float8 = _float8(model, device, amp_dtype(amp_mode, dtype), kwargs, say=False)
    evaluator = _engine(_with_float8(EvalStep(model, device=device, dtype=dtype, non_blocking=non_blocking,
                                              prepare_batch=prepare_batch, model_fn=model_fn,
                                              model_transform=model_transform, output_transform=output_transform,
                                              **kwargs), float8))
    if is_distributed():  # every rank evaluates its shard with rank 0's buffers (see AmpStep)
        evaluator.add_event_handler(Events.STARTED, lambda _: broadcast_buffers(model))
    for name, metric in (metrics or {}).items():
        metric.attach(evaluator, name)
    return evaluator


# Ignite's names, so that ``from ignite.engine import Engine, Events, create_supervised_trainer,
# create_supervised_evaluator`` ports by changing ``ignite.engine`` to ``ignite_amp.engine`` (Engine and
# Events are Ignite's own, imported above; tests/step/test_ignite_parity.py runs such a script).
#: Ignite's name of :func:`create_amp_trainer` (see the "Coming from Ignite" guide).
create_supervised_trainer = create_amp_trainer
#: Ignite's name of :func:`create_amp_evaluator` (see ``create_supervised_trainer``).
create_supervised_evaluator = create_amp_evaluator
