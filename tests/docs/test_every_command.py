"""Every command of the README and the guides, run as written, in the order a reader meets them (the README, then
the site's pages in its table of contents), one after another in a fresh copy of the checkout: as a user who types
them would. tests/docs/test_docs.py checks each block alone; this checks that each works after the ones before it.

A command that cannot run here is skipped with its reason (:data:`NOT_RUN`: it needs a GPU, a release, the network,
or it is the test suite itself) and listed in the test's output; a ``tensorboard`` command serves until stopped, so
its log directory is checked instead (the one the run printed, with this run's event files alone). A ``train``
must train the epochs it asks for (a finished run and a changed config is a new run, or an extended one, never a
refusal). The checkout is left as it was.

To stay within the suite's time, each training command gets the same smaller data set appended
(``--set data.train_size=... --set data.val_size=...``: the same for every command, so what changes from one
command to the next is what the page changes). ``IGNITE_AMP_VERBATIM=1`` runs the commands exactly as written.
"""
import itertools
import os
import re
import shlex
import subprocess
import sys
from typing import List, NamedTuple, Optional

import pytest
import torch
import yaml

from helpers import ROOT, checkout_copy
from helpers.docs import code_blocks
from helpers.forks import Forks

pytestmark = [pytest.mark.docs]


VERBATIM = os.environ.get("IGNITE_AMP_VERBATIM") == "1"
SMALLER = {"data.train_size": "64", "data.val_size": "32"}
GPU = "needs a GPU"
# (a pattern of the command as written, why it is not run here): the first that matches.
NOT_RUN = [
    (r"^pip install ignite-amp\b", "needs a release on the package index (ignite-amp is not released yet)"),
    (r"^pip install .*(-e|\.\[)", "installs this checkout into the environment the suite runs in (it is installed)"),
    (r"^pip install torch torchvision --index-url", "downloads PyTorch's CPU-only build (the network; torch is "
     "installed)"),
    (r"^\.ci/lint\b", "the form checks: .ci/run runs them just before this suite"),
    (r"^pip download ", "downloads wheels from the package index (the network)"),
    (r"^(python3? -m pip install .*--no-index|export PYTHONPATH|PYTHONPATH=)",
     "the offline install of a GPU machine, from the wheels `pip download` fetched"),
    (r"-m pytest\b", "runs the test suite, which this test is part of"),
    (r"^sphinx-build ", "builds the documentation site: tests/docs/test_docs_site.py does (the docs extra)"),
    (r"cifar10_resnet18", "the CIFAR-10 recipe: downloads CIFAR-10, and trains ResNet-18 for a GPU"),
    (r"--device cuda|gpu_suite\.py|bench_amp\.py", GPU),
    (r"--nproc_per_node=8|--nnodes", "needs 8 GPUs, or 2 machines"),
    (r"amp\.dtype=float8|--modes .*float8", "float8 needs torchao (the fp8 extra) and a GPU with float8 matmuls"),
    (r"^python3? benchmarks/(overhead|launch_overhead|fsdp_cpu)\.py",
     "a measurement, minutes by design (tests/benchmarks runs its code at a tiny size)"),
]


class Command(NamedTuple):
    where: str  # page:line of its block
    words: List[str]

    @property
    def shown(self) -> str:
        return " ".join(self.words)


def reading_order() -> List[str]:
    """The README, then the site's pages as its table of contents lists them."""
    index = open(os.path.join(ROOT, "docs", "index.md"), encoding="utf-8").read()
    pages = re.findall(r"^((?:guides|reference)/[\w-]+)$", index, re.M)
    written = [os.path.join(ROOT, "docs", f"{page}.md") for page in pages]  # (api.md and others are generated)
    return [os.path.join(ROOT, "README.md")] + [path for path in written if os.path.isfile(path)]


def documented_commands(page: str) -> List[Command]:
    """The page's shell commands, in order (a line's ``a && b`` are two commands)."""
    commands = []
    for block in code_blocks(page):
        if block.language != "bash" or block.not_run:
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands += [Command(block.name, shlex.split(c)) for c in re.split(r"\s*&&\s*", line)]
    return commands


def not_run(command: Command) -> Optional[str]:
    return next((why for pattern, why in NOT_RUN if re.search(pattern, command.shown)), None)


def _sets(words: list) -> dict:
    return dict(w.split("=", 1) for a, w in itertools.pairwise(words) if a == "--set")


def _epochs(words: list, cwd) -> int:
    sets = _sets(words)
    if "train.epochs" in sets:
        return int(sets["train.epochs"])
    config = words[words.index("train") + 1]
    path = os.path.join(cwd, config)
    if not os.path.isfile(path):  # a built-in config's name (ignite-amp train quickstart)
        from ignite_amp.config.builtin import builtin_path

        path = builtin_path(config)
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)["train"]["epochs"]


def _same_run(words: list, other: list) -> bool:
    """Two training commands of the same config and settings, whatever starts them (``ignite-amp``, ``torchrun``)."""
    def run(w):
        return "train" in w and (w[w.index("train") + 1], _sets(w))
    return bool(run(words)) and run(words) == run(other)


def _argv(words: list) -> list:
    """The command as this interpreter runs it (the suite's environment, not whatever is first on PATH)."""
    head = {"ignite-amp": ["-m", "ignite_amp"], "torchrun": ["-m", "torch.distributed.run"], "python": [],
            "python3": []}
    assert words[0] in head, f"{' '.join(words)}: this test does not know how to run it; add it (or to NOT_RUN)"
    return [sys.executable, *head[words[0]], *words[1:]]


def check_dashboard(words: list, cwd, dashboards: list) -> str:
    """A ``tensorboard`` command: its log directories hold event files, and ``--logdir`` of one run is the one the
    run printed, with no run moved aside in it."""
    shown = " ".join(words)
    if "--logdir_spec" in words:
        logdirs = [spec.split(":", 1)[1] for spec in words[words.index("--logdir_spec") + 1].split(",")]
    else:
        logdirs = [words[words.index("--logdir") + 1]]
        one_run = os.path.isfile(os.path.join(cwd, logdirs[0], "config.yaml"))
        if one_run:
            assert logdirs[0] in dashboards, f"{shown}: the runs printed {dashboards}"
            aside = [d for d, _, _ in os.walk(os.path.join(cwd, logdirs[0])) if ".replaced-" in d]
            assert not aside, f"{shown}: runs moved aside are in the dashboard: {aside}"
    for logdir in logdirs:
        events = [f for _, _, files in os.walk(os.path.join(cwd, logdir)) for f in files if "tfevents" in f]
        assert events, f"{shown}: no TensorBoard event files under {logdir}"
    return f"{shown}: checked (a server): event files under {', '.join(logdirs)}"


def run_in_order(commands: List[Command], cwd, forks: Forks, wheel_dir=None) -> List[str]:
    """Run ``commands`` one after another in ``cwd``; returns a line per command saying what it did (or why it was
    not run), and fails at the first one that did not work as written. A block that starts with ``pip install
    ignite-amp`` is a wheel user's: its other commands run in ``wheel_dir``, a directory with nothing in it.
    A Python command (``ignite-amp``, ``python``) runs in a process forked from ``forks``, which has imported torch
    and the package (``helpers.forks``: a fresh process less its imports); a ``torchrun`` starts afresh."""
    done, said, dashboards = [], [], []
    wheel_block = None
    for command in commands:
        words, shown = command.words, command.shown
        if re.match(r"pip install ignite-amp\b", shown):
            wheel_block = command.where
        here = wheel_dir if wheel_block == command.where and wheel_dir is not None else cwd
        why = not_run(command)
        if why:
            said.append(f"{command.where}: {shown}: not run: {why}")
            continue
        if words[0] == "tensorboard":
            said.append(f"{command.where}: " + check_dashboard(words, here, dashboards))
            continue
        argv = _argv(words)
        training = words[0] in ("ignite-amp", "torchrun") and "train" in words  # torchrun ... -m ignite_amp train
        if training and not VERBATIM:
            argv += [a for k, v in SMALLER.items() if k not in _sets(words) for a in ("--set", f"{k}={v}")]
        if words[0] == "torchrun":
            proc = subprocess.run(argv, cwd=here, capture_output=True, text=True, timeout=900)
        else:
            proc = forks.run(argv[1:], here, limit=900)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, (f"after {done}:\n{command.where}: {shown}\n"
                                      f"exited {proc.returncode}:\n{out[-3000:]}")
        if training:
            epochs = _epochs(words, here)
            trained = f"after {epochs} epoch" in out
            again = any(_same_run(words, before) for before in done)  # e.g. under torchrun after a plain run
            assert trained or (again and "already trained" in out), \
                f"after {done}:\n{shown}\ndid not train the {epochs} epochs it asks for:\n{out[-3000:]}"
            dashboards += re.findall(r"^dashboard: tensorboard --logdir (\S+)$", out, re.M)
            start = re.search(r"^training .*$", out, re.M)
            if trained and "amp.dtype" not in _sets(words) and not torch.cuda.is_available():  # dtype auto: why
                assert start and "(dtype auto: " in start.group(0), f"{shown}: the start line says no why: {start}"
        done.append(words)
        said.append(f"{command.where}: {shown}: " + (out.strip().splitlines() or ["(no output)"])[0])
    return said


def checkout_state() -> set:
    """What git sees in the checkout, ignored files included (a build/ folder, runs/, ...)."""
    status = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return {line for line in status.splitlines() if "__pycache__" not in line}


@pytest.mark.timeout(3600)
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_the_readme_and_guides_commands_work_in_the_order_written(tmp_path, capsys, forks):
    commands = [c for page in reading_order() for c in documented_commands(page)]
    assert len(commands) > 30 and commands[0].where.startswith("README.md")
    before = checkout_state()
    clone = checkout_copy(tmp_path / "clone")  # a fresh clone: the files, nothing run yet
    (tmp_path / "wheel").mkdir()  # a wheel user's directory: nothing in it
    said = run_in_order(commands, clone, forks, wheel_dir=tmp_path / "wheel")
    assert len(said) == len(commands)
    with capsys.disabled():
        print("\n" + "\n".join(said))
    skipped = [line for line in said if ": not run: " in line]
    assert all(line.split(": not run: ")[1] for line in skipped)  # each with its reason
    assert len(said) - len(skipped) >= 20, said  # every command a CPU can run without the network: 23 of 69
    assert not checkout_state() - before  # the checkout is as it was: no file added or changed (build/, runs/)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_a_command_that_cannot_run_here_says_why():
    assert not_run(Command("p", ["pip", "install", "ignite-amp"])).startswith("needs a release")
    assert not_run(Command("p", shlex.split('pip install -e ".[test]"'))).startswith("installs this checkout")
    assert not_run(Command("p", ["python", "benchmarks/bench_amp.py", "--device", "cuda"])) == GPU
    assert not_run(Command("p", ["ignite-amp", "train", "configs/quickstart.yaml"])) is None
    with pytest.raises(AssertionError, match="does not know how to run it"):
        _argv(["make", "all"])
