"""Gradient clipping on unscaled gradients, once per optimizer step."""
from typing import Iterable, Optional

import torch
from ignite.engine import Engine

from handlers._grad_norm import total_grad_norm
from ignite_amp.events import AmpEvents

__all__ = ["GradientClipping"]


class GradientClipping:
    """Clip gradients by total norm (any ``norm_type``) or by value at ``AmpEvents.GRADS_READY``.

    There the gradients are unscaled, whatever the dtype (float16 with a scaler, bfloat16 and
    float32 without), and the event fires once per optimizer step, not per accumulation step.
    The pre-clip total norm is kept as a device tensor in ``self.last_norm`` and
    ``engine.state.grad_norm`` for logging; no host sync.

    Args:
        max_norm: clip the total norm of the gradients to this value.
        norm_type: the norm's order (``float("inf")`` for the max norm).
        clip_value: clip each gradient element to ``[-clip_value, clip_value]`` instead.
        parameters: what to clip; the trainer's model parameters by default.

    Example:
        >>> import torch
        >>> from ignite_amp import create_amp_trainer
        >>> from handlers import GradientClipping
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
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"Argument max_norm should be a positive number, got {max_norm!r}.")
        if clip_value is not None and not (isinstance(clip_value, (int, float)) and clip_value > 0):
            raise ValueError(f"Argument clip_value should be a positive number, got {clip_value!r}.")
        if not (isinstance(norm_type, (int, float)) and norm_type > 0):
            raise ValueError(f"Argument norm_type should be a positive number, got {norm_type!r}.")
        self.max_norm = max_norm
        self.norm_type = float(norm_type)
        self.clip_value = clip_value
        self.parameters = list(parameters) if parameters is not None else None
        self.last_norm: Optional[torch.Tensor] = None

    def __call__(self, engine: Engine) -> None:
        params = self.parameters if self.parameters is not None else list(engine.amp_step.model.parameters())
        params = [p for p in params if p.grad is not None]
        self.last_norm = total_grad_norm(engine, params, self.norm_type, share=self.parameters is None)
        if self.max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, self.last_norm)
        else:
            torch.nn.utils.clip_grad_value_(params, self.clip_value)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(AmpEvents.GRADS_READY, self)
