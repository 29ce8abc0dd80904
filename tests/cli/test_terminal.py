"""What `ignite-amp train` shows in a terminal: driven in a pseudo-terminal (160 columns), whose output is
rendered as a terminal would (carriage returns, cursor moves, erases) and checked line by line."""
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import yaml

from helpers import ROOT, tiny_config

COLUMNS = 160


def _own_terminal():
    os.setsid()  # the pseudo-terminal becomes the child's controlling terminal: Ctrl-C typed there reaches it
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def run_in_a_terminal(args, cwd, timeout=600, ctrl_c_after=None, columns=COLUMNS):
    """Run ``python -m ignite_amp ARGS`` with stdin, stdout and stderr on one pseudo-terminal; its raw bytes.
    ``ctrl_c_after``: once the output holds these bytes, type Ctrl-C (the terminal echoes ``^C`` and sends SIGINT)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = dict(os.environ, COLUMNS=str(columns), TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "ignite_amp", *args], stdin=slave, stdout=slave, stderr=slave,
                            cwd=cwd, env=env, close_fds=True, preexec_fn=_own_terminal if ctrl_c_after else None)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
            if ctrl_c_after and ctrl_c_after in out:
                os.write(master, b"\x03")
                ctrl_c_after = None
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    return proc.wait(timeout=30), out.decode("utf-8", "replace")


def render(raw: str) -> list:
    """The screen's lines after ``raw``: CR, LF, cursor up/down/column, erase in line, other escapes dropped."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[^\[]|\r|\n|[^\x1b\r\n]+", raw):
        if token == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        elif token == "\r":
            col = 0
        elif token.startswith("\x1b["):
            n = int(re.sub(r"\D", "", token[2:-1]) or 1)
            kind = token[-1]
            if kind == "A":
                row = max(row - n, 0)
            elif kind == "B":
                row = min(row + n, len(lines) - 1)
            elif kind == "G":
                col = n - 1
            elif kind == "K":  # erase: to the end (0) or the whole line (2)
                lines[row] = "" if token[2:-1] == "2" else lines[row][:col]
        elif not token.startswith("\x1b"):
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token):]
            col += len(token)
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def config(tmp_path, **changes):
    cfg = tiny_config(tmp_path, name="term", data={"train_size": 256, "val_size": 64}, train={"epochs": 2})
    del cfg["handlers"]
    cfg.update(changes)
    path = tmp_path / "term.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def check_epochs_and_bars(screen, epochs=2):
    """Each epoch line starts its own line, right after its bar, which ends at 100% and [N/N]."""
    at = [i for i, line in enumerate(screen) if "epoch " in line and "train loss" in line]
    assert len(at) == epochs, screen
    for i in at:
        assert screen[i].startswith("epoch "), screen[i]  # never on the bar's line
        bar = screen[i - 1]
        done = re.search(r"\[(\d+)/(\d+)\] +100%", bar)
        assert done and done.group(1) == done.group(2), (bar, screen)


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_in_a_terminal_bars_end_at_100_percent_before_each_epoch_line_and_the_hint_is_quoted(tmp_path):
    out = tmp_path / "my runs" / "term run"  # spaces: the hint must quote the path
    code, raw = run_in_a_terminal(["train", config(tmp_path, output_dir=str(out))], ROOT)
    screen = render(raw)
    assert code == 0, "\n".join(screen)
    check_epochs_and_bars(screen)
    # The hint names the run alone, quoted for a shell, and the page on a line of its own.
    assert screen[-4:-2] == [f"dashboard: tensorboard --logdir '{out}'",
                             "  then open http://localhost:6006/#custom_scalars&_smoothingWeight=0"], screen
    assert screen[-2].startswith("  and untick \"Ignore outliers in chart scaling\""), screen
    assert screen[-1].startswith("  (Time Series has its own: untick it"), screen


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_one_epoch_has_an_epoch_bar_and_the_hint_names_the_output_dir_when_its_parent_holds_other_things(tmp_path):
    (tmp_path / "notes.txt").write_text("not a run")  # a home or scratch directory
    out = tmp_path / "x"
    code, raw = run_in_a_terminal(["train", config(tmp_path, output_dir=str(out), train={"epochs": 1})], ROOT)
    screen = render(raw)
    assert code == 0, "\n".join(screen)
    check_epochs_and_bars(screen, epochs=1)
    bar = screen[[i for i, line in enumerate(screen) if line.startswith("epoch 1/1")][0] - 1]
    assert bar.startswith("Epoch: ") and "Iteration" not in raw, bar  # as the runs of several epochs label it
    assert screen[-4] == f"dashboard: tensorboard --logdir {out}", screen


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_ctrl_c_mid_epoch_leaves_no_stale_bar_and_the_next_lines_start_at_their_line(tmp_path):
    data = {"name": "shapes", "batch_size": 8, "num_workers": 0, "train_size": 4096, "val_size": 32, "image_size": 16}
    code, raw = run_in_a_terminal(["train", config(tmp_path, data=data)], ROOT, ctrl_c_after=b"[1/512]")
    screen = render(raw)
    assert code == 130, "\n".join(screen)
    shown = "\n".join(screen)  # whole in a failure's message (pytest cuts a long list in the middle)
    assert "health of the run:" in screen, shown  # on its own line: no "^C" (or its wrapped "C") before it
    # The stopped bar's line is cleared, the terminal's "^C" with it, and tqdm draws no stale bar at exit.
    assert not [line for line in screen if "%|" in line or "^C" in line or line.startswith("C")], shown
    assert screen[-1].startswith("ignite-amp: interrupted"), shown


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo processes on Linux")
def test_with_two_processes_the_bars_and_epoch_lines_do_not_share_lines(tmp_path):
    out = tmp_path / "runs" / "two"
    code, raw = run_in_a_terminal(["train", config(tmp_path, output_dir=str(out)),
                                   "--set", "distributed.nproc_per_node=2"], ROOT)
    screen = render(raw)
    assert code == 0, "\n".join(screen)
    check_epochs_and_bars(screen)
    assert screen[-4] == f"dashboard: tensorboard --logdir {out}", screen


def test_at_80_columns_each_line_fits_and_the_start_line_takes_two_rows_and_says_the_batch(tmp_path):
    """A newcomer's terminal: the start line was 249 characters (4 rows, cut mid-word) and never said the batch
    size; the health summary's compute line was 81."""
    out = tmp_path / "x"
    code, raw = run_in_a_terminal(["train", config(tmp_path, output_dir=str(out), train={"epochs": 1},
                                                   handlers={"tensorboard": {"log_every": 4}})], ROOT, columns=80)
    screen = [line.replace(str(out), "runs/quickstart") for line in render(raw)]  # as the quickstart's would be
    assert code == 0, "\n".join(screen)
    (start,) = [line for line in screen if line.startswith("training term on cpu")]
    assert ", batch 32; output in runs/quickstart" in start and len(start) <= 160, start
    assert any(line.startswith("  compute: ") for line in screen), screen
    assert [line for line in screen if len(line) > 80 and line != start] == [], screen
