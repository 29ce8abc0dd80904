"""Batches as a step sees them: their size, their chunks, and the chunks' outputs joined back.

A batch is any nesting of tensors, mappings (dicts, Hugging Face ``BatchEncoding``), lists and
tuples. Its size is the length of the first tensor found. Splitting it into chunks splits every
tensor along dim 0, and a list or tuple of ``n`` non-tensor items (strings, ids: one per sample)
like a tensor; anything else (a scalar, a short list of settings) goes to every chunk whole.
Joining outputs back concatenates at any nesting, in chunk order.
"""
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from ignite.utils import apply_to_type, convert_tensor

__all__ = ["prepare_batch", "batch_size_of", "chunk_sizes", "split_batch", "join_chunks", "to_float32",
           "to_channels_last", "detach"]


def prepare_batch(batch: Any, device: Optional[torch.device] = None, non_blocking: bool = False) -> Tuple[Any, Any]:
    """The default ``prepare_batch``: an ``(x, y)`` pair, or a mapping that is all input.

    - ``(x, y)`` (a tuple or list of two): both moved to ``device``, as Ignite's default does.
    - a mapping (``{"input_ids": ..., "labels": ...}``): ``x`` is the mapping moved to ``device``
      (non-tensor fields kept as they are) and ``y`` is None, so a model that computes its own loss
      is served by ``loss_fn=lambda out, y: out["loss"]`` and ``model_fn=lambda model, x: model(**x)``.

    Anything else is a ValueError that says what to pass instead.
    """
    if isinstance(batch, Mapping):
        return convert_tensor(batch, device=device, non_blocking=non_blocking), None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        return (convert_tensor(x, device=device, non_blocking=non_blocking),
                convert_tensor(y, device=device, non_blocking=non_blocking))
    shape = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__
    raise ValueError(f"batch: the default prepare_batch takes (x, y) pairs or a mapping of inputs, got {shape}: "
                     f"return one of those from the loader, or pass prepare_batch=fn(batch, device, non_blocking) "
                     f"-> (x, y)")


def batch_size_of(batch: Any) -> int:
    """Length of the first tensor (of at least one dimension) found in a (nested) batch."""
    if torch.is_tensor(batch):
        if batch.dim() == 0:
            raise TypeError("a 0-d tensor has no batch dimension")
        return batch.shape[0]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            try:
                return batch_size_of(item)
            except TypeError:
                continue
    raise TypeError(f"cannot find a tensor in the batch (got {type(batch).__name__})")


def chunk_sizes(n: int, chunks: int) -> List[int]:
    """Sizes of ``torch.tensor_split(range(n), chunks)``: the first ``n % chunks`` are one larger."""
    return [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]


def _per_sample(value: Any, n: int) -> bool:
    """A list or tuple with one non-tensor item per sample (strings, ids, per-sample dicts)."""
    return (isinstance(value, (list, tuple)) and len(value) == n and n > 0
            and not any(torch.is_tensor(v) for v in value))


def _rebuild(template: Any, items: Any) -> Any:
    """A container of ``template``'s type holding ``items`` (a dict for mappings, a list for sequences)."""
    if isinstance(template, Mapping):
        try:
            return type(template)(items)
        except TypeError:
            return dict(items)
    if isinstance(template, tuple) and hasattr(template, "_fields"):  # a namedtuple
        return type(template)(*items)
    return type(template)(items) if isinstance(template, list) else tuple(items)


def split_batch(batch: Any, chunks: int) -> List[Any]:
    """Split a (nested) batch into ``chunks`` near-equal parts along the samples.

    Tensors are split along dim 0 into views (no copy, so a pinned batch stays pinned); a list or
    tuple of one non-tensor item per sample is split alongside; other values go to every chunk.
    """
    if chunks == 1:
        return [batch]
    n = batch_size_of(batch)
    sizes = chunk_sizes(n, chunks)

    def split(value: Any) -> List[Any]:
        if torch.is_tensor(value):
            return list(torch.tensor_split(value, chunks)) if value.dim() else [value] * chunks
        if isinstance(value, Mapping):
            parts = {k: split(v) for k, v in value.items()}
            return [_rebuild(value, {k: parts[k][i] for k in value}) for i in range(chunks)]
        if _per_sample(value, n):
            bounds = [sum(sizes[:i]) for i in range(chunks + 1)]
            return [type(value)(value[bounds[i]:bounds[i + 1]]) for i in range(chunks)]
        if isinstance(value, (list, tuple)):
            parts = [split(v) for v in value]
            return [_rebuild(value, [p[i] for p in parts]) for i in range(chunks)]
        return [value] * chunks

    return split(batch)


def join_chunks(parts: Sequence[Any], sizes: Sequence[int]) -> Any:
    """The inverse of :func:`split_batch` for outputs: ``parts[i]`` came from a chunk of ``sizes[i]`` samples.

    Tensors with a batch dimension are concatenated; a 0-d tensor (a chunk's own mean loss, say)
    becomes the mean of the chunks' values weighted by their samples; mappings, lists and tuples
    are joined element by element, and per-sample lists concatenated; None stays None; other
    values are taken from the first chunk.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    n = sum(sizes)
    if torch.is_tensor(first):
        if first.dim() == 0:
            return sum(p.float() * (s / n) for p, s in zip(parts, sizes))
        return torch.cat(list(parts))
    if isinstance(first, Mapping):
        return _rebuild(first, {k: join_chunks([p[k] for p in parts], sizes) for k in first})
    if isinstance(first, (list, tuple)):
        if all(_per_sample(p, s) for p, s in zip(parts, sizes)):
            return type(first)(item for p in parts for item in p)
        return _rebuild(first, [join_chunks([p[i] for p in parts], sizes) for i in range(len(first))])
    return first


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return apply_to_type(value, torch.Tensor, fn)


def to_float32(value: Any) -> Any:
    """Every float16 and bfloat16 tensor at any nesting in float32 (others as they are)."""
    return _map(value, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)


def to_channels_last(value: Any) -> Any:
    """Every 4-d floating-point tensor at any nesting in channels-last memory format."""
    return _map(value, lambda t: t.contiguous(memory_format=torch.channels_last)
                if t.dim() == 4 and t.is_floating_point() else t)


def detach(value: Any) -> Any:
    """Every tensor at any nesting detached from the autograd graph."""
    return _map(value, torch.Tensor.detach)
