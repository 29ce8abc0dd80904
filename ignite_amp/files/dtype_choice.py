"""``dtype: auto`` on a CPU decided once per machine and model, then kept: a small JSON file of choices.

A timed probe's outcome moves with the machine's load (the quickstart measured a bfloat16 step at 0.35x-1.92x
float32's time on one 2-core machine), so a choice made afresh each run cannot be repeated. As cuDNN's
autotuner keeps the algorithm it found, the first probe's choice is written here and every later run and
``ignite-amp plan`` of the same model on the same machine reads it back. The file lives in the user's cache
folder (``$XDG_CACHE_HOME/ignite-amp``, else ``~/.cache/ignite-amp``; a relative ``XDG_CACHE_HOME`` is ignored,
as the XDG spec says), or in :data:`CACHE_ENV`'s folder (``~`` expanded); delete it (or its entry) to probe again.
Two processes keeping choices at once (two runs or plans started together) take turns: each reads, updates and
replaces the file under a lock (an ``flock`` on ``dtype-choices.json.lock`` beside it; where there is no ``fcntl``,
that file created exclusively), so neither loses the other's entry.
"""
import contextlib
import errno
import json
import os
import time
from typing import Iterator, NamedTuple, Optional

try:
    import fcntl
except ImportError:  # not on POSIX: an exclusively created lock file instead
    fcntl = None  # type: ignore[assignment]  # (mypy's idiom for an optional module; checked before each use)

__all__ = ["CACHE_ENV", "KeptChoice", "choices_path", "kept_choice", "keep_choice", "shown_path"]

#: A folder for the kept choices instead of the user's cache folder (the test suite points it at a temporary one).
CACHE_ENV = "IGNITE_AMP_CACHE_DIR"
FILE = "dtype-choices.json"


class KeptChoice(NamedTuple):
    """A choice read back: the dtype's name, why it was chosen (the probe's words) and when (UTC)."""

    dtype: str
    why: str
    decided: str


#: How long a process waits for another's turn at the file (its turn takes milliseconds) before it gives up.
LOCK_WAIT_S = 10.0
#: Without ``fcntl``: a lock file older than this was left by a process that died in its turn, and is taken over.
STALE_LOCK_S = 60.0


def choices_path() -> str:
    """The file of kept choices: in :data:`CACHE_ENV`'s folder (``~`` expanded, made absolute), else the user's cache
    folder (``$XDG_CACHE_HOME`` where it is an absolute path, else ``~/.cache``)."""
    folder = os.environ.get(CACHE_ENV)
    if folder:
        folder = os.path.abspath(os.path.expanduser(folder))
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "ignite-amp")
    return os.path.join(folder, FILE)


def shown_path(path: str) -> str:
    """``path`` with the home folder as ``~``, for a line."""
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home not in ("", "/", "~") and path.startswith(home + os.sep) else path


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            choices = json.load(f)
    except (OSError, ValueError):  # none yet, unreadable or not JSON: a cache, so it starts empty
        return {}
    return choices if isinstance(choices, dict) else {}


def kept_choice(key: str) -> Optional[KeptChoice]:
    """The choice kept under ``key``, or None (no file, no entry, or an entry that does not read as one)."""
    entry = _read(choices_path()).get(key)
    if not isinstance(entry, dict) or entry.get("dtype") not in ("float32", "bfloat16"):
        return None
    return KeptChoice(entry["dtype"], str(entry.get("why", "")), str(entry.get("decided", "")))


def keep_choice(key: str, dtype: str, why: str, what: str) -> str:
    """Write the choice under ``key`` (``what``: the machine and model in words, for a reader of the file), replacing
    the file atomically under the file's lock (another process's entries kept); returns the file's path. An OSError
    (a read-only home, a full disk, a file where the folder goes, the lock held past :data:`LOCK_WAIT_S`) is the
    caller's; its ``strerror`` is a phrase for a line."""
    named = os.environ.get(CACHE_ENV, "")
    if named.startswith("~") and os.path.expanduser(named) == named:  # not a folder of ./~user
        raise FileNotFoundError(errno.ENOENT, f"{CACHE_ENV} {named}: {named.split(os.sep)[0]} is no user's home")
    path = choices_path()
    folder = os.path.dirname(path)
    _refuse_a_file_for_the_folder(folder)
    os.makedirs(folder, exist_ok=True)
    with _turn(path + ".lock"):
        choices = _read(path)
        choices[key] = {"dtype": dtype, "why": why, "decided": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "for": what}
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as f:
                json.dump(choices, f, indent=1, sort_keys=True)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    return path


def _refuse_a_file_for_the_folder(folder: str) -> None:
    """A file where the folder (or one above it) goes: an OSError that names it (makedirs says only "File exists")."""
    head = folder
    while head and not os.path.lexists(head):
        head = os.path.dirname(head)
    if head and not os.path.isdir(head):
        named = f"{CACHE_ENV} names a file, {head}" if os.environ.get(CACHE_ENV) and head == folder else \
            f"{head} is a file"
        raise NotADirectoryError(errno.ENOTDIR, f"{named}, not a folder")


@contextlib.contextmanager
def _turn(lock_path: str) -> Iterator[None]:
    """This process's turn at the file: an exclusive ``flock`` on ``lock_path`` (the kernel drops it if the process
    dies), or without ``fcntl`` the file ``lock_path`` created exclusively and removed after (one older than
    :data:`STALE_LOCK_S` was left by a process that died, and is taken over). Waits up to :data:`LOCK_WAIT_S`."""
    deadline = time.monotonic() + LOCK_WAIT_S
    busy = OSError(errno.EWOULDBLOCK, f"{lock_path} stayed locked by another process for {LOCK_WAIT_S:g} s")
    if fcntl is not None:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise busy from None
                    time.sleep(0.005)
            yield
        finally:
            os.close(fd)  # drops the lock; the file stays (removing it would race with a process opening it)
        return
    while True:
        try:
            os.close(os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            break
        except FileExistsError:
            try:
                stale = time.time() - os.stat(lock_path).st_mtime > STALE_LOCK_S
            except FileNotFoundError:
                continue
            if stale:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock_path)
            elif time.monotonic() > deadline:
                raise busy from None
            time.sleep(0.005)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock_path)
