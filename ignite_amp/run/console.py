"""Printing to a terminal that may go away."""
import os
import sys
import textwrap
from typing import Any

__all__ = ["safe_print", "silent", "drop_unfinished_bar"]


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


def fitted(line: str, width: int = 80, indent: str = "  ") -> str:
    """``line`` wrapped at word boundaries to ``width`` columns, the rows after the first indented by ``indent``, so
    that a terminal of 80 columns never cuts a word; a line that fits is returned as it is."""
    if len(line) <= width:
        return line
    return textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def silent(*args: Any, **kwargs: Any) -> None:
    """What ranks other than 0 print: nothing."""


def drop_unfinished_bar(bar: Any) -> None:
    """After a run stopped mid-epoch (Ctrl-C, an error): clear the line of Ignite's ``ProgressBar`` now,
    so that the lines after it start at a line's start (not after the terminal's ``^C``) and tqdm does not
    redraw the stale bar when the process exits. A bar its epoch closed (``pbar`` None) is left alone."""
    pbar = getattr(bar, "pbar", None)
    if pbar is not None:
        pbar.leave = False  # close() then erases the line instead of drawing the bar once more
        pbar.close()
        bar.pbar = None
        stream = getattr(pbar, "fp", None)
        try:
            if stream is not None and stream.isatty():  # and the terminal's "^C" past the bar's width (or wrapped)
                stream.write("\r\x1b[2K")
                stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
