"""``dtype: auto`` on a CPU decided once per machine and model, then kept: a small JSON file of choices.

A timed probe's outcome moves with the machine's load (the quickstart measured a bfloat16 step at 0.35x-1.92x
float32's time on one 2-core machine), so a choice made afresh each run cannot be repeated. As cuDNN's
autotuner keeps the algorithm it found, the first probe's choice is written here and every later run and
``ignite-amp plan`` of the same model on the same machine reads it back. The file lives in the user's cache
folder (``$XDG_CACHE_HOME/ignite-amp``, else ``~/.cache/ignite-amp``), or in :data:`CACHE_ENV`'s folder;
delete it (or its entry) to probe again.
"""
import json
import os
import time
from typing import NamedTuple, Optional

__all__ = ["CACHE_ENV", "KeptChoice", "choices_path", "kept_choice", "keep_choice", "shown_path"]

#: A folder for the kept choices instead of the user's cache folder (the test suite points it at a temporary one).
CACHE_ENV = "IGNITE_AMP_CACHE_DIR"
FILE = "dtype-choices.json"


class KeptChoice(NamedTuple):
    """A choice read back: the dtype's name, why it was chosen (the probe's words) and when (UTC)."""

    dtype: str
    why: str
    decided: str


def choices_path() -> str:
    """The file of kept choices: in :data:`CACHE_ENV`'s folder, else the user's cache folder."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
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
    the file atomically; returns the file's path. An OSError (a read-only home, a full disk) is the caller's."""
    path = choices_path()
    choices = _read(path)
    choices[key] = {"dtype": dtype, "why": why, "decided": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "for": what}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(choices, f, indent=1, sort_keys=True)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path
