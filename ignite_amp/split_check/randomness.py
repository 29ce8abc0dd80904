"""Randomness held still, so that one function can be compared on a batch and on its chunks (the split check).

Under :func:`still` a model computes the same function of each sample whatever else is in its batch:

- dropout of every kind does nothing (``F.dropout`` and its 1d/2d/3d/alpha variants return their input, and
  ``scaled_dot_product_attention`` runs with ``dropout_p=0``), as in evaluation;
- torch's random operators return the most likely or the middle value instead of a draw: ``bernoulli(p)`` gives
  ``p >= 0.5`` (a keep mask of stochastic depth keeps everything), ``rand``/``uniform_`` the middle of their
  range, ``randn``/``normal_`` their mean, ``randint``/``random_`` their lower bound, ``randperm(n)`` the
  identity, ``multinomial`` the most likely outcomes;
- augmentation inside the model that draws per batch: transformers' SpecAugment (``apply_spec_augment``) is off;
- BatchNorm layers in training mode normalise with their running statistics (zero mean and unit variance
  where they keep none), so rows do not mix, and update nothing.

torch's generators are never drawn from (and restored on exit all the same). NumPy's and Python's global generators (Wav2Vec2's SpecAugment masks
draw from NumPy row by row) are set by :meth:`Still.replay` to the state they had on entry, so a batch and
its first chunk draw the same numbers for the same rows and the next chunk continues where the first stopped.
On exit every generator's state, and every buffer and BatchNorm flag of the model, is what it was.
"""
import contextlib
import random
from typing import Any, Iterator

import numpy
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ignite_amp.core.rng import get_rng_state, set_rng_state

__all__ = ["still", "Still"]

aten = torch.ops.aten

_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout}


class _NoDropout(TorchFunctionMode):
    """Dropout at the functional level (above autograd, so its backward agrees): the identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention and len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
            args = (*args[:4], 0.0, *args[5:])
        elif func is F.scaled_dot_product_attention and "dropout_p" in kwargs:
            kwargs = dict(kwargs, dropout_p=0.0)
        return func(*args, **kwargs)


def _fill(like: torch.Tensor, value: Any) -> torch.Tensor:
    return torch.full_like(like, value)


def _bernoulli(args: tuple, kwargs: dict, inplace: bool) -> torch.Tensor:
    self, p = args[0], (args[1] if len(args) > 1 else kwargs.get("p", None))
    if p is None:  # bernoulli(input): input holds the probabilities
        p = self
    keep = (p >= 0.5) if torch.is_tensor(p) else torch.full_like(self, float(p >= 0.5), dtype=torch.bool)
    out = keep.to(self.dtype).expand_as(self) if keep.shape != self.shape else keep.to(self.dtype)
    return self.copy_(out) if inplace else out.clone()


def _middle(func: Any, args: tuple, kwargs: dict) -> Any:
    """The constant a random operator gives under :func:`still`, or NotImplemented for any other operator."""
    packet = getattr(func, "overloadpacket", None)
    if packet in (aten.bernoulli, aten.bernoulli_):
        return _bernoulli(args, kwargs, packet is aten.bernoulli_)
    if packet is aten.native_dropout:  # (output, mask): keep everything
        return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
    if packet is aten.uniform_:
        low, high = (list(args[1:3]) + [kwargs.get("from", 0.0), kwargs.get("to", 1.0)][len(args[1:3]):])
        return args[0].fill_((low + high) / 2)
    if packet is aten.normal_:
        return args[0].fill_(args[1] if len(args) > 1 else kwargs.get("mean", 0.0))
    if packet is aten.random_:  # random_(), random_(to), random_(from, to)
        return args[0].fill_(args[1] if len(args) > 2 else 0)
    if packet is aten.exponential_:
        return args[0].fill_(1.0 / (args[1] if len(args) > 1 else kwargs.get("lambd", 1.0)))
    made = {"dtype": kwargs.get("dtype"), "device": kwargs.get("device")}
    if packet in (aten.rand, aten.randn):
        return torch.full(args[0], 0.5 if packet is aten.rand else 0.0, dtype=made["dtype"] or torch.get_default_dtype(),
                          device=made["device"])
    if packet in (aten.rand_like, aten.randn_like):
        return torch.full_like(args[0], 0.5 if packet is aten.rand_like else 0.0,
                               **{k: v for k, v in kwargs.items() if k in ("dtype", "device")})
    low = func._overloadname.startswith("low")  # randint(high, size), randint(low, high, size), randint_like(t, [low,] high)
    if packet is aten.randint:
        return torch.full(args[-1], args[0] if low else 0, dtype=made["dtype"] or torch.long, device=made["device"])
    if packet is aten.randint_like:
        return torch.full_like(args[0], args[1] if low else 0, **{k: v for k, v in made.items() if v is not None})
    if packet is aten.randperm:
        n = args[0]
        return torch.arange(n, dtype=kwargs.get("dtype") or torch.long, device=kwargs.get("device"))
    if packet is aten.multinomial:
        probs, samples = args[0], args[1]
        return torch.topk(probs, samples, dim=-1).indices
    return NotImplemented


class _Middle(TorchDispatchMode):
    """torch's random operators, below autograd: the constants of :func:`_middle` instead of draws."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _middle(func, args, kwargs)
        return func(*args, **kwargs) if out is NotImplemented else out


class Still:
    """What :func:`still` yields: :meth:`replay` sets NumPy's and Python's generators back to their entry state."""

    def __init__(self) -> None:
        self._numpy = numpy.random.get_state()
        self._python = random.getstate()

    def replay(self) -> None:
        """NumPy's and Python's global generators back to the state they had on entry."""
        numpy.random.set_state(self._numpy)
        random.setstate(self._python)


@contextlib.contextmanager
def _batch_norm_fixed(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers in training mode normalise with running statistics (or 0 and 1), then are restored."""
    changed = []
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.training:
            missing = m.running_mean is None
            if missing:
                m.running_mean = torch.zeros(m.num_features, device=m.weight.device if m.weight is not None else None)
                m.running_var = torch.ones_like(m.running_mean)
            m.training = False
            changed.append((m, missing))
    try:
        yield
    finally:
        for m, missing in changed:
            m.training = True
            if missing:
                m.running_mean = m.running_var = None


@contextlib.contextmanager
def _no_spec_augment(module: nn.Module) -> Iterator[None]:
    """transformers' SpecAugment (``config.apply_spec_augment``: masks drawn from NumPy once per batch, then row by
    row, so a batch and its chunks cannot draw alike) switched off, then back on."""
    configs = {id(c): c for m in module.modules() if getattr(c := getattr(m, "config", None), "apply_spec_augment",
                                                                 False) is True}
    for config in configs.values():
        config.apply_spec_augment = False
    try:
        yield
    finally:
        for config in configs.values():
            config.apply_spec_augment = True


@contextlib.contextmanager
def still(module: nn.Module) -> Iterator[Still]:
    """Randomness and BatchNorm held still in ``module`` (see the module's docstring); every generator's and
    buffer's state restored on exit."""
    rng = get_rng_state()
    numpy_state = numpy.random.get_state()
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with _batch_norm_fixed(module), _no_spec_augment(module), _NoDropout(), _Middle():
            yield Still()
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        set_rng_state(rng)
        numpy.random.set_state(numpy_state)
