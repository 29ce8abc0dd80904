"""How ``ignite-amp`` handles SIGTERM and Ctrl-C around a command's end: its handlers go when the command returns,
and a signal in the interpreter's teardown (torch's exit callbacks take seconds on a GPU machine) ends the process as
the signal, with no traceback."""
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import tiny_config
from ignite_amp.cli.main import main

# The console command (``entry``) with a slow exit callback standing in for torch's teardown: registered before
# torch is imported, it runs last, says when it starts and waits.
SLOW_TEARDOWN = ("import atexit, sys, time\n"
                 "def teardown():\n"
                 "    print('tearing down', flush=True)\n"
                 "    time.sleep(60)\n"
                 "atexit.register(teardown)\n"
                 "from ignite_amp.cli.main import entry\n"
                 "sys.exit(entry())\n")


def _config(tmp_path) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path)))
    return str(path)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_after_done_ends_the_process_with_no_traceback(tmp_path, signal_name):
    """It printed "Exception ignored in atexit callback ... Terminated" (or KeyboardInterrupt), then exit 0: the
    run's handler stayed installed through the teardown."""
    number = getattr(signal, signal_name)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TEARDOWN, "train", _config(tmp_path)], cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines, deadline = [], time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line == "tearing down\n":
                break
        assert lines and lines[-1] == "tearing down\n", lines
        assert any(line.startswith("done: ") for line in lines), lines
        os.kill(proc.pid, number)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "ignite-amp: " not in err, err  # the run was done and said so: nothing more to say
    assert proc.returncode == -number and time.monotonic() - stopped < 30  # the signal's own end, at once


def test_a_signal_while_the_last_lines_print_says_the_run_had_finished(tmp_path, monkeypatch, capsys):
    """A signal between "done:" and the command's return said "run the same command to resume from the last
    checkpoint", as if the run had stopped."""
    import ignite_amp.run.console as console
    from ignite_amp.cli.failures import Terminated

    printed = console.safe_print

    def safe_print(line, *args, **kwargs):
        if line.startswith("best checkpoint"):
            raise Terminated()
        printed(line, *args, **kwargs)

    monkeypatch.setattr(console, "safe_print", safe_print)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main(["train", _config(tmp_path)]) == 143
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # left as found
    captured = capsys.readouterr()
    assert "done: " in captured.out
    assert captured.err.strip().splitlines()[-1] == ("ignite-amp: terminated (SIGTERM) after the run finished: "
                                                     "nothing lost (its checkpoints and logs are written)")
