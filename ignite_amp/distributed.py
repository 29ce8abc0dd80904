"""Data-parallel training through ``ignite.distributed``: launch, agreement between ranks, samplers.

A run is distributed when it is started by ``torchrun`` (the environment says so) or when the
config asks for ``distributed.nproc_per_node > 1`` (the processes are then spawned by
``idist.Parallel``). In both cases :func:`launch` runs a function on every rank and returns
rank 0's result; with one process and no ``torchrun`` it simply calls the function.

The collectives used by the step live here too: :func:`any_rank` (the out-of-memory
agreement, on a CPU group so it never waits for the device), :func:`all_reduce_gradients`
and :func:`broadcast_buffers`.
"""
import gc
import logging
import os
import pickle
import shutil
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, Iterator, Optional

import ignite.distributed as idist
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException
from torch.utils.data import DistributedSampler

__all__ = ["launch", "under_torchrun", "resolve_backend", "is_distributed", "any_rank", "all_reduce_gradients",
           "broadcast_buffers", "min_across_ranks", "unwrap", "EvenShardSampler"]

logger = logging.getLogger("ignite_amp")

BACKENDS = ("auto", "nccl", "gloo")


def under_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (or another launcher setting its variables)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto``: NCCL for CUDA, gloo for CPU. Raises ValueError for NCCL without CUDA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend should be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"nccl needs CUDA devices and this run is on {device}; use gloo")
    return backend


def is_distributed() -> bool:
    return idist.get_world_size() > 1


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` / ``DataParallel`` wrapper (or the model itself)."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


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
    return int(idist.all_reduce(torch.tensor(value, device=idist.device()), op="MIN").item())


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
    bucket, size = [], 0

    def flush():
        if not bucket:
            return
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        flat.div_(world)
        for grad, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)
        bucket.clear()

    for grad in grads:
        if bucket and (grad.dtype != bucket[0].dtype or grad.device != bucket[0].device or size >= limit):
            flush()
            size = 0
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
    flush()


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics), e.g. before evaluating."""
    if not is_distributed():
        return
    for buffer in unwrap(model).buffers():
        dist.broadcast(buffer, src=0)


class EvenShardSampler(DistributedSampler):
    """Validation sharding without padding: rank ``r`` takes samples ``r, r + world, ...``.

    ``DistributedSampler`` pads the data set to a multiple of the world size by repeating
    samples, which would count them twice in the metrics; here each sample is evaluated once
    and Ignite's metrics add the ranks' counts up.
    """

    def __init__(self, dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.num_samples = len(range(self.rank, len(dataset), self.num_replicas))

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


IGNITE_CHATTER = ("torch.multiprocessing.spawn", "ignite.distributed.launcher.Parallel", "ignite.distributed.auto.auto_dataloader",
                  "ignite.distributed.auto.auto_model", "ignite.distributed.auto.auto_optim")


def _quiet_ignite() -> None:
    """Leave out the info lines of Ignite's launcher and auto_* helpers, and torch's notice that it
    stops the other processes when one failed (the failure itself is reported)."""
    for name in IGNITE_CHATTER:  # ignite.utils.setup_logger leaves an existing logger as it is
        logging.getLogger(name).setLevel(logging.ERROR if name.startswith("torch") else logging.WARNING)


_quiet_ignite()


def _quiet_other_ranks() -> None:
    """Rank 0 prints and logs; the others keep to errors."""
    if idist.get_rank() != 0:
        logging.getLogger().setLevel(logging.ERROR)
        logging.getLogger("ignite_amp").setLevel(logging.ERROR)


def _call(fn: Callable, args: tuple) -> Any:
    try:
        return fn(*args)
    finally:
        # Free the DDP model (held in reference cycles through the engines' handlers) while the
        # process group still exists: freed at interpreter exit instead, gloo aborted now and then
        # ("terminate called without an active exception").
        gc.collect()


def _spawned(local_rank: int, fn: Callable, outbox: str, log_level: int, args: tuple) -> None:
    """Body of a spawned process: run ``fn``, leave its result or its error for the parent."""
    logging.basicConfig(level=log_level, format="%(name)s: %(message)s")
    sys.stdout.reconfigure(line_buffering=True)  # rank 0's epoch lines as they come, also through a pipe
    rank = idist.get_rank()
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun does (N x all cores thrashes)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // idist.get_nproc_per_node()))
    _quiet_other_ranks()
    try:
        outcome = ("ok", _call(fn, args))
    except BaseException as exc:  # the parent re-raises it; a non-zero exit makes it stop the other ranks
        outcome = ("error", exc, traceback.format_exc())
        _post(outbox, rank, outcome)
        sys.exit(1)
    if rank == 0:
        _post(outbox, rank, outcome)


def _post(outbox: str, rank: int, outcome: tuple) -> None:
    path = os.path.join(outbox, f"rank{rank}.pkl")
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # an unpicklable result or error: send its text
        payload = pickle.dumps(("error", RuntimeError(repr(outcome[1])), outcome[-1]))
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)


def _collect(outbox: str, nproc: int) -> Any:
    outcomes = {}
    for rank in range(nproc):
        path = os.path.join(outbox, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                outcomes[rank] = pickle.load(f)
    errors = [(rank, o) for rank, o in sorted(outcomes.items()) if o[0] == "error"]
    if errors:
        rank, (_, exc, text) = errors[0]
        from ignite_amp.run import RUN_STOPPED, USER_ERRORS

        if isinstance(exc, USER_ERRORS + RUN_STOPPED + (KeyboardInterrupt,)):
            raise exc
        raise RuntimeError(f"rank {rank} of {nproc} failed:\n{text}")
    if 0 not in outcomes:
        raise RuntimeError(f"the {nproc} training processes ended without a result (killed?)")
    return outcomes[0][1]


def launch(cfg: dict, fn: Callable, *args: Any) -> Any:
    """Run ``fn(*args)`` on every rank the config (or ``torchrun``) asks for; return rank 0's result.

    - under ``torchrun``: this process is one rank; the process group is set up with
      ``idist.Parallel(backend)`` (``distributed.nproc_per_node`` is then torchrun's business);
    - ``distributed.nproc_per_node: N > 1``: ``idist.Parallel`` spawns N processes on this machine;
    - otherwise ``fn(*args)`` runs here, without a process group.

    Errors raised on a rank are raised here (the first rank's), so a user error stays one line.
    """
    from ignite_amp.run import config_device

    nproc = cfg["distributed"]["nproc_per_node"] or 1
    if idist.get_world_size() > 1 or (nproc == 1 and not under_torchrun()):
        return fn(*args)  # already inside a process group, or a plain single-process run
    from ignite_amp.config import ConfigError

    try:
        backend = resolve_backend(cfg["distributed"]["backend"], config_device(cfg))
    except ValueError as exc:
        raise ConfigError(f"distributed.backend: {exc}") from None
    if under_torchrun():
        result = []
        with idist.Parallel(backend=backend) as parallel:
            _quiet_other_ranks()
            parallel.run(lambda local_rank: result.append(_call(fn, args)))
        return result[0]
    if backend == "nccl" and nproc > torch.cuda.device_count():
        raise ConfigError(f"distributed.nproc_per_node: {nproc} processes but {torch.cuda.device_count()} GPUs")
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise ValueError(f"spawning {nproc} processes needs picklable arguments (print_fn=print, not a lambda); "
                         f"{exc}") from None
    outbox = tempfile.mkdtemp(prefix="ignite-amp-")
    try:
        try:
            with idist.Parallel(backend=backend, nproc_per_node=nproc, master_port=_free_port()) as parallel:
                parallel.run(_spawned, fn, outbox, logging.getLogger().getEffectiveLevel(), args)
        except ProcessException:
            pass  # a rank failed (and torch stopped the others): its error is in the outbox
        return _collect(outbox, nproc)
    finally:
        shutil.rmtree(outbox, ignore_errors=True)
