"""Checkpoint files on disk: crash-safe writes, reads that fail in one line, and what rides along.

The storage half of checkpointing (Ignite's ``DiskSaver`` made crash-safe); the policy, which
files to keep and which to resume from, is :class:`ignite_amp.handlers.BestCheckpoint`.
"""
import contextlib
import errno
import importlib
import logging
import os
import re
import shutil
import warnings
from typing import Any, Callable, Iterator, List, Mapping, Optional, TypeVar, Union

import ignite.distributed as idist
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ignite.base.mixins import Serializable
from ignite.handlers import DiskSaver
from torch.distributed.checkpoint.api import CheckpointException

from ignite_amp.core.collectives import any_rank, broadcast_text, is_distributed
from ignite_amp.errors import CheckpointError, CheckpointTypeError, CheckpointWriteError, first_line

__all__ = ["SafeDiskSaver", "ShardedDiskSaver", "StoredValue", "load_checkpoint", "remove_path", "disk_full",
           "out_of_room", "ROOM", "interrupt_inside", "TEMP_MARK", "STATE_FILE", "dcp_cause", "TYPE_PACKAGES",
           "refused_class", "with_types", "type_error"]

logger = logging.getLogger("ignite_amp")

TEMP_MARK = ".tmp-"  # a save in progress: ".<filename>.tmp-<pid>" (of a sharded one: rank 0's pid)
STATE_FILE = "state.pt"  # in a sharded checkpoint's directory: what is not in its DCP shards
SHARDED_KEYS = ("model", "optimizer")  # what a sharded checkpoint keeps in its DCP shards
# The packages whose tensor classes a checkpoint of ours may hold, with what installs them: importing one registers
# its classes with weights_only loading (torchao.float8: the float8 weights FSDP2 all-gathers in float8).
TYPE_PACKAGES = {"torchao.float8": 'torchao to load: pip install -e ".[fp8]" (or pip install "torchao>=0.17")'}
T = TypeVar("T")


class StoredValue(Serializable):
    """A plain value (e.g. the resolved config) that rides along in a checkpoint."""

    _state_dict_all_req_keys = ("value",)

    def __init__(self, value: Any = None):
        self.value = value

    # ignite's Serializable says OrderedDict; a dict serves (Checkpoint and load_state_dict only read it)
    def state_dict(self) -> dict:  # type: ignore[override]
        return {"value": self.value}

    def load_state_dict(self, state_dict: Mapping) -> None:
        super().load_state_dict(state_dict)
        self.value = state_dict["value"]


def interrupt_inside(exc: BaseException) -> Optional[KeyboardInterrupt]:
    """The Ctrl-C or SIGTERM (a ``KeyboardInterrupt``) that ``exc`` hides, if any: raised in the Python write
    that ``torch.save`` calls, it comes out as torch's "unexpected pos" write error, with the interrupt as its
    context."""
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


#: What stops a write for want of room, by errno: the words for it, and what to do before running again.
ROOM = {errno.ENOSPC: ("no space left on device", "free space"),
        errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
        errno.EFBIG: ("file too large for the file-size limit (ulimit -f)", "raise the limit")}


def out_of_room(exc: BaseException) -> Optional[tuple]:
    """``(what, what to do)`` where ``exc`` (or what caused it) says a write found no room (:data:`ROOM`; torch's
    write errors read as a full disk), else None; an interrupt that torch's writer turned into one is not."""
    if interrupt_inside(exc) is not None:
        return None
    for error in (exc, exc.__cause__, exc.__context__):
        if isinstance(error, OSError) and error.errno in ROOM:
            return ROOM[error.errno]
    text = str(exc)
    full = "No space left" in text or "unexpected pos" in text or "file write failed" in text
    return ROOM[errno.ENOSPC] if full else None


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says a write found no room: :func:`out_of_room`."""
    return out_of_room(exc) is not None


def _kept(dirname: Union[str, os.PathLike], room: Optional[tuple] = None) -> str:
    """After a failed save: what is on disk (the previous checkpoints, or none yet); out of ``room``, what to do."""
    try:
        kept = any(n.endswith((".pt", ".dcp")) and not n.startswith(".") for n in os.listdir(dirname))
    except OSError:
        kept = False
    if room is None:
        return "the previous checkpoints are kept" if kept else "no checkpoint was written yet"
    return (f"the previous checkpoints are kept: {room[1]} and run the same command to resume" if kept else
            f"no checkpoint was written yet: {room[1]} and run the same command to start again")


class SafeDiskSaver(DiskSaver):
    """Ignite's ``DiskSaver`` made crash-safe: a new file is complete before an old one goes.

    Ignite's ``Checkpoint`` asks its saver to remove the file it replaces *before* it saves the
    new one, so a kill in between would leave nothing to resume. Here ``remove`` only queues
    the name; ``__call__`` writes the new file to ``.<name>.tmp-<pid>``, flushes and fsyncs it,
    renames it into place, fsyncs the directory, and only then removes what was queued. A
    failed write (disk full, say) removes its temp file, keeps every old file and raises
    :class:`~ignite_amp.errors.CheckpointWriteError`.
    """

    def __init__(self, dirname: str, **kwargs: Any):
        super().__init__(dirname, atomic=True, create_dir=True, require_empty=False, **kwargs)
        self._pending: List[str] = []

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Optional[Mapping] = None) -> None:
        if idist.get_rank() != self.save_on_rank:
            return
        path = os.path.join(self.dirname, filename)
        tmp = os.path.join(self.dirname, f".{filename}{TEMP_MARK}{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f, **self.kwargs)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(str(self.dirname))
        except BaseException as exc:
            self._pending.clear()  # the files it would replace are the good ones now
            try:
                os.remove(tmp)
            except OSError:
                pass
            interrupt = interrupt_inside(exc)
            if interrupt is not None and interrupt is not exc:  # Ctrl-C or SIGTERM in torch's writer: itself
                raise interrupt from None
            room = out_of_room(exc) if isinstance(exc, Exception) else None
            if room is not None:
                raise CheckpointWriteError(f"cannot write checkpoint {path}: {room[0]}; {_kept(self.dirname, room)}"
                                           ) from None
            raise
        self._remove_pending(filename)

    def _remove_pending(self, saved: str) -> None:
        """After ``saved`` is in place: remove the checkpoints it replaces."""
        pending, self._pending = self._pending, []
        for old in pending:
            if old != saved:  # Ignite "removes" a file it is about to overwrite
                try:
                    remove_path(os.path.join(self.dirname, old))
                except OSError as exc:  # the new one is in place: an old one left behind costs only space
                    logger.warning("could not remove the old checkpoint %s (%s): it stays on disk",
                                   os.path.join(self.dirname, old), exc.strerror or exc)

    def remove(self, filename: str) -> None:
        if idist.get_rank() == self.save_on_rank:
            self._pending.append(filename)

    @staticmethod
    def remove_temp_files(dirname: str) -> List[str]:
        """Remove what killed saves left (``.<name>.tmp-<pid>``); returns their names. A temp file whose pid is a
        live process other than this one is a save in progress (another script on the same directory): kept."""
        if not os.path.isdir(dirname):
            return []
        left = [n for n in os.listdir(dirname) if n.startswith(".") and TEMP_MARK in n and not _saving(n)]
        for name in left:
            try:
                remove_path(os.path.join(dirname, name))
            except OSError:
                pass
        return left


class ShardedDiskSaver(SafeDiskSaver):
    """Crash-safe saves of a sharded model's checkpoint: a directory per checkpoint.

    Every rank writes its shards of ``model`` and ``optimizer`` with ``torch.distributed.checkpoint``
    into ``.<name>.tmp-<pid of rank 0>`` (torch fsyncs them), rank 0 adds the rest as ``state.pt`` (fsynced),
    then renames the directory into place and only then removes the checkpoints it replaces. The
    ranks agree on the outcome, so a failed write (disk full on any rank) raises
    :class:`~ignite_amp.errors.CheckpointWriteError` on every rank and keeps the old checkpoints.
    """

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Optional[Mapping] = None) -> None:
        main = idist.get_rank() == self.save_on_rank
        path = os.path.join(self.dirname, filename)
        pid = broadcast_text(str(os.getpid()), src=self.save_on_rank)  # its pid names the save in progress
        tmp = os.path.join(self.dirname, f".{filename}{TEMP_MARK}{pid}")
        error: Optional[BaseException] = None
        try:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)  # left by a killed save
            if is_distributed():
                idist.barrier()  # no rank writes into tmp before it is clean
            with single_process_quiet():
                dcp.save({k: v for k, v in checkpoint.items() if k in SHARDED_KEYS}, checkpoint_id=tmp,
                         no_dist=not is_distributed())
            if main:
                with open(os.path.join(tmp, STATE_FILE), "wb") as f:
                    torch.save({k: v for k, v in checkpoint.items() if k not in SHARDED_KEYS}, f, **self.kwargs)
                    f.flush()
                    os.fsync(f.fileno())
                _fsync_dir(tmp)
                old = f"{tmp}-old"
                if os.path.exists(path):  # Ignite overwrites a name it saved before: keep it until the new one is in
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(path, old)
                os.replace(tmp, path)
                _fsync_dir(str(self.dirname))
                shutil.rmtree(old, ignore_errors=True)
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            error = exc
        failures = _gather_failures(error)
        if failures:
            self._pending.clear()  # the checkpoints it would replace are the good ones now
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            if is_distributed():
                idist.barrier()  # every rank stops with the directory as it was
            rank, text, room = failures[0]
            if room:
                raise CheckpointWriteError(f"cannot write checkpoint {path}: {room[0]}; {_kept(self.dirname, room)}"
                                           ) from None
            if error is not None and rank == idist.get_rank() and not isinstance(error, (OSError, CheckpointException)):
                raise error  # not a storage fault: the run's own error
            who = f"rank {rank}: " if is_distributed() else ""
            raise CheckpointWriteError(f"cannot write checkpoint {path} ({who}{text}); {_kept(self.dirname)}"
                                       ) from None
        if main:
            self._remove_pending(filename)


def dcp_cause(error: BaseException) -> BaseException:
    """The error inside DCP's CheckpointException (the first failing rank's), else ``error`` itself."""
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and failures:
        first = next(iter(failures.values()))  # (exception, its frames), as torch wraps it
        first = first[0] if isinstance(first, tuple) and first else first
        return first if isinstance(first, BaseException) else error
    return error


def _gather_failures(error: Optional[BaseException]) -> List[tuple]:
    """Every rank's failure as ``(rank, first line, out of room: what and what to do, or None)``, the same list on
    every rank."""
    error = dcp_cause(error) if error is not None else None
    mine = None if error is None else (idist.get_rank(), first_line(error), out_of_room(error))
    if not is_distributed():
        return [mine] if mine else []
    if not any_rank(mine is not None):  # the usual case: one integer, no pickling
        return []
    everyone: List[Any] = [None] * idist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [f for f in everyone if f is not None]


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Around ``torch.distributed.checkpoint`` calls: no warning that one process saves or loads alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def remove_path(path: str) -> None:
    """Remove a checkpoint file or a sharded checkpoint's directory; one already gone is fine (every rank
    of a resume prunes the same directory)."""
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def _saving(name: str) -> bool:
    """Whether the temp file ``name`` (``.<name>.tmp-<pid>[-old]``) is a save in progress: its pid is a live process
    other than this one (this one is not saving while it attaches; a killed run's pid may come back after a
    restart). A pid reused by an unrelated process keeps a stale file until a later attach: it costs only space."""
    match = re.search(rf"{re.escape(TEMP_MARK)}(\d+)(?:-old)?$", name)
    if match is None or int(match.group(1)) in (os.getpid(), 0):
        return False
    try:
        os.kill(int(match.group(1)), 0)  # signal 0: only asks whether the process exists
    except PermissionError:  # another user's live process
        return True
    except (OSError, OverflowError):  # no such process (ProcessLookupError), or a pid no process can have
        return False
    return True


def _fsync_dir(dirname: str) -> None:
    try:
        fd = os.open(dirname, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_shards(path: str) -> None:
    """Every shard file a sharded checkpoint's metadata names is there, as long as the metadata says."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        needed: dict = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable .metadata ({exc.__class__.__name__})") from None
    for name, size in sorted(needed.items()):
        shard = os.path.join(path, name)
        have = os.path.getsize(shard) if os.path.isfile(shard) else None
        if have is None or have < size:
            raise CheckpointError(f"checkpoint {path}: shard {name} is {'missing' if have is None else 'truncated'}")


def refused_class(error: BaseException) -> Optional[str]:
    """The class a ``weights_only`` load refused (torch names it ``GLOBAL module.Class``), or None: the file is a
    sound pickle that holds that class, not damaged bytes (those fail to decode, or name no such dotted path)."""
    match = re.search(r"GLOBAL ([A-Za-z_][\w.]*\.[A-Za-z_]\w*) (?:was not an allowed global|whose module)",
                      str(dcp_cause(error)))
    return match.group(1) if match else None


def _package(name: str) -> Optional[str]:
    return next((p for p in TYPE_PACKAGES if name.startswith(p + ".")), None)


def with_types(load: Callable[[], T]) -> T:
    """``load()``; when its ``weights_only`` reading refused a class of :data:`TYPE_PACKAGES` (a float8 run's
    shards read in a process that has not imported torchao.float8), that package is imported and ``load()``
    runs once more. Any other error is ``load()``'s."""
    try:
        return load()
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        package = _package(refused_class(exc) or "")
        if package is None:
            raise
        try:
            importlib.import_module(package)
        except ImportError:
            raise exc from None
    return load()


def type_error(path: str, error: BaseException) -> Optional[CheckpointTypeError]:
    """The one-line error for a sound checkpoint that holds a class this process cannot load, or None when
    ``error`` is not such a refusal (damage, or a checkpoint that does not fit)."""
    name = refused_class(error)
    if name is None:
        return None
    package = _package(name)
    if package is not None:
        return CheckpointTypeError(f"checkpoint {path}: holds {name}, which needs {TYPE_PACKAGES[package]}")
    return CheckpointTypeError(f"checkpoint {path}: holds {name}, which weights-only loading refuses (a class "
                               f"ignite-amp does not save: not a checkpoint of this run)")


def load_checkpoint(path: str) -> dict:
    """``torch.load(path, weights_only=True)`` on the CPU; a missing or unreadable file is a CheckpointError.

    A sharded checkpoint (a directory) gives what its ``state.pt`` holds: all but the sharded
    model and optimizer state, which :func:`ignite_amp.transforms.sharding.load_sharded` loads."""
    if os.path.isdir(path):
        for name in (".metadata", STATE_FILE):
            if not os.path.isfile(os.path.join(path, name)):
                raise CheckpointError(f"checkpoint {path}: not a complete sharded checkpoint (no {name})")
        _check_shards(path)
        return load_checkpoint(os.path.join(path, STATE_FILE))
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        state = with_types(lambda: torch.load(path, map_location="cpu", weights_only=True))
    except Exception as exc:  # truncated zip, foreign pickle...: whatever torch.load raised
        refused = type_error(path, exc)
        if refused is not None:  # a sound file: never taken for damage
            raise refused from None
        raise CheckpointError(f"checkpoint {path}: truncated or not a checkpoint file "
                              f"({exc.__class__.__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: not a checkpoint of this run (holds a {type(state).__name__})")
    return state
