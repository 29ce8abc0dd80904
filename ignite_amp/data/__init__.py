"""Data: the built-in shapes data set, CIFAR and image folders, their loaders and samplers.

The code lives in :mod:`ignite_amp.data.datasets` (with ``image_folder`` and ``passes`` beside it);
``ignite_amp.data`` is its public path: every name of that module is reachable from here, as before
the package had folders.
"""
from typing import Any

from ignite_amp.data.datasets import *  # noqa: F401,F403
from ignite_amp.data.datasets import __all__  # noqa: F401


def __getattr__(name: str) -> Any:
    import ignite_amp.data.datasets as datasets

    try:
        return getattr(datasets, name)
    except AttributeError:
        raise AttributeError(f"module 'ignite_amp.data' has no attribute {name!r}") from None
