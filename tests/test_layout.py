"""The package's shape: one installed package, layers without import circles, honest floors."""
import ast
import configparser
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest
import torch

from helpers import ROOT, checkout_copy

PACKAGES = {"ignite_amp": os.path.join(ROOT, "ignite_amp"), "ignite_amp.handlers": os.path.join(ROOT, "handlers")}


def modules() -> dict:
    """{module name: path} of every module of the package, handlers included."""
    found = {}
    for package, folder in PACKAGES.items():
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if os.path.exists(os.path.join(root, d, "__init__.py")))
            rel = os.path.relpath(root, folder)
            here = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in sorted(files):
                if name.endswith(".py"):
                    found[here if name == "__init__.py" else f"{here}.{name[:-3]}"] = os.path.join(root, name)
    return found


def import_graph() -> dict:
    """{module: set of package modules it imports}, from the source: every import statement,
    in functions too, and the names a package's ``__init__.py`` imports lazily (``_EXPORTS``)."""
    known = modules()
    graph = {}
    for module, path in known.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
            elif (isinstance(node, ast.Assign) and path.endswith("__init__.py")
                  and getattr(node.targets[0], "id", "") in ("_EXPORTS", "_SUBMODULES")):
                value = ast.literal_eval(node.value)
                targets.update(value.values() if isinstance(value, dict) else (f"ignite_amp.{v}" for v in value))
        graph[module] = {t for t in targets if t in known and t != module}
    return graph


def find_cycle(graph: dict):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_import_graph_has_no_circles():
    graph = import_graph()
    assert len(graph) >= 20 and graph["ignite_amp.run.compose"] >= {"ignite_amp.handlers", "ignite_amp.engine"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def folder_of(module: str) -> str:
    """The folder (a package's top-level subpackage or module) ``module`` belongs to: ``ignite_amp.run.plan`` ->
    ``ignite_amp.run``, ``ignite_amp.handlers.tensorboard.metrics`` -> ``ignite_amp.handlers``."""
    return ".".join(module.split(".")[:2])


def folder_graph(graph: dict) -> dict:
    """{folder: folders its modules import}: a loop between two folders is a circle here even where no module
    circles (run/compose -> launcher -> run/builders is no module circle, but run and launcher lean on each other)."""
    folders: dict = {}
    for module, deps in graph.items():
        if module in ABOVE_ALL:
            continue
        here = folder_of(module)
        folders.setdefault(here, set()).update(folder_of(d) for d in deps if folder_of(d) != here
                                               and d not in ABOVE_ALL)
    for deps in list(folders.values()):
        for d in deps:
            folders.setdefault(d, set())
    return folders


def test_no_two_folders_import_each_other():
    assert find_cycle(folder_graph(import_graph())) is None, " -> ".join(find_cycle(folder_graph(import_graph())))


def test_a_loop_between_folders_is_found():  # the checker itself can fail
    graph = {"ignite_amp.run.compose": {"ignite_amp.launcher"}, "ignite_amp.launcher": {"ignite_amp.run.builders"},
             "ignite_amp.run.builders": set()}
    assert find_cycle(graph) is None  # no circle of modules...
    assert find_cycle(folder_graph(graph)) == ["ignite_amp.launcher", "ignite_amp.run", "ignite_amp.launcher"]


def test_find_cycle_finds_one():  # the checker itself can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The layers, top-down, by package (docs/guides/architecture.md draws them): a module imports from its own
# layer or the layers below it, never above. ``ignite_amp`` itself (the lazy public names) and ``__main__`` sit
# above them all.
LAYERS = (
    ("the command line", ("ignite_amp.cli",)),
    ("the run from a config", ("ignite_amp.run",)),
    ("the processes", ("ignite_amp.launcher",)),
    ("the config", ("ignite_amp.config",)),
    ("handlers", ("ignite_amp.handlers",)),
    ("components", ("ignite_amp.engine", "ignite_amp.data", "ignite_amp.models", "ignite_amp.memory_plan",
                    "ignite_amp.batch_search")),
    ("the step", ("ignite_amp.step", "ignite_amp.split_check", "ignite_amp.batching")),
    ("model transforms", ("ignite_amp.transforms",)),
    ("files", ("ignite_amp.files",)),
    ("core", ("ignite_amp.core", "ignite_amp.errors", "ignite_amp.version")),
)
ABOVE_ALL = ("ignite_amp", "ignite_amp.__main__")


def layer_of(module: str) -> int:
    """The index in LAYERS of ``module``'s layer (0: the top)."""
    for index, (_, packages) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return index
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and to the architecture guide")


def upward_imports(graph: dict) -> list:
    """``(module, import)`` pairs where a module imports from a layer above its own."""
    return sorted((m, d) for m, deps in graph.items() if m not in ABOVE_ALL
                  for d in deps if layer_of(d) < layer_of(m))


def test_every_module_is_in_a_layer_and_imports_only_downward():
    graph = import_graph()
    assert upward_imports(graph) == []


def test_upward_imports_are_found():  # the checker itself can fail
    graph = {"ignite_amp.core.device": {"ignite_amp.step.train"}, "ignite_amp.step.train": {"ignite_amp.core.device"}}
    assert upward_imports(graph) == [("ignite_amp.core.device", "ignite_amp.step.train")]


def test_no_folder_is_a_hall():
    """A folder per concept, none over about ten modules (issue 43)."""
    folders = {}
    for module, path in modules().items():
        if not path.endswith("__init__.py"):
            folders.setdefault(os.path.dirname(path), []).append(module)
    crowded = {os.path.relpath(f, ROOT): len(m) for f, m in folders.items() if len(m) > 11}
    assert not crowded, crowded


@pytest.mark.slow
@pytest.mark.subprocess
def test_each_folder_names_its_public_names_and_imports_them_on_first_use():
    """``from ignite_amp.step import AmpStep``, as ``from ignite.engine import Engine``: the defining module's
    object, listed by ``dir()``; nothing is imported before a name is used (a fresh interpreter)."""
    import importlib

    exporting = {m: p for m, p in modules().items() if p.endswith("__init__.py") and "_EXPORTS = {" in open(p).read()}
    assert {"ignite_amp", "ignite_amp.step", "ignite_amp.transforms", "ignite_amp.run"} <= set(exporting)
    for package in exporting:
        module = importlib.import_module(package)
        for name, where in module._EXPORTS.items():
            assert getattr(module, name) is getattr(importlib.import_module(where), name), (package, name)
            assert name in dir(module) and name in module.__all__
    code = ("import sys, ignite_amp.step, ignite_amp.transforms, ignite_amp.run; "
            "print(sorted(m for m in sys.modules if m.startswith('ignite_amp.') and m.count('.') > 1))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert eval(proc.stdout) == ["ignite_amp.core.exports", "ignite_amp.core.versions"], proc.stdout  # none of theirs


def test_the_boundaries_that_matter():
    graph = import_graph()
    importers_of_handlers = {m for m, deps in graph.items()
                             if not m.startswith("ignite_amp.handlers") and any(d.startswith("ignite_amp.handlers")
                                                                                for d in deps)}
    # The config tree gathers each handler's own declaration, resume finds its checkpoint, the composition root
    # attaches the handlers (the built run holds the checkpoint handler), compare logs with TensorBoardMetrics;
    # the package's top level names the subpackage (ignite_amp.handlers, imported on first use). Nothing else
    # imports a handler.
    assert importers_of_handlers == {"ignite_amp.run.compose", "ignite_amp.config.tree", "ignite_amp.run.resume",
                                     "ignite_amp.run.built_run", "ignite_amp.cli.compare", "ignite_amp"}
    for leaf in ("ignite_amp.errors", "ignite_amp.step.events"):
        assert graph[leaf] == set(), (leaf, graph[leaf])
    assert graph["ignite_amp.core.config_keys"] == {"ignite_amp.errors"}  # declarations sit below every component
    assert graph["ignite_amp.core.collectives"] == set()
    # The step's parts, bottom-up: what a batch is and where it runs know nothing of steps.
    steps = {"ignite_amp.step.base", "ignite_amp.step.train", "ignite_amp.step.evaluate", "ignite_amp.engine"}
    for low in ("ignite_amp.batching", "ignite_amp.step.scaler", "ignite_amp.step.contracts"):
        assert not graph[low] & steps, (low, graph[low] & steps)
    assert "ignite_amp.engine" not in graph["ignite_amp.step.train"] | graph["ignite_amp.step.base"]


def test_the_architecture_guide_draws_every_package():
    guide = open(os.path.join(ROOT, "docs", "guides", "architecture.md"), encoding="utf-8").read()
    packages = {p for _, ps in LAYERS for p in ps}
    missing = sorted(p for p in packages if f"`{p.split('.', 1)[1]}" not in guide)
    assert not missing, missing


def test_no_module_is_a_hall():
    """One owner per module, read as one idea: none over 400 lines."""
    long = {m: n for m, path in modules().items() if (n := len(open(path, encoding="utf-8").readlines())) > 400}
    assert not long, long


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_wheel_installs_one_package_named_ignite_amp(tmp_path):
    before = set(os.listdir(ROOT))
    source = checkout_copy(tmp_path / "source")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), source], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert set(os.listdir(ROOT)) - before == set()  # no build/ in the checkout (it made `python -m build` fail)
    wheel, = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"ignite_amp", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "ignite_amp/handlers/oom_backoff.py" in names and "ignite_amp/handlers/__init__.py" in names
    assert "ignite_amp/batch_search/policy.py" in names and "ignite_amp/handlers/tensorboard/metrics.py" in names
    # The ready configs and their schema: the wheel trains without a checkout (ignite-amp train quickstart).
    shipped = {f"ignite_amp/configs/{n}" for n in os.listdir(os.path.join(ROOT, "configs"))
               if n.endswith((".yaml", ".json"))}
    assert "ignite_amp/configs/quickstart.yaml" in shipped and shipped <= set(names), shipped - set(names)
    from ignite_amp import __version__
    assert wheel.startswith(f"ignite_amp-{__version__}-"), wheel  # the version: ignite_amp/version.py alone
    info = f"{wheel.split('-py')[0]}.dist-info"  # LICENSE, or licenses/LICENSE with a newer setuptools (PEP 639)
    assert {f"{info}/LICENSE", f"{info}/licenses/LICENSE"} & set(names), [n for n in names if n.startswith(info)]
    # The sdist (setuptools' own build, as `python -m build` calls it) ships the LICENSE too.
    proc = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                           "print(b.build_sdist(sys.argv[1]))", str(tmp_path)], cwd=source, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(tmp_path / proc.stdout.split()[-1]) as sdist:
        assert {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n} >= {"LICENSE", "CHANGELOG.md"}


@pytest.mark.slow
@pytest.mark.subprocess
def test_importing_the_package_leaves_logging_alone():
    code = ("import logging; before = {n: logging.getLogger(n).level for n in logging.root.manager.loggerDict}; "
            "root = logging.getLogger().level; handlers = list(logging.getLogger().handlers); "
            "import ignite_amp, ignite_amp.run.compose, ignite_amp.cli.main, ignite_amp.launcher, "
            "ignite_amp.cli.compare; "
            "changed = {n: l for n, l in before.items() if logging.getLogger(n).level != l}; "
            "new = [n for n in logging.root.manager.loggerDict if logging.getLogger(n).level != logging.NOTSET "
            "and n not in before]; "
            "assert not changed and logging.getLogger().level == root and logging.getLogger().handlers == handlers, "
            "changed; print(new)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not [n for n in eval(proc.stdout) if n.startswith(("ignite", "torch.multiprocessing"))], proc.stdout


# The newest torch API each call needs: the floor in setup.cfg must admit none older.
TORCH_APIS = {
    "torch.nn.utils.get_total_norm": (2, 6),
    "torch.nn.utils.clip_grads_with_norm_": (2, 6),
    "torch.amp.GradScaler": (2, 3),
    "torch.OutOfMemoryError": (2, 5),
}


def test_setup_cfg_floors_admit_no_torch_without_the_apis_we_call():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    requires = cfg["options"]["install_requires"]
    floor = tuple(int(v) for v in re.search(r"^\s*torch>=(\d+)\.(\d+)", requires, re.M).groups())
    for api, since in TORCH_APIS.items():
        obj = torch
        for part in api.split(".")[1:]:
            obj = getattr(obj, part)  # the API exists in the torch we test with
        assert floor >= since, f"setup.cfg says torch>={floor[0]}.{floor[1]} but {api} needs {since}"
    calls = "".join(open(p, encoding="utf-8").read() for p in modules().values())
    for api in ("get_total_norm", "clip_grads_with_norm_"):
        assert api in calls  # still used: otherwise drop it from the table
