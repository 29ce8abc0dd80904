"""ignite-amp: a mixed-precision training engine and handlers for PyTorch Ignite.

The names below are imported on first use (PEP 562), so ``import ignite_amp`` and
``ignite-amp --help`` do not pay for importing torch.
"""
import importlib
from typing import TYPE_CHECKING, Any

from ignite_amp.core.exports import lazy_exports, moved_modules
from ignite_amp.core.versions import check_versions
from ignite_amp.version import __version__ as __version__

check_versions()  # an older torch or Ignite than the package serves: one line here, not an AttributeError mid-epoch

if TYPE_CHECKING:  # what type checkers and IDEs see: _EXPORTS's names and types (tests/test_typing.py: the same)
    from ignite_amp.batch_search import find_batch_size as find_batch_size
    from ignite_amp.config.tree import load_config as load_config
    from ignite_amp.engine import create_amp_evaluator as create_amp_evaluator
    from ignite_amp.engine import create_amp_trainer as create_amp_trainer
    from ignite_amp.errors import ConfigError as ConfigError
    from ignite_amp.memory_plan.plan import estimate_memory as estimate_memory
    from ignite_amp.run.compose import train_from_config as train_from_config
    from ignite_amp.run.dtype_probe import probe_cpu_dtype as probe_cpu_dtype
    from ignite_amp.step.evaluate import EvalStep as EvalStep
    from ignite_amp.step.events import AmpEvents as AmpEvents
    from ignite_amp.step.train import AmpStep as AmpStep
    from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks as checkpoint_blocks
    from ignite_amp.transforms.sharding import shard_model as shard_model

# In the order a newcomer looks for them (the API page follows it): the factories first.
_EXPORTS = {
    "create_amp_trainer": "ignite_amp.engine",
    "create_amp_evaluator": "ignite_amp.engine",
    "AmpEvents": "ignite_amp.step.events",
    "AmpStep": "ignite_amp.step.train",
    "EvalStep": "ignite_amp.step.evaluate",
    "ConfigError": "ignite_amp.errors",
    "load_config": "ignite_amp.config.tree",
    "train_from_config": "ignite_amp.run.compose",
    "find_batch_size": "ignite_amp.batch_search",
    "shard_model": "ignite_amp.transforms.sharding",
    "checkpoint_blocks": "ignite_amp.transforms.activation_checkpointing",
    "estimate_memory": "ignite_amp.memory_plan.plan",
    "probe_cpu_dtype": "ignite_amp.run.dtype_probe",
}

# "handlers" is the repository's handlers/ folder, installed as ignite_amp.handlers (setup.cfg package_dir); like
# the others it is imported on first use, so ``import ignite_amp`` stays cheap. Not "configs": package data, read
# through ignite_amp.config.builtin.
_SUBMODULES = ("batch_search", "batching", "cli", "config", "core", "data", "engine", "errors", "files",
               "handlers", "launcher", "memory_plan", "models", "run", "split_check", "step", "transforms",
               "version")

# The 0.2.0 paths the guides documented, moved in 0.3.0: importable (with a DeprecationWarning) until 0.4.0.
_MOVED = {
    "ignite_amp.checkpointing": "ignite_amp.transforms.activation_checkpointing",
    "ignite_amp.sharding": "ignite_amp.transforms.sharding",
    "ignite_amp.float8": "ignite_amp.transforms.float8",
    "ignite_amp.facts": "ignite_amp.step.facts",
    "ignite_amp.auto_checkpoint": "ignite_amp.memory_plan.auto_checkpoint",
    "ignite_amp.device": "ignite_amp.core.device",
    "ignite_amp.handlers.tensorboard_metrics": "ignite_amp.handlers.tensorboard.metrics",
}

__all__ = list(_EXPORTS)
_export, _exported = lazy_exports(__name__, _EXPORTS)
moved_modules(_MOVED, until="0.4.0")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # ignite_amp.config etc. without importing them first
        return importlib.import_module(f"ignite_amp.{name}")
    return _export(name)


def __dir__() -> list:
    return sorted({*_exported(), *_SUBMODULES})
