"""The annotations users' type checkers see (the wheel ships py.typed): a user's script written against the public
names type-checks clean, and the same script with the mistakes a user makes is told each one, so the names are
typed (an untyped name would be Any and pass anything). The README's Python examples type-check clean too (its
``trainer.amp_step.scaler``: the trainer is typed by its step)."""
import ast
import os
import re
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from helpers import ROOT, checkout_copy

SCRIPT = textwrap.dedent('''
    import torch
    from ignite.engine import Engine
    from ignite.metrics import Accuracy, Loss

    from ignite_amp import AmpEvents, create_amp_evaluator, create_amp_trainer, load_config
    from ignite_amp.handlers import BestCheckpoint, GradientClipping, OOMBackoff, ProfilerCapture, TensorBoardMetrics

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.cross_entropy
    trainer: Engine = create_amp_trainer(model, optimizer, loss_fn, device="cpu", dtype="bfloat16")
    evaluator: Engine = create_amp_evaluator(model, metrics={"accuracy": Accuracy(), "loss": Loss(loss_fn)},
                                             device="cpu")
    GradientClipping(max_norm=1.0).attach(trainer)
    BestCheckpoint("runs/x/ckpt", to_save={"model": model}, metric="accuracy").attach(trainer, evaluator)
    OOMBackoff(min_batch_size=1).attach(trainer)
    ProfilerCapture("runs/x/tb", wait=5, warmup=2, active=5).attach(trainer)
    TensorBoardMetrics("runs/x/tb", log_every=50).attach(trainer, evaluator=evaluator, optimizer=optimizer)
    trainer.add_event_handler(AmpEvents.GRADS_READY, lambda engine: None)
    config = load_config("quickstart")
    epochs: int = config.train.epochs  # a loaded config's keys are typed attributes
    plain: dict = config.to_dict()
''')

MISTAKES = {  # the line a user writes -> what the checker must say about it
    'GradientClipping(max_norm="1.0")': 'Argument "max_norm" to "GradientClipping" has incompatible type "str"',
    "OOMBackoff(min_batch_size=1).attach(trainer, evaluator)": 'Too many arguments for "attach" of "OOMBackoff"',
    "create_amp_trainer(model, optimizer, loss_fn, accumulation_steps=None).run([])":
        'Argument "accumulation_steps" to "create_amp_trainer" has incompatible type "None"',
    "AmpEvents.GRADS_READYY": 'has no attribute "GRADS_READYY"',
    # each engine typed by its step (neither StepBase nor Any)
    "create_amp_trainer(model, optimizer, loss_fn).amp_step.scalar": '"AmpStep" has no attribute "scalar"',
    "create_amp_evaluator(model).amp_step.scaler": '"EvalStep" has no attribute "scaler"',
    # a misspelt config key, and a value that may be "auto" used as a number
    "config.train.epoch": '"TrainConfig" has no attribute "epoch"',
    "config.data.batch_size // 2": 'Unsupported operand types for // ("Literal[\'auto\']" and "int")',
}


README_BLOCKS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
                           flags=re.S)


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """One mypy run (it reads torch's stubs once) over the user's script, the script with the mistakes and each of
    the README's Python blocks: {name: the file}, and mypy's lines."""
    folder = tmp_path_factory.mktemp("typing")
    # names of this run's own (mypy's cache shared with .ci/lint maps a module name to the file it saw last)
    texts = {"clean": SCRIPT, "wrong": SCRIPT + "\n".join(MISTAKES) + "\n",
             **{f"readme_{i}": block for i, block in enumerate(README_BLOCKS)}}
    files = {name: folder / f"user_{name}_{os.getpid()}.py" for name in texts}
    for name, text in texts.items():
        files[name].write_text(text)
    done = subprocess.run([os.path.join(ROOT, ".ci", "typecheck"), *map(str, files.values())], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode in (0, 1) and "error:" in done.stdout, done.stdout + done.stderr  # the mistakes at least
    return files, done.stdout.splitlines()


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_a_users_script_type_checks_clean_and_each_mistake_is_told(checked):
    files, lines = checked
    clean, wrong = files["clean"], files["wrong"]
    assert not [line for line in lines if line.startswith(str(clean))], lines
    found = [line for line in lines if line.startswith(str(wrong))]
    first = len(SCRIPT.splitlines()) + 1
    for line, (mistake, said) in enumerate(MISTAKES.items(), start=first):
        assert any(f":{line}: error: " in f and said in f for f in found), (mistake, found)
    assert len([f for f in found if ": error: " in f]) == len(MISTAKES), found  # and nothing else in the script


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_readmes_python_examples_type_check_clean(checked):
    # as a user's checker reads them: trainer.amp_step.scaler.is_enabled() needs the trainer typed by its step
    files, lines = checked
    assert README_BLOCKS
    for i in range(len(README_BLOCKS)):
        said = [line for line in lines if line.startswith(str(files[f"readme_{i}"]))]
        assert not said, (f"README.md's python block {i + 1}", said)


def test_the_top_level_names_are_visible_to_type_checkers():
    # ignite_amp imports its names on first use (PEP 562): its TYPE_CHECKING block imports the same names from
    # the same modules, or a checker would see Any.
    import ignite_amp

    tree = ast.parse(open(os.path.join(ROOT, "ignite_amp", "__init__.py"), encoding="utf-8").read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in block.body for alias in node.names}
    assert seen == ignite_amp._EXPORTS


def test_the_wheel_ships_py_typed():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert "py.typed" in cfg["options.package_data"]["ignite_amp"]
    assert os.path.isfile(os.path.join(ROOT, "ignite_amp", "py.typed"))


def test_the_documented_editable_install_is_seen_by_mypy(tmp_path):
    """`pip install -e .` installs an import hook (handlers/ becomes ignite_amp.handlers) that mypy cannot follow:
    import-not-found. The install the guides give developers who type-check, editable_mode=strict, lays out links
    that it reads. Installed into an empty virtual environment that sees this one's packages."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "outer.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # torch, Ignite... from this environment
    # from a copy: strict mode lays its link tree in build/ beside the sources, and a build/ in the checkout would
    # shadow the `build` package that .ci/run's release step runs next
    source = checkout_copy(tmp_path / "source")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "-e",
                              source, "--config-settings", "editable_mode=strict"], capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stderr
    (tmp_path / "mine.py").write_text("from ignite_amp import create_amp_trainer\n"
                                      "from ignite_amp.handlers import BestCheckpoint\n"
                                      "reveal_type(BestCheckpoint)\nx: int = create_amp_trainer\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--python-executable", python,
                           "mine.py"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert "import-not-found" not in proc.stdout and "ignite_amp.handlers.best_checkpoint.BestCheckpoint" \
        in proc.stdout, proc.stdout
    assert 'expression has type "def create_amp_trainer(' in proc.stdout  # typed: a wrong use is caught
