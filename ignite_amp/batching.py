"""Batches as a step sees them: the default ``prepare_batch``, and how ``(x, y)`` is counted and cut.

The step calls ``prepare_batch`` first, then counts and cuts what it returned, with the hooks
``batch_size(x, y) -> int`` and ``split_batch(x, y, chunks) -> [(x, y), ...]``; the defaults here serve
tensors, mappings, dataclasses, namedtuples, tuples of fields and per-sample lists:

- **The number of samples** is the first dimension ``x``'s tensors share: every tensor outside a list (in
  mappings, dataclass fields and namedtuples too) must agree, a leading size of 1 counting as broadcast.
  ``y``'s tensors agree with it, or hold a row per position of an ``(n, T, ...)`` input of ``x`` (flattened
  per-token targets); anything else is one line (a sequence-first ``(T, n, F)`` input is not guessed).
  Without such a tensor in ``x``, ``y``'s rows; without any, a list or tuple says it: of tensors,
  either their shared first dimension (several batched inputs) or its length (one tensor per sample);
  of other items (per-sample dicts, strings), its length. Tensors that disagree are one line naming
  them and the ``batch_size`` hook.
- **A per-sample list** is a list or tuple of ``n`` items (``n`` the number of samples) that are not all
  tensors with ``n`` rows, nor all lists or tuples: torchvision detection's list of images and list of
  target dicts, a list of strings. It is cut by slicing. A list of ``n`` tensors that all have ``n`` rows
  is one tensor per sample when the batch also holds such a list of other items (3 RGB images beside
  3 target dicts), else ``n`` batched inputs.
- **Cutting**: a tensor with ``n`` rows is split along dim 0 into views (no copy); a 0-d tensor or one of
  leading size 1 goes to every chunk whole, as do strings, numbers and a list that is not per-sample
  (settings); mappings, dataclasses, namedtuples and tuples are cut field by field. A tensor with some
  other number of rows, or an object that holds tensors (a graph ``Batch``), cannot be cut: one line
  naming it and the ``split_batch`` hook.
- **Labels a loss ignores**: :func:`ignore_index_of` reads the label value a loss skips (its ``ignore_index``),
  for the step's padding warning and the split check's token counts.
"""
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from ignite_amp.core.nested import is_per_sample, rebuild, to_device
from ignite_amp.errors import BatchError

__all__ = ["prepare_batch", "batch_size_of", "split_batch", "split_pairs", "chunk_sizes", "split_into",
           "ignore_index_of"]

SIZE_HOOK = "pass batch_size=fn(x, y) -> int"
SPLIT_HOOK = "pass split_batch=fn(x, y, chunks) -> [(x, y), ...]"


def prepare_batch(batch: Any, device: Optional[torch.device] = None, non_blocking: bool = False) -> Tuple[Any, Any]:
    """The default ``prepare_batch``: an ``(x, y)`` pair, or a mapping that is all input.

    - ``(x, y)`` (a tuple or list of two, or a tensor of two rows: ``x, y = batch`` as Ignite's
      ``_prepare_batch`` unpacks it): both moved to ``device``, as Ignite's default does.
    - a mapping (``{"input_ids": ..., "labels": ...}``): ``x`` is the mapping moved to ``device`` and
      ``y`` is None, so a model that computes its own loss is served by ``loss_fn=lambda out, y: out["loss"]``
      and ``model_fn=lambda model, x: model(**x)``.

    Non-tensor values (ints, floats, None, strings, ragged lists) are kept as they are; an object with
    its own ``.to`` is moved with it. Anything else is a ValueError that says what to pass instead.
    """
    if isinstance(batch, Mapping):
        return to_device(batch, device, non_blocking), None
    if isinstance(batch, (tuple, list)) and len(batch) == 2 or torch.is_tensor(batch) and batch.shape[:1] == (2,):
        x, y = batch
        return to_device(x, device, non_blocking), to_device(y, device, non_blocking)
    shape = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else
             f"a tensor of shape {tuple(batch.shape)}" if torch.is_tensor(batch) else type(batch).__name__)
    raise ValueError(f"batch: the default prepare_batch takes (x, y) pairs or a mapping of inputs, got {shape}: "
                     f"return one of those from the loader, or pass prepare_batch=fn(batch, device, non_blocking) "
                     f"-> (x, y)")


def chunk_sizes(n: int, chunks: int) -> List[int]:
    """Sizes of ``torch.tensor_split(range(n), chunks)``: the first ``n % chunks`` are one larger."""
    return [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]


def _fields(value: Any) -> Optional[dict]:
    """The named parts of a mapping or a dataclass instance, else None."""
    if isinstance(value, Mapping):
        return dict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return None


def _name(path: str, key: Any, value: Any) -> str:
    return f"{path}[{key!r}]" if isinstance(value, Mapping) else f"{path}.{key}"


def _evidence(value: Any, path: str) -> Iterator[Tuple[str, str, Any]]:
    """``(kind, path, size)`` for each part that tells the number of samples: ``"tensor"`` (a tensor outside
    any list: its rows), ``"tensors"`` (a list of tensors: its shared rows or None, and its length),
    ``"items"`` (a list of other items: its length)."""
    if torch.is_tensor(value):
        if value.dim():
            yield "tensor", path, value.shape[0]
        return
    fields = _fields(value)
    if fields is not None or (isinstance(value, tuple) and hasattr(value, "_fields")):
        named = fields if fields is not None else value._asdict()
        for key, item in named.items():
            yield from _evidence(item, _name(path, key, value) if fields is not None else f"{path}.{key}")
        return
    if not isinstance(value, (list, tuple)) or not value:
        return
    tensors = [torch.is_tensor(v) and v.dim() > 0 for v in value]
    if all(isinstance(v, (list, tuple)) for v in value) or (any(tensors) and not all(tensors)):
        # fields: (images, targets), (a tensor, a list of strings)
        for i, item in enumerate(value):
            yield from _evidence(item, f"{path}[{i}]")
    elif all(tensors):
        rows = {v.shape[0] for v in value}
        yield "tensors", path, (rows.pop() if len(rows) == 1 else None, len(value))  # (as inputs, as samples)
    elif not any(isinstance(v, (str, bytes, int, float, bool)) or v is None for v in value) or \
            all(isinstance(v, (str, bytes)) for v in value):
        yield "items", path, len(value)  # per-sample dicts or strings; a list of numbers may be settings


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor at any nesting (mappings, dataclass fields, lists and tuples)."""
    if torch.is_tensor(value):
        yield value
        return
    fields = _fields(value)
    for item in (fields.values() if fields is not None else value if isinstance(value, (list, tuple)) else ()):
        yield from _tensors(item)


def _rows(found: List[Tuple[str, str, Any]]) -> Optional[int]:
    """The rows the tensors of one side (``x`` or ``y``) agree on (1 counts as broadcast), or None."""
    rows = [(path, size) for kind, path, size in found if kind == "tensor"]
    sizes = {size for _, size in rows}
    if len(sizes) > 1:
        sizes.discard(1)
    if len(sizes) > 1:
        shown = ", ".join(f"{path} has {size}" for path, size in rows[:4])
        raise BatchError(f"batch: its tensors disagree on the number of samples ({shown}): {SIZE_HOOK} "
                         f"(and {SPLIT_HOOK.split('pass ')[1]} for micro-batches)")
    return sizes.pop() if sizes else None


def batch_size_of(x: Any, y: Any = None) -> int:
    """The default ``batch_size(x, y)``: the number of samples (see the module's rules).

    Raises ``ignite_amp.errors.BatchError`` (one line naming the parts and the hook) when the tensors disagree or
    nothing tells it.
    """
    in_x, in_y = list(_evidence(x, "x")), list(_evidence(y, "y"))
    n, targets = _rows(in_x), _rows(in_y)
    if n is not None and targets is not None and targets != n:
        # Flattened per-token targets: y has a row per position of an (n, T, ...) input. Anything else (a
        # graph's 16 labels beside its 113 nodes, a sequence-first (T, n, F) input) is not guessed.
        if not any(t.dim() >= 2 and t.shape[0] * t.shape[1] == targets for t in _tensors(x)):
            raise BatchError(f"batch: x and y disagree on the number of samples (x has {n} rows, y {targets}): "
                             f"{SIZE_HOOK} (and {SPLIT_HOOK.split('pass ')[1]} for micro-batches)")
        return n
    if n is not None:
        return n
    if targets is not None:
        return targets
    lists = [(kind, size) for kind, _, size in in_x + in_y if kind != "tensor"]
    if lists:
        common = set.intersection(*({v for v in size if v is not None} if kind == "tensors" else {size}
                                    for kind, size in lists))
        if len(common) == 1:
            return common.pop()
        if common:  # lists of n tensors of d rows and nothing else: d, as n batched inputs
            return next(size[0] for kind, size in lists if kind == "tensors")
    raise BatchError(f"batch: cannot tell its number of samples (x is {type(x).__name__}, y is "
                     f"{type(y).__name__}): {SIZE_HOOK}")


def split_into(value: Any, n: int, chunks: int, path: str = "x", tensors_as_samples: bool = False) -> List[Any]:
    """``value``, part of a batch of ``n`` samples, cut into ``chunks`` parts (see the module's rules);
    ``tensors_as_samples``: a list of ``n`` tensors of ``n`` rows is one tensor per sample."""
    sizes = chunk_sizes(n, chunks)
    if torch.is_tensor(value):
        if value.dim() and value.shape[0] == n:
            return list(torch.tensor_split(value, chunks))
        if value.dim() == 0 or value.shape[0] == 1:
            return [value] * chunks
        raise BatchError(f"batch: cannot cut {path} ({value.shape[0]} rows) into micro-batches of a batch of {n} "
                         f"samples: {SPLIT_HOOK} (and batch_size=fn(x, y) if {n} is not the number of samples)")
    fields = _fields(value)
    if fields is not None:
        parts = {k: split_into(v, n, chunks, _name(path, k, value), tensors_as_samples) for k, v in fields.items()}
        if isinstance(value, Mapping):
            return [rebuild(value, {k: parts[k][i] for k in fields}) for i in range(chunks)]
        return [dataclasses.replace(value, **{k: parts[k][i] for k in fields}) for i in range(chunks)]
    if is_per_sample(value, n, tensors_as_samples):
        bounds = [sum(sizes[:i]) for i in range(chunks + 1)]
        return [type(value)(value[bounds[i]:bounds[i + 1]]) for i in range(chunks)]
    if isinstance(value, (list, tuple)):
        if hasattr(value, "_fields") or any(torch.is_tensor(v) or isinstance(v, (list, tuple, Mapping)) for v in value):
            pieces = [split_into(v, n, chunks, f"{path}[{i}]", tensors_as_samples) for i, v in enumerate(value)]
            return [rebuild(value, [p[i] for p in pieces]) for i in range(chunks)]
        return [value] * chunks  # a list of settings (not one item per sample)
    if isinstance(value, (str, bytes, int, float, bool, type(None))) or not _holds_tensors(value):
        return [value] * chunks
    raise BatchError(f"batch: cannot cut {path} (a {type(value).__name__}) into micro-batches: {SPLIT_HOOK}")


def _holds_tensors(value: Any) -> bool:
    """An object that carries a batch's data: it moves with ``.to``, or holds tensors in its attributes."""
    if callable(getattr(value, "to", None)):
        return True
    return any(torch.is_tensor(v) for v in getattr(value, "__dict__", {}).values())


def split_batch(x: Any, y: Any, chunks: int) -> List[Tuple[Any, Any]]:
    """The default ``split_batch(x, y, chunks)``: ``chunks`` near-equal ``(x, y)`` parts along the samples.

    Tensors are split into views (no copy); per-sample lists are sliced alongside; see the module's rules.
    """
    return split_pairs(x, y, batch_size_of(x, y), chunks)


def split_pairs(x: Any, y: Any, n: int, chunks: int) -> List[Tuple[Any, Any]]:
    """:func:`split_batch` for a batch whose number of samples ``n`` is known."""
    chunks = min(chunks, n)
    if chunks == 1:
        return [(x, y)]
    # A list of n tensors of n rows is one tensor per sample when the batch holds per-sample items too
    # (detection: 3 RGB images beside 3 target dicts), else n batched inputs.
    samples = any(kind == "items" and size == n for kind, _, size in [*_evidence(x, "x"), *_evidence(y, "y")])
    return list(zip(split_into(x, n, chunks, "x", samples), split_into(y, n, chunks, "y", samples), strict=True))


def ignore_index_of(loss_fn: Optional[Callable]) -> Optional[int]:
    """The label value ``loss_fn`` ignores, where it says: an ``ignore_index`` attribute (``nn.CrossEntropyLoss``,
    ``nn.NLLLoss``) or keyword (``functools.partial(cross_entropy, ignore_index=255)``); else None.

    Example:
        >>> import torch
        >>> ignore_index_of(torch.nn.CrossEntropyLoss(ignore_index=255)), ignore_index_of(torch.nn.MSELoss())
        (255, None)
    """
    value = getattr(loss_fn, "ignore_index", None)
    if value is None and isinstance(loss_fn, functools.partial):
        value = loss_fn.keywords.get("ignore_index")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
