"""Nested config values (dicts and lists) walked without recursion, in time linear in what is written.

YAML aliases let a 1 KB file name the same mapping many times over: twelve levels of ten aliases
is 10**12 values once expanded, which Python's ``==``, ``str`` or ``json.dumps`` would visit one by
one (for hours, in C code that a SIGTERM does not interrupt). Here each shared value is visited
once: :func:`check_tree` refuses a tree that expands past a size or depth (or refers to itself),
:func:`same` compares two trees, and :func:`brief` shows one in a bounded line.
"""
import reprlib
from typing import Any, Dict, List, Tuple

from ignite_amp.errors import ConfigError

__all__ = ["MAX_VALUES", "MAX_DEPTH", "check_tree", "same", "brief"]

MAX_VALUES = 100_000  # a config is a page of values; 10x the largest shipped model's kwargs is still far below
MAX_DEPTH = 64  # levels of nesting (a 3,000-level --set key path is a mistake, and recursion would fail on it)

_CONTAINERS = (dict, list, tuple)


def _children(node: Any) -> list:
    return list(node.values()) if isinstance(node, dict) else list(node)


def _measure(root: Any, where: str) -> Dict[int, Tuple[int, int]]:
    """``id(container) -> (values once expanded, depth)`` for every container under ``root``."""
    sizes: Dict[int, Tuple[int, int]] = {}
    active = set()
    stack: List[Tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            active.discard(key)
            values, depth = 1, 0
            for kid in _children(node):
                kid_values, kid_depth = sizes[id(kid)] if isinstance(kid, _CONTAINERS) else (1, 0)
                values, depth = values + kid_values, max(depth, kid_depth + 1)
            sizes[key] = (values, depth)
        elif key not in sizes:
            if key in active:
                raise ConfigError(f"{where}: a YAML alias refers to a value that contains it (an endless value)")
            active.add(key)
            stack.append((node, True))
            stack.extend((kid, False) for kid in _children(node) if isinstance(kid, _CONTAINERS))
    return sizes


def check_tree(root: Any, where: str = "config", max_values: int = MAX_VALUES, max_depth: int = MAX_DEPTH) -> None:
    """Refuse (one-line ConfigError) a value that, with its aliases expanded, holds more than ``max_values``
    values or nests deeper than ``max_depth``, naming the key path where it does."""
    if not isinstance(root, _CONTAINERS):
        return
    sizes = _measure(root, where)
    values, depth = sizes[id(root)]
    if values <= max_values and depth <= max_depth:
        return
    over = (lambda n: sizes[id(n)][0] > max_values) if values > max_values else (lambda n: sizes[id(n)][1] > max_depth)
    path, node = [] if where == "config" else [where], root
    while isinstance(node, dict) and len(path) < 6:  # down the mapping keys that hold the excess
        inside = [(k, v) for k, v in node.items() if isinstance(v, _CONTAINERS) and over(v)]
        if len(inside) != 1:
            break
        path.append(str(inside[0][0]))
        node = inside[0][1]
    name = ".".join(path) or "config"
    if values > max_values:
        raise ConfigError(f"{name}: expands to {sizes[id(node)][0]:,} values through YAML aliases (the limit is "
                          f"{max_values:,}); write the value out or alias less")
    raise ConfigError(f"{name}: nested {depth} levels deep (the limit is {max_depth}); flatten the value")


def same(a: Any, b: Any) -> bool:
    """``a == b`` for nested dicts and lists, visiting each pair of shared values once."""
    seen = set()
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if x is y:
            continue
        if isinstance(x, _CONTAINERS) or isinstance(y, _CONTAINERS):
            kind = dict if isinstance(x, dict) else type(x)
            if not isinstance(y, kind) or len(x) != len(y) or (kind is dict and x.keys() != y.keys()):
                return False
            if (id(x), id(y)) in seen:
                continue
            seen.add((id(x), id(y)))
            if kind is dict:
                stack.extend((x[k], y[k]) for k in x)
            else:
                stack.extend(zip(x, y, strict=True))
        elif x != y:
            return False
    return True


_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxdict, _brief.maxlist, _brief.maxstring, _brief.maxother = 3, 6, 6, 60, 60


def brief(value: Any) -> str:
    """``str(value)`` for a scalar; a container's repr cut to a few levels and items (a bounded line)."""
    return _brief.repr(value) if isinstance(value, _CONTAINERS) else str(value)
