"""A training step's FLOPs, counted on the memory plan's fake trace (:mod:`ignite_amp.memory_plan.fake_step`).

The matmuls, convolutions and attention count as torch's ``torch.utils.flop_counter.FlopCounterMode`` counts them
(its formulas, ``flop_registry``; here also the CPU's attention kernel, which it has no formula for); every other op
that computes (norms, activations, additions, the optimizer's update) counts one FLOP per output element, so
recomputing the cheap ops (selective checkpointing) costs something too. Activation checkpointing's recompute is
the difference between the step's FLOPs with it and without it: the recompute runs under the same count (ops whose
outputs selective checkpointing kept are read back, not run, and not counted).

The formulas run in a dispatch mode of their own rather than under ``FlopCounterMode`` itself: its module tracker's
hooks on each block's outputs keep the recomputed blocks' tensors alive, which raised the planned peak with every
block checkpointed (by 28% on a small CNN with four blocks) and made the plan wrong.
"""
import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["count_flops"]

aten = torch.ops.aten


def _cpu_attention(query, key, value, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward(grad_out, query, key, value, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_FORMULAS = {**flop_registry,  # FlopCounterMode's own (called with the op's arguments and out_val=its output)
             aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
             aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward}


class _StepFlops(TorchDispatchMode):
    """FlopCounterMode's formulas where it has one; else one FLOP per floating-point output element (views
    compute nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(getattr(func, "overloadpacket", func))
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        elif not getattr(func, "is_view", False):
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
    mode = _StepFlops()
    with mode:
        yield lambda: mode.flops
