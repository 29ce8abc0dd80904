"""The speed defaults of a config run (issue 51): what ``auto`` chose for the memory format, the optimizer step and
the loader's workers, and why, and whether batches are prefetched to the GPU: for the start line and the run facts.

Each choice is its own rule (:mod:`ignite_amp.transforms.memory_format`, :mod:`ignite_amp.run.fused`,
:mod:`ignite_amp.data.workers`, :mod:`ignite_amp.data.prefetch`); this module applies them to a config and says
them in one place.
"""
from typing import Any, Dict, Iterable, Optional

import torch

from ignite_amp.config.tree import Config
from ignite_amp.data.datasets import data_workers
from ignite_amp.data.device_batches import DeviceBatches
from ignite_amp.data.prefetch import DevicePrefetcher
from ignite_amp.run.fused import fused_choice
from ignite_amp.run.plan import RunPlan, Settled
from ignite_amp.transforms.memory_format import ChannelsLastChoice, choose_channels_last

__all__ = ["config_channels_last", "speed_choices", "speed_facts", "SPEED_FACTS", "speed_words", "start_speed_words"]

#: The run facts of the speed defaults, in the order the facts list them.
SPEED_FACTS = ("data_on_device", "channels_last", "channels_last_why", "fused_optimizer", "fused_optimizer_why",
               "num_workers", "num_workers_why", "prefetch")


def config_channels_last(cfg: Config, model: torch.nn.Module, device: torch.device) -> ChannelsLastChoice:
    """``amp.channels_last`` for the config's model on ``device``; ``auto`` is off under FSDP2 (which shards
    contiguous parameters only; an explicit true is refused there by the config's check)."""
    requested = cfg.amp.channels_last
    if requested == "auto" and cfg.distributed.sharded:
        return ChannelsLastChoice(False, "auto: off under distributed.strategy fsdp (contiguous shards only)")
    return choose_channels_last(requested, model, device)


def speed_choices(cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  device: torch.device, loader: Optional[Iterable] = None) -> Dict[str, Settled]:
    """The speed defaults a run settled (:meth:`ignite_amp.run.plan.RunPlan.settle`): each value that ran, and why
    (empty where the config gave it). ``loader``: the run's training loader; batches cut on the device
    (``data.on_device``) take no workers, ``prefetch``: it copies the next batch to the device on a side stream."""
    layout = config_channels_last(cfg, model, device)
    fused = fused_choice(cfg.optimizer.name, cfg.optimizer.kwargs, device, sharded=cfg.distributed.sharded)
    workers = data_workers(cfg.data, device)
    on_device = isinstance(loader, DeviceBatches)
    if on_device:
        workers = workers._replace(workers=0, why=f"data on the {'GPU' if device.type == 'cuda' else device.type}")
    return {"data_on_device": Settled(on_device), "channels_last": Settled(layout.on, layout.why),
            "fused_optimizer": Settled(any(bool(group.get("fused")) for group in optimizer.param_groups), fused.why),
            "num_workers": Settled(workers.workers, workers.why),
            "prefetch": Settled(isinstance(loader, DevicePrefetcher) and loader.prefetches)}


def speed_facts(cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                device: torch.device, loader: Optional[Iterable] = None) -> Dict[str, Any]:
    """:func:`speed_choices` as the run facts name them (``num_workers``, ``num_workers_why``, ...)."""
    plan = RunPlan(cfg, device, 1, None).settle(**speed_choices(cfg, model, optimizer, device, loader))
    return {k: v for k, v in plan.facts().items() if k in SPEED_FACTS}


def speed_words(facts: Dict[str, Any], optimizer_name: str) -> str:
    """The start line's words for :func:`speed_facts`:
    ``channels_last off (auto: ...), AdamW step unfused (...), 0 loader workers (auto: ...)``, and on CUDA
    ``, prefetch to GPU on a side stream``."""
    def why(key: str) -> str:
        return f" ({facts[key]})" if facts.get(key) else ""

    workers = facts["num_workers"]
    return (f"channels_last {'on' if facts['channels_last'] else 'off'}{why('channels_last_why')}, "
            f"{optimizer_name} step {'fused' if facts['fused_optimizer'] else 'unfused'}{why('fused_optimizer_why')}, "
            f"{workers} loader worker{'' if workers == 1 else 's'}{why('num_workers_why')}"
            f"{', prefetch to GPU on a side stream' if facts.get('prefetch') else ''}")


def start_speed_words(facts: Dict[str, Any], optimizer_name: str, on_gpu: bool) -> str:
    """The start line's short form of :func:`speed_words`: the values without their reasons (the run facts and
    train.log hold those), and off a GPU only what is on (loader workers, channels_last, a fused step):
    ``channels_last on, AdamW step fused, 4 loader workers, prefetch to GPU``, ``2 loader workers`` or ``""``."""
    words = []
    if on_gpu or facts["channels_last"]:
        words.append(f"channels_last {'on' if facts['channels_last'] else 'off'}")
    if on_gpu or facts["fused_optimizer"]:
        words.append(f"{optimizer_name} step {'fused' if facts['fused_optimizer'] else 'unfused'}")
    workers = facts["num_workers"]
    if on_gpu or workers:
        words.append(f"{workers} loader worker{'' if workers == 1 else 's'}")
    if facts.get("prefetch"):
        words.append("prefetch to GPU")
    return ", ".join(words)
