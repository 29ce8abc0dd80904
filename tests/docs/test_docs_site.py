"""The documentation site as a reader gets it: ``sphinx-build -W --keep-going`` (the README's command) builds it
with no warning, every public name has a docstring and an entry in the API reference, every config key and CLI
command is on its reference page, and (in headless Chromium, when installed) the API page and the offline search
work from the built files."""
import inspect
import os
import subprocess
import sys
import urllib.parse

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.docs]


PUBLIC = ("ignite_amp", "ignite_amp.handlers")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built as the README says, into a temporary folder; its build log."""
    out = tmp_path_factory.mktemp("site") / "html"
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "docs", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc.stderr


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_site_builds_without_a_warning(site):
    out, log = site
    assert "WARNING" not in log and "ERROR" not in log, log
    pages = [p for p in out.rglob("*.html") if "_static" not in p.parts]
    assert len(pages) >= 15 and (out / "guides" / "getting-started.html").exists()


def public_names():
    """(documented name, object) of every name the public modules export."""
    import importlib

    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            yield f"{module_name}.{name}", getattr(module, name)


def own_members(cls):
    """(member name, value, defining class) of the public attributes ``cls`` and its ignite_amp bases define."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("ignite_amp"):
            for member, value in vars(klass).items():
                if not member.startswith("_"):
                    yield member, value, klass


def public_classes():
    for name, obj in public_names():
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            yield name, obj


def public_objects():
    """(documented name, object) of every public name, and of the public methods and properties of its class."""
    yield from public_names()
    for name, cls in public_classes():
        for member, value, _ in own_members(cls):
            if callable(value) or isinstance(value, property):
                yield f"{name}.{member}", value


def test_every_public_name_and_member_has_a_docstring():
    missing = [name for name, obj in public_objects() if not (inspect.getdoc(obj) or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"


def test_every_public_class_constant_has_a_doc_comment():
    """A class attribute that is data (``BestCheckpoint.LAST_PREFIX``) is documented by a ``#:`` comment above it."""
    from sphinx.pycode import ModuleAnalyzer

    missing = []
    for name, cls in public_classes():
        for member, value, klass in own_members(cls):
            if callable(value) or isinstance(value, (property, staticmethod, classmethod)):
                continue
            if member in getattr(cls, "__members__", {}):  # enum members: the class docstring documents them
                continue
            if (klass.__qualname__, member) not in ModuleAnalyzer.for_module(klass.__module__).find_attr_docs():
                missing.append(f"{name}.{member}")
    assert not missing, f"class constants without a #: doc comment: {missing}"


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_every_public_name_is_in_the_api_reference(site):
    from sphinx.util.inventory import InventoryFile

    out, _ = site
    with open(out / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", os.path.join)
    documented = {name for kind in inventory for name in inventory[kind]}
    missing = [name for name, obj in public_objects() if name not in documented]
    assert not missing, f"public names missing from the API reference: {missing}"


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_config_reference_lists_every_key_with_its_doc(site):
    from ignite_amp.config.tree import Config
    from ignite_amp.core.config_keys import leaves

    out, _ = site
    page = (out / "reference" / "config.html").read_text(encoding="utf-8")
    for path, f in leaves(Config):
        assert f.metadata["doc"].strip(), path
        assert f"<span class=\"pre\">{path}</span>" in page, path


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_cli_reference_shows_every_command(site):
    from ignite_amp.cli.main import build_parser

    out, _ = site
    page = (out / "reference" / "cli.html").read_text(encoding="utf-8")
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert len(commands) >= 4
    for name in commands:
        assert f"usage: ignite-amp {name}" in page, name
        for action in commands[name]._actions:
            for option in action.option_strings:
                assert option in page, (name, option)


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_api_page_and_the_offline_search_in_a_browser(site, browser):
    out, _ = site
    browser.open((out / "reference" / "api.html").as_uri() + "#ignite_amp.create_amp_trainer")
    signature = browser.wait_for("const el = document.getElementById('ignite_amp.create_amp_trainer');"
                                 "return el && el.textContent;")
    assert "create_amp_trainer(" in signature and "accumulation_steps" in signature
    query = urllib.parse.urlencode({"q": "OOMBackoff"})
    browser.open((out / "search.html").as_uri() + "?" + query)  # file://: no server, no network
    found = browser.wait_for("const items = document.querySelectorAll('#search-results li a');"
                             "return items.length ? Array.from(items).map(a => a.getAttribute('href')) : null;")
    assert any("reference/handlers.html" in href for href in found), found
