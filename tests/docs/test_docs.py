"""The documentation site stays true: it builds with no warning (every cross-reference resolved), every
public name and config key is documented in it, and every code block of the guides runs or is checked.

Code blocks in ``docs/`` (Markdown fences):
- ``python``: run as a script in an empty directory, as a user who pastes it would.
- ``yaml``: a config or part of one: ``load_config`` must accept it.
- ``bash``: each command is checked: ``ignite-amp`` commands parse with the real parser and name files that
  exist, ``pip install`` names extras that exist, ``python``/``torchrun`` name scripts that exist.
- ``text``: what a program prints; not run.
A python or bash block preceded by ``<!-- not run: why -->`` (one that needs a GPU, say) is skipped with that reason.
The site itself is built and checked by tests/docs/test_docs_site.py.
"""
import configparser
import os
import re
import shlex
from typing import List, Optional

import pytest

from helpers import ROOT
from helpers.docs import Block, code_blocks, guide_pages
from helpers.forks import Forks

pytestmark = [pytest.mark.docs]


LANGUAGES = {"python", "yaml", "bash", "text"}
# The first word of a documented command, and what is checked of the rest (see check_command).
COMMANDS = {"ignite-amp", "python", "python3", "pip", "torchrun", "tensorboard", "sphinx-build", "git", "cd", "export",
            "nvidia-smi", "chromium", "apt-get", "CI=true"}


BLOCKS = [b for page in guide_pages() for b in code_blocks(page)]


def of(language: str) -> list:
    return [pytest.param(b, id=b.name) for b in BLOCKS if b.language == language]


def test_every_block_says_its_language():
    assert len(BLOCKS) > 20
    unknown = [(b.name, b.language) for b in BLOCKS if b.language not in LANGUAGES]
    assert not unknown, f"a code block needs one of {sorted(LANGUAGES)}: {unknown}"
    for page in guide_pages():  # a fence inside a list item would escape the checks below
        indented = re.findall(r"^[ \t]+```\w", open(page, encoding="utf-8").read(), re.M)
        assert not indented, f"{page}: an indented code fence is not checked; move it out of the list"


def run_python_blocks(blocks: List[Block], tmp_path_factory, forks: Forks) -> dict:
    """Runs each of ``blocks`` as a script in its own empty directory, in a process of its own forked from one that
    imported what every block's start would (``helpers.forks``): ``{name: (exit code, stdout, stderr)}``."""
    ran = {}
    for block in blocks:
        folder = tmp_path_factory.mktemp("block")
        (folder / "block.py").write_text(block.text)
        ran[block.name] = tuple(forks.run([str(folder / "block.py")], cwd=folder))
    return ran


@pytest.fixture(scope="module")
def python_blocks_ran(request, tmp_path_factory, forks):
    """The python blocks of the selected tests (``-k "guides/architecture"``: that page's), run once for all."""
    selected = {item.callspec.params["block"].name for item in request.session.items
                if getattr(item, "originalname", "") == "test_python_block_runs"}
    return run_python_blocks([b for b in BLOCKS if b.name in selected and not b.not_run], tmp_path_factory, forks)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("block", of("python"))
def test_python_block_runs(block, python_blocks_ran):
    if block.not_run:
        pytest.skip(block.not_run)
    code, stdout, stderr = python_blocks_ran[block.name]
    shown = stderr if len(stderr) <= 6000 else f"{stderr[:3000]}\n...\n{stderr[-3000:]}"  # a rank's error: first
    assert code == 0, f"{block.name}\n{shown}"
    if "val accuracy" in block.text:  # a script that says it learns does
        accuracies = [float(a) for a in re.findall(r"val accuracy ([0-9.]+)", stdout)]
        assert len(accuracies) >= 2 and accuracies[-1] > accuracies[0], stdout


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_python_block_runs_as_a_script_of_its_own(tmp_path_factory, forks):
    """The runner: each block in its own directory and process, as ``__main__`` with its own imports, and a
    failure (an exception, an exit code) is its block's alone."""
    blocks = [Block("p", 1, "python", "import os\nopen('mine.txt', 'w').write(os.getcwd())\nprint(__name__)", ""),
              Block("p", 2, "python", "import os, sys\nassert not os.listdir('.') or os.listdir('.') == ['block.py']"
                                      "\nprint(sorted(os.listdir('.')))\nsys.exit(3)", ""),
              Block("p", 3, "python", "print(torch)", ""),  # no import of its own: fails, as it would when pasted
              Block("p", 4, "python", "print('after')", "")]
    ran = run_python_blocks(blocks, tmp_path_factory, forks)
    assert ran["p:1"][0] == 0 and ran["p:1"][1] == "__main__\n"
    assert ran["p:2"][0] == 3 and ran["p:2"][1] == "['block.py']\n"  # a's file is not in b's directory
    assert ran["p:3"][0] == 1 and "NameError: name 'torch' is not defined" in ran["p:3"][2]
    assert ran["p:4"] == (0, "after\n", "")


@pytest.mark.parametrize("block", of("yaml"))
def test_yaml_block_is_a_valid_config(block):
    import yaml

    from ignite_amp import load_config

    document = yaml.safe_load(block.text)
    if document is None:  # comments only, e.g. "# yaml-language-server: $schema=..."
        assert block.text.lstrip().startswith("#"), block.name
        return
    load_config(document)


def _extras() -> set:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return set(cfg["options.extras_require"])


def check_command(words: List[str], where: str, made: Optional[set] = None) -> None:
    """One documented shell command names real things (a config: a file, a built-in config's name, or a file
    that an ``ignite-amp init`` earlier in the block wrote: ``made``)."""
    from ignite_amp.cli.main import build_parser
    from ignite_amp.config.builtin import builtin_names

    while words and "=" in words[0] and words[0] != "CI=true":  # VAR=value before the command
        words = words[1:]
    if words and words[0].startswith(".ci/"):  # the checkout's own scripts (.ci/lint)
        assert os.access(os.path.join(ROOT, words[0]), os.X_OK), f"{where}: no script {words[0]} in the checkout"
        return
    assert words and words[0] in COMMANDS, f"{where}: an unknown command {words[:1]} (add it to COMMANDS)"
    head, rest = words[0], words[1:]
    if head == "python3":
        head = "python"
    if head == "python" and rest[:2] == ["-m", "ignite_amp"]:
        head, rest = "ignite-amp", rest[2:]
    if head == "python" and rest[:2] == ["-m", "pip"]:
        head, rest = "pip", rest[2:]
    if head == "python" and rest[:2] == ["-m", "pytest"]:
        return
    if head == "ignite-amp":
        if rest in (["--help"], ["--version"]):
            return
        args = build_parser().parse_args(rest)
        if getattr(args, "config", None):
            known = os.path.exists(os.path.join(ROOT, args.config)) or args.config in builtin_names()
            assert known or args.config in (made or ()), f"{where}: no file or built-in config {args.config}"
        if args.command == "init" and made is not None:
            made.add(args.output or f"{args.name}.yaml")
    elif head == "pip" and rest[:1] == ["install"]:
        for word in rest[1:]:
            extras = re.fullmatch(r"\.\[([\w,]+)\]", word)  # .[test] names extras; -e, . and files name none
            if extras:
                missing = set(extras.group(1).split(",")) - _extras()
                assert not missing, f"{where}: setup.cfg has no extra {missing}"
    elif head in ("python", "torchrun"):
        scripts = [w for w in rest if w.endswith(".py")]
        for script in scripts:
            assert os.path.exists(os.path.join(ROOT, script)), f"{where}: no file {script}"
        if "-m" in rest and head == "torchrun":  # torchrun ... -m ignite_amp train CONFIG
            check_command(["python"] + rest[rest.index("-m"):], where, made)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("block", of("bash"))
def test_bash_block_names_real_things(block):
    if block.not_run:
        pytest.skip(block.not_run)
    text = block.text.replace("\\\n", " ")
    made: set = set()  # the files `ignite-amp init` wrote so far in this block
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for command in re.split(r"\s*(?:&&|\|\||;)\s*", line):
            words = shlex.split(command)
            words = [w for w in words if not w.startswith("$(")]
            check_command(words, block.name, made)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_command_check_knows_built_in_configs_and_the_files_init_wrote():
    made: set = set()
    check_command(["ignite-amp", "train", "quickstart"], "t", made)
    with pytest.raises(AssertionError, match="no file or built-in config my_run.yaml"):
        check_command(["ignite-amp", "train", "my_run.yaml"], "t", made)
    check_command(["ignite-amp", "init", "quickstart", "-o", "my_run.yaml"], "t", made)
    check_command(["ignite-amp", "train", "my_run.yaml"], "t", made)
