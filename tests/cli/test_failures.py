"""How a command ends when it fails (``ignite_amp.cli.failures``): one line for what Python raises deep inside a
library where the machine, not the code, is at fault; the thread excepthook when threading hands it no value."""
import shutil
import tempfile
import threading
from collections import namedtuple

import pytest

from ignite_amp.cli import failures
from ignite_amp.cli.failures import describe


def test_no_usable_temporary_folder_says_which_folders_and_whether_the_disk_is_full(tmp_path, monkeypatch,
                                                                                    file_size_limit):
    """Issue 59, unclear: a full disk under /tmp, /var/tmp and the working directory ended in "internal error:
    FileNotFoundError: No usable temporary directory"."""
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile looks again, as a fresh process does
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with file_size_limit(0), pytest.raises(FileNotFoundError) as raised:  # no folder takes tempfile's test file
        tempfile.gettempdir()
    code, line = describe(raised.value)
    assert code == 1 and line.startswith(f"ignite-amp: stopped: no folder for temporary files takes a file "
                                         f"({tmp_path}, /tmp, ")
    assert line.endswith("); set TMPDIR to a folder you can write to, and run the command again")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2 ** 30, 10 * 2 ** 30, 4096))  # all full
    code, line = describe(raised.value)
    assert code == 1 and line.startswith(f"ignite-amp: stopped: the disk is full: no folder for temporary files has "
                                         f"room ({tmp_path}, /tmp, ")
    assert line.endswith("); free some space, or set TMPDIR to a folder on a disk with room, and run the command "
                         "again") and "\n" not in line


def test_a_thread_error_without_a_value_goes_to_the_usual_hook(monkeypatch):
    # threading's documentation: ExceptHookArgs.exc_value "can be None"; the hook read its __cause__ (AttributeError).
    seen = []
    monkeypatch.setitem(failures.state, "excepthook", seen.append)
    args = threading.ExceptHookArgs([RuntimeError, None, None, threading.current_thread()])
    failures.thread_failed(args)
    assert seen == [args]
