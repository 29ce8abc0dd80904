"""A newcomer's path: the getting-started guide's commands, run in the order written, in one directory, as a
user would type them one after another (tests/docs/test_docs.py checks each block alone, in an empty directory).

Every documented command must work after the ones before it: a ``train`` trains the epochs it asks for (a
finished run and a changed config is a new run, or an extended one, never a refusal), and the documented
``tensorboard --logdir`` is the one the run printed, holding this run alone.

To stay within the suite's time, each ``ignite-amp train`` gets the same smaller data set appended
(``--set data.train_size=... --set data.val_size=...``: the same for every command, so what changes from one
command to the next is what the guide changes). ``IGNITE_AMP_VERBATIM=1`` runs the commands exactly as written.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

import torch
import yaml

from conftest import CONFIGS, ROOT
from test_docs import code_blocks

GUIDE = os.path.join(ROOT, "docs", "guides", "getting-started.md")
VERBATIM = os.environ.get("IGNITE_AMP_VERBATIM") == "1"
SMALLER = {"data.train_size": "256", "data.val_size": "128"}


def documented_commands(page: str) -> list:
    """The page's shell commands, in order (a line's ``a && b`` are two commands)."""
    commands = []
    for block in code_blocks(page):
        if block.language != "bash" or block.not_run:
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands += [shlex.split(c) for c in re.split(r"\s*&&\s*", line)]
    return commands


def _sets(words: list) -> dict:
    return dict(w.split("=", 1) for a, w in zip(words, words[1:]) if a == "--set")


def _epochs(words: list, cwd) -> int:
    sets = _sets(words)
    if "train.epochs" in sets:
        return int(sets["train.epochs"])
    path = os.path.join(cwd, words[2])
    if not os.path.isfile(path):  # a built-in config's name (ignite-amp train quickstart)
        from ignite_amp.config.builtin import builtin_path

        path = builtin_path(words[2])
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)["train"]["epochs"]


def run_in_order(commands: list, cwd) -> list:
    """Run ``commands`` one after another in ``cwd``; returns a line per command saying what it did, and fails at
    the first one that did not work as written."""
    done, said, dashboards = [], [], []
    for words in commands:
        shown = " ".join(words)
        if words[0] == "pip" or words[:3] == ["python", "-m", "pytest"]:
            said.append(f"{shown}: not run (the test runs in the installed package, inside the suite)")
            continue
        if words[0] == "tensorboard":
            logdir = words[words.index("--logdir") + 1]
            assert dashboards, f"{shown}: the guide names a dashboard before any run printed one"
            assert logdir == dashboards[-1], f"{shown}: the run printed `tensorboard --logdir {dashboards[-1]}`"
            events = [f for _, _, files in os.walk(os.path.join(cwd, logdir)) for f in files if "tfevents" in f]
            assert events, f"{shown}: no TensorBoard event files under {logdir}"
            aside = [d for d, _, _ in os.walk(os.path.join(cwd, logdir)) if ".replaced-" in d]
            assert not aside, f"{shown}: runs moved aside are in the dashboard: {aside}"
            said.append(f"{shown}: the logdir the run printed, {len(events)} event files of this run alone")
            continue
        assert words[0] == "ignite-amp", f"{shown}: the newcomer's path does not know how to run this; add it here"
        args = list(words[1:])
        if words[1] == "train" and not VERBATIM:
            args += [a for k, v in SMALLER.items() if k not in _sets(words) for a in ("--set", f"{k}={v}")]
        proc = subprocess.run([sys.executable, "-m", "ignite_amp", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=900)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"after {done}:\n{shown}\nexited {proc.returncode}:\n{out[-3000:]}"
        if words[1] == "train":
            epochs = _epochs(words, cwd)
            trained = f"after {epochs} epoch" in out
            assert trained or (words in done and "already trained" in out), \
                f"after {done}:\n{shown}\ndid not train the {epochs} epochs it asks for:\n{out[-3000:]}"
            dashboards += re.findall(r"^dashboard: tensorboard --logdir (\S+)$", out, re.M)
            start = re.search(r"^training .*$", out, re.M)
            if "amp.dtype" not in _sets(words) and not torch.cuda.is_available():  # the quickstart's dtype: auto
                assert start and "(dtype auto: " in start.group(0), f"{shown}: the start line says no why: {start}"
        done.append(words)
        said.append(f"{shown}: " + (out.strip().splitlines() or ["(no output)"])[0])
    return said


def two_paths(commands: list) -> tuple:
    """The guide opens with the path of a user who installed the wheel (any directory, built-in configs), then
    the clone's path from its ``pip install -e``: two users, each in a directory of their own."""
    clone = next(i for i, words in enumerate(commands) if words[:3] == ["pip", "install", "-e"])
    return commands[:clone], commands[clone:]


def test_the_getting_started_commands_work_in_the_order_written(tmp_path):
    wheel, clone = two_paths(documented_commands(GUIDE))
    trains = [c for c in clone if c[:2] == ["ignite-amp", "train"]]
    assert len(trains) >= 2, "the guide runs the quickstart, then a changed config"
    assert any(c[:2] == ["ignite-amp", "train"] for c in wheel), "the guide opens with the wheel user's training"
    (tmp_path / "wheel").mkdir()  # a wheel user's directory: nothing in it
    shutil.copytree(CONFIGS, tmp_path / "clone" / "configs")  # a clone's: the configs, nothing run yet
    for commands, where in ((wheel, tmp_path / "wheel"), (clone, tmp_path / "clone")):
        said = run_in_order(commands, where)
        assert len(said) == len(commands)
