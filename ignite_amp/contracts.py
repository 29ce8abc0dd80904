"""What the training step requires of its arguments, checked where it can be.

- the optimizer holds the model's parameters;
- the loss is a scalar and a mean (over samples, or over the items ``num_items`` counts): a
  ``reduction`` attribute or keyword other than ``"mean"`` is refused when the step is built, and
  a loss that doubles when the first batch is doubled is refused at the first iteration.
"""
import functools
import math
from typing import Any, Callable

import torch
from torch import nn

from ignite_amp.tree import join_chunks

__all__ = ["check_optimizer", "check_mean_reduction", "check_scalar", "refuse_a_sum"]


def check_optimizer(optimizer: Any, model: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer should be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    ids = {id(p) for p in model.parameters()}
    if ids and not any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("optimizer: none of its parameters belong to the model (was it built for another "
                         "model, or before the model was copied?)")


def check_mean_reduction(loss_fn: Callable) -> None:
    """Micro-batches and accumulation weight each chunk's loss by its share: they need a mean."""
    reduction = getattr(loss_fn, "reduction", None)
    if reduction is None and isinstance(loss_fn, functools.partial):
        reduction = loss_fn.keywords.get("reduction")
    if reduction is not None and reduction != "mean":
        raise ValueError(f"loss_fn: reduction={reduction!r}; the step needs a mean-reduced loss (micro-batches "
                         f"and accumulation weight each chunk's mean by its share of the samples)")


def check_scalar(loss: Any) -> None:
    if not torch.is_tensor(loss) or loss.ndim != 0:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"loss_fn should return a scalar (0-d) tensor, got {shape}: reduce it (mean) "
                         f"over the batch")



def check_requires_grad(loss: torch.Tensor, model: nn.Module) -> None:
    """A loss backward cannot go through: say why, rather than torch's "element 0 of tensors does not require grad"."""
    if loss.requires_grad:
        return
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("loss_fn: the loss does not require grad: no parameter of the model requires grad (a frozen "
                         "model?); unfreeze what should train")
    raise ValueError("loss_fn: the loss does not require grad: it was computed without the model's parameters (an "
                     "integer or argmax-based loss, .detach(), torch.no_grad()); return a differentiable loss")


def refuse_a_sum(loss_fn: Callable, loss: torch.Tensor, y_pred: Any, y: Any, autocast: Callable) -> None:
    """Refuse a loss that doubles on the batch doubled: it sums over the samples (one host sync).

    Where the loss is ``loss_fn(y_pred, y)`` with a tensor ``y``: ``y_pred`` a tensor, or a mapping or
    sequence of outputs whose tensors with a batch dimension are doubled. A loss the model computed
    itself (``y`` None) cannot be doubled here, and the README states the rule for it.
    """
    if not (torch.is_tensor(y) and y.dim()):
        return
    if torch.is_tensor(y_pred):
        if not (y_pred.dim() and len(y_pred) == len(y)):
            return
        twice = torch.cat([y_pred, y_pred])
    else:  # a mapping or sequence of outputs (logits and more): each output with a batch dimension, doubled
        n = len(y)
        twice = join_chunks([y_pred, y_pred], [n, n])
    with torch.no_grad(), autocast():
        try:
            doubled = loss_fn(twice, torch.cat([y, y]))
        except Exception:  # outputs that do not double along the batch: nothing to compare
            return
    if not torch.is_tensor(doubled) or doubled.dim():
        return
    single, double = float(loss.detach()), float(doubled)
    if abs(single) > 1e-12 and math.isclose(double, 2 * single, rel_tol=1e-3):
        raise ValueError("loss_fn: its value doubles when the batch is doubled, so it sums over the samples; "
                         "the step needs a mean (micro-batches, accumulation and DDP weigh each chunk's mean "
                         "by its share): use reduction='mean', or divide by the sample or item count")
