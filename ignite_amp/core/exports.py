"""A folder's public names in its ``__init__``, imported on first use (PEP 562).

``from ignite_amp.step import AmpStep`` reaches the class that ``ignite_amp.step.train`` defines, as
``from ignite.engine import Engine`` reaches ``ignite.engine.engine.Engine``; the module is imported only
when the name is first used, so a package's ``__init__`` adds no import and no import circle.

A module that moved keeps its old path for a release (:func:`moved_modules`): ``import`` of the old path warns
(``DeprecationWarning`` naming the new one) and gives the module at the new path.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["lazy_exports", "moved_modules"]


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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of moved modules (after every other finder: a file of that name would win) and
    loads each as the module at its new path, with a ``DeprecationWarning`` at the importing line."""

    def __init__(self, moved: Dict[str, str], until: str):
        self.moved, self.until = moved, until

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.moved else None

    def create_module(self, spec: Any) -> None:
        return None  # a placeholder module: exec_module puts the new one in its place

    def exec_module(self, module: Any) -> None:
        old, new = module.__name__, self.moved[module.__name__]
        warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in {self.until})",
                      DeprecationWarning, stacklevel=2)  # warnings skips the import system's frames
        sys.modules[old] = importlib.import_module(new)  # the import statement returns this entry


def moved_modules(moved: Dict[str, str], until: str) -> None:
    """Keep each old module path of ``moved`` (old -> new full name) importable until version ``until``: the
    new module, with a ``DeprecationWarning`` naming it. Installed once, for the package's lifetime."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules(dict(moved), until))
