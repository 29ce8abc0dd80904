"""ignite_amp.files.run_directory: a run directory belongs to one run at a time, and its dashboard is its own."""
import os

import pytest

from ignite_amp.errors import RunDirInUseError
from ignite_amp.files.run_directory import RunLock, dashboard_command


def test_a_second_lock_on_a_run_directory_is_refused_naming_the_holder_and_a_released_one_leaves_no_file(tmp_path):
    held = RunLock(str(tmp_path)).acquire()
    lock_file = os.path.join(tmp_path, ".lock")
    assert open(lock_file).read() == str(os.getpid())
    with pytest.raises(RunDirInUseError, match=rf"is in use by another run \(PID {os.getpid()}\)"):
        RunLock(str(tmp_path)).acquire()
    held.release()
    assert not os.path.exists(lock_file)
    RunLock(str(tmp_path)).acquire().release()  # free again


def test_the_dashboard_command_shows_the_run_alone_quoted_for_a_shell():
    assert dashboard_command("runs/quickstart/") == "tensorboard --logdir runs/quickstart"
    assert dashboard_command("runs/my run") == "tensorboard --logdir 'runs/my run'"
