"""How a command of ``ignite-amp`` ends when it fails: one line on stderr and an exit code.

A user error (bad config, missing data, unwritable output, a run directory in use) exits 2; a run stopped for a
stated reason (non-finite loss, out of memory at the floor, disk full) exits 1 and says how to resume; Ctrl-C
exits 130 and SIGTERM 143; an unexpected error exits 1 and points at the traceback in the run's ``train.log``.
``--debug`` also prints the traceback. Under torchrun, rank 0 says it.
"""
import argparse
import errno
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Optional, Tuple

__all__ = ["state", "one_line", "describe", "interrupted", "failed", "thread_failed", "Terminated", "terminated"]

state: dict = {}  # what the command knew before it failed (the run's log file, its checkpoints, how to resume)


def one_line(exc: BaseException) -> str:
    """The user-facing line of an error: its first line; for an error raised in a DataLoader worker
    (which arrives as "Caught X in DataLoader worker ... Original Traceback ..."), the original's."""
    text = str(exc).strip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        name, sep, message = last.partition(": ")
        text = message if sep and re.fullmatch(r"[\w.]+", name) else last
    return text.splitlines()[0] if text else exc.__class__.__name__


def _checkpoint_kept() -> bool:
    """Whether the run being trained has a checkpoint on disk (what "resume" would load)."""
    folder = state.get("checkpoints")
    if not folder:
        return False
    return os.path.isdir(folder) and any(
        n.endswith((".pt", ".dcp")) and not n.startswith(".") for n in os.listdir(folder))


def _rerun() -> str:
    """How to resume the run being trained from its last checkpoint: the same command, unless that names
    another checkpoint (``resume:`` a path) or starts over (``never``)."""
    command = state.get("resume")
    return f"run {command}" if command else "run the same command"


def describe(exc: BaseException) -> Tuple[int, str]:
    """(exit code, the one line) for a failure of a command. A user's error is told without importing torch (a
    refused ``init`` or config answers at once)."""
    from ignite_amp.errors import RUN_STOPPED, USER_ERRORS, RankDiedError

    if isinstance(exc, USER_ERRORS):
        return 2, f"ignite-amp: error: {one_line(exc)}"
    from ignite_amp.core.device import is_oom_error
    from ignite_amp.files.checkpoints import out_of_room

    if isinstance(exc, RankDiedError):
        then = (f"the last checkpoint is intact: {_rerun()} to resume" if _checkpoint_kept() else
                "no checkpoint was written yet: run the same command to start again")
        return 1, f"ignite-amp: stopped: {one_line(exc)}; {then}"
    if isinstance(exc, RUN_STOPPED):
        return 1, f"ignite-amp: stopped: {one_line(exc)}"
    if is_oom_error(exc):  # one process, or one rank of several (FSDP2 cannot retry a batch: no OOMBackoff)
        # amp.micro_batches may change on a resume; data.batch_size not under a schedule
        then = (f"the last checkpoint is intact: {_rerun()} with --set amp.micro_batches=N (the same batch in N "
                f"smaller chunks) to resume" if _checkpoint_kept() else "lower data.batch_size, or raise "
                "amp.micro_batches (the same batch in smaller chunks), and run it again")
        return 1, f"ignite-amp: stopped: out of memory ({one_line(exc)}); {then}"
    room = out_of_room(exc)
    if room is not None:  # a full disk, a quota, a file-size limit
        what, fix = room
        if state.get("command", "train") != "train":  # a command that writes a file or its output, no run
            where = _written_file(exc, "writing the output")
            return 1, f"ignite-amp: stopped: {what} ({where}); {fix} and run the command again"
        then = (f"the last checkpoint is kept: {fix} and {_rerun()} to resume" if _checkpoint_kept() else
                f"no checkpoint was written yet: {fix} and run the same command again")
        return 1, f"ignite-amp: stopped: {what} ({_written_file(exc)}); {then}"
    no_temporary = _no_temporary_folder(exc)
    if no_temporary:
        return 1, f"ignite-amp: stopped: {no_temporary}"
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM, errno.EISDIR,
                                                  errno.ENOTDIR):
        # EISDIR/ENOTDIR: a directory where the run keeps a file (.lock, config.yaml), or the reverse
        return 2, f"ignite-amp: error: cannot write {exc.filename or ''}: {exc.strerror}"
    log = state.get("log")
    where = f"the traceback is in {log}" if log and os.path.exists(log) else "run it again with --debug"
    written = _written_file(exc) if isinstance(exc, OSError) and not exc.filename else None
    what = f" ({written})" if written and written != "writing the run" else ""
    return 1, f"ignite-amp: internal error: {exc.__class__.__name__}: {one_line(exc)}{what} ({where})"


def _no_temporary_folder(exc: BaseException) -> Optional[str]:
    """Python's "No usable temporary directory found in [...]" (``tempfile`` could write a file in none of them), in
    words: the folders tried, and whether their disks are full (measured), else that none takes a file."""
    import ast
    import shutil

    text = str(exc.args[1]) if isinstance(exc, FileNotFoundError) and len(exc.args) > 1 else ""
    if not text.startswith("No usable temporary directory found in "):
        return None
    try:
        folders = [str(f) for f in ast.literal_eval(text.partition(" found in ")[2])]
    except (ValueError, SyntaxError):
        folders = []
    free = {}
    for folder in folders:
        try:
            free[folder] = shutil.disk_usage(folder).free
        except OSError:  # not there
            pass
    tried = ", ".join(dict.fromkeys(folders)) or "the temporary folders"
    if free and all(room < 2 ** 20 for room in free.values()):
        return (f"the disk is full: no folder for temporary files has room ({tried}); free some space, or set TMPDIR "
                f"to a folder on a disk with room, and run the command again")
    return (f"no folder for temporary files takes a file ({tried}); set TMPDIR to a folder you can write to, and run "
            f"the command again")


def _written_file(exc: BaseException, otherwise: str = "writing the run") -> str:
    """The file a write error was about: its name, else TensorBoard's event files where its writer raised it (its
    thread's error, raised again in the run's next write), else ``otherwise``."""
    filename = getattr(exc, "filename", None)
    if filename:
        return filename
    return "writing TensorBoard's event files" if _from_tensorboard(exc.__traceback__) else otherwise


def _from_tensorboard(tb) -> bool:
    """Whether a traceback passes through TensorBoard's writer (whose thread's errors it raises again in the run)."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    return any(f"{os.sep}tensorboard{os.sep}" in frame.filename for frame in frames)


def interrupted(args: argparse.Namespace, exc: KeyboardInterrupt, signals: bool) -> int:
    """Ctrl-C or SIGTERM (``signals``: this thread handles them): one line on what was kept; its exit code."""
    if signals:  # a second Ctrl-C while this one is handled: no traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if getattr(args, "debug", False):
        traceback.print_exc()
    what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    log = state.get("log")
    if log and os.path.exists(log):
        with open(log, "a") as f:
            f.write(f"ignite-amp: {what}\n")
    if state.get("finished"):  # while the last lines printed
        what, then = f"{what} after the run finished", "nothing lost (its checkpoints and logs are written)"
    elif args.command != "train":
        then = "nothing was kept: run the command again"
    elif _checkpoint_kept():
        then = f"{_rerun()} to resume from the last checkpoint"
    else:
        then = "no checkpoint was written yet: run the same command to start again"
    if int(os.environ.get("RANK", 0)) == 0:  # under torchrun every rank gets the signal: rank 0 says it
        print(f"ignite-amp: {what}: {then}", file=sys.stderr)
    return 143 if isinstance(exc, Terminated) else 130


def failed(args: argparse.Namespace, exc: Exception, signals: bool) -> int:
    """A command's error: its one line on stderr (see :func:`describe`); its exit code."""
    stopped = _stopped_with_rank_0() if signals else None
    if stopped is not None:  # under torchrun: rank 0 says it, in its one line
        return stopped
    if getattr(args, "debug", False):
        traceback.print_exc()
    code, line = describe(exc)
    print(line, file=sys.stderr)
    _log_rank_death(exc, line)
    return code


def _stopped_with_rank_0(wait: float = 3.0) -> Optional[int]:
    """Under torchrun, on a rank other than 0: whether the error came from a stop of every worker (torchrun
    sends each one the signal; rank 0 stopped first and this rank's collective lost its peer, "Connection
    closed by peer"). Waits up to ``wait`` seconds for this rank's own signal; returns its exit code, or None."""
    if int(os.environ.get("RANK", 0)) == 0 or "LOCAL_RANK" not in os.environ:
        return None
    deadline = time.monotonic() + wait
    try:
        while "signalled" not in state and time.monotonic() < deadline:
            time.sleep(0.02)
    except KeyboardInterrupt as exc:
        state["signalled"] = 143 if isinstance(exc, Terminated) else 130
    return state.get("signalled")


def _log_rank_death(exc: BaseException, line: str) -> None:
    """A killed rank wrote nothing about it: the command's line goes to train.log too."""
    from ignite_amp.errors import RankDiedError

    log = state.get("log")
    if isinstance(exc, RankDiedError) and log and os.path.exists(log):
        with open(log, "a") as f:
            f.write(line + "\n")


def thread_failed(args: "threading.ExceptHookArgs") -> None:
    """A thread's error: a full disk (or quota, or file-size limit), and any error of TensorBoard's writer thread
    (which TensorBoard raises again in the run's next write), go to train.log only: the run stops on it in one
    line. Others as usual."""
    from ignite_amp.files.checkpoints import disk_full

    # (exc_value may be None, threading's documentation says: the usual hook then)
    if args.exc_value is None or not (disk_full(args.exc_value) or _from_tensorboard(args.exc_traceback)):
        state.get("excepthook", threading.__excepthook__)(args)
        return
    log = state.get("log")
    if log is None:  # no run's log yet: nowhere to write it
        return
    try:
        with open(log, "a") as f:
            f.write("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
    except (OSError, TypeError):
        pass


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so it unwinds like Ctrl-C."""


def terminated(signum, frame) -> None:
    """The SIGTERM handler: raise :class:`Terminated` where the run is."""
    state["signalled"] = 143
    raise Terminated()
