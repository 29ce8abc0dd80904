"""The file of dtype auto's kept choices (``ignite_amp.files.dtype_choice``): processes keeping choices at once lose
no entry (under its lock, or the lock file where there is no ``fcntl``), and the folder it lives in is the one the
environment names (``~`` expanded, a relative ``XDG_CACHE_HOME`` ignored, a file in the way named)."""
import glob
import json
import multiprocessing
import os

import pytest

from ignite_amp.files import dtype_choice
from ignite_amp.files.dtype_choice import CACHE_ENV, choices_path, keep_choice, kept_choice, shown_path

WORKERS, EACH = 4, 40


def _keep_many(start, worker: int) -> None:
    start.wait(120)  # every process starts its writes together
    for i in range(EACH):
        keep_choice(f"{worker}-{i}", "bfloat16" if i % 2 else "float32", "why", f"worker {worker}")


@pytest.mark.parametrize("lock", ["flock", "exclusive file"])
def test_processes_keeping_choices_at_once_lose_no_entry(tmp_path, monkeypatch, lock):
    """Issue 59.1: two runs or plans keeping choices at once read, updated and replaced the file with no lock:
    241-359 of 600 entries were lost."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    if lock == "exclusive file":  # a system without fcntl: the forked writers inherit the stand-in
        monkeypatch.setattr(dtype_choice, "fcntl", None)
    context = multiprocessing.get_context("fork")
    start = context.Barrier(WORKERS)
    writers = [context.Process(target=_keep_many, args=(start, w)) for w in range(WORKERS)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(300)
    assert [w.exitcode for w in writers] == [0] * WORKERS
    kept = json.loads((tmp_path / "cache" / "dtype-choices.json").read_text())
    assert sorted(kept) == sorted(f"{w}-{i}" for w in range(WORKERS) for i in range(EACH))
    assert kept_choice("3-7").dtype == "bfloat16" and kept["3-7"]["for"] == "worker 3"
    assert not glob.glob(str(tmp_path / "cache" / "*.tmp"))
    left = os.listdir(tmp_path / "cache")  # the flock's file stays (unlocked); the exclusive one is removed
    assert sorted(left) == (["dtype-choices.json", "dtype-choices.json.lock"] if lock == "flock" else
                            ["dtype-choices.json"])


def test_a_lock_held_too_long_is_an_oserror_that_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(dtype_choice, "fcntl", None)
    monkeypatch.setattr(dtype_choice, "LOCK_WAIT_S", 0.05)
    (tmp_path / "dtype-choices.json.lock").write_text("")  # another process's turn, fresh
    with pytest.raises(OSError, match=r"dtype-choices.json.lock stayed locked by another process for 0.05 s"):
        keep_choice("k", "float32", "why", "what")
    os.utime(tmp_path / "dtype-choices.json.lock", (0, 0))  # left by a process that died: taken over
    keep_choice("k", "float32", "why", "what")
    assert kept_choice("k").dtype == "float32" and not (tmp_path / "dtype-choices.json.lock").exists()


def test_a_cache_folder_under_the_home_is_expanded_and_a_relative_xdg_cache_home_ignored(tmp_path, monkeypatch):
    """Issue 59.2: IGNITE_AMP_CACHE_DIR="~/cache" kept the choice in ./~/cache/ while the line said ~/cache; a
    relative XDG_CACHE_HOME was read from each working directory (the XDG spec says to ignore it)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CACHE_ENV, "~/cache")
    assert keep_choice("k", "float32", "why", "what") == str(tmp_path / "home" / "cache" / "dtype-choices.json")
    assert shown_path(choices_path()) == "~/cache/dtype-choices.json" and not (tmp_path / "~").exists()
    monkeypatch.setenv(CACHE_ENV, "~nosuchuser/cache")  # no such home: said, not made in the working directory
    with pytest.raises(FileNotFoundError, match=f"^.*{CACHE_ENV} ~nosuchuser/cache: ~nosuchuser is no user's home$"):
        keep_choice("k", "float32", "why", "what")
    assert sorted(os.listdir(tmp_path)) == ["home"]
    monkeypatch.setenv(CACHE_ENV, "relative")  # a folder the user named: this working directory's, said in full
    assert choices_path() == str(tmp_path / "relative" / "dtype-choices.json")
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "xdg")
    assert choices_path() == str(tmp_path / "home" / ".cache" / "ignite-amp" / "dtype-choices.json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert choices_path() == str(tmp_path / "xdg" / "ignite-amp" / "dtype-choices.json")


def test_a_file_where_the_cache_folder_goes_is_named(tmp_path, monkeypatch):
    """Issue 59, unclear: IGNITE_AMP_CACHE_DIR naming a file said "not kept: File exists"."""
    (tmp_path / "file").write_text("mine")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file"))
    with pytest.raises(NotADirectoryError) as raised:
        keep_choice("k", "float32", "why", "what")
    assert raised.value.strerror == f"{CACHE_ENV} names a file, {tmp_path / 'file'}, not a folder"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file" / "below"))
    with pytest.raises(NotADirectoryError) as raised:
        keep_choice("k", "float32", "why", "what")
    assert raised.value.strerror == f"{tmp_path / 'file'} is a file, not a folder"
    assert (tmp_path / "file").read_text() == "mine"
