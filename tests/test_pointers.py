"""Every project file and every ``ignite_amp`` name that the package's docstrings, comments and messages point a
reader to exists in the checkout, so a pointer cannot dangle after a file moves or a name is dropped.

What counts as a pointer (the rule; other names are a user's own files and are not checked):

- a path whose first part is a top-level folder of the repository (``docs/``, ``tests/``, ``benchmarks/``,
  ``configs/``, ``examples/``, ``ignite_amp/``, ``handlers/``, ``.ci/``): ``docs/guides/memory.md``,
  ``tests/step/``; ``ignite_amp/handlers/...`` and ``ignite_amp/configs/...`` are the installed names of
  ``handlers/`` and ``configs/`` (setup.cfg ``package_dir``). A user's placeholders (``mine.yaml``, a run
  folder's ``config.yaml``, ``runs/...``, ``output_dir/train.log``) and TensorBoard tags (``run/facts``,
  ``step/batch_size``) start with no such folder;
- a bare name of a top-level file: an upper-case ``*.md`` (``README.md``, ``CHANGELOG.md``), ``setup.cfg``,
  ``pyproject.toml``, ``MANIFEST.in`` (a file in a folder is named with its folder: ``benchmarks/RESULTS.md``);
- a dotted name that starts with ``ignite_amp.`` (``ignite_amp.memory_plan.auto_checkpoint.checkpoint_to_fit``):
  it imports (a module, then attributes), as a user who copies it from a message would import it; the profiler's
  phase labels (``ignite_amp.forward``: ``ignite_amp.core.phases.PHASES``) name trace ranges, not code.

Scanned: every ``.py`` file under ``ignite_amp/`` and ``handlers/``; its string literals (docstrings, messages;
an f-string with ``{}`` in place of each field) and its comments.

And the subpackages the guides name as ``ignite_amp.X`` (``ignite_amp.handlers.BestCheckpoint``) are attributes of
``ignite_amp`` after ``import ignite_amp``, imported on first use.
"""
import ast
import functools
import glob
import importlib
import io
import os
import re
import subprocess
import sys
import tokenize
import warnings

import pytest
import torch

from helpers import ROOT

FOLDERS = ("docs", "tests", "benchmarks", "configs", "examples", "ignite_amp", "handlers", ".ci")
TOP_FILES = r"[A-Z][A-Z_]*\.md|setup\.cfg|pyproject\.toml|MANIFEST\.in"
INSTALLED = {"ignite_amp/handlers": "handlers", "ignite_amp/configs": "configs"}  # setup.cfg package_dir
# a name starts after a space, a quote or a bracket (not inside a longer path or an f-string's field)
PATH = re.compile(r"(?<![\w./{}~-])((?:%s)/[\w./-]*|%s)(?![\w/{}-])" % ("|".join(map(re.escape, FOLDERS)), TOP_FILES))
DOTTED = re.compile(r"(?<![\w./{}-])(ignite_amp(?:\.\w+)+)")


def sources() -> list:
    files = [p for folder in ("ignite_amp", "handlers")
             for p in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)]
    assert len(files) > 100
    return sorted(files)


def texts(path: str):
    """(line, text) of each string literal and comment of a source file."""
    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
            yield node.lineno, node.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


@functools.lru_cache(maxsize=1)
def scanned() -> tuple:
    """("file:line", text) of every string literal and comment of the scanned sources."""
    return tuple((f"{os.path.relpath(path, ROOT)}:{line}", text) for path in sources() for line, text in texts(path))


def pointers(pattern: re.Pattern) -> dict:
    """{name: ["file:line", ...]} of every match of ``pattern`` in the scanned sources."""
    found: dict = {}
    for at, text in scanned():
        for match in pattern.finditer(text):
            found.setdefault(match.group(1).rstrip("."), []).append(at)  # rstrip: a sentence's full stop
    return found


def in_checkout(name: str) -> str:
    for installed, folder in INSTALLED.items():
        if name == installed or name.startswith(installed + "/"):
            name = folder + name[len(installed):]
    return os.path.join(ROOT, name)


def imports(name: str) -> bool:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):  # the longest module, then its attributes
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for part in parts[end:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_every_file_the_sources_point_to_exists():
    found = pointers(PATH)
    assert {"benchmarks/RESULTS.md", "setup.cfg", "tests/step/test_engine.py"} <= set(found)  # the rule sees them
    missing = {name: at for name, at in found.items()
               if not (os.path.isdir if name.endswith("/") else os.path.exists)(in_checkout(name))}
    assert not missing, missing


@pytest.mark.parametrize("text, names", [
    ("see docs/guides/memory.md.", ["docs/guides/memory.md"]),
    ("(DESIGN.md) and ``tests/step/``", ["DESIGN.md", "tests/step/"]),
    ('written to output_dir/config.yaml, mine.yaml, runs/x; the tag run/facts, "{}/tests/x"', []),
    ("PrefixStore('ignite_amp/attempt_{}')", []),
])
def test_the_rule_takes_project_paths_and_leaves_a_users_names(text, names):
    assert [m.group(1).rstrip(".") for m in PATH.finditer(text)] == names


def test_every_ignite_amp_name_the_sources_give_imports():
    from ignite_amp.core.phases import PHASES

    found = pointers(DOTTED)
    assert "ignite_amp.memory_plan.auto_checkpoint.checkpoint_to_fit" in found  # the rule sees the factory's message
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a moved path a message names on purpose still imports
        missing = {name: at for name, at in found.items() if name not in PHASES.values() and not imports(name)}
    assert not missing, missing


def test_activation_checkpointing_auto_names_a_function_that_imports():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError) as raised:
        from ignite_amp import create_amp_trainer

        create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                           device="cpu", activation_checkpointing="auto")
    named = re.search(r"call ([\w.]+)\(", str(raised.value)).group(1)
    module, _, function = named.rpartition(".")
    assert callable(getattr(importlib.import_module(module), function)), named


def test_the_architecture_guide_names_each_way_handlers_look_a_step_up():
    """The guide's handler interface says which ``ignite_amp.engine`` functions handlers find a step with."""
    used = set()
    for path in glob.glob(os.path.join(ROOT, "handlers", "**", "*.py"), recursive=True):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom) and node.module == "ignite_amp.engine":
                used |= {alias.name for alias in node.names if alias.name.endswith("_step_of")}
    guide = open(os.path.join(ROOT, "docs", "guides", "architecture.md"), encoding="utf-8").read()
    assert "trainer_step_of" in used  # the scan sees them
    assert all(f"`ignite_amp.engine.{name}`" in guide for name in used), used


def test_every_subpackage_is_an_attribute_of_the_package():
    """Each module and subpackage of ``ignite_amp/``, and ``handlers/`` (installed as ``ignite_amp.handlers``), is
    named by the package's ``_SUBMODULES`` and ``dir()``; ``configs/`` is package data (ignite_amp.config.builtin)."""
    import ignite_amp

    folder = os.path.join(ROOT, "ignite_amp")
    on_disk = {name.removesuffix(".py") for name in os.listdir(folder) if not name.startswith("_")
               and (name.endswith(".py") or os.path.isfile(os.path.join(folder, name, "__init__.py")))}
    assert set(ignite_amp._SUBMODULES) == on_disk | {"handlers"}
    assert set(ignite_amp._SUBMODULES) <= set(dir(ignite_amp))


@pytest.mark.slow
@pytest.mark.subprocess
def test_ignite_amp_handlers_is_reached_on_first_use():
    # a fresh interpreter: in this one a test has imported the handlers already (which binds the attribute)
    code = ("import sys, ignite_amp; print(sorted(m for m in ('torch', 'ignite_amp.handlers') if m in sys.modules)); "
            "print(ignite_amp.handlers is sys.modules['ignite_amp.handlers'], ignite_amp.handlers.BestCheckpoint)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "True <class 'ignite_amp.handlers.best_checkpoint.BestCheckpoint'>"]
