"""ignite_amp.run.console: printing to a terminal that may go away, and a progress bar a stopped epoch left."""
import io
import os
import sys
from types import SimpleNamespace

from ignite_amp.run.console import drop_unfinished_bar, safe_print


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
