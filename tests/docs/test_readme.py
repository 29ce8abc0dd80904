"""The README stays true: its Python example runs as written and its commands name real things."""
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.docs]


README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


@pytest.mark.slow
@pytest.mark.subprocess
def test_readme_python_blocks_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        if "val accuracy" in block:  # the script example learns
            accuracies = [float(a) for a in re.findall(r"val accuracy ([0-9.]+)", proc.stdout)]
            assert len(accuracies) == 4 and accuracies[-1] > accuracies[0]


def test_readme_test_command_is_what_ci_runs():
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    command = 'pip install -e ".[test]" && python -m pytest --cov'  # the whole suite, with the coverage floor
    assert command in README and command in ci


def test_readme_docs_command_is_what_the_tests_build():
    command = 'pip install -e ".[docs]" && sphinx-build -W --keep-going docs docs/_build/html'
    site_test = open(os.path.join(ROOT, "tests", "docs", "test_docs_site.py"), encoding="utf-8").read()
    assert command in README and '"-W", "--keep-going"' in site_test


def test_readme_links_to_files_that_exist():
    links = re.findall(r"\]\(((?:docs|benchmarks|examples|configs)/[^)#]+)\)", README)
    assert len(links) >= 8
    for path in links:
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_readme_is_a_landing_page():
    assert len(README.splitlines()) <= 150


def test_readme_configs_exist():
    for path in re.findall(r"configs/[\w.]+\.yaml", README):
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_the_cpu_only_install_takes_torch_and_torchvision_from_the_same_index():
    """Installed alone from the CPU index, torch leaves torchvision to `pip install -e .`, which takes it from the
    default index with the CUDA torch it requires (and 3 GB of CUDA libraries) in place of the CPU one."""
    pages = [README] + [open(os.path.join(ROOT, "docs", "guides", name), encoding="utf-8").read()
                        for name in sorted(os.listdir(os.path.join(ROOT, "docs", "guides"))) if name.endswith(".md")]
    installs = [line for page in pages for line in page.splitlines() if re.match(r"pip install .*--index-url", line)]
    assert installs
    for line in installs:
        packages = line.split("--index-url")[0].split()[2:]
        assert "torch" in packages and "torchvision" in packages, line
