"""``activation_checkpointing: auto``: the cheapest checkpointing of the blocks that makes the planned step fit
the memory.

The choices (:mod:`ignite_amp.memory_plan.choices`) are ordered by the memory they save per unit of recompute
(FLOPs): when selective checkpointing saves more per FLOP than going from selective to full does (the usual case:
it recomputes only norms, activations and additions), the ladder is selective on the first 1, 2, ... blocks, then
all selective with the first 1, 2, ... blocks full; otherwise full on the first 1, 2, ... blocks. Blocks are taken
from the input end (where a network's activations are largest). The ladder's ends are traced, then the first rung
whose planned peak is within ``(1 - margin) x memory`` is found by bisection and applied to the model.
"""
import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ignite_amp.memory_plan.choices import CheckpointOption, OptionPlanner, options_lines, share
from ignite_amp.memory_plan.plan import DEFAULT_MARGIN, format_bytes
from ignite_amp.transforms.activation_checkpointing import checkpoint_modules, describe_blocks

__all__ = ["checkpoint_to_fit", "CheckpointChoice"]


@dataclasses.dataclass
class CheckpointChoice:
    """What :func:`checkpoint_to_fit` chose: the blocks checkpointed and how, the planned peaks and the recompute."""

    checkpointed: List[str]  #: module paths of the blocks checkpointed (empty: none needed, or none found)
    blocks: int  #: the model's blocks (the block rule's)
    batch_size: int  #: the batch size planned for
    budget: Optional[float]  #: bytes the step may peak at ((1 - margin) x memory); None: no memory known
    peak_without: Optional[int]  #: the planned peak with no block checkpointed (None: not traced)
    peak: Optional[int]  #: the planned peak with the chosen blocks checkpointed
    untraced: Optional[str] = None  #: why the step could not be traced fake
    selective: List[str] = dataclasses.field(default_factory=list)  #: those of ``checkpointed`` under selective
    recompute: Optional[float] = None  #: the FLOPs the choice adds, as a share of the step's without checkpointing
    options: List[CheckpointOption] = dataclasses.field(default_factory=list)  #: the choices traced

    @property
    def fits(self) -> bool:
        """Whether the planned peak is within the budget."""
        return self.budget is not None and self.peak is not None and self.peak <= self.budget

    def _what(self) -> str:
        full = [n for n in self.checkpointed if n not in set(self.selective)]
        parts = [f"{policy} on {len(names)}" for policy, names in (("full", full), ("selective", self.selective))
                 if names]
        where = "; ".join(f"{policy}: {describe_blocks(names)}" for policy, names in
                          (("full", full), ("selective", self.selective)) if names)
        return f"{' and '.join(parts)} of {self.blocks} blocks ({where})"

    def line(self) -> str:
        """One line for the run's log: what was checkpointed, why, and what it costs."""
        head = "activation checkpointing auto"
        if self.untraced:
            return f"{head}: no block checkpointed: the step cannot be traced fake ({self.untraced})"
        if self.budget is None:
            return (f"{head}: no block checkpointed: no device memory to fit (a CPU run; plan for a GPU with "
                    "ignite-amp plan --memory)")
        at = f"at batch {self.batch_size} in {format_bytes(self.budget)}"
        if not self.blocks:
            return f"{head}: the model has no blocks to checkpoint; planned peak {format_bytes(self.peak)} {at}"
        if not self.checkpointed:
            return f"{head}: none of {self.blocks} blocks needed: planned peak {format_bytes(self.peak)} {at}"
        cost = "" if self.recompute is None else f", recompute {share(self.recompute)} of the step's FLOPs"
        what = (f"{self._what()}: planned peak {format_bytes(self.peak)}, {format_bytes(self.peak_without)} "
                f"without{cost}, {at}")
        if self.fits:
            return f"{head}: {what}"
        return (f"{head}: {what}; it does not fit even so: lower data.batch_size or raise amp.micro_batches")

    def lines(self) -> List[str]:
        """:meth:`line`, then the table of the choices traced (``ignite-amp plan``)."""
        rung = (len(self.checkpointed) - len(self.selective), len(self.selective))
        chosen = [o for o in self.options if (o.full, o.selective) == rung]
        table = options_lines(self.options, chosen[0] if chosen else None, self.budget) if self.options else []
        return [self.line(), *table]


def _ladder(planner: OptionPlanner) -> List[Tuple[int, int]]:
    """The rungs (full, selective) from none to all full, cheapest memory saved first (see the module's doc)."""
    n = len(planner.names)
    none, selective, full = planner(0, 0), planner(0, n), planner(n, 0)
    peak0, peak_selective, peak_full = none.peak, selective.peak, full.peak
    flops0, flops_selective, flops_full = none.flops, selective.flops, full.flops
    if (peak0 is None or peak_selective is None or peak_full is None or flops0 is None or flops_selective is None
            or flops_full is None):
        return [(k, 0) for k in range(n + 1)]
    per_flop_selective = (peak0 - peak_selective) / max(1, flops_selective - flops0)
    per_flop_upgrade = (peak_selective - peak_full) / max(1, flops_full - flops_selective)
    if peak0 > peak_selective and per_flop_selective >= per_flop_upgrade:
        return [(0, k) for k in range(n + 1)] + [(k, n - k) for k in range(1, n + 1)]
    return [(k, 0) for k in range(n + 1)]


def checkpoint_to_fit(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, batch: Any,
                      batch_size: int, memory: Union[None, int, str] = None, margin: float = DEFAULT_MARGIN,
                      device: Union[str, torch.device] = "auto", blocks: Optional[Sequence[str]] = None,
                      **step_kwargs: Any) -> CheckpointChoice:
    """Checkpoint (in place) ``model``'s blocks in the cheapest way that makes the planned step fit ``memory``.

    Python's ``activation_checkpointing="auto"``: call it before :func:`~ignite_amp.create_amp_trainer` (which
    then leaves the checkpointed blocks as they are). Without a memory on a CPU nothing is checkpointed.

    Args:
        model, optimizer, loss_fn, batch, memory, margin, device, step_kwargs: as for
            :func:`~ignite_amp.estimate_memory` (``batch``: ``batch(n)`` or an example batch).
        batch_size: the batch size to fit.
        blocks: class names of the blocks (default: the block rule's repeated blocks).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from ignite_amp.memory_plan.auto_checkpoint import checkpoint_to_fit
        >>> from ignite_amp.transforms.activation_checkpointing import checkpoint_policies
        >>> block = lambda: nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        >>> model = nn.Sequential(*[block() for _ in range(4)])
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> batch = lambda n: (torch.randn(n, 256), torch.randint(0, 256, (n,)))
        >>> checkpoint_to_fit(model, opt, nn.functional.cross_entropy, batch, 64, device="cpu",
        ...                   dtype="float32").line()  # doctest: +NORMALIZE_WHITESPACE
        'activation checkpointing auto: no block checkpointed: no device memory to fit (a CPU run; plan for a GPU
        with ignite-amp plan --memory)'
        >>> choice = checkpoint_to_fit(model, opt, nn.functional.cross_entropy, batch, 4096, memory="140MiB",
        ...                            device="cpu", dtype="float32")
        >>> choice.fits, checkpoint_policies(model)
        (True, {'0': 'full', '1': 'selective', '2': 'selective', '3': 'selective'})
        >>> print("\\n".join(choice.lines()))  # doctest: +NORMALIZE_WHITESPACE
        activation checkpointing auto: full on 1 and selective on 3 of 4 blocks (full: 0; selective: 1-3): planned
        peak 113.1 MiB, 177.1 MiB without, recompute 4.4% of the step's FLOPs, at batch 4096 in 119.0 MiB
        | checkpointing | peak | recompute (% of the step's FLOPs) | fits |
        |---|---|---|---|
        | none | 177.1 MiB | 0.0% | no |
        | selective 4/4 | 129.1 MiB | 0.03% | no |
        | full 1 + selective 3/4 (chosen) | 113.1 MiB | 4.4% | yes |
        | full 2 + selective 2/4 | 97.1 MiB | 8.7% | yes |
        | full 4/4 | 81.1 MiB | 17.4% | yes |
    """
    planner = OptionPlanner(model, optimizer, loss_fn, batch, batch_size, memory=memory, margin=margin,
                            device=device, blocks=blocks, **step_kwargs)
    n = len(planner.names)
    resolved = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                            "cpu" if device == "auto" else device)
    if memory is None and resolved.type != "cuda":
        return CheckpointChoice([], n, batch_size, None, None, None)
    none = planner(0, 0)
    budget = planner.budget  # (known: a memory was given, or the trace read the GPU's free memory)
    if none.peak is None or budget is None:
        return CheckpointChoice([], n, batch_size, budget, None, None, planner.untraced)

    def fits(rung: Tuple[int, int]) -> bool:
        peak = planner(*rung).peak
        return peak is not None and peak <= budget

    rung = (0, 0)
    if none.peak > budget and n:
        ladder = _ladder(planner)
        lo, hi = 0, len(ladder) - 1  # lo does not fit; hi fits, or is all the blocks full
        if fits(ladder[hi]):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(ladder[mid]) else (mid, hi)
        rung = ladder[hi]
    option = planner(*rung)
    policies = option.policies(planner.names)
    for policy in ("full", "selective"):
        checkpoint_modules(model, [name for name, p in policies.items() if p == policy], policy)
    options = sorted(planner.planned.values(), key=lambda o: (o.full, o.selective))
    return CheckpointChoice(list(policies), n, batch_size, budget, none.peak, option.peak,
                            selective=[name for name, p in policies.items() if p == "selective"],
                            recompute=option.recompute, options=options)
