"""Counter-based draws keyed by sample: the same random values for a sample in a batch and in any piece of it.

A random operator under the split check does not draw from a generator: each element of its output gets a value
that is a hash of ``(seed, the operator's call number in this forward, the sample the element belongs to, the
element's position inside that sample)`` (splitmix64's finaliser on int64 tensors, in the spirit of Philox and
JAX's ``fold_in``). So a batch and its pieces see identical, realistic draws for every sample, whatever the
batch's shape or the sample's place in it.

A sample is named by a fingerprint of its own data (:func:`sample_keys`: a hash of the bits of its rows in every
tensor of the batch whose first dimension holds the samples), so a piece cut in any order meets the same draws.
Which axis of an operator's output holds the samples is an :data:`Axis`: ``(axis, k)`` where that axis has ``k``
rows per sample (``k > 1``: samples and something else flattened together, sample-major), or :data:`CONSTANT`
(no sample axis: the same values in the batch and its pieces). :func:`guess_axis` guesses it from the shape and
the forward's samples; :func:`learn_axes` learns it for sure from the shapes one operator had in a batch and in
its pieces, and names the operators that follow the batch in a way no key can (a permutation of the batch's rows,
draws without replacement across samples).
"""
from typing import Any, List, Optional, Sequence, Tuple, Union, cast

import torch

__all__ = ["sample_keys", "keyed_uniforms", "guess_axis", "learn_axes", "CONSTANT", "Axis"]

CONSTANT = "constant"
#: Where an output's samples are: ``(axis, rows per sample)``, or :data:`CONSTANT`.
Axis = Union[str, Tuple[int, int]]


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_C1, _C2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """A logical right shift of int64 values (torch's ``>>`` keeps the sign)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's step (add the golden gamma, then its finaliser): int64 in, well-mixed int64 out
    (multiplications wrap, as in C)."""
    x = x + _GOLDEN
    x = (x ^ _lsr(x, 30)) * _C1
    x = (x ^ _lsr(x, 27)) * _C2
    return x ^ _lsr(x, 31)


def combine(a: torch.Tensor, b: Any) -> torch.Tensor:
    return mix(a * _GOLDEN + b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as int64 bit patterns (equal values, equal patterns)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        wide = t.double() if t.dtype == torch.float64 else t.float()  # float16/bfloat16 widen exactly
        return wide.view(torch.int64 if wide.dtype == torch.float64 else torch.int32).long()
    return t.long()


def _row_hashes(rows: torch.Tensor) -> torch.Tensor:
    """One int64 per row of a 2-d tensor: order-aware over the row's values, exact (integer sums wrap)."""
    n, d = rows.shape
    if d == 0:
        return torch.zeros(n, dtype=torch.long, device=rows.device)
    positions = torch.arange(d, device=rows.device, dtype=torch.long)
    return mix(mix(_bits(rows) * _GOLDEN + positions).sum(dim=1) + d)


def _tensors(obj: Any, found: List[torch.Tensor]) -> List[torch.Tensor]:
    if torch.is_tensor(obj):
        found.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, found)
    return found


def _item_hash(item: Any, device: torch.device) -> torch.Tensor:
    h = torch.zeros((), dtype=torch.long, device=device)
    for i, t in enumerate(_tensors(item, [])):
        flat = t.reshape(1, -1).to(device)
        h = combine(h, _row_hashes(flat)[0] + i + flat.shape[1])
    return h


def sample_keys(x: Any, y: Any, n: int) -> Optional[torch.Tensor]:
    """An int64 key per sample of a batch of ``n`` samples: a hash of the sample's rows in every tensor whose
    first dimension is ``n`` (else of each item of a per-sample list of length ``n``); None when nothing in the
    batch is laid out by sample."""
    tensors = [t for t in _tensors((x, y), []) if t.dim() >= 1 and t.shape[0] == n and t.numel()]
    if tensors:
        keys = torch.zeros(n, dtype=torch.long, device=tensors[0].device)
        for i, t in enumerate(tensors):
            keys = combine(keys, _row_hashes(t.detach().reshape(n, -1).to(keys.device)) + i)
        return keys
    lists = [obj for obj in (x, y, *(x if isinstance(x, (list, tuple)) else ()))
             if isinstance(obj, (list, tuple)) and len(obj) == n and n > 1]
    for items in lists:
        found = _tensors(items, [])
        if found:
            device = found[0].device
            return torch.stack([_item_hash(item, device) for item in items])
    return None


def guess_axis(shape: Sequence[int], n: Optional[int]) -> Axis:
    """Where the samples probably are in an output of ``shape`` in a forward of ``n`` samples (``n`` None: no
    samples known, :data:`CONSTANT`)."""
    if not n or not shape:
        return CONSTANT
    if shape[0] == n:
        return 0, 1
    if len(shape) > 1 and shape[1] == n:
        return 1, 1  # batch-second (time, batch, features)
    if shape[0] % n == 0:
        return 0, shape[0] // n
    return CONSTANT


def learn_axes(shapes: Sequence[Sequence[int]], sizes: Sequence[int]) -> Optional[Axis]:
    """The axis of one operator's output, from its shapes in forwards of ``sizes`` samples (a batch and its
    pieces): :data:`CONSTANT` where they are equal, ``(axis, k)`` where only that axis changes, by ``k`` rows per
    sample; None where no axis explains them (a shape that follows the batch otherwise)."""
    first = tuple(shapes[0])
    if all(tuple(s) == first for s in shapes):
        return CONSTANT
    if any(len(s) != len(first) for s in shapes):
        return None
    for axis in range(len(first)):
        if any(tuple(s[:axis]) + tuple(s[axis + 1:]) != first[:axis] + first[axis + 1:] for s in shapes):
            continue
        if all(s[axis] % size == 0 for s, size in zip(shapes, sizes, strict=True)):
            rows = {s[axis] // size for s, size in zip(shapes, sizes, strict=True)}
            if len(rows) == 1 and rows != {0}:
                return axis, rows.pop()
    return None


def keyed_uniforms(shape: Sequence[int], device: Any, salt: int, keys: Optional[torch.Tensor], axis: Axis,
                   count: int = 1) -> List[torch.Tensor]:
    """``count`` float64 tensors of ``shape`` in (0, 1): each element a hash of the salt, its sample's key (by
    ``axis``; :data:`CONSTANT` or no keys: its position only) and its position inside the sample."""
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    base = mix(torch.full((), salt, dtype=torch.long, device=device))
    if axis == CONSTANT or keys is None or not shape:
        h = combine(base, torch.arange(numel, dtype=torch.long, device=device)).reshape(shape)
    else:
        a, k = cast(Tuple[int, int], axis)
        rows = shape[a]
        rest = numel // rows if rows else 0
        index = torch.arange(rows, dtype=torch.long, device=device)
        sample = torch.div(index, k, rounding_mode="floor").clamp(max=len(keys) - 1)
        per_sample = combine(base, keys.to(device)[sample])  # (rows,)
        within = (index % k) * rest
        h = combine(per_sample[:, None], within[:, None] + torch.arange(rest, dtype=torch.long, device=device))
        moved = (rows, *shape[:a], *shape[a + 1:])
        h = h.reshape(moved).movedim(0, a).reshape(shape)
    return [(_lsr(combine(h, j), 11).double() + 0.5) * 2.0 ** -53 for j in range(count)]
