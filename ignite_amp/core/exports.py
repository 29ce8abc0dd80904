"""A folder's public names in its ``__init__``, imported on first use (PEP 562).

``from ignite_amp.step import AmpStep`` reaches the class that ``ignite_amp.step.train`` defines, as
``from ignite.engine import Engine`` reaches ``ignite.engine.engine.Engine``; the module is imported only
when the name is first used, so a package's ``__init__`` adds no import and no import circle.
"""
import importlib
import sys
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__``; ``exports`` maps each public name to the
    module (full name) that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # once: later lookups do not come here
        return value

    def __dir__() -> List[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
