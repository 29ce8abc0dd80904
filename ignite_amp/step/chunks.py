"""The chunks of a training batch: where the batch stands in its accumulation cycle, each chunk's weight in the
cycle's gradient, and the batch's loss, items and outputs joined from its chunks.

The weight makes the optimizer see the gradient of one mean over the whole cycle: each chunk's share of the samples
(each iteration counting once), or, with ``num_items``, of the items the losses average over (tokens, say), over
every chunk, iteration and rank of the cycle. With ``num_items`` every chunk weighs its items against a reference
(agreed by all ranks once) and the optimizer step divides by the cycle's items on all ranks
(:meth:`ChunkWeights.divide_by_cycle_items`); a lone chunk of a lone iteration needs neither.

:class:`~ignite_amp.step.train.AmpStep` runs the chunks in the AMP order; this module does their arithmetic and
knows nothing of autocast or the scaler.
"""
import functools
import operator
from typing import Any, List, Optional, Sequence

import ignite.distributed as idist
import torch

from ignite_amp.core.collectives import is_distributed, max_across_ranks, sum_across_ranks
from ignite_amp.core.nested import detach, join_chunks, to_float32
from ignite_amp.split_check.check import SplitCheck
from ignite_amp.split_check.protocol import CheckedStep
from ignite_amp.step.base import Cycle
from ignite_amp.step.contracts import check_count, warn_batch_norm, warn_padding_without_items

__all__ = ["BatchChunks", "ChunkWeights", "cycle_at"]

_WHOLE = Cycle(True, True, 1)  # without accumulation every iteration is a cycle: one (immutable) instance


def cycle_at(accumulation_steps: int, state: Any) -> Cycle:
    """Where the engine's current iteration (``state.iteration``) stands in its accumulation cycle. A cycle never
    crosses an epoch boundary: the epoch's last iteration ends one (shorter) cycle."""
    acc = accumulation_steps
    if acc == 1:
        return _WHOLE
    length = state.epoch_length
    if not length:  # an iterator of unknown length: cycles follow the global iteration
        pos = (state.iteration - 1) % acc
        return Cycle(pos == 0, pos == acc - 1, acc)
    pos = (state.iteration - 1) % length  # position in the epoch; cycles restart each epoch
    start = pos - pos % acc
    size = min(acc, length - start)
    return Cycle(pos == start, pos == start + size - 1, size)


class ChunkWeights:
    """How a training step weighs its chunks, across the batches of its accumulation cycles.

    Args:
        device: the step's device (where a tensor count of items lives).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cycle_items: Any = 0  # items of the cycle so far (num_items), summed on this rank
        self.item_ref = 0.0  # items per chunk that weigh 1: 0 until the first count() agrees it with all ranks (>= 1)
        self.by_items = False  # this cycle's chunks were weighed by their items
        self.bad_items: Optional[torch.Tensor] = None  # a negative or NaN num_items in this batch (on device)
        self._batch_norm_named = self._padding_checked = False  # said once each

    def start(self, step: CheckedStep, check: SplitCheck, batch: tuple, sizes: Sequence[int], cycle: Cycle
              ) -> "BatchChunks":
        """A batch of chunks of ``sizes`` samples starts at this place of its cycle. A cut or combined batch: the
        step's split ``check`` (on its first batches, per chunk count), and a warning, once, of what it may get
        wrong."""
        chunks = len(sizes)
        counted = step.num_items is not None
        if cycle.first:
            self.cycle_items = 0
        if chunks > 1 and not self._batch_norm_named:
            self._batch_norm_named = True
            warn_batch_norm(step.module)
        self.by_items = counted and (chunks > 1 or cycle.length > 1 or is_distributed())
        check(step, batch, chunks, cycle.length)  # once per chunk count, where cut or combined
        # Without the check (which decides from the loss's behaviour), a warning of padding weighed by samples.
        if not counted and not self._padding_checked and (chunks > 1 or cycle.length > 1) and \
                not check.enabled:
            self._padding_checked = True
            x, y = batch
            warn_padding_without_items(x, y, step.loss_fn, step.module)
        return BatchChunks(self, step.batch_size, sizes, cycle.length, counted)

    def count(self, value: Any, where: str) -> Any:
        """A chunk's ``num_items`` ``value``, checked (``where`` names the chunk in an error); the first one sets the
        reference every rank weighs its chunks against."""
        count, invalid = check_count(value, self.device, where)
        if invalid is not None:  # the batch's loss will read NaN (see BatchChunks.loss)
            self.bad_items = invalid if self.bad_items is None else self.bad_items | invalid
        if not self.item_ref:  # once: the reference every rank weighs its chunks against
            self.item_ref = max(max_across_ranks(float(count)), 1.0)
        return count

    def divide_by_cycle_items(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Chunks weighed ``items / reference``: the mean over the cycle's items on all ranks is that sum
        times ``reference * world / all items`` (DDP already divided by the world size)."""
        total = self.cycle_items
        if is_distributed():
            device = torch.device("cpu") if idist.backend() == "gloo" else self.device
            total = sum_across_ranks(torch.as_tensor(total, dtype=torch.float32).to(device).clone())
            total = total.to(self.device)
        # A cycle without items has nothing to average: its gradient stays the (zero) sum.
        total = torch.where(total > 0, total, torch.ones_like(total)) if torch.is_tensor(total) else \
            (total if total > 0 else 1)
        factor = self.item_ref * idist.get_world_size() / total
        grads = [p.grad for p in params if p.grad is not None]
        if grads:  # one fused kernel per device and dtype, as torch.optim's foreach paths use
            torch._foreach_mul_(grads, factor)


class BatchChunks:
    """One batch's chunks as they run: each one's weight, the batch's loss and items, its joined outputs.

    Made by :meth:`ChunkWeights.start`; a local of the step's attempt, so a failed attempt's outputs go with it.
    """

    __slots__ = ("weights", "n", "sizes", "cycle_length", "counted", "parts", "items", "kept")

    def __init__(self, weights: ChunkWeights, n: int, sizes: Sequence[int], cycle_length: int, counted: bool):
        self.weights = weights
        self.n = n  # the batch's samples
        self.sizes = sizes
        self.cycle_length = cycle_length
        self.counted = counted  # weighed by num_items
        self.parts: List[torch.Tensor] = []  # the chunks' losses, weighted (summed in their order by loss())
        self.items: Any = 0  # the batch's items so far (num_items)
        self.kept: List[tuple] = []  # (output, count) of each chunk, where the step keeps them (output_transform)

    def weigh(self, loss: torch.Tensor, chunk: int, count: Any) -> Any:
        """The weight of chunk ``chunk``'s ``loss`` in the cycle's gradient (``count``: its items, or None to
        weigh its samples); its detached loss joins the batch's."""
        sizes = self.sizes
        weight: Any  # a number, or a tensor (items counted on the device)
        if count is None:  # the chunk's share of the batch's samples, and of the cycle
            if len(sizes) == 1:
                part, weight = loss.detach(), 1 / self.cycle_length
            else:
                share = sizes[chunk] / self.n
                part, weight = loss.detach() * share, share / self.cycle_length
        else:
            weights = self.weights
            # A chunk that counts no items weighs as one: a loss divided by count.clamp(min=1) (a focal loss over
            # the positives, on background-only images) still has a gradient there, and the cycle divides by the
            # items it counted; a padding-only mean (0/0, no gradient) adds nothing either way. A count between 0
            # and 1 (a sum of per-sample weights) weighs as itself.
            least = torch.where(count > 0, count, torch.ones_like(count)) if torch.is_tensor(count) else \
                (count if count > 0 else 1)
            weight = 1
            if weights.by_items:  # (count() agreed item_ref at the cycle's first chunk)
                weight = least / weights.item_ref
            part = loss.detach() * least
            if torch.is_tensor(count):
                part = torch.where((count > 0) | torch.isfinite(part), part, torch.zeros_like(part))
            elif count == 0:  # (no host read: the loss stays on its device)
                part = torch.where(torch.isfinite(part), part, torch.zeros_like(part))
            self.items = self.items + count
        self.parts.append(part)
        return weight

    def keep(self, y_pred: Any, count: Any) -> None:
        """Keep a chunk's output (detached, floats in float32) for :meth:`outputs`."""
        self.kept.append((to_float32(detach(y_pred)), count))

    def loss(self) -> tuple:
        """The batch's loss (a detached float32 tensor: the mean over its samples, or its items) and what it
        averaged over; with ``num_items`` its items join the cycle's. Called once every chunk was weighed."""
        total = functools.reduce(operator.add, self.parts)  # ((p1 + p2) + p3)...: one part is itself, no kernel
        if not self.counted:
            return total.float(), self.n
        weights, items = self.weights, self.items
        weights.cycle_items = weights.cycle_items + items
        total = total / items  # 0 / 0: a batch of padding only has no loss (NaN, with items 0)
        if weights.bad_items is not None:
            total = torch.where(weights.bad_items, torch.full_like(total, float("nan")), total)
            weights.bad_items = None
        return total.float(), items

    def outputs(self) -> Any:
        """The kept outputs joined into the batch's (a loss among them: the mean over the samples, or the items)."""
        counts = [c for _, c in self.kept] if self.counted else None
        return join_chunks([p for p, _ in self.kept], self.sizes, counts)
