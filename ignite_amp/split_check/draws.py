"""Each random operator's values under the split check: keyed uniforms (:mod:`ignite_amp.split_check.keyed`) turned
into the operator's distribution, instead of a draw from a generator (see :mod:`ignite_amp.split_check.randomness`).

``held.uniforms(name, shape, device, count)`` gives the keyed uniforms of one call (and records it); :func:`draw`
returns the operator's output, or NotImplemented for an operator it does not know.
"""
import math
from typing import Any, List, Tuple

import torch

__all__ = ["draw"]

aten = torch.ops.aten


def _size(value: Any) -> Tuple[int, ...]:
    return tuple(int(s) for s in value)


def _low_high(args: tuple, kwargs: dict, defaults: Tuple[float, float], names: Tuple[str, str]) -> List[Any]:
    return list(args[1:3]) + [kwargs.get(names[0], defaults[0]), kwargs.get(names[1], defaults[1])][len(args[1:3]):]


def _made(kwargs: dict, dtype: Any) -> dict:
    return {"dtype": kwargs.get("dtype") or dtype, "device": kwargs.get("device")}


def _into(self: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return self.copy_(values.to(self.dtype))


def draw(held: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """The keyed values a random operator gives under :func:`still` (see the module), or NotImplemented for any other
    operator. ``held.uniforms(name, shape, device, count)`` gives the keyed uniforms of this call."""
    packet = getattr(func, "overloadpacket", None)
    name = str(packet).rpartition(".")[2] if packet is not None else ""
    if packet is aten.native_dropout:  # (output, mask): keep everything (dropout is off, as in evaluation)
        return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
    if packet in (aten.bernoulli, aten.bernoulli_):
        self = args[0]
        p = args[1] if len(args) > 1 else kwargs.get("p", self if packet is aten.bernoulli else 0.5)
        u = held.uniforms(name, self.shape, self.device)[0]
        keep = u < (p.double() if torch.is_tensor(p) else float(p))
        return _into(self, keep) if packet is aten.bernoulli_ else keep.to(self.dtype)
    if packet in _IN_PLACE:
        self = args[0]
        return _into(self, _IN_PLACE[packet](args, kwargs, held.uniforms(name, self.shape, self.device, 2)))
    if packet in _OUT_OF_PLACE:  # uniform(self, ...), cauchy(self, ...): the in-place rule on a copy
        return draw(held, _OUT_OF_PLACE[packet], (args[0].clone(), *args[1:]), kwargs)
    if packet in (aten.rand, aten.randn):
        made = _made(kwargs, torch.get_default_dtype())
        u = held.uniforms(name, _size(args[0]), made["device"], 1)[0]
        return (u if packet is aten.rand else torch.special.ndtri(u)).to(**made)
    if packet in (aten.rand_like, aten.randn_like):
        like = args[0]
        u = held.uniforms(name, like.shape, like.device)[0]
        return (u if packet is aten.rand_like else torch.special.ndtri(u)).to(dtype=kwargs.get("dtype") or like.dtype)
    if packet in (aten.randint, aten.randint_like):
        return _randint(held, name, func, args, kwargs)
    if packet is aten.randperm:
        n = int(args[0])
        u = held.uniforms(name, (n,), kwargs.get("device"))[0]
        return torch.argsort(u).to(**_made(kwargs, torch.long))
    if packet is aten.multinomial:
        return _multinomial(held, name, args, kwargs)
    return _more(held, name, packet, func, args, kwargs)


def _randint(held: Any, name: str, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    # randint(high, size), randint(low, high, size); randint_like(t, high), randint_like(t, low, high)
    overload = func._overloadname
    if func.overloadpacket is aten.randint:
        low, high, size = (args[0], args[1], args[2]) if overload.startswith("low") else (0, args[0], args[1])
        made = _made(kwargs, torch.long)
        shape, device = _size(size), made["device"]
    else:
        like = args[0]
        low, high = (args[1], args[2]) if overload.startswith("low") else (0, args[1])
        made = {"dtype": kwargs.get("dtype") or like.dtype, "device": like.device}
        shape, device = tuple(like.shape), like.device
    high = float(high) if not torch.is_tensor(high) else float(high.item())
    u = held.uniforms(name, shape, device)[0]
    return (float(low) + torch.floor(u * (high - float(low)))).clamp(max=high - 1).to(**made)


def _multinomial(held: Any, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    probs, draws = args[0], int(args[1])
    replacement = args[2] if len(args) > 2 else kwargs.get("replacement", False)
    weights = probs.double() / probs.double().sum(-1, keepdim=True)
    if replacement:  # each draw by the inverse of the rows' cumulative distribution
        out_shape = (*probs.shape[:-1], draws)
        u = held.uniforms(name, out_shape, probs.device, out_shape=out_shape)[0]
        cdf = weights.cumsum(-1)
        picked = torch.searchsorted(cdf.expand(*out_shape[:-1], cdf.shape[-1]).contiguous(), u.contiguous())
        return picked.clamp(max=probs.shape[-1] - 1)
    # without: the top draws of Gumbel keys per category (a category of weight 0 never drawn)
    u = held.uniforms(name, probs.shape, probs.device, out_shape=(*probs.shape[:-1], draws))[0]
    keys = torch.where(weights > 0, weights.log() - torch.log(-torch.log(u)), torch.full_like(u, -torch.inf))
    return torch.topk(keys, draws, dim=-1).indices


def _uniform(args: tuple, kwargs: dict, u: List[torch.Tensor]) -> torch.Tensor:
    low, high = _low_high(args, kwargs, (0.0, 1.0), ("from", "to"))
    return low + u[0] * (high - low)


def _normal(args: tuple, kwargs: dict, u: List[torch.Tensor]) -> torch.Tensor:
    mean, std = _low_high(args, kwargs, (0.0, 1.0), ("mean", "std"))
    return mean + std * torch.special.ndtri(u[0])


def _random(args: tuple, kwargs: dict, u: List[torch.Tensor]) -> torch.Tensor:  # random_(), (to), (from, to)
    low, high = (args[1], args[2]) if len(args) > 2 else (0, args[1] if len(args) > 1 else 2 ** 24)
    high = 2 ** 24 if high is None else high
    return (low + torch.floor(u[0] * (high - low))).clamp(max=high - 1)


def _exponential(args: tuple, kwargs: dict, u: List[torch.Tensor]) -> torch.Tensor:
    return -torch.log(u[0]) / (args[1] if len(args) > 1 else kwargs.get("lambd", 1.0))


def _cauchy(args: tuple, kwargs: dict, u: List[torch.Tensor]) -> torch.Tensor:
    median, sigma = _low_high(args, kwargs, (0.0, 1.0), ("median", "sigma"))
    return median + sigma * torch.tan(math.pi * (u[0] - 0.5))


def _log_normal(args: tuple, kwargs: dict, u: List[torch.Tensor]) -> torch.Tensor:
    return torch.exp(_normal(args, kwargs, u))


def _geometric(args: tuple, kwargs: dict, u: List[torch.Tensor]) -> torch.Tensor:
    p = args[1] if len(args) > 1 else kwargs["p"]
    return torch.ceil(torch.log(u[0]) / math.log1p(-p)).clamp(min=1)


_IN_PLACE = {aten.uniform_: _uniform, aten.normal_: _normal, aten.random_: _random, aten.exponential_: _exponential,
             aten.cauchy_: _cauchy, aten.log_normal_: _log_normal, aten.geometric_: _geometric}
_OUT_OF_PLACE = {getattr(aten, name): getattr(aten, name + "_").default
                 for name in ("uniform", "cauchy", "exponential", "geometric", "log_normal") if hasattr(aten, name)}


def _more(held: Any, name: str, packet: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """:func:`draw` for ``normal(mean, std)``, the distributions held at their mean, and RReLU."""
    if packet in (aten.rrelu_with_noise, aten.rrelu_with_noise_):  # (self, noise, lower, upper, training)
        x, noise = args[0], args[1]
        lower, upper = (list(args[2:4]) + [kwargs.get("lower", 1 / 8), kwargs.get("upper", 1 / 3)][len(args[2:4]):])
        slope = torch.where(x >= 0, torch.ones_like(x), torch.full_like(x, (lower + upper) / 2))
        noise.resize_as_(x).copy_(slope)  # the backward reads the noise it was given: the evaluation slope
        return x.mul_(slope) if packet is aten.rrelu_with_noise_ else x * slope
    if packet is aten.normal:  # normal(mean, std[, size]): mean + std * a keyed normal draw
        mean = args[0] if args else kwargs["mean"]
        std = args[1] if len(args) > 1 else kwargs.get("std", 1.0)
        if func._overloadname == "float_float":
            made = _made(kwargs, torch.get_default_dtype())
            shape, device, dtype = _size(args[2] if len(args) > 2 else kwargs["size"]), made["device"], made["dtype"]
        else:
            like = torch.broadcast_tensors(*[t for t in (mean, std) if torch.is_tensor(t)])[0]
            shape, device, dtype = tuple(like.shape), like.device, like.dtype
        z = torch.special.ndtri(held.uniforms(name, shape, device)[0])
        return (mean + std * z).to(dtype)
    if packet in (aten.poisson, aten._standard_gamma):  # held at their mean (no keyed inverse here)
        return args[0].clone()
    if packet is aten.binomial:
        return args[0] * args[1]
    if packet is aten._sample_dirichlet:
        return args[0] / args[0].sum(-1, keepdim=True)
    return NotImplemented
