"""Data: the built-in shapes data set, CIFAR and image folders, and their loaders.

The public names live in :mod:`ignite_amp.data.datasets`; ``ignite_amp.data`` is their path.
"""
from ignite_amp.data.datasets import *  # noqa: F401,F403
from ignite_amp.data.datasets import __all__  # noqa: F401
