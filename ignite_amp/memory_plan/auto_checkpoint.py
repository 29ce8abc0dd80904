"""``activation_checkpointing: auto``: checkpoint the fewest blocks that make the planned step fit the memory.

The blocks are the block rule's (:func:`ignite_amp.transforms.blocks.block_names`), taken from the input end (where a
network's activations are largest): the plan (:func:`ignite_amp.memory_plan.plan.estimate_memory`) of the step
with the first ``k`` blocks checkpointed is traced for ``k`` found by bisection, and the smallest ``k`` whose
peak is within ``(1 - margin) x memory`` is applied to the model.
"""
import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from ignite_amp.transforms.blocks import block_names
from ignite_amp.transforms.activation_checkpointing import checkpoint_modules, checkpointed_blocks, describe_blocks
from ignite_amp.memory_plan.plan import DEFAULT_MARGIN, estimate_memory, format_bytes

__all__ = ["checkpoint_to_fit", "CheckpointChoice"]


@dataclasses.dataclass
class CheckpointChoice:
    """What :func:`checkpoint_to_fit` chose: the blocks checkpointed, and the planned peaks."""

    checkpointed: List[str]  #: module paths of the blocks checkpointed (empty: none needed, or none found)
    blocks: int  #: the model's blocks (the block rule's)
    batch_size: int  #: the batch size planned for
    budget: Optional[float]  #: bytes the step may peak at ((1 - margin) x memory); None: no memory known
    peak_without: Optional[int]  #: the planned peak with no block checkpointed (None: not traced)
    peak: Optional[int]  #: the planned peak with the chosen blocks checkpointed
    untraced: Optional[str] = None  #: why the step could not be traced fake

    @property
    def fits(self) -> bool:
        """Whether the planned peak is within the budget."""
        return self.budget is not None and self.peak is not None and self.peak <= self.budget

    def line(self) -> str:
        """One line for the run's log: what was checkpointed and why."""
        head = "activation checkpointing auto"
        if self.untraced:
            return f"{head}: no block checkpointed: the step cannot be traced fake ({self.untraced})"
        if self.budget is None:
            return f"{head}: no block checkpointed: no device memory to fit (a CPU run; plan for a GPU with ignite-amp plan --memory)"
        at = f"at batch {self.batch_size} in {format_bytes(self.budget)}"
        if not self.blocks:
            return f"{head}: the model has no blocks to checkpoint; planned peak {format_bytes(self.peak)} {at}"
        if not self.checkpointed:
            return f"{head}: none of {self.blocks} blocks needed: planned peak {format_bytes(self.peak)} {at}"
        what = (f"{len(self.checkpointed)} of {self.blocks} blocks ({describe_blocks(self.checkpointed)}): planned "
                f"peak {format_bytes(self.peak)}, {format_bytes(self.peak_without)} without, {at}")
        if self.fits:
            return f"{head}: {what}"
        return (f"{head}: {what}; it does not fit even so: lower data.batch_size or raise amp.micro_batches")


def checkpoint_to_fit(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, batch: Any,
                      batch_size: int, memory: Union[None, int, str] = None, margin: float = DEFAULT_MARGIN,
                      device: Union[str, torch.device] = "auto", blocks: Optional[Sequence[str]] = None,
                      **step_kwargs: Any) -> CheckpointChoice:
    """Checkpoint (in place) the fewest of ``model``'s blocks that make the planned step fit ``memory``.

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
        >>> from ignite_amp.transforms.activation_checkpointing import checkpointed_blocks
        >>> block = lambda: nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        >>> model = nn.Sequential(*[block() for _ in range(4)])
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> batch = lambda n: (torch.randn(n, 256), torch.randint(0, 256, (n,)))
        >>> checkpoint_to_fit(model, opt, nn.functional.cross_entropy, batch, 64, device="cpu", dtype="float32").line()
        'activation checkpointing auto: no block checkpointed: no device memory to fit (a CPU run; plan for a GPU with ignite-amp plan --memory)'
        >>> choice = checkpoint_to_fit(model, opt, nn.functional.cross_entropy, batch, 4096, memory="150MiB",
        ...                            device="cpu", dtype="float32")
        >>> choice.checkpointed, choice.fits, checkpointed_blocks(model)
        (['0', '1'], True, ['0', '1'])
        >>> print(choice.line())
        activation checkpointing auto: 2 of 4 blocks (0-1): planned peak 113.1 MiB, 177.1 MiB without, at batch 4096 in 127.5 MiB
    """
    names = [n for n in block_names(model, blocks) if n not in set(checkpointed_blocks(model))]
    resolved = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                            "cpu" if device == "auto" else device)
    if memory is None and resolved.type != "cuda":
        return CheckpointChoice([], len(names), batch_size, None, None, None)

    def plan(k: int):
        return estimate_memory(model, optimizer, loss_fn, batch, [batch_size], memory=memory, margin=margin,
                               device=device, fit=False, checkpoint=names[:k], **step_kwargs)

    first = plan(0)
    if first.untraced:
        return CheckpointChoice([], len(names), batch_size, first.budget, None, None, first.untraced)
    peaks = {0: first.peaks[0].peak}
    budget = first.budget
    if peaks[0] > budget and names:
        peaks[len(names)] = plan(len(names)).peaks[0].peak
        lo, hi = 0, len(names)  # lo does not fit; hi fits, or is all the blocks
        if peaks[hi] <= budget:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                peaks[mid] = plan(mid).peaks[0].peak
                lo, hi = (lo, mid) if peaks[mid] <= budget else (mid, hi)
        chosen = checkpoint_modules(model, names[:hi])
        return CheckpointChoice(chosen, len(names), batch_size, budget, peaks[0], peaks[hi])
    return CheckpointChoice([], len(names), batch_size, budget, peaks[0], peaks[0])
