"""A CPU stand-in of CUDA's caching allocator, and a model that allocates through it.

What it keeps of the real one (c10/cuda/CUDACachingAllocator.cpp), the parts that decide what fits:

- a request rounds up to 512 bytes; a request of at most 1 MiB comes from 2 MiB segments (the small
  pool), a larger one from a cached free block at least as large (best fit, split when more than 1 MiB
  is left) or from a new segment of its size rounded up to 2 MiB (the large pool);
- a freed block stays reserved (cached) and merges with free neighbours in its segment;
- the reserve may not pass the per-process cap: a request that needs a new segment past it frees the
  cached segments (``empty_cache``) and tries again, then raises ``torch.OutOfMemoryError``;
- an elastic workspace (cuDNN's): as much of what it wants as fits without passing the cap, at least
  what it must have;
- torch.cuda's counters: allocated and reserved, now and at their peak, and their reset.

It implements :class:`ignite_amp.core.memory.CudaAllocator`'s methods, so the batch-size search's meter and
:class:`~ignite_amp.core.memory.PeakWindow` run on it unchanged.
"""
from typing import List, Optional

import torch
from torch import nn

MiB = 2 ** 20
SMALL, SEGMENT, ROUND = 1 * MiB, 2 * MiB, 512


def _round(n: float, unit: int) -> int:
    return -(-int(n) // unit) * unit


class Block:
    """A block of a segment; freed when dropped (as a tensor's storage is)."""

    def __init__(self, allocator: "CachingAllocatorStandIn", segment: "Segment", offset: int, size: int):
        self.allocator, self.segment, self.offset, self.size = allocator, segment, offset, size
        self.free = False

    def release(self) -> None:
        if not self.free and self.allocator is not None:
            self.allocator._free(self)

    def __del__(self):
        self.release()


class Segment:
    def __init__(self, size: int, small: bool):
        self.size, self.small = size, small
        self.blocks: List[list] = [[0, size, True]]  # [offset, size, free], in offset order

    @property
    def empty(self) -> bool:
        return len(self.blocks) == 1 and self.blocks[0][2]


class CachingAllocatorStandIn:
    """CUDA's caching allocator in miniature (see the module's docstring), capped at ``cap`` bytes; ``card``
    is the whole device (what ``mem_get_info`` would report as total)."""

    def __init__(self, cap: float, card: Optional[float] = None):
        self.cap, self.card = int(cap), int(card or cap)
        self.segments: List[Segment] = []
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.ooms = 0

    # -- allocation --------------------------------------------------------------------------------
    def malloc(self, nbytes: float) -> Block:
        size = max(ROUND, _round(nbytes, ROUND))
        small = size <= SMALL
        block = self._from_cache(size, small)
        if block is None:
            seg_size = SEGMENT if small else _round(size, SEGMENT)
            if self.reserved + seg_size > self.cap:
                self.empty_cache()
                block = self._from_cache(size, small)
            if block is None:
                if self.reserved + seg_size > self.cap:
                    self.ooms += 1
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory (stand-in). Tried to allocate {size / MiB:.2f} MiB; "
                        f"{self.allocated / MiB:.0f} MiB allocated, {self.reserved / MiB:.0f} MiB reserved, "
                        f"cap {self.cap / MiB:.0f} MiB")
                segment = Segment(seg_size, small)
                self.segments.append(segment)
                self.reserved += seg_size
                self.peak_reserved = max(self.peak_reserved, self.reserved)
                block = self._carve(segment, 0, size)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def workspace(self, want: float, least: float = 0) -> Optional[Block]:
        """An elastic workspace: ``want`` bytes, or the most that fits without passing the cap (at least ``least``;
        None for none at all)."""
        free_in_cache = max((b[1] for s in self.segments if not s.small for b in s.blocks if b[2]), default=0)
        room = max(free_in_cache, (self.cap - self.reserved) // SEGMENT * SEGMENT)
        size = int(min(want, room))
        if size < least:
            size = int(least)  # out of memory, as cuDNN is when not even its least workspace fits
        return self.malloc(size) if size > 0 else None

    def _from_cache(self, size: int, small: bool) -> Optional[Block]:
        best = None
        for segment in self.segments:
            if segment.small != small:
                continue
            for i, (_, bsize, free) in enumerate(segment.blocks):
                if free and bsize >= size and (best is None or bsize < best[2]):
                    best = (segment, i, bsize)
        if best is None:
            return None
        segment, i, _ = best
        return self._carve(segment, segment.blocks[i][0], size)

    def _carve(self, segment: Segment, offset: int, size: int) -> Block:
        i = next(k for k, b in enumerate(segment.blocks) if b[0] == offset)
        _, bsize, _ = segment.blocks[i]
        keep = size if segment.small or bsize - size > SMALL else bsize  # a large block splits past 1 MiB left
        segment.blocks[i] = [offset, keep, False]
        if bsize > keep:
            segment.blocks.insert(i + 1, [offset + keep, bsize - keep, True])
        return Block(self, segment, offset, keep)

    def _free(self, block: Block) -> None:
        block.free = True
        segment = block.segment
        i = next(k for k, b in enumerate(segment.blocks) if b[0] == block.offset)
        segment.blocks[i][2] = True
        self.allocated -= block.size
        # merge with free neighbours
        merged: List[list] = []
        for b in segment.blocks:
            if merged and merged[-1][2] and b[2]:
                merged[-1][1] += b[1]
            else:
                merged.append(list(b))
        segment.blocks = merged

    def hold(self, device, nbytes: float) -> None:
        block = self.malloc(nbytes)
        block.release()

    # -- torch.cuda's counters ---------------------------------------------------------------------
    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak_allocated

    def memory_reserved(self, device=None) -> int:
        return self.reserved

    def max_memory_reserved(self, device=None) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def empty_cache(self, device=None) -> None:
        kept = [s for s in self.segments if not s.empty]
        self.reserved -= sum(s.size for s in self.segments if s.empty)
        self.segments = kept

    def capacity(self, device=None) -> float:
        return float(self.cap)


class _Layers(torch.autograd.Function):
    """The stand-in's activations (``x * weight``, for real): kept from forward to backward in the allocator;
    backward frees them layer by layer, each with an elastic workspace and a gradient buffer for a moment."""

    @staticmethod
    def forward(ctx, x, weight, net):
        n = x.shape[0]
        ctx.net = net
        ctx.save_for_backward(x, weight)
        ctx.blocks = [net.allocator.malloc(net.per_sample * n / net.layers) for _ in range(net.layers)]
        if net.benchmark and n not in net.tuned:  # cuDNN's autotuning on a new shape: tries what is free
            net.tuned.add(n)
            try:
                net.allocator.workspace(float("inf")).release()
            except torch.OutOfMemoryError:
                pass  # cuDNN skips an algorithm whose workspace does not fit
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        net, n = ctx.net, grad.shape[0]
        x, weight = ctx.saved_tensors
        for block in reversed(ctx.blocks):
            space = net.allocator.workspace(net.workspace_want, net.workspace_least)
            grad_buffer = net.allocator.malloc(net.per_sample * n / net.layers)
            block.release()
            del space, grad_buffer
        ctx.blocks = []
        return grad * weight, (grad * x).sum(0), None


class AllocatingNet(nn.Module):
    """A real (tiny) model whose memory lives in a :class:`CachingAllocatorStandIn`: weights, gradients and
    optimizer state ``fixed`` bytes, held from the start; ``per_sample`` bytes of activations per sample in
    ``layers`` blocks from forward to backward; in backward, per layer, an elastic workspace (``workspace_want``,
    at least ``workspace_least``) and a gradient buffer; ``benchmark``: the first forward of each batch size
    tries a workspace of all that is free (cuDNN's autotuning). An evaluation forward frees its activations
    as it returns."""

    def __init__(self, allocator: CachingAllocatorStandIn, fixed: float, per_sample: float, layers: int = 8,
                 workspace_want: float = 64 * MiB, workspace_least: float = 4 * MiB, benchmark: bool = True):
        super().__init__()
        self.allocator, self.per_sample, self.layers = allocator, per_sample, layers
        self.workspace_want, self.workspace_least, self.benchmark = workspace_want, workspace_least, benchmark
        self.tuned: set = set()
        self.weights = allocator.malloc(fixed)
        self.scale = nn.Parameter(torch.ones(4))
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(_Layers.apply(x, self.scale, self))
