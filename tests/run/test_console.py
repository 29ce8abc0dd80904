"""ignite_amp.run.console: printing to a terminal that may go away, and a progress bar a stopped epoch left."""
import io
import os
import sys
from types import SimpleNamespace

from ignite_amp.run.console import drop_unfinished_bar, progress_bar, safe_print


def test_safe_print_outlives_a_closed_pipe_and_prints_nothing_after(monkeypatch):
    read, write = os.pipe()
    os.close(read)  # the reader went away (`ignite-amp train ... | head`)
    stdout = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        safe_print("first line")  # a broken pipe, not an error: stdout now goes to /dev/null
        assert os.path.samestat(os.fstat(write), os.stat(os.devnull))
        safe_print("second line")
    finally:
        stdout.close()


def test_an_unfinished_bar_is_erased_and_a_closed_one_left_alone():
    closed = []
    pbar = SimpleNamespace(leave=True, close=lambda: closed.append(True), fp=io.StringIO())
    bar = SimpleNamespace(pbar=pbar)
    drop_unfinished_bar(bar)
    assert closed == [True] and pbar.leave is False and bar.pbar is None
    drop_unfinished_bar(bar)  # its epoch closed it: nothing to do
    assert closed == [True]


class _Terminal(io.StringIO):
    """A terminal whose first flush after a bar's first line is where a Ctrl-C lands."""

    def __init__(self):
        super().__init__()
        self.interrupt = True

    def isatty(self):
        return True

    def flush(self):
        if self.interrupt and "[1/4]" in self.getvalue():
            self.interrupt = False
            raise KeyboardInterrupt


def test_a_ctrl_c_in_tqdms_constructor_after_its_first_line_still_clears_the_line():
    """Seen in a pty (tests/cli/test_terminal.py, 1 run in 6): the Ctrl-C landed after tqdm drew the epoch's first
    line but before Ignite's ProgressBar got the bar, so nothing cleared the line and the summary followed ``^C``."""
    from ignite.engine import Engine

    terminal = _Terminal()
    bar = progress_bar(persist=True, desc="Epoch", file=terminal)
    trainer = Engine(lambda engine, batch: None)
    bar.attach(trainer)
    try:
        trainer.run(range(4), max_epochs=2)
    except KeyboardInterrupt:
        pass
    assert bar.pbar is None and "Epoch[1/4]" in terminal.getvalue()  # drawn, never handed over
    drop_unfinished_bar(bar)
    assert terminal.getvalue().endswith("\r\x1b[2K")
    ended = terminal.getvalue()
    drop_unfinished_bar(bar)  # once is enough
    assert terminal.getvalue() == ended
