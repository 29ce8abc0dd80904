"""The batch-size search for a config: its model, dtype, input shape and evaluation batch.

:func:`search_built` serves a run being built with ``data.batch_size: auto``;
:func:`search_config` serves ``ignite-amp find-batch-size`` (it builds the model first).
"""
import ignite.distributed as idist
import torch

from ignite_amp.batch_search import find_batch_size, print_progress
from ignite_amp.config.tree import Config
from ignite_amp.core.collectives import per_process
from ignite_amp.errors import ConfigError
from ignite_amp.models import build_model
from ignite_amp.run.builders import build_optimizer, checkpoint_activations, config_device, input_shape, seed_everything

__all__ = ["search_built", "search_config", "search_line"]


def search_built(cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, objective: str = "largest", progress: bool = False):
    """Run :func:`~ignite_amp.batch_search.find_batch_size` for a config's model, dtype, input shape and
    evaluation batch; returns its :class:`~ignite_amp.batch_search.BatchSizeResult` (the size per
    process, the trials, ``.table``). ``progress``: rank 0 prints each trial on stderr."""
    if device.type != "cuda":
        raise ConfigError(f"data.batch_size: the batch-size search needs a GPU, and this run is on {device}")
    shape, classes = input_shape(cfg.data), cfg.model.num_classes

    def make_batch(n: int):
        return (torch.randn(n, *shape, device=device), torch.randint(0, classes, (n,), device=device))

    amp = cfg.amp
    world, eval_batch = idist.get_world_size(), cfg.data.eval_batch_size
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = amp.cudnn_benchmark  # the run's convolution algorithms and workspaces
    try:
        return find_batch_size(model, optimizer, torch.nn.functional.cross_entropy, make_batch, device=device,
                               dtype=amp.dtype, channels_last=amp.channels_last,
                               fp32_modules=amp.fp32_modules, float8_recipe=amp.float8_recipe,
                               compile=amp.compile, objective=objective,
                               eval_batch_size=per_process(eval_batch, world) if eval_batch else None,
                               progress=print_progress if progress and idist.get_rank() == 0 else None)
    finally:
        torch.backends.cudnn.benchmark = previous


def search_config(cfg: Config, objective: str = "largest", progress: bool = False):
    """``ignite-amp find-batch-size``: builds the config's model and optimizer and searches;
    ``(result, device name, processes)``, the size per process."""
    device = config_device(cfg)
    if device.type != "cuda":
        raise ConfigError(f"the batch-size search needs a GPU; CUDA is not available here ({device})")
    seed_everything(cfg.seed)
    model = build_model(cfg.model.name, cfg.model.num_classes, cfg.model.kwargs)
    checkpoint_activations(cfg, model, device)  # as the run will (its blocks keep only their inputs)
    optimizer = build_optimizer(cfg.optimizer, model, device, sharded=cfg.distributed.sharded)
    result = search_built(cfg, model, optimizer, device, objective, progress)  # the optimizer train builds (fused)
    return result, torch.cuda.get_device_name(device), idist.get_world_size()


def search_line(found, world: int) -> str:
    """The line a run prints after its search: the largest fit, the size used per process, the trials."""
    per_rank = f" per process x {world} processes" if world > 1 else ""
    return (f"batch-size search: largest fit {found.largest_fit}, using {found.batch_size}{per_rank} "
            f"({len(found.trials)} trials; {found.reason})")
