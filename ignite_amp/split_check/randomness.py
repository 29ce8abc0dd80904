"""Randomness held still, so that one function can be compared on a batch and on its chunks (the split check).

Under :func:`still` a model computes the same function of each sample whatever else is in its batch:

- dropout of every kind does nothing (``F.dropout`` and its 1d/2d/3d/alpha variants return their input, and
  ``scaled_dot_product_attention`` runs with ``dropout_p=0``), as in evaluation;
- torch's random operators return the most likely or the middle value instead of a draw: ``bernoulli(p)`` gives
  ``p >= 0.5`` (a keep mask of stochastic depth keeps everything), ``rand``/``uniform_`` the middle of their
  range, ``randn``/``normal_``/``normal(mean, std)`` their mean, ``randint``/``random_`` their lower bound,
  ``randperm(n)`` the identity, ``multinomial`` the most likely outcomes, ``RReLU`` its evaluation slope,
  ``poisson``/``binomial``/``Gamma``/``Dirichlet`` their mean, ``log_normal_``/``cauchy_`` their median,
  ``geometric_`` its mean (their out-of-place forms alike); any other operator torch tags as seeded (an RNN's
  dropout inside cuDNN) runs as it is and is named in :attr:`Still.unheld` (the check says it could not hold
  it still when it changes the gradient);
- augmentation inside the model that draws per batch: transformers' SpecAugment (``apply_spec_augment``) is off;
- BatchNorm layers in training mode normalise with their running statistics (zero mean and unit variance
  where they keep none), so rows do not mix, and update nothing.

torch's generators are never drawn from by the operators above (and restored on exit all the same). NumPy's and
Python's global generators (Wav2Vec2's SpecAugment masks draw from NumPy row by row) are set by
:meth:`Still.replay` to the state they had on entry, so a batch and its first chunk draw the same numbers for the
same rows and the next chunk continues where the first stopped. :meth:`Still.reset` also puts the model's buffers
back as they were on entry (a forward that changes its own state, as the legacy ``spectral_norm``'s power
iteration does, starts each of the check's forwards from the same state), and :meth:`Still.changed` names the
buffers a forward changed. On exit every generator's state, and every buffer and BatchNorm flag of the model, is
what it was.
"""
import contextlib
import math
import random
from typing import Any, Dict, Iterator, List, Tuple, cast

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
_SEEDED = torch.Tag.nondeterministic_seeded

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
        return torch.full(args[0], 0.5 if packet is aten.rand else 0.0,
                          dtype=made["dtype"] or torch.get_default_dtype(), device=made["device"])
    if packet in (aten.rand_like, aten.randn_like):
        return torch.full_like(args[0], 0.5 if packet is aten.rand_like else 0.0,
                               **{k: v for k, v in kwargs.items() if k in ("dtype", "device")})
    # randint(high, size), randint(low, high, size), randint_like(t, [low,] high)
    low = func._overloadname.startswith("low")
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
    return _more(packet, func, args, kwargs)


_OUT_OF_PLACE = {getattr(aten, name): getattr(aten, name + "_").default
                 for name in ("uniform", "cauchy", "exponential", "geometric", "log_normal") if hasattr(aten, name)}


def _more(packet: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """:func:`_middle` for the operators of distributions and of RReLU."""
    if packet in (aten.rrelu_with_noise, aten.rrelu_with_noise_):  # (self, noise, lower, upper, training)
        x, noise = args[0], args[1]
        lower, upper = (list(args[2:4]) + [kwargs.get("lower", 1 / 8), kwargs.get("upper", 1 / 3)][len(args[2:4]):])
        slope = torch.where(x >= 0, torch.ones_like(x), torch.full_like(x, (lower + upper) / 2))
        noise.resize_as_(x).copy_(slope)  # the backward reads the noise it was given: the evaluation slope
        return x.mul_(slope) if packet is aten.rrelu_with_noise_ else x * slope
    if packet in _OUT_OF_PLACE:  # uniform(self, ...), cauchy(self, ...): the in-place rule on a copy
        return _middle(_OUT_OF_PLACE[packet], (args[0].clone(), *args[1:]), kwargs)
    if packet is aten.normal:  # normal(mean, std[, size]): the mean
        mean = args[0] if args else kwargs["mean"]
        std = args[1] if len(args) > 1 else kwargs.get("std", 1.0)
        if func._overloadname == "float_float":
            size = args[2] if len(args) > 2 else kwargs["size"]
            return torch.full(size, float(mean), dtype=kwargs.get("dtype") or torch.get_default_dtype(),
                              device=kwargs.get("device"))
        if not torch.is_tensor(mean):
            return torch.full_like(std, float(mean))
        return (mean + torch.zeros_like(std)).clone() if torch.is_tensor(std) else mean.clone()
    if packet in (aten.poisson, aten._standard_gamma):
        return args[0].clone()
    if packet is aten.binomial:
        return args[0] * args[1]
    if packet is aten._sample_dirichlet:
        return args[0] / args[0].sum(-1, keepdim=True)
    if packet is aten.log_normal_:
        return args[0].fill_(math.exp(args[1] if len(args) > 1 else kwargs.get("mean", 1.0)))
    if packet is aten.cauchy_:
        return args[0].fill_(args[1] if len(args) > 1 else kwargs.get("median", 0.0))
    if packet is aten.geometric_:
        return args[0].fill_(1.0 / (args[1] if len(args) > 1 else kwargs["p"]))
    return NotImplemented


class _Middle(TorchDispatchMode):
    """torch's random operators, below autograd: the constants of :func:`_middle` instead of draws; any other
    seeded operator runs and is named in ``unheld``."""

    def __init__(self, unheld: set) -> None:
        super().__init__()
        self.unheld = unheld

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _middle(func, args, kwargs)
        if out is NotImplemented:
            if _SEEDED in func.tags and "attention" not in func.__name__:  # attention's dropout_p is 0 here
                self.unheld.add(str(func.overloadpacket))
            return func(*args, **kwargs)
        return out


class Still:
    """What :func:`still` yields: :meth:`replay` sets NumPy's and Python's generators back to their entry state,
    :meth:`reset` the model's buffers too; :meth:`changed` and :meth:`drew` say what a forward changed or drew,
    :attr:`unheld` the seeded torch operators that ran as they are."""

    def __init__(self, buffers: List[Tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        # the legacy tuple (numpy's stubs say a dict too: that is get_state(legacy=False)'s)
        self._numpy = cast(Tuple[Any, ...], numpy.random.get_state())
        self._python = random.getstate()
        self._buffers = buffers
        self.unheld: set = set()

    def replay(self) -> None:
        """NumPy's and Python's global generators back to the state they had on entry."""
        numpy.random.set_state(self._numpy)
        random.setstate(self._python)

    def reset(self, replay: bool = True) -> None:
        """The model's buffers back to their state on entry, and NumPy's and Python's generators (``replay``)."""
        with torch.no_grad():
            for _, b, saved in self._buffers:
                b.copy_(saved)
        if replay:
            self.replay()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Dropout off and torch's random operators constant (the dispatch modes), for a forward."""
        with _NoDropout(), _Middle(self.unheld):
            yield

    def changed(self) -> List[str]:
        """The buffers whose values differ from their state on entry (a forward that changes its own state)."""
        return [name for name, b, saved in self._buffers if not torch.equal(b, saved)]

    def drew(self) -> List[str]:
        """The global generators (NumPy's, Python's) that are not in their entry state: a forward drew from them."""
        np_now, py_now = cast(Tuple[Any, ...], numpy.random.get_state()), random.getstate()
        drawn = [] if (np_now[1] == self._numpy[1]).all() and np_now[2] == self._numpy[2] else ["NumPy's"]
        return drawn + ([] if py_now == self._python else ["Python's"])


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
    configs: Dict[int, Any] = {id(c): c for m in module.modules()
                               if getattr(c := getattr(m, "config", None), "apply_spec_augment", False) is True}
    for config in configs.values():
        config.apply_spec_augment = False
    try:
        yield
    finally:
        for config in configs.values():
            config.apply_spec_augment = True


@contextlib.contextmanager
def still(module: nn.Module, forwards_only: bool = False) -> Iterator[Still]:
    """Randomness and BatchNorm held still in ``module`` (see the module's docstring); every generator's and
    buffer's state restored on exit. ``forwards_only``: the random operators are held still only inside
    :meth:`Still.forward` (a backward outside it runs without the Python dispatch modes' cost per operator)."""
    rng = get_rng_state()
    numpy_state = numpy.random.get_state()
    buffers = [(name, b, b.detach().clone()) for name, b in module.named_buffers()]
    held = Still(buffers)
    try:
        with _batch_norm_fixed(module), _no_spec_augment(module):
            if forwards_only:
                yield held
            else:
                with held.forward():
                    yield held
    finally:
        with torch.no_grad():
            for _, b, saved in buffers:
                b.copy_(saved)
        set_rng_state(rng)
        numpy.random.set_state(numpy_state)
