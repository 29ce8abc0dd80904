"""Printing to a terminal that may go away."""
import os
import sys
import textwrap
from typing import Any

__all__ = ["safe_print", "silent", "progress_bar", "drop_unfinished_bar"]


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


def progress_bar(**kwargs: Any) -> Any:
    """Ignite's ``ProgressBar(**kwargs)`` that knows its tqdm bar from the moment the bar starts to draw: a Ctrl-C
    that lands in tqdm's constructor after its first line (the epoch's first iteration) leaves the
    ``ProgressBar.pbar`` unset, and :func:`drop_unfinished_bar` would leave that line to the terminal's ``^C``."""
    from ignite.handlers import ProgressBar

    bar = ProgressBar(**kwargs)

    class Drawn(bar.pbar_cls):  # type: ignore[name-defined]
        def __init__(self, *args: Any, **kw: Any) -> None:
            bar.drawn = self  # type: ignore[attr-defined]  # read by drop_unfinished_bar
            super().__init__(*args, **kw)

    bar.pbar_cls = Drawn
    return bar


def drop_unfinished_bar(bar: Any) -> None:
    """After a run stopped mid-epoch (Ctrl-C, an error): clear the line of Ignite's ``ProgressBar`` now,
    so that the lines after it start at a line's start (not after the terminal's ``^C``) and tqdm does not
    redraw the stale bar when the process exits. A bar its epoch closed (``pbar`` None, and the one
    :func:`progress_bar` saw drawn closed) is left alone."""
    pbar = getattr(bar, "pbar", None)
    drawn = getattr(bar, "drawn", None)
    if pbar is None and drawn is not None and not getattr(drawn, "disable", True):
        pbar = drawn  # stopped in tqdm's constructor: drawn, never handed to the ProgressBar
    if pbar is not None:
        pbar.leave = False  # close() then erases the line instead of drawing the bar once more
        try:
            pbar.close()
        except AttributeError:  # a bar stopped before tqdm set it up
            pass
        bar.pbar = bar.drawn = None
        stream = getattr(pbar, "fp", None)
        try:
            if stream is not None and stream.isatty():  # and the terminal's "^C" past the bar's width (or wrapped)
                stream.write("\r\x1b[2K")
                stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
