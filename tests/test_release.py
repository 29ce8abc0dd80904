"""What a user installs is built, checked and tried the way it ships: one version, a changelog that names it, and
a CI that builds the sdist and the wheel, checks them and trains from the wheel outside the checkout."""
import configparser
import os
import re
import shutil
import subprocess

import pytest

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
    for release in re.split(r"^## ", CHANGELOG, flags=re.M)[1:]:  # each heading once per release (merged, not two)
        kinds = re.findall(r"^### (.+)$", release, re.M)
        assert len(kinds) == len(set(kinds)), (release.splitlines()[0], kinds)


# git's conflict markers: 7 characters at the start of a line, the sides' names after a space. A line of 7 "="
# alone is also an RST or Markdown underline: it counts only in a file that holds a start or end marker too.
_SIDE = re.compile(r"^(?:<{7}|>{7}|\|{7})(?: |$)", re.M)
_MIDDLE = re.compile(r"^={7}$", re.M)


def conflict_markers(text: str) -> list:
    """The line numbers of merge-conflict markers in ``text``."""
    lines = [m.start() for m in _SIDE.finditer(text)]
    if lines:
        lines += [m.start() for m in _MIDDLE.finditer(text)]
    return sorted(text.count("\n", 0, at) + 1 for at in lines)


def test_conflict_markers_are_found_and_underlines_are_not():
    assert conflict_markers("a\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> issue-50\nb\n") == [2, 4, 6]
    assert conflict_markers("Title\n=======\n\n<<<<<<<< eight\n>>>>>>>x\n") == []  # an underline; not markers


@pytest.mark.skipif(not (os.path.isdir(os.path.join(ROOT, ".git")) or os.path.isfile(os.path.join(ROOT, ".git")))
                    or shutil.which("git") is None, reason="not a git checkout")
def test_no_tracked_file_holds_a_merge_conflict_marker():
    """A merge left half done (CHANGELOG.md's Unreleased section held both sides once) fails here, whatever the
    file's kind; .ci/lint refuses the same markers."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    found = {}
    for name in names.decode().split("\0"):
        path = os.path.join(ROOT, name)
        if not name or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" not in data:  # text only
            lines = conflict_markers(data.decode("utf-8", "replace"))
            if lines:
                found[name] = lines
    assert not found, f"merge-conflict markers (file: lines): {found}"


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
