"""Collectives the AMP step and the batch-size search use under data-parallel training.

- :func:`any_rank`: the out-of-memory agreement, one integer all-reduced over a CPU (gloo)
  group, so it never waits for work queued on the GPU;
- :func:`all_reduce_gradients`: what DDP does during backward, done after it, once every rank
  agreed that none ran out of memory;
- :func:`broadcast_text`: a string from rank 0 to every rank, any Unicode (sized in bytes);
- :func:`broadcast_buffers`, :func:`min_across_ranks`, :func:`unwrap`, :func:`is_distributed`;
- :func:`per_process` and :func:`global_batch`: the one rule between a global batch and each process's share.

Without a process group every function here is a no-op or returns its input.
"""
import logging
from typing import Any, Iterator, List, Optional, cast

import ignite.distributed as idist
import torch
import torch.distributed as dist

__all__ = ["is_distributed", "unwrap", "any_rank", "min_across_ranks", "max_across_ranks", "sum_across_ranks",
           "all_reduce_gradients", "broadcast_buffers", "is_sharded", "broadcast_text",
           "adopt_ignite_loggers", "no_buffer_sync_in_forward", "per_process", "global_batch"]

IGNITE_LOGGERS = ("ignite.distributed.launcher.Parallel", "ignite.distributed.auto.auto_dataloader",
                  "ignite.distributed.auto.auto_model", "ignite.distributed.auto.auto_optim")


def adopt_ignite_loggers() -> None:
    """Leave Ignite's auto_* and launcher records to the application's logging configuration.

    On first use, ``ignite.utils.setup_logger`` gives each of those loggers an INFO stream
    handler of its own (so every run printed "Use data loader kwargs for dataset ..."); it
    leaves a logger that already exists as it is. Creating them first (level untouched) is
    enough: their records then go where the application's other records go.
    """
    for name in IGNITE_LOGGERS:
        logging.getLogger(name)



def is_distributed() -> bool:
    return idist.get_world_size() > 1


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` / ``DataParallel`` wrapper (or the model itself)."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was sharded with FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


_CPU_GROUPS: dict = {}


def _cpu_group() -> Optional[Any]:
    """A gloo group for host-side flags (the default group when it is gloo already): an all-reduce
    over it never waits for work queued on the GPU. Made once per process group, by every rank
    at the same point (the first step)."""
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (one all-reduce of one integer, on the CPU)."""
    group = _cpu_group()
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def min_across_ranks(value: int) -> int:
    """The smallest ``value`` over all ranks (``value`` itself when not distributed)."""
    if not is_distributed():
        return value
    # ignite's all_reduce gives back the type it was given (its annotation: a tensor or a float)
    return int(cast(torch.Tensor, idist.all_reduce(torch.tensor(value, device=idist.device()), op="MIN")).item())


def max_across_ranks(value: float) -> float:
    """The largest ``value`` over all ranks (``value`` itself when not distributed); a host sync."""
    if not is_distributed():
        return value
    total = idist.all_reduce(torch.tensor(float(value), device=idist.device()), op="MAX")
    return float(cast(torch.Tensor, total).item())  # a tensor in, a tensor out (see min_across_ranks)


def sum_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` (a tensor on the backend's device) summed over all ranks, in place; no host sync."""
    if is_distributed():
        dist.all_reduce(value)
    return value


def all_reduce_gradients(parameters: Iterator[torch.nn.Parameter], bucket_mb: float = 64) -> None:
    """Average the gradients over all ranks, in flat buckets of about ``bucket_mb`` megabytes.

    What DDP does during backward, done after it instead: used when every backward ran under
    ``no_sync`` so that the ranks could first agree that none of them ran out of memory.
    Every rank must hold gradients for the same parameters (the same model on batches of the
    same shape does).
    """
    world = idist.get_world_size()
    grads = [p.grad for p in parameters if p.grad is not None]
    limit = int(bucket_mb * 2**20)
    bucket: List[torch.Tensor] = []
    size = 0

    def flush():
        if not bucket:
            return
        flat = torch.cat([grad.reshape(-1) for grad in bucket])
        dist.all_reduce(flat)
        flat.div_(world)
        for grad, reduced in zip(bucket, flat.split([grad.numel() for grad in bucket]), strict=True):
            grad.copy_(reduced.view_as(grad))
        bucket.clear()

    for grad in grads:
        if bucket and (grad.dtype != bucket[0].dtype or grad.device != bucket[0].device or size >= limit):
            flush()
            size = 0
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
    flush()


def broadcast_text(text: str, src: int = 0) -> str:
    """Rank ``src``'s ``text`` on every rank (``text`` itself when not distributed).

    Ignite's ``idist.broadcast`` of a string sizes its buffer in characters and fills it with UTF-8
    bytes: a path with a non-ASCII character arrived cut ("runü/last_checkpoint_1.pt" as "...pM").
    Here the UTF-8 bytes are sent with their length, so any Unicode arrives whole.
    """
    if not is_distributed():
        return text
    device = idist.device()
    data = text.encode("utf-8") if idist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if buffer.numel():
        if idist.get_rank() == src:
            buffer.copy_(torch.tensor(list(data), dtype=torch.uint8))
        dist.broadcast(buffer, src=src)
    return bytes(buffer.cpu().tolist()).decode("utf-8")


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics), e.g. before evaluating."""
    if not is_distributed():
        return
    for buffer in unwrap(model).buffers():
        dist.broadcast(buffer, src=0)


def no_buffer_sync_in_forward(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Turn off DDP's broadcast of rank 0's buffers at each forward.

    That broadcast is a collective inside the step: a rank retrying after an out-of-memory error
    would call it once more than the others and hang. Rank 0's buffers (BatchNorm running
    statistics) evolve from its own batches either way, and the evaluator made by
    :func:`create_amp_evaluator` sends them to every rank before each evaluation.
    """
    if hasattr(ddp, "forward_sync_buffers"):  # torch >= 2.13
        ddp.forward_sync_buffers = False
    else:
        ddp.broadcast_buffers = False


def per_process(batch: int, world: int) -> int:
    """Each of ``world`` processes' share of the global batch ``batch``: ``batch // world``, at least 1.

    A training batch divides evenly (the config's check and the loaders refuse one that does not); an evaluation
    batch smaller than ``world`` gives each process one sample. Every per-process batch of the package (the loaders,
    the memory plan, the batch-size search, the start line) is this function's.
    """
    if batch < 1 or world < 1:
        raise ValueError(f"a batch of {batch} over {world} processes")
    return max(1, batch // world)


def global_batch(per_process_batch: int, world: int) -> int:
    """The global batch of ``world`` processes loading ``per_process_batch`` each (what a search or a retry found)."""
    return per_process_batch * world
