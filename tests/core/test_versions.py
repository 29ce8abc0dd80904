"""ignite_amp.core.versions: a torch or Ignite older than the floor stops ``import ignite_amp`` in one line."""
import configparser
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from ignite_amp.core import versions

# import ignite_amp in a fresh interpreter whose metadata reports NAME at VERSION (the rest as installed)
_OLD = """import sys
from importlib import metadata
real = metadata.version
metadata.version = lambda name: sys.argv[2] if name == sys.argv[1] else real(name)
import ignite_amp
print("imported")
"""


def _floors_in_setup_cfg() -> dict:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = [line.split("#")[0].strip() for line in cfg["options"]["install_requires"].splitlines()]
    return dict(line.split(">=") for line in lines if ">=" in line)


def test_the_floors_checked_are_setup_cfgs_and_the_oldest_set_ci_runs():
    declared = _floors_in_setup_cfg()
    with open(os.path.join(ROOT, ".ci", "constraints-oldest.txt"), encoding="utf-8") as f:
        pinned = dict(line.strip().split("==") for line in f if "==" in line and not line.startswith("#"))
    for name, floor in versions.FLOORS.items():
        assert versions.release(declared[name]) == floor, (name, declared[name], floor)
    for name, floor in declared.items():  # every install_requires floor is the release CI installs as the oldest
        assert versions.release(pinned[name.lower()])[:len(versions.release(floor))] == versions.release(floor), name


@pytest.mark.parametrize("given, expected", [("2.11.0", (2, 11, 0)), ("2.11.0a0+nv25.3", (2, 11, 0)),
                                             ("0.5.0.post2", (0, 5, 0)), ("2.6", (2, 6)), ("dev", ())])
def test_release_reads_the_numbers_a_pre_release_or_local_build_carries(given, expected):
    assert versions.release(given) == expected


@pytest.mark.parametrize("name", sorted(versions.FLOORS))
def test_an_older_release_than_the_floor_is_one_line_naming_the_release_needed(name, monkeypatch):
    floor = versions.FLOORS[name]
    older = f"{floor[0]}.{floor[1] - 1}.1" if floor[1] else f"{floor[0] - 1}.99.0"
    real = versions.metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda n: older if n == name else real(n))
    need = ".".join(map(str, floor))
    with pytest.raises(ImportError, match=rf"^ignite-amp needs {name}>={need}, found {name} {older}: "
                                          rf"pip install --upgrade '{name}>={need}'$"):
        versions.check_versions()
    monkeypatch.setattr(versions.metadata, "version", lambda n: need if n == name else real(n))
    versions.check_versions()  # the floor itself is served


def test_import_ignite_amp_stops_on_an_old_torch_before_any_training(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _OLD, "torch", "2.4.1"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and "imported" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ImportError: ignite-amp needs torch>={'.'.join(map(str, versions.FLOORS['torch']))}, found torch 2.4.1: "
        f"pip install --upgrade 'torch>={'.'.join(map(str, versions.FLOORS['torch']))}'")
    ok = subprocess.run([sys.executable, "-c", _OLD, "torch", "2.11.0a0+nv25.3"], capture_output=True, text=True,
                        cwd=tmp_path, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == "imported", ok.stderr[-2000:]
