"""Randomness made the same for a batch and its pieces, so that one function can be compared on both (the split
check).

Under :func:`still` a model computes the same function of each sample whatever else is in its batch:

- dropout of every kind does nothing (``F.dropout`` and its 1d/2d/3d/alpha variants return their input, and
  ``scaled_dot_product_attention`` runs with ``dropout_p=0``), as in evaluation;
- torch's random operators draw keyed values instead of drawing from a generator
  (:mod:`ignite_amp.split_check.keyed`): each element's value is a hash of the operator's call number in the
  forward, the sample it belongs to (a fingerprint of that sample's data) and its position inside the sample,
  turned into the operator's distribution: ``rand``/``uniform_``, ``randn``/``normal_``/``normal(mean, std)``,
  ``bernoulli``, ``randint``/``random_``, ``multinomial`` (with replacement by the inverse distribution, without
  by Gumbel keys), ``exponential_``, ``cauchy_``, ``log_normal_``, ``geometric_``, ``randperm`` (their
  out-of-place forms alike). So a sample meets the same realistic draws in a batch and in any piece of it, and a
  mask drawn inside the model (a random count of masked tokens) is neither all nor nothing. ``poisson``,
  ``binomial``, ``Gamma`` and ``Dirichlet`` give their mean, ``RReLU`` its evaluation slope. Any other operator
  torch tags as seeded (an RNN's dropout inside cuDNN) runs as it is and is named in :attr:`Still.unheld`;
- which axis of an operator's output holds the samples is guessed from its shape, then learned from the shapes
  it had in the batch and in its pieces (:meth:`Still.learn`): a wrong guess runs the forwards again with the
  learned axis; an operator no key can serve (a permutation of the samples, draws without replacement across
  them) is named;
- augmentation inside the model that draws per batch: transformers' SpecAugment (``apply_spec_augment``) is off;
- BatchNorm layers in training mode normalise with their running statistics (zero mean and unit variance
  where they keep none), so rows do not mix, and update nothing.

torch's generators are never drawn from by the operators above (and restored on exit all the same). NumPy's and
Python's global generators (Wav2Vec2's SpecAugment masks draw from NumPy row by row) are set by
:meth:`Still.replay` to the state they had on entry, so a batch and its first chunk draw the same numbers for the
same rows and the next chunk continues where the first stopped. :meth:`Still.reset` also puts torch's generators
and the model's buffers back as they were on entry (a forward that changes its own state, as the legacy
``spectral_norm``'s power iteration does, starts each of the check's forwards from the same state; a changed
buffer gets a new tensor, so no tensor an earlier forward's graph saved is written), and :meth:`Still.changed`
names the buffers a forward changed. On exit every generator's state, and every buffer and BatchNorm flag of the
model, is what it was.
"""
import contextlib
import random
import zlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import numpy
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ignite_amp.core.rng import get_rng_state, set_rng_state
from ignite_amp.split_check.draws import draw as _draw
from ignite_amp.split_check.keyed import CONSTANT, Axis, guess_axis, keyed_uniforms, learn_axes, sample_keys

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


class _Keyed(TorchDispatchMode):
    """torch's random operators, below autograd: keyed values (:func:`_draw`) instead of draws; any other seeded
    operator runs and is named in ``unheld``."""

    def __init__(self, held: "Still") -> None:
        super().__init__()
        self.held = held

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _draw(self.held, func, args, kwargs)
        if out is NotImplemented:
            if _SEEDED in func.tags and "attention" not in func.__name__:  # attention's dropout_p is 0 here
                self.held.unheld.add(str(func.overloadpacket))
            return func(*args, **kwargs)
        return out


class _Forward:
    """One forward's keys: its samples, their keys, and the random calls it made (name, shape keyed, shape out,
    the axis used)."""

    def __init__(self, n: Optional[int], batch: Any = None) -> None:
        self.n = n
        self._batch: Any = batch
        self._keys: Optional[torch.Tensor] = None
        self.calls: List[Tuple[str, Tuple[int, ...], Tuple[int, ...], Axis]] = []

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """The samples' keys, computed at the first random call that needs them (a forward without one reads none
        of the batch)."""
        if self._keys is None and self.n and self._batch is not None:
            x, y = self._batch
            self._keys, self._batch = sample_keys(x, y, self.n), None
        return self._keys


class Still:
    """What :func:`still` yields: :meth:`forward` runs one forward with the randomness keyed by its samples,
    :meth:`replay` sets NumPy's and Python's generators back to their entry state, :meth:`reset` torch's, the
    model's buffers and those; :meth:`changed` and :meth:`drew` say what a forward changed or drew, :attr:`unheld`
    the seeded torch operators that ran as they are, :meth:`learn` what the forwards' random calls were."""

    def __init__(self, buffers: List[Tuple[nn.Module, str, str, torch.Tensor, torch.Tensor]], seed: int = 0) -> None:
        # the legacy tuple (numpy's stubs say a dict too: that is get_state(legacy=False)'s)
        self._numpy = cast(Tuple[Any, ...], numpy.random.get_state())
        self._python = random.getstate()
        self._torch = get_rng_state()
        self._buffers = buffers
        self.seed = seed
        self.unheld: set = set()
        self.axes: Dict[int, Axis] = {}  # learned: the call number's axis (see learn)
        self.by_shape = False  # every call keyed by its operator and shape alone (see learn)
        self.forwards: List[_Forward] = []  # the forwards since the last learn()
        self._current = _Forward(None, None)

    def uniforms(self, name: str, shape: Sequence[int], device: Any, count: int = 1,
                 out_shape: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
        """This call's keyed uniforms (see :mod:`ignite_amp.split_check.keyed`), recorded as the forward's next."""
        current = self._current
        number, shape = len(current.calls), tuple(int(s) for s in shape)
        if self.by_shape:
            axis: Axis = CONSTANT
            salt = zlib.crc32(f"{name}{shape}".encode())
        else:
            axis, salt = self.axes.get(number) or guess_axis(shape, current.n), number
        current.calls.append((name, shape, tuple(out_shape) if out_shape is not None else shape, axis))
        keys = current.keys if axis != CONSTANT else None
        return keyed_uniforms(shape, device, self.seed * 1_000_003 + salt, keys, axis, count)

    def replay(self) -> None:
        """NumPy's and Python's global generators back to the state they had on entry."""
        numpy.random.set_state(self._numpy)
        random.setstate(self._python)

    def reset(self, replay: bool = True) -> None:
        """The model's buffers back to their state on entry, and torch's, NumPy's and Python's generators
        (``replay``). A buffer a forward changed gets a fresh tensor with its entry value (no in-place write to a
        tensor an earlier forward's graph saved); one it did not change is not written at all."""
        with torch.no_grad():
            for module, name, _, _, saved in self._buffers:
                now = module._buffers[name]
                if now is not None and not torch.equal(now, saved):
                    module._buffers[name] = saved.clone()
        if replay:
            set_rng_state(self._torch)
            self.replay()

    @contextlib.contextmanager
    def forward(self, x: Any = None, y: Any = None, n: Optional[int] = None) -> Iterator[None]:
        """Dropout off and torch's random operators keyed by the samples of ``(x, y)`` (``n`` of them: see the
        module; without ``n``, by position only), for a forward."""
        self._current = _Forward(n, (x, y) if n else None)
        try:
            with _NoDropout(), _Keyed(self):
                yield
        finally:
            self.forwards.append(self._current)
            self._current = _Forward(None, None)

    def learn(self, sizes: Sequence[int]) -> Tuple[bool, List[str]]:
        """After forwards of ``sizes`` samples (a batch, then its pieces): whether they must run again, and the
        random operators no sample key can serve (a permutation of the samples, draws without replacement across
        them). Again: an axis was guessed wrong (the learned ones are used then), or the forwards made different
        random calls (a loop over the samples, as torchvision's detection samples proposals image by image): every
        call is then keyed by its operator and shape alone, so a sample's own calls draw alike wherever it is."""
        forwards, self.forwards = self.forwards[-len(sizes):], []
        if self.by_shape:
            return False, []
        counts = {len(f.calls) for f in forwards}
        if len(counts) > 1 or any(len({f.calls[i][0] for f in forwards}) > 1 for i in range(min(counts, default=0))):
            self.by_shape = True
            return True, []
        again, unkeyable = False, set()
        for number in range(counts.pop() if counts else 0):
            calls = [f.calls[number] for f in forwards]
            name = calls[0][0]
            axis = learn_axes([c[1] for c in calls], sizes)
            follows_out = learn_axes([c[2] for c in calls], sizes)
            permutes = name == "randperm" and axis != CONSTANT
            if axis is None or (axis == CONSTANT and follows_out != CONSTANT) or permutes:
                unkeyable.add(name)
                continue
            if any(c[3] != axis for c in calls):
                again = True
            self.axes[number] = axis
        return again and not unkeyable, sorted(unkeyable)

    def changed(self) -> List[str]:
        """The buffers whose values differ from their state on entry (a forward that changes its own state)."""
        return [path for module, name, path, _, saved in self._buffers
                if (now := module._buffers[name]) is not None and not torch.equal(now, saved)]

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
def still(module: nn.Module, forwards_only: bool = False, seed: int = 0) -> Iterator[Still]:
    """Randomness keyed and BatchNorm held still in ``module`` (see the module's docstring); every generator's and
    buffer's state restored on exit. ``forwards_only``: the random operators are keyed only inside
    :meth:`Still.forward` (a backward outside it runs without the Python dispatch modes' cost per operator).
    ``seed`` varies the keyed values (the same seed, the same values)."""
    rng = get_rng_state()
    numpy_state = numpy.random.get_state()
    buffers = [(owner, name, f"{path}.{name}" if path else name, b, b.detach().clone())
               for path, owner in module.named_modules() for name, b in owner._buffers.items() if b is not None]
    held = Still(buffers, seed)
    try:
        with _batch_norm_fixed(module), _no_spec_augment(module):
            if forwards_only:
                yield held
            else:
                with held.forward():
                    yield held
    finally:
        with torch.no_grad():
            for owner, name, _, original, saved in buffers:
                owner._buffers[name] = original
                if not torch.equal(original, saved):
                    original.copy_(saved)
        set_rng_state(rng)
        numpy.random.set_state(numpy_state)
