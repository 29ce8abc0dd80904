"""Nested values (batches and model outputs) walked without stopping at what they do not know.

Mappings (dicts, Hugging Face ``BatchEncoding`` and ``ModelOutput``), namedtuples, lists and tuples are
walked; tensors are transformed; every other leaf (a cache object, a string, a number, None, a custom
object) passes through untouched, where Ignite's ``apply_to_type`` raises ``TypeError``.
"""
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["rebuild", "map_tensors", "detach", "to_float32", "to_channels_last", "to_device", "is_per_sample",
           "join_chunks"]


def rebuild(template: Any, items: Any) -> Any:
    """A container of ``template``'s type holding ``items`` (a dict for mappings, a list for sequences)."""
    if isinstance(template, Mapping):
        kind: Any = type(template)  # a concrete mapping type, whose constructor may take other arguments
        try:
            return kind(items)
        except TypeError:  # a mapping type whose constructor takes something else (defaultdict)
            return dict(items)
    if isinstance(template, tuple) and hasattr(template, "_fields"):  # a namedtuple
        return type(template)(*items)
    return type(template)(items) if isinstance(template, list) else tuple(items)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` applied to every tensor at any nesting; other leaves are returned as they are."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, Mapping):
        return rebuild(value, {k: map_tensors(v, fn) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return rebuild(value, [map_tensors(v, fn) for v in value])
    return value


def detach(value: Any) -> Any:
    """Every tensor at any nesting detached from the autograd graph."""
    return map_tensors(value, torch.Tensor.detach)


def to_float32(value: Any) -> Any:
    """Every float16 and bfloat16 tensor at any nesting in float32 (others as they are)."""
    return map_tensors(value, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)


def to_channels_last(value: Any) -> Any:
    """Every 4-d floating-point tensor at any nesting in channels-last memory format."""
    return map_tensors(value, lambda t: t.contiguous(memory_format=torch.channels_last)
                       if t.dim() == 4 and t.is_floating_point() else t)


def to_device(value: Any, device: Any, non_blocking: bool = False) -> Any:
    """Every tensor at any nesting moved to ``device``; an object with its own ``.to`` (a PyTorch Geometric
    ``Batch``, a dataclass batch that defines one) is moved with ``value.to(device)``; other leaves stay."""
    if device is None:
        return value
    if torch.is_tensor(value):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return rebuild(value, {k: to_device(v, device, non_blocking) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return rebuild(value, [to_device(v, device, non_blocking) for v in value])
    move = getattr(value, "to", None)
    return move(device) if callable(move) and not isinstance(value, (str, bytes, type)) else value


def is_per_sample(value: Any, n: int, tensors_as_samples: bool = False) -> bool:
    """Whether ``value`` is a per-sample list of a batch of ``n``: a list or tuple (not a namedtuple) of ``n``
    items that are not all tensors with ``n`` rows (those are ``n`` batched fields, unless
    ``tensors_as_samples``), nor all lists or tuples (those are fields too: ``(images, targets)``), nor a tensor of
    ``n`` rows beside a list of ``n`` items (fields: a batch of 2 images and its list of 2 target dicts)."""
    if not isinstance(value, (list, tuple)) or hasattr(value, "_fields") or len(value) != n or n == 0:
        return False
    if not tensors_as_samples and all(torch.is_tensor(v) and v.dim() and v.shape[0] == n for v in value):
        return False
    # (images, targets) of n = 2: a tensor of n rows beside a list of n items are two fields of n samples each
    if any(torch.is_tensor(v) and v.dim() and v.shape[0] == n for v in value) and \
            any(isinstance(v, (list, tuple)) and len(v) == n for v in value):
        return False
    return not all(isinstance(v, (list, tuple)) for v in value)


def _same(parts: Sequence[Any]) -> bool:
    first = parts[0]
    if all(p is first for p in parts):
        return True
    simple = (str, bytes, int, float, bool, type(None))
    return isinstance(first, simple) and all(type(p) is type(first) and p == first for p in parts)


def _per_sample_output(value: Any, n: int) -> bool:
    """A chunk's output list of one item per sample (detection's dicts, per-sample masks): per-sample by
    :func:`is_per_sample`, and neither mixing tensors with other items nor holding None or a 0-d tensor,
    which mark a tuple of outputs (``(logits, None)``, ``(logits, aux_loss)``) whatever its length."""
    if not is_per_sample(value, n):
        return False
    tensors = [torch.is_tensor(v) for v in value]
    if any(v is None or (torch.is_tensor(v) and v.dim() == 0) for v in value):
        return False
    return all(tensors) or not any(tensors)


def join_chunks(parts: Sequence[Any], sizes: Sequence[int], weights: Optional[Sequence[Any]] = None) -> Any:
    """Join the outputs of a batch's chunks: ``parts[i]`` came from a chunk of ``sizes[i]`` samples.

    Tensors with a batch dimension are concatenated; a 0-d tensor (a chunk's own mean loss, say)
    becomes the mean of the chunks' values weighted by their samples (or by ``weights``: the items
    ``num_items`` counted in each chunk, for a token-mean loss); per-sample lists are concatenated;
    mappings, namedtuples, lists and tuples are joined element by element. Any other value (None, a
    string, a cache object) is kept once when every chunk gave the same, else as the list of the
    chunks' values, in order.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    n = sum(sizes)
    if all(torch.is_tensor(p) for p in parts):
        if first.dim() == 0:
            if weights is None:
                return sum(p.float() * (s / n) for p, s in zip(parts, sizes, strict=True))
            total = sum(weights)  # a chunk that counted no items (padding only, its mean 0/0) adds nothing
            return sum(torch.where(torch.as_tensor(w) > 0, p.float() * w, torch.zeros_like(p.float()))
                       for p, w in zip(parts, weights, strict=True)) / total
        if all(p.dim() and p.shape[1:] == first.shape[1:] for p in parts):
            return torch.cat(list(parts))
        return list(parts)
    if all(isinstance(p, Mapping) for p in parts) and all(p.keys() == first.keys() for p in parts):
        return rebuild(first, {k: join_chunks([p[k] for p in parts], sizes, weights) for k in first})
    if all(isinstance(p, (list, tuple)) for p in parts):
        if all(_per_sample_output(p, s) for p, s in zip(parts, sizes, strict=True)):
            return type(first)(item for p in parts for item in p) if not hasattr(first, "_fields") else first
        if all(len(p) == len(first) for p in parts):
            return rebuild(first, [join_chunks([p[i] for p in parts], sizes, weights) for i in range(len(first))])
    return first if _same(parts) else list(parts)
