"""Sphinx directives that generate the reference pages from the code, so that none is kept by hand.

- ``public-api MODULE`` documents every name of ``MODULE.__all__`` (or ``:names:``) with autodoc.
- ``config-reference`` lists every config key from the declarations that make the JSON Schema:
  its type, default, resume rule and doc, one table per section, then every default as YAML.
- ``cli-reference`` prints the help of the ``ignite-amp`` parser and of each of its commands.
"""
import argparse
import dataclasses
import importlib
import inspect
import json

import yaml
from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


class _Generated(SphinxDirective):
    """A directive whose body is reStructuredText written by :meth:`lines`."""

    def lines(self) -> list:
        raise NotImplementedError

    def run(self) -> list:
        node = nodes.section()
        node.document = self.state.document
        source = self.get_source_info()[0]
        nested_parse_with_titles(self.state, StringList(self.lines(), source=source), node)
        return node.children


def public_names(module_name: str) -> list:
    """The names a module exports, in its own order."""
    return list(importlib.import_module(module_name).__all__)


class PublicApi(_Generated):
    required_arguments = 1
    option_spec = {"names": directives.unchanged}

    def lines(self) -> list:
        module_name = self.arguments[0]
        module = importlib.import_module(module_name)
        names = self.options["names"].split() if "names" in self.options else public_names(module_name)
        out = []
        for name in names:
            obj = getattr(module, name)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                out += [f".. autoexception:: {module_name}.{name}", ""]
            elif inspect.isclass(obj):
                out += [f".. autoclass:: {module_name}.{name}", "   :members:", "   :undoc-members:"]
                if any(base.__module__.startswith("ignite_amp.") for base in obj.__mro__[1:]):
                    out.append("   :inherited-members:")  # an internal base's members (StepBase's) are the class's
                out.append("")
            elif callable(obj):
                out += [f".. autofunction:: {module_name}.{name}", ""]
            else:
                out += [f".. autodata:: {module_name}.{name}", "   :annotation:", ""]
        return out


def _cell(text: str) -> str:
    """Plain text as one reStructuredText table cell (its markup characters escaped)."""
    text = " ".join(str(text).split())
    for char in "\\*`|_<>":
        text = text.replace(char, "\\" + char)
    return text or " "


def _default(value) -> str:
    return "``" + json.dumps(value) + "``"


class ConfigReference(_Generated):
    def lines(self) -> list:
        from ignite_amp.config.tree import Config, default_config

        out = []
        self._section(Config, "", out)
        out += ["All defaults", "-" * 12, "", "Every key with its default, as a config file:", "",
                ".. code-block:: yaml", ""]
        text = yaml.safe_dump(default_config(), sort_keys=False, default_flow_style=False)
        out += ["   " + line for line in text.splitlines()] + [""]
        return out

    def _section(self, cls, prefix: str, out: list) -> None:
        from ignite_amp.core.config_keys import defaults_of

        fields = dataclasses.fields(cls)
        settings = [f for f in fields if "section" not in f.metadata]
        if settings:
            title = f"``{prefix.rstrip('.')}``" if prefix else "Top level"
            doc = (cls.__doc__ or "").strip() if prefix else "Keys at the top of the file."
            out += [title, "-" * len(title), "", _cell(doc), "",
                    ".. list-table::", "   :header-rows: 1", "   :widths: 26 14 12 48", "",
                    "   * - key", "     - default", "     - on resume", "     - what it does (and what it takes)"]
            for f in settings:
                meta = f.metadata
                out += [f"   * - ``{prefix}{f.name}``", f"     - {_default(defaults_of(f))}",
                        f"     - {meta['resume']}", f"     - {_cell(meta['doc'])} *({_cell(meta['check'].what)})*"]
            out.append("")
        for f in fields:
            if "section" in f.metadata:
                self._section(f.metadata["section"], f"{prefix}{f.name}.", out)


class CliReference(_Generated):
    def lines(self) -> list:
        from ignite_amp.cli.main import build_parser

        parser = build_parser()
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        out = []
        for name, command in [("ignite-amp", parser)] + [(f"ignite-amp {n}", s) for n, s in subparsers.choices.items()]:
            # argparse wraps the help to the terminal's width: a fixed one, whatever the terminal building the docs
            command.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
            title = f"``{name}``"
            out += [title, "-" * len(title), "", ".. code-block:: text", ""]
            out += ["   " + line for line in command.format_help().splitlines()] + [""]
        return out


def _aliases() -> dict:
    """Where each documented public name is defined (``ignite_amp.engine.create_amp_trainer``) -> the
    name it is documented under (``ignite_amp.create_amp_trainer``), so docstrings may link either."""
    out = {}
    for module_name in ("ignite_amp", "ignite_amp.handlers", "ignite_amp.batch_search"):
        module = importlib.import_module(module_name)
        for name in public_names(module_name):
            obj = getattr(module, name)
            if hasattr(obj, "__module__") and hasattr(obj, "__qualname__"):
                out[f"{obj.__module__}.{obj.__qualname__}"] = f"{module_name}.{name}"
    return out


def resolve_alias(app, env, node, contnode):
    """A reference to a public name by the module that defines it resolves to its documented entry."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    module = node.get("py:module")
    aliases = getattr(app.env, "ignite_amp_aliases", None)
    if aliases is None:
        aliases = app.env.ignite_amp_aliases = _aliases()
    for candidate in [target] + ([f"{module}.{target}"] if module else []):
        for defined, documented in aliases.items():
            if candidate == defined or candidate.startswith(defined + "."):
                new = documented + candidate[len(defined):]
                return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"], new,
                                                         node, contnode)
    return None


def _attribute_docstring_is_prose(self) -> list:
    """Napoleon reads the first line of a property's docstring as ``type: description``; ours are prose
    that often hold a colon, and their types are the annotations. Keep the whole docstring as prose."""
    return self._format_field("", "", self._dedent(self._consume_to_end()))


def setup(app):
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    GoogleDocstring._parse_attribute_docstring = _attribute_docstring_is_prose
    app.connect("missing-reference", resolve_alias)
    app.add_directive("public-api", PublicApi)
    app.add_directive("config-reference", ConfigReference)
    app.add_directive("cli-reference", CliReference)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
