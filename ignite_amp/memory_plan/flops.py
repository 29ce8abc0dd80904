"""A training step's FLOPs, counted on the memory plan's fake trace (:mod:`ignite_amp.memory_plan.fake_step`).

torch's ``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls, convolutions and attention (here also the
CPU's attention kernel, which it has no formula for); every other op that computes (norms, activations, additions,
the optimizer's update) counts one FLOP per output element, so recomputing the cheap ops (selective checkpointing)
costs something too. Activation checkpointing's recompute is the difference between the step's FLOPs with it and
without it: the recompute runs under the same counters (ops whose outputs selective checkpointing kept are read
back, not run, and not counted).
"""
import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["count_flops"]

aten = torch.ops.aten


def _cpu_attention(query, key, value, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


_CUSTOM = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
           aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward}


class _Elementwise(TorchDispatchMode):
    """One FLOP per floating-point output element of the ops ``FlopCounterMode`` has no formula for (views
    compute nothing)."""

    def __init__(self, counted: set):
        super().__init__()
        self.counted, self.flops = counted, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "overloadpacket", func) not in self.counted and not getattr(func, "is_view", False):
            self.flops += sum(int(t.numel()) for t in tree_leaves(out)
                              if isinstance(t, torch.Tensor) and t.is_floating_point())
        return out


@contextlib.contextmanager
def count_flops() -> Iterator[Callable[[], int]]:
    """Count the FLOPs of what runs inside; yields a function that returns the count so far.

    >>> import torch
    >>> a, b = torch.ones(4, 8), torch.ones(8, 2)
    >>> with count_flops() as flops:
    ...     y = torch.relu(a @ b)
    >>> flops()  # 2 x 4 x 8 x 2 for the matmul, 8 for the ReLU's outputs
    136
    """
    counter = FlopCounterMode(display=False, custom_mapping=_CUSTOM)
    elements = _Elementwise(set(counter.flop_registry))
    with counter, elements:
        yield lambda: int(counter.get_total_flops()) + elements.flops
