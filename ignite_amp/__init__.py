"""ignite-amp: a mixed-precision training engine and handlers for PyTorch Ignite."""
from ignite_amp.batch_size import find_batch_size
from ignite_amp.config import ConfigError, load_config
from ignite_amp.events import AmpEvents
from ignite_amp.step import AmpStep, EvalStep, create_amp_evaluator, create_amp_trainer

__version__ = "0.1.0"

__all__ = [
    "AmpEvents",
    "AmpStep",
    "EvalStep",
    "ConfigError",
    "create_amp_trainer",
    "create_amp_evaluator",
    "load_config",
    "train_from_config",
    "find_batch_size",
]



def train_from_config(cfg, **kwargs):
    """Build everything a config describes and train; see :func:`ignite_amp.run.train_from_config`.

    Imported when called: ``ignite_amp.run`` imports ``handlers``, which import ``ignite_amp.events``.
    """
    from ignite_amp.run import train_from_config as run

    return run(cfg, **kwargs)
