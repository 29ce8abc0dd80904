"""Config YAML read as editors read it: the YAML 1.2 core schema's scalars, on PyYAML.

PyYAML implements YAML 1.1, where ``yes``/``on`` are booleans, ``017`` is octal 15, ``1_000`` is
1000, ``2024-01-01`` is a date and ``1e3`` is the string "1e3". Editors that check a config against
the JSON Schema (the YAML language server) read YAML 1.2, where those are the strings "yes",
"on", "1_000" and "2024-01-01" and the numbers 17 and 1000. A config has one meaning: the loader
reads YAML 1.2 core scalars too (``true``/``false``, ``null``/``~``, decimal, ``0o`` and ``0x``
integers, floats with or without a dot, ``.inf``, ``.nan``), keeps merge keys (``<<``), and
refuses a key written twice in one mapping. :func:`dump` quotes every string that YAML 1.1 *or*
1.2 would read as something else, so a written config means the same to any reader.
"""
import math
import re
from typing import Any, Dict

import yaml

__all__ = ["Loader", "load", "dump"]

# YAML 1.2.2 core schema, tag resolution (10.3.2), in its order: int before float.
_CORE = (
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    ("tag:yaml.org,2002:float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", list("-+.0123456789")),
    ("tag:yaml.org,2002:merge", r"^(?:<<)$", ["<"]),
)


def _int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)  # "017" is 17: the regex let through ASCII digits only


def _float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-").lower()
    if body == ".inf":
        return sign * math.inf
    return math.nan if body == ".nan" else sign * float(body)


class Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader with YAML 1.2 core scalars, refusing a key written twice in one mapping, and a key that is
    a list or a mapping (``? [a, b]``)."""

    yaml_implicit_resolvers: dict = {}

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: Dict[Any, int] = {}  # key -> its line
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:  # "? [a, b]": a list (or mapping) as a key; a config's keys are names
                    what = "mapping" if isinstance(key, dict) else type(key).__name__
                    raise yaml.constructor.ConstructorError(
                        None, None, f"a {what} as a key ({key!r}); a config's keys are names", key_node.start_mark) \
                        from None
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


for _tag, _regexp, _first in _CORE:
    Loader.add_implicit_resolver(_tag, re.compile(_regexp), _first)
Loader.add_constructor("tag:yaml.org,2002:int", _int)
Loader.add_constructor("tag:yaml.org,2002:float", _float)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that also knows YAML 1.2's plain scalars, so it quotes a string either version would not read
    as a string ("1e3", "017", "yes")."""


for _tag, _regexp, _first in _CORE:
    _Dumper.add_implicit_resolver(_tag, re.compile(_regexp), _first)


def load(stream: Any) -> Any:
    """Parse YAML text (or a file) as a config: YAML 1.2 core scalars, duplicate keys refused (``yaml.YAMLError``)."""
    return yaml.load(stream, Loader=Loader)


def dump(data: Any) -> str:
    """YAML text that any YAML 1.1 or 1.2 reader reads back as ``data``."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=False)
