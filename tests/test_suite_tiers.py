"""The suite's tiers: the fast one (``python -m pytest -m "not slow"``, run after each edit) holds a test of every
module of the package, the whole suite is what CI runs with its coverage floor, and the README names both."""
import ast
import configparser
import os
import re

import pytest

from helpers import ROOT

PACKAGES = {"ignite_amp": "ignite_amp", "ignite_amp.handlers": "handlers"}
# The modules whose fast tests are not where the convention looks (tests/<folder>/test_<module>.py, a folder per
# subpackage; tests/handlers/test_tensorboard_<module>.py for handlers/tensorboard; tests/test_<module>.py for the
# package's top level; any test file of the folder for a subpackage's __init__): where they are.
ELSEWHERE = {
    "ignite_amp": "tests/test_layout.py",
    "ignite_amp.__main__": "tests/cli/test_cli.py",
    "ignite_amp.batching": "tests/step/test_batching.py",
    "ignite_amp.engine": "tests/step/test_engine.py",
    "ignite_amp.errors": "tests/config/test_config.py",
    "ignite_amp.config.run_keys": "tests/config/test_typed_config.py",
    "ignite_amp.core.config_values": "tests/config/test_typed_config.py",
    "ignite_amp.launcher": "tests/step/test_hooks.py",
    "ignite_amp.models": "tests/config/test_config.py",
    "ignite_amp.version": "tests/test_release.py",
    "ignite_amp.batch_search.policy": "tests/batch_search/test_batch_size.py",
    "ignite_amp.batch_search.results": "tests/batch_search/test_batch_size.py",
    "ignite_amp.batch_search.runner": "tests/batch_search/test_batch_size.py",
    "ignite_amp.batch_search.strategies": "tests/batch_search/test_batch_size.py",
    "ignite_amp.cli.commands": "tests/cli/test_cli.py",
    "ignite_amp.cli.configs": "tests/config/test_builtin_configs.py",
    "ignite_amp.cli.main": "tests/cli/test_cli.py",
    "ignite_amp.cli.plan": "tests/cli/test_adversarial_commands.py",
    "ignite_amp.config.builtin": "tests/config/test_builtin_configs.py",
    "ignite_amp.config.limits": "tests/config/test_config.py",
    "ignite_amp.config.tree": "tests/config/test_config.py",
    "ignite_amp.config.yaml12": "tests/config/test_schema.py",
    "ignite_amp.core.collectives": "tests/run/test_distributed.py",
    "ignite_amp.core.config_keys": "tests/core/test_fields.py",
    "ignite_amp.core.exports": "tests/test_layout.py",
    "ignite_amp.core.nested": "tests/step/test_batching.py",
    "ignite_amp.core.rng": "tests/step/test_train.py",
    "ignite_amp.data.datasets": "tests/data/test_data.py",
    "ignite_amp.data.image_folder": "tests/run/test_adversarial_use.py",
    "ignite_amp.data.passes": "tests/data/test_device_batches.py",
    "ignite_amp.data.samplers": "tests/data/test_data.py",
    "ignite_amp.files.checkpoints": "tests/handlers/test_best_checkpoint.py",
    "ignite_amp.memory_plan.plan": "tests/memory_plan/test_memory_plan.py",
    "ignite_amp.memory_plan.cuda_extras": "tests/memory_plan/test_memory_plan.py",
    "ignite_amp.memory_plan.fake_step": "tests/memory_plan/test_memory_plan.py",
    "ignite_amp.memory_plan.choices": "tests/memory_plan/test_auto_checkpoint.py",
    "ignite_amp.run.builders": "tests/run/test_fast_path.py",
    "ignite_amp.run.built_run": "tests/run/test_resume.py",
    "ignite_amp.run.compose": "tests/run/test_resume.py",
    "ignite_amp.run.epochs": "tests/run/test_epoch_line.py",
    "ignite_amp.run.fused": "tests/run/test_fast_path.py",
    "ignite_amp.run.plan": "tests/files/test_dtype_choice.py",
    "ignite_amp.run.search": "tests/batch_search/test_batch_size.py",
    "ignite_amp.split_check.check": "tests/split_check/test_split_check.py",
    "ignite_amp.split_check.diagnosis": "tests/split_check/test_split_check.py",
    "ignite_amp.split_check.randomness": "tests/split_check/test_split_check.py",
    "ignite_amp.split_check.keyed": "tests/split_check/test_by_construction.py",
    "ignite_amp.split_check.draws": "tests/split_check/test_by_construction.py",
    "ignite_amp.step.base": "tests/step/test_train.py",
    "ignite_amp.step.chunks": "tests/step/test_batching.py",
    "ignite_amp.step.contracts": "tests/step/test_hooks.py",
    "ignite_amp.step.evaluate": "tests/step/test_engine.py",
    "ignite_amp.step.events": "tests/step/test_train.py",
    "ignite_amp.step.factory_args": "tests/step/test_hooks.py",
    "ignite_amp.step.facts": "tests/step/test_train.py",
    "ignite_amp.step.grad_norm": "tests/handlers/test_gradient_clipping.py",
    "ignite_amp.transforms.activation_checkpointing": "tests/transforms/test_checkpointing.py",
    "ignite_amp.transforms.blocks": "tests/transforms/test_checkpointing.py",
    "ignite_amp.transforms.sharding": "tests/transforms/test_fsdp.py",
    "ignite_amp.handlers.non_finite_guard": "tests/run/test_faults.py",
    "ignite_amp.handlers.resumable": "tests/run/test_resume.py",
    "ignite_amp.handlers.tensorboard": "tests/handlers/test_tensorboard_metrics.py",
    "ignite_amp.handlers.tensorboard.event": "tests/handlers/test_tensorboard_metrics.py",
    "ignite_amp.handlers.tensorboard.facts": "tests/handlers/test_tensorboard_metrics.py",
    "ignite_amp.handlers.tensorboard.scalars": "tests/handlers/test_tensorboard_metrics.py",
}


def package_modules() -> dict:
    """Every module of the package, by its import name: its file."""
    modules = {}
    for package, folder in PACKAGES.items():
        for where, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    parts = os.path.relpath(os.path.join(where, name), os.path.join(ROOT, folder))[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    modules[".".join([package, *parts])] = os.path.join(where, name)
    return modules


def by_convention(module: str) -> list:
    """Where the convention looks for a module's tests: one file, or any test file of a folder."""
    parts = module.split(".")[1:]
    if parts[:1] == ["handlers"] and len(parts) == 3:  # ignite_amp.handlers.tensorboard.<module>
        return [f"tests/handlers/test_tensorboard_{parts[2]}.py"]
    if len(parts) == 1 and os.path.isdir(os.path.join(ROOT, "tests", parts[0])):  # a subpackage's __init__
        folder = os.path.join(ROOT, "tests", parts[0])
        return sorted(f"tests/{parts[0]}/{name}" for name in os.listdir(folder) if name.startswith("test_"))
    return ["tests/" + "/".join(parts[:-1] + [f"test_{parts[-1]}.py"])] if parts else []


def fast_tests(path: str) -> list:
    """The tests of a file that the fast tier runs: not marked slow, by the module's ``pytestmark`` or a decorator."""
    source = open(os.path.join(ROOT, path), encoding="utf-8").read()
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if "pytest.mark.slow" in ast.get_source_segment(source, node.value):
                return []
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            and not any("pytest.mark.slow" in ast.get_source_segment(source, d) for d in node.decorator_list)]


def test_every_module_of_the_package_has_a_test_in_the_fast_tier():
    missing = {}
    for module in package_modules():
        places = [ELSEWHERE[module]] if module in ELSEWHERE else by_convention(module)
        if not any(os.path.isfile(os.path.join(ROOT, p)) and fast_tests(p) for p in places):
            missing[module] = places
    assert not missing, f"no fast test (a test not marked slow) where these modules' tests are: {missing}; " \
                        f"add one, or name the file in ELSEWHERE"


def test_the_table_of_exceptions_names_modules_that_exist_and_is_no_longer_than_it_must_be():
    modules = package_modules()
    assert set(ELSEWHERE) <= set(modules), set(ELSEWHERE) - set(modules)
    redundant = [m for m in ELSEWHERE if by_convention(m) == [ELSEWHERE[m]]]
    assert not redundant, redundant


def test_the_tier_check_finds_a_module_without_a_fast_test(tmp_path):
    (tmp_path / "test_a.py").write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_x():\n    pass\n\n\n"
                                        "def helper():\n    pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\n\npytestmark = [pytest.mark.docs, pytest.mark.slow]\n\n\n"
                                        "def test_y():\n    pass\n")
    (tmp_path / "test_c.py").write_text("import pytest\n\n\n@pytest.mark.subprocess\ndef test_z():\n    pass\n")
    assert fast_tests(str(tmp_path / "test_a.py")) == [] and fast_tests(str(tmp_path / "test_b.py")) == []
    assert fast_tests(str(tmp_path / "test_c.py")) == ["test_z"]
    assert by_convention("ignite_amp.step.train") == ["tests/step/test_train.py"]
    assert by_convention("ignite_amp.handlers.tensorboard.health") == ["tests/handlers/test_tensorboard_health.py"]
    assert by_convention("ignite_amp.engine") == ["tests/test_engine.py"]


def test_the_readme_names_the_fast_tier_and_the_whole_suite_and_ci_runs_the_whole_with_coverage():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert 'python -m pytest -m "not slow"' in readme
    assert 'pip install -e ".[test]" && python -m pytest --cov\n' in readme
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert re.search(r'^pip install -e "\.\[test\]" && python -m pytest --cov \|\| exit 1', ci, re.M)


def test_the_markers_are_declared_strictly_with_a_time_limit_and_a_coverage_floor():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    pytest_cfg = cfg["tool:pytest"]
    declared = {line.split(":")[0].strip() for line in pytest_cfg["markers"].strip().splitlines()}
    assert {"slow", "subprocess", "docs", "distributed", "gpu"} <= declared
    assert "--strict-markers" in pytest_cfg["addopts"].split() and int(pytest_cfg["timeout"]) >= 300
    assert cfg["coverage:run"]["source"].split() == ["ignite_amp", "handlers"]  # handlers/: ignite_amp.handlers
    assert cfg.getboolean("coverage:run", "branch")
    assert float(cfg["coverage:report"]["fail_under"]) >= 50  # the floor: just below the figure CI measured
    extras = cfg["options.extras_require"]["test"]
    assert re.search(r"^pytest-timeout\b", extras, re.M) and re.search(r"^pytest-cov\b", extras, re.M)


@pytest.mark.parametrize("marker", ["slow", "subprocess", "docs", "distributed"])
def test_each_kind_marks_some_test(marker):
    marked = []
    for where, _, files in os.walk(os.path.join(ROOT, "tests")):
        marked += [name for name in files if name.endswith(".py")
                   and f"pytest.mark.{marker}" in open(os.path.join(where, name), encoding="utf-8").read()
                   and name != os.path.basename(__file__)]
    assert marked, marker


def test_the_version_sets_test_list_names_paths_that_exist():
    """.ci/versions runs the tests .ci/versions-tests.txt lists: a renamed file would fail CI's other sets."""
    with open(os.path.join(ROOT, ".ci", "versions-tests.txt"), encoding="utf-8") as f:
        paths = [line.split("#")[0].strip() for line in f]
    paths = [p.split("::")[0] for p in paths if p]
    assert paths and [p for p in paths if not os.path.exists(os.path.join(ROOT, p))] == []
