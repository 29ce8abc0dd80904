"""The oldest torch and Ignite the package serves, checked once at ``import ignite_amp`` (one line, not mid-epoch).

The floors are setup.cfg's (``tests/core/test_versions.py`` keeps the two equal) and the ones CI runs
(``.ci/constraints-oldest.txt``, run by ``.ci/versions``). The installed versions are read from the packages'
metadata, so the check does not import torch: ``ignite-amp --help`` stays fast. A package without metadata (a
source build) is not judged here.
"""
import re
from importlib import metadata
from typing import Dict, Optional, Tuple

__all__ = ["FLOORS", "check_versions", "release"]

#: distribution name -> the oldest release (major, minor[, micro]) the package runs on
FLOORS: Dict[str, Tuple[int, ...]] = {"torch": (2, 11), "pytorch-ignite": (0, 5, 2)}


def release(version: str) -> Tuple[int, ...]:
    """The release numbers of a version string: ``"2.11.0a0+nv25.3"`` -> ``(2, 11, 0)`` (a pre-release of 2.11
    counts as 2.11: the GPU images build torch from a pre-release tag)."""
    found = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in found.group(0).split(".")) if found else ()


def _installed(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions() -> None:
    """Raise ImportError, in one line naming the release needed, where torch or Ignite is older than the floor."""
    for name, floor in FLOORS.items():
        found = _installed(name)
        if found is not None and release(found) < floor:
            need = ".".join(map(str, floor))
            raise ImportError(f"ignite-amp needs {name}>={need}, found {name} {found}: "
                              f"pip install --upgrade '{name}>={need}'")
