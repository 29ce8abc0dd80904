"""Ignite's factory arguments with Ignite's meaning: what ``create_supervised_trainer`` /
``create_supervised_evaluator`` keywords become in :func:`~ignite_amp.create_amp_trainer` /
:func:`~ignite_amp.create_amp_evaluator`, and the one-line errors of a call neither knows.

- ``gradient_accumulation_steps`` is Ignite's name of ``accumulation_steps``; both at once must agree.
- ``amp_mode="amp"`` is float16 autocast (with a ``GradScaler`` unless ``scaler=False``); ``"apex"`` is refused.
- ``device=None`` (Ignite's default: batches stay where the loader put them, the model where it is) is
  the model's device.
- A keyword neither the factory nor its step takes is a ``TypeError`` naming the factory and the
  closest accepted name.
"""
import difflib
import itertools
from typing import Iterable, Optional, Union

import torch
from torch import nn

from ignite_amp.core.config_keys import POSITIVE_INT

__all__ = ["AMP_MODES", "accumulation", "amp_dtype", "model_device", "check_flags", "check_keywords", "score_hint"]

#: Ignite's ``amp_mode`` values and the dtype each means here (``"apex"`` is refused, see :func:`amp_dtype`).
AMP_MODES = {None: None, "amp": "float16"}

# Ignite's message when a Checkpoint's score_function returns something that is not a number.
_NOT_A_NUMBER = "Output of score_function should be a number"
_SCORE_FIX = ("ignite_amp's trainer output is a 0-d tensor (read without a host sync each iteration): add .item(), "
              "e.g. score_function=lambda engine: -engine.state.output.item()")


def accumulation(accumulation_steps: int, gradient_accumulation_steps: int) -> int:
    """The accumulation steps given by either name (1, the default of both, gives way to the other)."""
    POSITIVE_INT.argument(accumulation_steps, "accumulation_steps")
    POSITIVE_INT.argument(gradient_accumulation_steps, "gradient_accumulation_steps")
    if gradient_accumulation_steps == 1:
        return accumulation_steps
    if accumulation_steps not in (1, gradient_accumulation_steps):
        raise ValueError(f"Argument gradient_accumulation_steps ({gradient_accumulation_steps}) is Ignite's name of "
                         f"accumulation_steps ({accumulation_steps}): pass one of them")
    return gradient_accumulation_steps


def amp_dtype(amp_mode: Optional[str], dtype: Union[str, torch.dtype]) -> Union[str, torch.dtype]:
    """The dtype that ``amp_mode`` means (``"amp"``: float16), or ``dtype`` when ``amp_mode`` is None."""
    if amp_mode == "apex":
        raise ValueError("Argument amp_mode: 'apex' (NVIDIA apex) is not supported, torch.amp replaces it: "
                         "pass amp_mode='amp' (float16 with a GradScaler) or dtype='bfloat16'")
    if amp_mode not in AMP_MODES:
        raise ValueError(f"Argument amp_mode should be None or 'amp', got {amp_mode!r}")
    wanted = AMP_MODES[amp_mode]
    if wanted is None:
        return dtype
    if dtype not in ("auto", wanted, getattr(torch, wanted)):
        raise ValueError(f"Argument amp_mode={amp_mode!r} means dtype {wanted}, but dtype is {dtype!r}: "
                         "pass one of them")
    return wanted


def model_device(model: nn.Module) -> Union[str, torch.device]:
    """Ignite's ``device=None``: where the model's first parameter or buffer is (``"auto"`` for a model without)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return "auto"


def check_keywords(factory: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    """A ``TypeError`` naming ``factory`` and the closest accepted name for the first of ``given`` it does not take."""
    accepted = sorted(set(accepted))
    for name in given:
        if name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(accepted)}"
            raise TypeError(f"{factory}() got an unexpected keyword argument {name!r}: {hint}")


def score_hint(error: BaseException) -> BaseException:
    """Ignite's "Output of score_function should be a number" with the one-word fix for a score over the
    trainer's output (a 0-d tensor); any other error unchanged."""
    if not isinstance(error, ValueError) or _NOT_A_NUMBER not in str(error) or _SCORE_FIX in str(error):
        return error
    hinted = ValueError(f"{error}: {_SCORE_FIX}")
    hinted.__cause__ = error
    return hinted



def check_flags(**flags: object) -> None:
    """Ignite's on/off arguments are booleans: a value in their place (``dtype`` passed by position, where
    Ignite's order puts ``non_blocking``) is a TypeError naming the argument."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"Argument {name} should be True or False, got {value!r} (the arguments after device "
                            f"follow Ignite's order; pass dtype= and ignite_amp's other arguments by name)")
