"""What the training step requires of its arguments, checked where it can be.

- the optimizer holds the model's parameters;
- the loss is a scalar and a mean (over samples, or over the items ``num_items`` counts): a
  ``reduction`` attribute or keyword ``"sum"`` or ``"none"`` is refused when the step is built (any other,
  ``"batchmean"`` included, is judged by the split check), and a loss that doubles when the first batch is
  doubled is refused at the first iteration;
- the loss takes the model's output: a dict or tuple given to a loss that takes a tensor names ``model_transform``.
"""
import functools
import logging
import math
from collections.abc import Mapping
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ignite_amp.batching import ignore_index_of
from ignite_amp.core.nested import join_chunks
from ignite_amp.errors import first_line

__all__ = ["check_optimizer", "check_mean_reduction", "check_scalar", "output_hint", "refuse_a_sum", "check_count",
           "warn_padding_without_items", "warn_batch_norm", "ignore_index_of"]

logger = logging.getLogger("ignite_amp")


def check_optimizer(optimizer: Any, model: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer should be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    ids = {id(p) for p in model.parameters()}
    if ids and not any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("optimizer: none of its parameters belong to the model (was it built for another "
                         "model, or before the model was copied?)")


#: Reductions that are not a mean, refused when the step is built; any other name (``"mean"``, KLDivLoss's
#: ``"batchmean"``, a zoo's own) is judged by what the loss does: the split check.
NOT_A_MEAN = {"sum": "a sum over the samples", "none": "one loss per element, not a scalar"}


def check_mean_reduction(loss_fn: Callable) -> None:
    """Micro-batches and accumulation weight each chunk's loss by its share: they need a mean. A reduction that
    says it is not one is refused here; the rest is judged by its behaviour (the split check)."""
    reduction = getattr(loss_fn, "reduction", None)
    if reduction is None and isinstance(loss_fn, functools.partial):
        reduction = loss_fn.keywords.get("reduction")
    if reduction in NOT_A_MEAN:
        mean = ("reduction='batchmean' (the mean over the samples; 'mean' would also divide by the classes)"
                if isinstance(loss_fn, nn.KLDivLoss) else "reduction='mean'")
        raise ValueError(f"loss_fn: reduction={reduction!r} is {NOT_A_MEAN[reduction]}; the step needs a mean "
                         f"(micro-batches and accumulation weight each chunk's mean by its share): use {mean}")


def check_scalar(loss: Any) -> None:
    if not torch.is_tensor(loss) or loss.ndim != 0:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"loss_fn should return a scalar (0-d) tensor, got {shape}: reduce it (mean) "
                         f"over the batch")



def output_hint(exc: Exception, y_pred: Any, y: Any, loss_fn: Callable) -> Optional[str]:
    """The line for a ``loss_fn`` that refused the model's output, a dict, tuple or list, where it takes a tensor
    (torch's "argument 'input' must be Tensor, not dict", or mse_loss's "'dict' object has no attribute 'size'"): it
    names ``model_transform``, with an example that ``loss_fn`` was seen to take (an entry of the output giving a
    scalar loss), where one does. None for another error, or another output: a ``loss_fn`` that takes dicts is left
    alone.
    """
    if not isinstance(y_pred, (Mapping, tuple, list)):
        return None
    said = str(exc)  # torch's words name both: "must be Tensor, not dict", "expected Tensor ..., but got tuple"
    if isinstance(exc, AttributeError):  # a tensor's method asked of the output itself (.size, .dim, .float...)
        if getattr(exc, "obj", None) is not y_pred or not hasattr(torch.Tensor, getattr(exc, "name", None) or "_"):
            return None
    elif not isinstance(exc, TypeError) or "Tensor" not in said or type(y_pred).__name__ not in said:
        return None
    if isinstance(y_pred, Mapping):
        keys = list(y_pred)
        what = f"a dict (keys {', '.join(map(repr, keys[:6]))}{', ...' if len(keys) > 6 else ''})"
        picks = [(f"output[{k!r}]", v) for k, v in y_pred.items() if torch.is_tensor(v)]
    else:
        what = f"a {type(y_pred).__name__} of {len(y_pred)}"
        picks = [(f"output[{i}]", v) for i, v in enumerate(y_pred) if torch.is_tensor(v)]

    def takes(value: torch.Tensor) -> bool:
        try:
            with torch.no_grad():
                loss = loss_fn(value, y)
        except Exception:
            return False
        return torch.is_tensor(loss) and loss.ndim == 0

    example = next((code for code, value in picks[:8] if takes(value)), None)
    how = f"model_transform=lambda output: {example}" if example else "model_transform (output -> what loss_fn takes)"
    return (f"the model returns {what}, and loss_fn takes a tensor ({first_line(exc)}): pass {how}, Ignite's hook "
            f"for what the loss gets of the model's output")


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
    itself (``y`` None) cannot be doubled here, and the any-model guide states the rule for it.
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
                         "by its share): divide it by the samples (reduction='none', then .mean()) or by the items "
                         "it adds up; reduction='mean' is that only where it averages over the samples (CTCLoss's "
                         "also divides each sample by its target length: another objective)")


def check_count(count: Any, device: torch.device, where: str) -> Tuple[Any, Optional[torch.Tensor]]:
    """What ``num_items`` returned (an int, or a 0-d tensor: made float32 on ``device``), checked without a
    host sync on an accelerator; returns the count and a flag of an invalid one (None when there is none).

    On the CPU (no pipeline to stall) a negative or NaN count is a ValueError naming it. Elsewhere it is
    replaced by 0 (it weighs nothing) and the flag (a device tensor) marks it, for the step to make the
    batch's loss NaN, which NonFiniteGuard reports.
    """
    if not (torch.is_tensor(count) and count.ndim == 0):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"num_items should return a non-negative int or a 0-d tensor, got {count!r}")
        return count, None
    count = count.detach().to(device, torch.float32, non_blocking=True)
    if count.device.type == "cpu":
        if not float(count) >= 0:
            raise ValueError(f"num_items returned {float(count):g} for {where}: it counts the items the chunk's "
                             f"mean averages over, a number >= 0")
        return count, None
    valid = count >= 0  # False for NaN too
    return torch.where(valid, count, torch.zeros_like(count)), ~valid


def _is_ctc(module: Optional[nn.Module]) -> bool:
    """A transformers CTC head (``*ForCTC``): a per-sample mean with ``ctc_loss_reduction="mean"``."""
    return module is not None and type(module).__name__.endswith("ForCTC")


def warn_padding_without_items(x: Any, y: Any, loss_fn: Optional[Callable] = None,
                               module: Optional[nn.Module] = None) -> None:
    """One warning when a batch cut or accumulated without num_items (and without the split check, which decides
    from the loss's behaviour) has labels holding the padding its loss ignores (``loss_fn``'s own
    ``ignore_index``, else -100, what Hugging Face losses ignore): a sample mean then differs from the token mean.
    One host read.

    The hint is one the split check passes: a lambda only where the loss's reading of the labels is known, a
    ``y`` read as it is by torch's cross-entropy (its ``ignore_index``, no class weights). Labels a model reads
    itself get what to count, not a lambda: whether it shifts them inside (most ``*ForCausalLM`` do,
    ``BartForCausalLM`` does not) shows in its loss's behaviour, which the split check measures. A CTC head
    (``*ForCTC``) is a per-sample mean with ``ctc_loss_reduction="mean"``: not warned."""
    labels = x.get("labels") if isinstance(x, Mapping) else None  # a BatchEncoding is a Mapping, not a dict
    named = "y" if labels is None else 'x["labels"]'
    labels = y if labels is None else labels
    ignore = ignore_index_of(loss_fn) if named == "y" else None
    pad = -100 if ignore is None else ignore
    if (named != "y" and _is_ctc(module)) or not torch.is_tensor(labels) or labels.is_floating_point() or \
            not bool((labels == pad).any()):
        return
    known = named == "y" and (ignore is not None or _plain_cross_entropy(loss_fn)) and \
        getattr(loss_fn, "weight", None) is None
    if not known:  # how the loss reads the labels is unknown (or a class-weighted mean): what to check, no lambda
        hint = ("pass num_items=fn(x, y) counting the items the loss averages over (the labels it does not ignore, "
                "after any shift the model makes inside; the split check, check_split=True, names the count that "
                "fits)")
    else:
        hint = f"pass num_items=lambda x, y: (y != {pad}).sum()"
    logger.warning("micro-batches or accumulation on labels holding %d (padding) without num_items: each chunk's "
                   "mean weighs by samples, not tokens, so the gradient is not the batch's token mean; %s", pad, hint)


def _plain_cross_entropy(loss_fn: Any) -> bool:
    """torch's cross_entropy or nll_loss called on (y_pred, y) as they are (ignore_index -100)."""
    return loss_fn in (torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss)


def warn_batch_norm(module: nn.Module) -> None:
    """One warning when micro-batches run a model with BatchNorm in training mode."""
    names = [name for name, m in module.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if names:
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        logger.warning("micro-batches on a model with BatchNorm (%s%s): each chunk is normalized with its own "
                       "statistics, so the gradient is no longer exactly the full batch's; GroupNorm or "
                       "LayerNorm keep it exact", names[0], more)
