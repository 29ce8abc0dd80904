"""Gradient clipping on unscaled gradients, once per optimizer step."""
import dataclasses
from typing import Iterable, Optional, Sequence

import torch
from ignite.engine import Engine

from ignite_amp.core.config_keys import Number, argument, setting
from ignite_amp.core.config_values import Section
from ignite_amp.engine import trainer_step_of
from ignite_amp.errors import ConfigError
from ignite_amp.step.events import AmpEvents
from ignite_amp.step.grad_norm import clip_to_norm_
from ignite_amp.step.train import AmpStep

__all__ = ["ClippingConfig", "GradientClipping"]


@dataclasses.dataclass(frozen=True, eq=False)
class ClippingConfig(Section):
    """handlers.clipping: GradientClipping's arguments; both bounds null turns clipping off."""

    max_norm: Optional[float] = setting(
        1.0, Number(nullable=True), "clip the gradients' total norm to this (null: no norm clip)")
    norm_type: float = setting(2.0, Number(allow_inf=True), "the norm's order (.inf for the max norm)")
    clip_value: Optional[float] = setting(None, Number(nullable=True), "clip each gradient element to [-v, v] instead")

    @staticmethod
    def check_values(values: dict, path: str) -> None:
        if values["max_norm"] is not None and values["clip_value"] is not None:
            raise ConfigError(f"{path}: set max_norm or clip_value, not both (max_norm is {values['max_norm']:g} by "
                              f"default: to clip by value, also set max_norm: null)")


class GradientClipping:
    """Clip gradients by total norm (any ``norm_type``) or by value at ``AmpEvents.GRADS_READY``.

    There the gradients are unscaled, whatever the dtype (float16 with a scaler, bfloat16 and
    float32 without), and the event fires once per optimizer step, not per accumulation step.
    The pre-clip total norm is kept as a device tensor in ``self.last_norm``; no host sync. The
    L2 norm of all the model's gradients is the step's own ``grad_norm`` (computed once, before
    any ``GRADS_READY`` handler), so clipping and logging share it.

    Args:
        max_norm: clip the total norm of the gradients to this value.
        norm_type: the norm's order (``float("inf")`` for the max norm).
        clip_value: clip each gradient element to ``[-clip_value, clip_value]`` instead.
        parameters: what to clip; the trainer's model parameters by default.

    Example:
        >>> import torch
        >>> from ignite_amp import create_amp_trainer
        >>> from ignite_amp.handlers import GradientClipping
        >>> model = torch.nn.Linear(4, 2)
        >>> trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                              torch.nn.functional.cross_entropy, device="cpu")
        >>> clip = GradientClipping(max_norm=0.5)
        >>> clip.attach(trainer)
        >>> _ = trainer.run([(100 * torch.randn(8, 4), torch.randint(0, 2, (8,)))])
        >>> bool(clip.last_norm > 0.5)
        True
    """

    def __init__(self, max_norm: Optional[float] = None, norm_type: float = 2.0,
                 clip_value: Optional[float] = None, parameters: Optional[Iterable[torch.Tensor]] = None):
        if (max_norm is None) == (clip_value is None):
            raise ValueError("Argument max_norm or clip_value should be given, and not both.")
        self.max_norm = argument(ClippingConfig, "max_norm", max_norm)
        self.norm_type = argument(ClippingConfig, "norm_type", norm_type)
        self.clip_value = argument(ClippingConfig, "clip_value", clip_value)
        self.parameters = list(parameters) if parameters is not None else None
        self.last_norm: Optional[torch.Tensor] = None
        self._attached: Optional[_Attached] = None  # made by attach: what each clipping reads

    def __call__(self, engine: Engine) -> None:
        on = self._attached
        if on is None:
            raise RuntimeError("GradientClipping: call clip.attach(trainer) first (it finds the step and the "
                               "parameters; trainer.add_event_handler(..., clip) alone does not)")
        params = on.params
        if not params:
            return
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.clip_value)
            return
        if on.shares_norm:  # the step's norm, and its list and grouping of the same gradients
            step = on.step
            norm = step.grad_norm
            if norm is not None:
                self.last_norm = norm
                step.clip_grad_norm_(self.max_norm)
                return
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], self.norm_type,
                                             foreach=True)
        self.last_norm = norm
        clip_to_norm_(params, self.max_norm, norm)

    def attach(self, engine: Engine) -> None:
        """Clip at each ``AmpEvents.GRADS_READY`` of ``engine`` (a trainer from
        :func:`~ignite_amp.create_amp_trainer`)."""
        step = trainer_step_of(engine, type(self).__name__)
        # Parameters without a gradient at a step are skipped by the clipping functions themselves.
        params = self.parameters if self.parameters is not None else list(step.model.parameters())
        # The step's grad_norm is the L2 norm of every model gradient: the one this clipping needs.
        self._attached = _Attached(step, params, self.parameters is None and self.norm_type == 2.0)
        if self._attached.shares_norm:
            step.track_grad_norm()
        engine.add_event_handler(AmpEvents.GRADS_READY, self)


@dataclasses.dataclass(frozen=True)
class _Attached:
    """What :meth:`GradientClipping.attach` found, read at each clipping."""

    step: AmpStep
    params: Sequence[torch.Tensor]  # clipped (the model's by default)
    shares_norm: bool  # the step's grad_norm is their L2 norm: clipping and logging share it
