"""TensorBoard helpers: the events a run wrote (read as TensorBoard's loader reads them), and a real TensorBoard
server over a log directory, queried through its HTTP data API."""
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import free_port


def read(path, split=""):
    """The events of the run in ``path`` (its text, HParams and layout) or of one split's run (its scalars)."""
    acc = EventAccumulator(os.path.join(str(path), split), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def values(acc, tag):
    return {e.step: e.value for e in acc.Scalars(tag)}


def fetch(base: str, path: str, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def serve_tensorboard(command: str, runs: set):
    """A TensorBoard started as ``command`` (``tensorboard --logdir ...``; its base URL), once it lists ``runs``;
    stopped with its data server after."""
    port = free_port()
    words = shlex.split(command)
    assert words[0] == "tensorboard"
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", *words[1:], "--host",
                             "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, runs_seen = time.monotonic() + 30, []
        while time.monotonic() < deadline:  # TensorBoard loads the event files asynchronously
            if proc.poll() is not None:
                pytest.fail(f"tensorboard exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                runs_seen = fetch(base, "/data/runs")
            except OSError:
                runs_seen = []
            if runs <= set(runs_seen):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"tensorboard did not show the runs within 30 s (saw {runs_seen})")
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its data server too
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
