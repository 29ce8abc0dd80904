"""The ways to checkpoint a step's blocks, each planned: its peak memory and the recompute it costs.

A choice puts the first ``full`` blocks (from the input end, where a network's activations are largest) under full
checkpointing and the next ``selective`` under selective checkpointing
(:mod:`ignite_amp.transforms.activation_checkpointing`). Each is traced on fake tensors
(:func:`ignite_amp.memory_plan.plan.estimate_memory`): its peak, and its recompute as the FLOPs it adds to the step,
in % of the step's FLOPs without checkpointing (:mod:`ignite_amp.memory_plan.flops`). ``ignite-amp plan`` shows
the table of choices (:func:`checkpoint_options`); ``activation_checkpointing: auto`` picks among them
(:mod:`ignite_amp.memory_plan.auto_checkpoint`).
"""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ignite_amp.memory_plan.plan import DEFAULT_MARGIN, estimate_memory, format_bytes
from ignite_amp.transforms.activation_checkpointing import checkpointed_blocks
from ignite_amp.transforms.blocks import block_names

__all__ = ["CheckpointOption", "OptionPlanner", "checkpoint_options", "options_lines", "share"]


def share(value: Optional[float]) -> str:
    """A share in %, with two decimals below 1% (selective checkpointing's recompute is often 0.05%)."""
    return "-" if value is None else f"{value:.1%}" if value >= 0.01 or value == 0 else f"{value:.2%}"


@dataclasses.dataclass
class CheckpointOption:
    """One way to checkpoint the blocks, planned."""

    full: int  #: the first blocks, under full checkpointing
    selective: int  #: the next blocks, under selective checkpointing
    blocks: int  #: the model's blocks
    peak: Optional[int]  #: the planned peak in bytes (None: not traced)
    flops: Optional[int] = None  #: the step's FLOPs with it
    recompute: Optional[float] = None  #: the FLOPs it adds, as a share of the step's without checkpointing

    @property
    def name(self) -> str:
        """``none``, ``selective 4/6``, ``full 2/6``, ``full 2 + selective 4/6``."""
        parts = [f"{policy} {k}" for policy, k in (("full", self.full), ("selective", self.selective)) if k]
        return " + ".join(parts) + f"/{self.blocks}" if parts else "none"

    def policies(self, names: Sequence[str]) -> Dict[str, str]:
        """``{block path: policy}`` of this choice on the blocks ``names``."""
        return {**dict.fromkeys(names[:self.full], "full"),
                **dict.fromkeys(names[self.full:self.full + self.selective], "selective")}


class OptionPlanner:
    """Plans choices (each traced once) for a model's blocks not checkpointed yet; ``planner(full, selective)``.

    Args: those of :func:`checkpoint_options`, and ``memory``/``margin`` (the budget,
    :attr:`~ignite_amp.memory_plan.plan.MemoryPlan.budget`) as for :func:`~ignite_amp.estimate_memory`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, batch: Any,
                 batch_size: int, memory: Union[None, int, str] = None, margin: float = DEFAULT_MARGIN,
                 device: Union[str, torch.device] = "auto", blocks: Optional[Sequence[str]] = None,
                 **step_kwargs: Any):
        done = set(checkpointed_blocks(model))
        self.names = [n for n in block_names(model, blocks) if n not in done]
        self.args = (model, optimizer, loss_fn, batch, [batch_size])
        self.kwargs = dict(memory=memory, margin=margin, device=device, fit=False, **step_kwargs)
        self.batch_size = batch_size
        self.budget: Optional[float] = None
        self.untraced: Optional[str] = None
        self.planned: Dict[Tuple[int, int], CheckpointOption] = {}

    def __call__(self, full: int, selective: int) -> CheckpointOption:
        key = (full, selective)
        if key not in self.planned:
            option = CheckpointOption(full, selective, len(self.names), None)
            plan = estimate_memory(*self.args, checkpoint=option.policies(self.names), **self.kwargs)
            self.budget, self.untraced = plan.budget, plan.untraced
            if plan.peaks:
                option.peak, option.flops = plan.peaks[0].peak, plan.peaks[0].flops
                base = option.flops if key == (0, 0) else self(0, 0).flops
                if base and option.flops is not None:
                    option.recompute = max(0.0, (option.flops - base) / base)
            self.planned[key] = option
        return self.planned[key]


def _counts(blocks: int) -> List[int]:
    """1 to ``blocks`` in at most four steps (a quarter of the blocks each)."""
    return sorted({max(1, round(blocks * q / 4)) for q in range(1, 5)}) if blocks else []


def checkpoint_options(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, batch: Any,
                       batch_size: int, device: Union[str, torch.device] = "auto",
                       blocks: Optional[Sequence[str]] = None, counts: Optional[Sequence[int]] = None,
                       **step_kwargs: Any) -> List[CheckpointOption]:
    """The choices none, selective on the first ``k`` blocks and full on the first ``k`` (``k`` in ``counts``,
    default a quarter of the blocks to all of them), each planned at ``batch_size``; empty when the step cannot be
    traced fake. Args as for :func:`~ignite_amp.estimate_memory` (``blocks``: class names of the blocks).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> block = lambda: nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        >>> model = nn.Sequential(*[block() for _ in range(4)])
        >>> batch = lambda n: (torch.randn(n, 64), torch.randint(0, 64, (n,)))
        >>> options = checkpoint_options(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                              nn.functional.cross_entropy, batch, 256, device="cpu", dtype="float32",
        ...                              counts=[2, 4])
        >>> print("\\n".join(options_lines(options)))  # the recompute stops at the last output the backward needs
        | checkpointing | peak | recompute (% of the step's FLOPs) |
        |---|---|---|
        | none | 3.2 MiB | 0.0% |
        | selective 2/4 | 2.7 MiB | 0.07% |
        | selective 4/4 | 2.4 MiB | 0.14% |
        | full 2/4 | 2.2 MiB | 8.7% |
        | full 4/4 | 1.9 MiB | 17.5% |
    """
    planner = OptionPlanner(model, optimizer, loss_fn, batch, batch_size, device=device, blocks=blocks,
                            **step_kwargs)
    if planner(0, 0).peak is None:
        return []
    ks = list(counts) if counts is not None else _counts(len(planner.names))
    ks = [k for k in ks if 0 < k <= len(planner.names)]
    return ([planner(0, 0)] + [planner(0, k) for k in ks] + [planner(k, 0) for k in ks])


def options_lines(options: Sequence[CheckpointOption], chosen: Optional[CheckpointOption] = None,
                  budget: Optional[float] = None) -> List[str]:
    """The choices as a table (``chosen`` marked, and whether each fits ``budget`` when one is given)."""
    fits = budget is not None
    out = ["| checkpointing | peak | recompute (% of the step's FLOPs) |" + (" fits |" if fits else ""),
           "|---|---|---|" + ("---|" if fits else "")]
    for option in options:
        mark = (" (chosen)" if chosen is not None and (option.full, option.selective) == (chosen.full, chosen.selective)
                else "")
        recompute = share(option.recompute)
        fit = "" if budget is None else (" yes |" if option.peak is not None and option.peak <= budget else " no |")
        out.append(f"| {option.name}{mark} | {format_bytes(option.peak)} | {recompute} |{fit}")
    return out
