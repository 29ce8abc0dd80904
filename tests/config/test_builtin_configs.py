"""The built-in configs ship inside the package: ``ignite-amp train quickstart`` from any directory (a local file
of that name wins, and the run says which it took), ``ignite-amp init`` copies one out with the JSON Schema beside
it, ``ignite-amp configs`` lists them. (That a wheel holds them: tests/test_layout.py; that an installed wheel
trains outside the checkout: .ci/run.)"""
import json
import os

import pytest
import yaml

import ignite_amp.config.builtin as builtin_configs
from helpers import CONFIGS, assert_doctests_pass
from ignite_amp.cli.commands import _train_command
from ignite_amp.cli.configs import resolve_config
from ignite_amp.cli.main import build_parser, main
from ignite_amp.config.builtin import SCHEMA_FILE, SCHEMA_LINE, builtin_names, builtin_path, find_config, init_config
from ignite_amp.config.tree import config_schema, load_config
from ignite_amp.errors import ConfigError

# The quickstart made tiny: a run of a few seconds on a CPU.
TINY = ["--set", "device=cpu", "--set", "data.train_size=64", "--set", "data.val_size=32",
        "--set", "data.batch_size=32", "--set", "data.image_size=16", "--set", "model.kwargs={width: 8}",
        "--set", "train.epochs=1",
        "--set", "handlers.tensorboard.enabled=false"]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory outside the checkout, as a user who installed the wheel has."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_package_ships_the_repository_configs_and_the_schema():
    shipped = sorted(n[:-5] for n in os.listdir(CONFIGS) if n.endswith(".yaml"))
    assert builtin_names() == shipped and "quickstart" in shipped and "cifar10_resnet18" in shipped
    for name in shipped:
        with open(builtin_path(name), encoding="utf-8") as f, open(os.path.join(CONFIGS, name + ".yaml")) as g:
            assert f.read() == g.read()
        assert builtin_configs.builtin_summary(name)  # a line for `ignite-amp configs`
    schema = os.path.join(os.path.dirname(builtin_path("quickstart")), SCHEMA_FILE)
    assert json.load(open(schema)) == config_schema()


def test_doctests(elsewhere):
    assert_doctests_pass(builtin_configs)


def test_a_name_finds_the_built_in_and_a_local_file_of_that_name_wins(elsewhere):
    source = find_config("quickstart")
    assert source.builtin == "quickstart" and source.path == builtin_path("quickstart")
    assert source.note.startswith("config: the built-in quickstart (") and "ignite-amp init quickstart" in source.note
    assert find_config("quickstart.yaml").builtin == "quickstart"  # not here: the built-in, said so
    (elsewhere / "quickstart").mkdir()  # a folder of that name is not a config
    assert find_config("quickstart").builtin == "quickstart"
    (elsewhere / "quickstart.yaml").write_text("name: mine\n")
    for typed in ("quickstart", "quickstart.yaml"):
        source = find_config(typed)
        assert (source.path, source.builtin) == ("quickstart.yaml", None)
        assert source.note == "config: quickstart.yaml from this directory (not the built-in quickstart)"
    assert find_config("./quickstart.yaml") == ("./quickstart.yaml", None, "")  # a path: said nothing
    (elsewhere / "mine.yaml").write_text("name: mine\n")
    assert find_config("mine.yaml") == ("mine.yaml", None, "")


def test_a_config_that_is_neither_a_file_nor_a_name_is_one_line(elsewhere, capsys):
    with pytest.raises(ConfigError, match=r"^quickstrt: no such file, and no built-in config of that name "
                                          r"\(built-in: cifar10_resnet18, quickstart\)$"):
        find_config("quickstrt")
    with pytest.raises(ConfigError, match=r"^sub/quickstart.yaml: no such file$"):
        find_config("sub/quickstart.yaml")
    assert main(["train", "quickstrt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ignite-amp: error: quickstrt: no such file") and err.count("\n") == 1


def test_without_the_built_ins_installed_a_file_still_trains_and_a_name_says_how_to_fix(elsewhere, monkeypatch):
    """An editable install made before the configs were a package maps no ignite_amp.configs."""
    monkeypatch.setattr(builtin_configs, "PACKAGE", "ignite_amp.no_such_package")
    (elsewhere / "mine.yaml").write_text("name: mine\n")
    assert find_config("mine.yaml") == ("mine.yaml", None, "")
    with pytest.raises(ConfigError, match=r"built-in configs are not installed .* run pip install -e \. again\)$"):
        find_config("quickstart")


@pytest.mark.slow
def test_train_by_name_from_another_directory_says_which_config_it_took(elsewhere, capsys):
    assert main(["train", "quickstart", *TINY]) == 0
    out = capsys.readouterr().out
    assert " ".join(out.split()).startswith(f"config: the built-in quickstart ({builtin_path('quickstart')}); a copy "
                                            f"to edit: ignite-amp init quickstart")  # (wrapped at 80 columns)
    saved = yaml.safe_load((elsewhere / "runs" / "quickstart" / "config.yaml").read_text())
    assert saved["name"] == "quickstart" and saved["data"]["train_size"] == 64
    # The commands the run suggests name the config as typed, not the installed file.
    args = build_parser().parse_args(["train", "quickstart", "--set", "seed=1"])
    resolve_config(args)
    capsys.readouterr()
    assert args.config == builtin_path("quickstart")
    assert _train_command(args) == "ignite-amp train quickstart --set seed=1"


def test_find_batch_size_does_not_write_into_the_installed_package(elsewhere, capsys):
    before = open(builtin_path("quickstart")).read()
    assert main(["find-batch-size", "quickstart", "--write"]) == 2
    err = capsys.readouterr().err
    assert err == ("ignite-amp: error: --write: quickstart is a built-in config, not a file of yours; write a copy "
                   "first (ignite-amp init quickstart -o FILE) and search with it\n")
    assert open(builtin_path("quickstart")).read() == before


def test_init_writes_the_config_to_edit_with_the_schema_beside_it(elsewhere, capsys):
    assert main(["init"]) == 0
    assert capsys.readouterr().out == ("wrote quickstart.yaml (the built-in quickstart) and the JSON Schema beside it"
                                       "\n  (for editors)\ntrain it: ignite-amp train quickstart.yaml\n")
    text = (elsewhere / "quickstart.yaml").read_text()
    assert text == open(builtin_path("quickstart")).read() and text.startswith(SCHEMA_LINE + "\n")
    assert json.loads((elsewhere / SCHEMA_FILE).read_text()) == config_schema()
    assert load_config("quickstart.yaml") == load_config(builtin_path("quickstart"))
    # An existing file is kept, in one line; --force replaces it.
    (elsewhere / "quickstart.yaml").write_text("name: edited\n")
    assert main(["init"]) == 2
    err = capsys.readouterr().err
    assert err == ("ignite-amp: error: quickstart.yaml: exists (init writes NAME.yaml when no -o is given); name "
                   "another file with -o FILE, or add --force to replace it\n")  # no -o was given: none is blamed
    assert (elsewhere / "quickstart.yaml").read_text() == "name: edited\n"
    assert main(["init", "--force"]) == 0 and (elsewhere / "quickstart.yaml").read_text() == text
    capsys.readouterr()


def test_init_names_the_run_after_its_file_and_refreshes_a_stale_schema(elsewhere, capsys):
    (elsewhere / "sub").mkdir()
    (elsewhere / "sub" / SCHEMA_FILE).write_text("{}")  # an older version's
    assert main(["init", "quickstart", "-o", "sub/my_run.yml"]) == 0
    cfg = load_config("sub/my_run.yml")
    assert cfg.name == "my_run" and cfg.output_dir == os.path.join("runs", "my_run")
    assert json.loads((elsewhere / "sub" / SCHEMA_FILE).read_text()) == config_schema()
    assert capsys.readouterr().out.splitlines()[-1] == "train it: ignite-amp train sub/my_run.yml"
    assert init_config("cifar10_resnet18", str(elsewhere / "sub" / "gpu.yaml")) == [str(elsewhere / "sub" / "gpu.yaml")]
    assert load_config("sub/gpu.yaml").name == "gpu"  # the schema beside it was current: not rewritten


def test_init_to_stdout_and_its_errors_in_one_line(elsewhere, capsys):
    assert main(["init", "cifar10_resnet18", "-o", "-"]) == 0
    assert capsys.readouterr().out == open(builtin_path("cifar10_resnet18")).read()
    assert os.listdir(elsewhere) == []
    for argv, line in [
        (["init", "nope"], "nope: no built-in config of that name (built-in: cifar10_resnet18, quickstart)"),
        (["init", "-o", "."], "-o .: is a directory; name the file to write, e.g. -o ./quickstart.yaml"),
        (["init", "-o", "no/such/dir.yaml"], "-o no/such/dir.yaml: cannot write (No such file or directory)"),
    ]:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err == f"ignite-amp: error: {line}\n"
    assert os.listdir(elsewhere) == []


def test_configs_lists_the_built_in_names(capsys):
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == builtin_names()
    assert lines[1].startswith("quickstart        A small CNN on the built-in shapes data set")
    assert lines[-1] == "train one: ignite-amp train NAME; a copy to edit: ignite-amp init NAME -o FILE"


@pytest.mark.parametrize("limit", [0, 1024])
def test_init_on_a_full_disk_leaves_nothing_and_the_retry_writes_both_files(elsewhere, capsys, file_size_limit, limit):
    """Issue 59.4: a write that failed (full disk, quota, ulimit -f) left a 0-byte mine.yaml that the retry refused
    ("exists; add --force") and train read as a config of defaults; under 1 KiB, a config beside a schema cut to
    invalid JSON."""
    with file_size_limit(limit):
        assert main(["init", "-o", "mine.yaml"]) == 2
    assert capsys.readouterr().err == (f"ignite-amp: error: {SCHEMA_FILE}: cannot write (File too large); mine.yaml "
                                       f"not written\n")
    assert os.listdir(elsewhere) == []
    (elsewhere / SCHEMA_FILE).write_text(json.dumps(config_schema(), indent=2) + "\n")  # current: not written again
    with file_size_limit(100):  # the config itself cut short
        assert main(["init", "-o", "mine.yaml"]) == 2
    assert capsys.readouterr().err == "ignite-amp: error: -o mine.yaml: cannot write (File too large)\n"
    assert os.listdir(elsewhere) == [SCHEMA_FILE]
    assert main(["init", "-o", "mine.yaml"]) == 0  # the retry, with room: no --force needed
    assert load_config("mine.yaml").name == "mine"
