"""The table of activation checkpointing choices for a config's run (``ignite-amp plan --checkpointing``).

For the config's model and step, at its batch size: none, selective and full checkpointing on a quarter of the blocks
up to all of them, each with its planned peak and recompute (:mod:`ignite_amp.memory_plan.choices`), so a user sees
the trade before running. The model is built as :func:`ignite_amp.run.plan.plan_config` builds it, without
checkpointing (the choices apply their own).
"""
import copy
from typing import List, Optional

import torch

from ignite_amp.errors import ConfigError
from ignite_amp.memory_plan.choices import CheckpointOption, checkpoint_options, options_lines
from ignite_amp.run.builders import config_device
from ignite_amp.run.plan import _make_batch, _model_and_optimizer, _step_kwargs

__all__ = ["config_checkpoint_options", "checkpoint_options_lines"]


def config_checkpoint_options(cfg: dict, batch_size: int) -> List[CheckpointOption]:
    """The choices for ``cfg``'s run at ``batch_size`` per process (``distributed.blocks``, or the repeated blocks);
    empty when the model has no blocks or its step cannot be traced fake."""
    plain = copy.deepcopy(cfg)
    plain["amp"]["activation_checkpointing"] = False
    device = config_device(plain)
    model, optimizer = _model_and_optimizer(plain, device)
    try:
        return checkpoint_options(model, optimizer, torch.nn.functional.cross_entropy, _make_batch(plain), batch_size,
                                  device=device, blocks=plain["distributed"]["blocks"] or None, **_step_kwargs(plain))
    except ValueError as exc:
        raise ConfigError(f"plan: {exc}") from None


def checkpoint_options_lines(options: List[CheckpointOption], batch_size: int,
                             budget: Optional[float] = None) -> List[str]:
    """The table, under a line that says what it is."""
    if not options:
        return ["activation checkpointing choices: none planned: the step cannot be traced fake"]
    if len(options) == 1:
        return ["activation checkpointing choices: the model has no repeated blocks (distributed.blocks names them)"]
    return [f"activation checkpointing choices at batch {batch_size} (first blocks from the input end; recompute: "
            f"the FLOPs checkpointing adds to a step without it)", *options_lines(options, budget=budget)]
