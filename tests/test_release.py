"""What a user installs is built, checked and tried the way it ships: one version, a changelog that names it, and
a CI that builds the sdist and the wheel, checks them and trains from the wheel outside the checkout."""
import configparser
import os
import re

from helpers import ROOT
from ignite_amp import __version__

CHANGELOG = open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8").read()
SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}  # Keep a Changelog's


def test_the_changelog_keeps_a_changelog_and_its_newest_release_is_this_version():
    assert CHANGELOG.startswith("# Changelog\n") and "https://keepachangelog.com/en/1.1.0/" in CHANGELOG
    headings = re.findall(r"^## (.+)$", CHANGELOG, re.M)
    assert headings[0] == "[Unreleased]", headings
    releases = [re.fullmatch(r"\[(\d+)\.(\d+)\.(\d+)\] - (2\d{3}-[01]\d-[0-3]\d)", h) for h in headings[1:]]
    assert releases and all(releases), headings
    versions = [tuple(int(g) for g in m.groups()[:3]) for m in releases]
    dates = [m.group(4) for m in releases]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), versions
    assert dates == sorted(dates, reverse=True), dates
    assert ".".join(map(str, versions[0])) == __version__, "a new version gets its section in CHANGELOG.md"
    assert set(re.findall(r"^### (.+)$", CHANGELOG, re.M)) <= SECTIONS


def test_the_version_is_written_in_one_place():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert cfg["metadata"]["version"] == "attr: ignite_amp.version.__version__"
    literal = re.compile(rf"['\"]{re.escape(__version__)}['\"]")
    for folder in ("ignite_amp", "handlers"):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py") and name != "version.py":
                assert not literal.search(open(os.path.join(ROOT, folder, name), encoding="utf-8").read()), name
    assert "include CHANGELOG.md" in open(os.path.join(ROOT, "MANIFEST.in")).read()  # in the sdist


def test_ci_builds_checks_and_trains_from_the_wheel_outside_the_checkout():
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    steps = ['pip install --quiet -e ".[lint]" && .ci/lint || exit 1',
             'pip install -e ".[test]" && python -m pytest', 'pip install --quiet -e ".[release]"',
             'work="$(mktemp -d)"', 'python -m build --outdir "$work/dist" .', 'twine check --strict "$work/dist"/*',
             'python -m venv --without-pip "$work/venv"',
             'python -m pip --python "$work/venv/bin/python" install --quiet "$work/dist"/*.whl',
             'cd "$work"', '"$work/venv/bin/ignite-amp" init quickstart -o mine.yaml',
             '"$work/venv/bin/ignite-amp" train quickstart --set train.epochs=1']
    at = [ci.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at, strict=True))
    assert ci.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in ci
    assert 'startswith(venv + os.sep)' in ci  # the wheel's own files are what runs, not the checkout's
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    release = cfg["options.extras_require"]["release"]
    assert re.search(r"^build\b", release, re.M) and re.search(r"^twine\b", release, re.M)


def test_the_license_is_the_bsd_3_clause_setup_cfg_declares_and_ships():
    """LICENSE is BSD-3-Clause, as setup.cfg says; setup.cfg and MANIFEST.in put it in the sdist and the wheel
    (tests/test_layout.py's wheel test builds both and finds it there)."""
    text = open(os.path.join(ROOT, "LICENSE"), encoding="utf-8").read()
    assert text.startswith("BSD 3-Clause License\n") and "Copyright (c) 2026, the ignite-amp authors" in text
    assert "Neither the name of the copyright holder" in text  # the third clause: BSD-3, not BSD-2
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert cfg["metadata"]["license"] == "BSD-3-Clause" and cfg["metadata"]["license_files"].split() == ["LICENSE"]
    assert "include LICENSE" in open(os.path.join(ROOT, "MANIFEST.in")).read()
