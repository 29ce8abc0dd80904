"""The run directory: one run at a time (a lock), everything writable before the first iteration,
a log file for tracebacks, and a previous run moved aside rather than mixed with a new one.
"""
import glob
import logging
import os
import shutil
import sys
import time
import weakref
from typing import Callable, List, NamedTuple, Optional

from ignite_amp.errors import ConfigError, RunDirInUseError

try:
    import fcntl
except ImportError:  # not on POSIX: no advisory lock
    fcntl = None  # type: ignore[assignment]  # (mypy's idiom for an optional module; checked before each use)

__all__ = ["RunLayout", "RunLock", "check_writable", "move_previous_run", "LogFile", "RUN_ARTIFACTS",
           "TENSORBOARD_SPLITS", "dashboard_command", "free_bytes", "terminal_log_handler", "RunFiles",
           "warn_if_disk_is_short", "move_aside", "move_files_aside", "COMMAND_PID", "check_run_directories"]

logger = logging.getLogger("ignite_amp")

LOCK_NAME = ".lock"
COMMAND_PID = "IGNITE_AMP_COMMAND_PID"  # set by the launcher: the command the user started, which the lock names
LOG_NAME = "train.log"
CONFIG_NAME = "config.yaml"
CHECKPOINTS = "checkpoints"
PROFILER = "profiler"
# What a training run writes in its output_dir (and what "starting over" moves aside).
TENSORBOARD_SPLITS = ("train", "val")  # TensorBoardMetrics' runs: one per split, in subdirectories
RUN_ARTIFACTS = (CHECKPOINTS, PROFILER, CONFIG_NAME, LOG_NAME, "events.out.tfevents.*", *TENSORBOARD_SPLITS)


class RunLayout(NamedTuple):
    """Where a run keeps each of its files: the one list of the run directory's names."""

    output_dir: str

    @property
    def tensorboard_dir(self) -> str:
        """The event files sit in output_dir itself: :func:`dashboard_command` names the run after it."""
        return self.output_dir

    @property
    def profiler_dir(self) -> str:
        return os.path.join(self.output_dir, PROFILER)

    @property
    def compare_dir(self) -> str:
        """``ignite-amp compare``'s TensorBoard runs (one per mode): beside the run, not in its dashboard."""
        return f"{os.path.normpath(self.output_dir)}-compare"

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.output_dir, CHECKPOINTS)

    @property
    def config_path(self) -> str:
        return os.path.join(self.output_dir, CONFIG_NAME)

    @property
    def log_path(self) -> str:
        return os.path.join(self.output_dir, LOG_NAME)

    @property
    def lock_path(self) -> str:
        return os.path.join(self.output_dir, LOCK_NAME)

    def is_run(self) -> bool:
        """Whether a training run has written here (its resolved config and its log)."""
        return os.path.isfile(self.config_path) and os.path.isfile(self.log_path)


def dashboard_command(output_dir: str) -> str:
    """The ``tensorboard`` command that shows this run alone, quoted for a shell: ``tensorboard --logdir
    runs/quickstart``. Not its parent (``runs/``): that also holds earlier runs moved aside and other
    experiments, whose curves would share the charts and their colours; comparing runs is a choice made on
    purpose (``tensorboard --logdir runs``, where the HParams tab compares them; the TensorBoard guide says how).
    TensorBoard names the run's own event files ``.`` and its splits ``train`` and ``val``."""
    import shlex

    return f"tensorboard --logdir {shlex.quote(os.path.normpath(output_dir))}"


class RunLock:
    """An advisory ``flock`` on ``output_dir/.lock``, held while the run lives; the file holds the PID.

    A second run into the same directory gets :class:`~ignite_amp.errors.RunDirInUseError` at
    once, naming the holder's PID: that of the command the user started (``$IGNITE_AMP_COMMAND_PID``,
    set by the launcher for the ranks it starts), not a spawned rank's. The kernel drops the lock
    when the process dies, so a killed run never leaves the directory locked (its ``.lock`` file
    stays, unlocked); a run that ends removes the file.
    """

    def __init__(self, output_dir: str):
        self.path = RunLayout(output_dir).lock_path
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        if fcntl is None or self._fd is not None:
            return self
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunDirInUseError(f"output_dir: {os.path.dirname(self.path)} is in use by another run (PID "
                                       f"{holder}); wait for it to end, or set another output_dir") from None
            try:  # the file a run that just ended removed (after we opened it) locks nothing: open it again
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, (os.environ.get(COMMAND_PID) or str(os.getpid())).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the file, then drop the lock (a run that opened it meanwhile sees it removed and retries)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(fd)


def check_run_directories(output_dir: str, tensorboard: bool, profiler: bool) -> None:
    """Create and test-write every directory a run in ``output_dir`` will write (rank 0): the checkpoints', and
    TensorBoard's and the profiler's when they are on."""
    layout = RunLayout(output_dir)
    check_writable(layout.checkpoint_dir, "output_dir")
    if tensorboard or profiler:
        check_writable(layout.tensorboard_dir, "output_dir")
    if profiler:
        check_writable(layout.profiler_dir, "output_dir")


def check_writable(path: str, key: str = "output_dir") -> None:
    """Create the directory ``path`` and write a file in it, or raise a ConfigError naming ``key``."""
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        if os.path.isfile(probe):  # written in part (a full disk): not left behind
            os.remove(probe)
        raise ConfigError(f"{key}: cannot write to {path} ({_in_the_way(path) or exc.strerror or exc})") from None


def _in_the_way(path: str) -> Optional[str]:
    """The part of ``path`` that is a file, or a symbolic link leading nowhere (makedirs' bare "File exists" or
    "Not a directory"), said so."""
    head = path
    while head and not os.path.exists(head):
        if os.path.islink(head):
            return f"{head} is a symbolic link that leads nowhere: a loop, or its target is missing"
        head = os.path.dirname(head.rstrip(os.sep))
    if head and not os.path.isdir(head):
        return f"{head} is a file, not a folder"
    return None


def _previous_artifacts(output_dir: str) -> List[str]:
    """The run files in ``output_dir``, if an earlier run got as far as writing one of its results
    (config.yaml, a checkpoint, an event file, a trace); else none. A start that failed its checks
    leaves only train.log and empty directories: that is not a run to move aside."""
    found = []
    for pattern in RUN_ARTIFACTS:
        found.extend(glob.glob(os.path.join(glob.escape(output_dir), pattern)))
    results = [p for p in found if os.path.basename(p) != LOG_NAME and (not os.path.isdir(p) or _holds_a_file(p))]
    return sorted(found) if results else []


def _holds_a_file(folder: str) -> bool:
    return any(files for _, _, files in os.walk(folder))


def move_previous_run(output_dir: str) -> Optional[str]:
    """Move what an earlier run left in ``output_dir`` to a sibling ``<dir>.replaced-<time>``.

    Returns the new place, or None when there was nothing. Only the run's own files move
    (:data:`RUN_ARTIFACTS`); anything else in the directory stays.
    """
    found = _previous_artifacts(output_dir)
    return move_files_aside(found, output_dir, "the previous run's files", then="") if found else None


def _aside(path: str) -> str:
    """A free sibling name ``<path>.replaced-<time>[-N]``."""
    base = os.path.abspath(path)  # "." moves beside the current directory, not into it
    target = f"{base}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while os.path.exists(target):
        suffix += 1
        target = f"{base}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
    return target


def move_aside(path: str) -> Optional[str]:
    """Rename the directory ``path``, if it holds a file, to a sibling ``<path>.replaced-<time>``; returns it."""
    if not (os.path.isdir(path) and _holds_a_file(path)):
        return None
    target = _aside(path)
    try:
        os.rename(path, target)
    except OSError as exc:
        raise ConfigError(f"output_dir: cannot move {path} aside ({exc.strerror or exc})") from None
    return target


def move_files_aside(paths: List[str], near: str, what: Optional[str] = None,
                     then: str = "; move them yourself, or resume from the newest checkpoint") -> str:
    """Move the files or directories ``paths`` into a new sibling ``<near>.replaced-<time>`` of ``near``; returns it.
    A failure is one line naming ``what`` (default: the files' names), then ``then``."""
    target = _aside(near)
    try:
        os.makedirs(target)
        for path in paths:
            shutil.move(path, os.path.join(target, os.path.basename(path)))
    except OSError as exc:
        what = what or ", ".join(map(os.path.basename, paths))
        raise ConfigError(f"output_dir: cannot move {what} out of {near} ({exc.strerror or exc}){then}") from None
    return target


def free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def terminal_log_handler(level: int = logging.WARNING) -> logging.Handler:
    """A stderr handler for ignite-amp's own warnings only: other libraries' log records (Ignite's
    "Engine run is terminating due to exception", say) go to the run's log file, not the terminal,
    where the command's one line already says what happened."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(level)
    handler.addFilter(lambda record: record.name == "ignite_amp"
                      or (record.name.startswith("ignite_amp.") and record.name != "ignite_amp.run.compose"))
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    return handler


class LogFile:
    """``output_dir/train.log``: the run's printed lines, every warning (Ignite's too) and the
    traceback of a run that failed, with times. Attached to the root logger while the run lives;
    it changes no logger's level, so the terminal shows what it showed before."""

    def __init__(self, output_dir: str):
        self.path = RunLayout(output_dir).log_path
        self.handler: Optional[logging.Handler] = None

    def open(self) -> "LogFile":
        try:
            handler = logging.FileHandler(self.path, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"output_dir: cannot write {self.path} ({exc.strerror or exc})") from None
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
        self.handler = handler
        return self

    def _emit(self, level: int, message: str, exc_info=None) -> None:
        if self.handler is not None:
            self.handler.handle(logging.LogRecord("ignite_amp.run.compose", level, __file__, 0, message, None,
                                                  exc_info))

    def line(self, message: str) -> None:
        """A line the run printed (epoch summaries, resume notices), into this file only."""
        self._emit(logging.INFO, message)

    def traceback(self, message: str) -> None:
        """The exception being handled, with its traceback, into this file only."""
        self._emit(logging.ERROR, message, sys.exc_info())

    def close(self) -> None:
        if self.handler is not None:
            handler, self.handler = self.handler, None
            logging.getLogger().removeHandler(handler)
            handler.close()


class RunFiles:
    """Rank 0's hold on the run directory: the lock, the log file, and switches to restore at the end."""

    def __init__(self, output_dir: str, main: bool):
        self.lock: Optional[RunLock] = None
        self.log = LogFile(output_dir)
        self._restore: list = []
        if main:
            check_writable(output_dir)
            self.lock = RunLock(output_dir).acquire()
        self._finalizer = weakref.finalize(self, _release, self.lock, self.log)

    def open_log(self) -> None:
        """Start ``train.log`` (rank 0), once an earlier run's files were moved aside or resumed."""
        if self.lock is not None:
            self.log.open()

    def restore_later(self, undo: Callable) -> None:
        self._restore.append(undo)

    def close(self) -> None:
        while self._restore:
            self._restore.pop()()
        self._finalizer()


def _release(lock: Optional[RunLock], log: LogFile) -> None:
    log.close()
    if lock is not None:
        lock.release()


def warn_if_disk_is_short(checkpoint_dir: str, weight_bytes: int, n_saved: int) -> None:
    """A checkpoint holds the weights and about twice their size of optimizer state; up to n_saved best
    files and a last one are kept, plus one being written."""
    need = 3 * weight_bytes * (n_saved + 2)
    free = free_bytes(checkpoint_dir)
    if free is not None and free < need:
        logger.warning("only %.0f MB free under %s; this run's checkpoints may need about %.0f MB: a save that "
                       "runs out of space stops the run and keeps the previous checkpoint", free / 2**20,
                       checkpoint_dir, need / 2**20)
