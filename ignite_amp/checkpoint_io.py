"""Checkpoint files on disk: crash-safe writes, reads that fail in one line, and what rides along.

The storage half of checkpointing (Ignite's ``DiskSaver`` made crash-safe); the policy, which
files to keep and which to resume from, is :class:`ignite_amp.handlers.BestCheckpoint`.
"""
import errno
import logging
import os
from typing import Any, List, Mapping, Optional

import ignite.distributed as idist
import torch
from ignite.base.mixins import Serializable
from ignite.handlers import DiskSaver

from ignite_amp.errors import CheckpointError, CheckpointWriteError

__all__ = ["SafeDiskSaver", "StoredValue", "load_checkpoint", "disk_full", "TEMP_MARK"]

logger = logging.getLogger("ignite_amp")

TEMP_MARK = ".tmp-"  # a save in progress: ".<filename>.tmp-<pid>"


class StoredValue(Serializable):
    """A plain value (e.g. the resolved config) that rides along in a checkpoint."""

    _state_dict_all_req_keys = ("value",)

    def __init__(self, value: Any = None):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state_dict: Mapping) -> None:
        super().load_state_dict(state_dict)
        self.value = state_dict["value"]


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the disk is full: ENOSPC, EDQUOT, or torch's write errors."""
    for error in (exc, exc.__cause__, exc.__context__):
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
    text = str(exc)
    return "No space left" in text or "unexpected pos" in text or "file write failed" in text


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
            if isinstance(exc, Exception) and disk_full(exc):
                raise CheckpointWriteError(f"cannot write checkpoint {path}: no space left on device; the previous "
                                           f"checkpoints are kept: free space and run the same command to resume"
                                           ) from None
            raise
        pending, self._pending = self._pending, []
        for old in pending:
            if old != filename:  # Ignite "removes" a file it is about to overwrite
                try:
                    os.remove(os.path.join(self.dirname, old))
                except FileNotFoundError:
                    pass
                except OSError as exc:  # the new file is in place: an old one left behind costs only space
                    logger.warning("could not remove the old checkpoint %s (%s): it stays on disk",
                                   os.path.join(self.dirname, old), exc.strerror or exc)

    def remove(self, filename: str) -> None:
        if idist.get_rank() == self.save_on_rank:
            self._pending.append(filename)

    @staticmethod
    def remove_temp_files(dirname: str) -> List[str]:
        """Remove what killed saves left (``.<name>.tmp-<pid>``); returns their names."""
        if not os.path.isdir(dirname):
            return []
        left = [n for n in os.listdir(dirname) if n.startswith(".") and TEMP_MARK in n]
        for name in left:
            try:
                os.remove(os.path.join(dirname, name))
            except OSError:
                pass
        return left


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


def load_checkpoint(path: str) -> dict:
    """``torch.load(path, weights_only=True)`` on the CPU; a missing or unreadable file is a CheckpointError."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, foreign pickle...: whatever torch.load raised
        raise CheckpointError(f"checkpoint {path}: truncated or not a checkpoint file "
                              f"({exc.__class__.__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: not a checkpoint of this run (holds a {type(state).__name__})")
    return state
