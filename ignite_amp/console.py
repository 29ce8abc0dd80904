"""Printing to a terminal that may go away."""
import os
import sys
from typing import Any

__all__ = ["safe_print", "silent"]


def safe_print(*args: Any, **kwargs: Any) -> None:
    """``print`` that outlives a closed stdout (``ignite-amp train ... | head``): the run goes on.

    After the first broken pipe, stdout is pointed at /dev/null for the rest of the process.
    """
    try:
        print(*args, **kwargs, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: stdout already closed
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def silent(*args: Any, **kwargs: Any) -> None:
    """What ranks other than 0 print: nothing."""
