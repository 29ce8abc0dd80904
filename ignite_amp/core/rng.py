"""Random-number-generator state: Python's and torch's (CPU, and CUDA once it is initialised)."""
import logging
import random
from typing import Any, List, Mapping

import torch
import torch.distributed as dist
from ignite.base.mixins import Serializable

from ignite_amp.core.collectives import is_distributed

__all__ = ["get_rng_state", "set_rng_state", "RNGState"]

logger = logging.getLogger("ignite_amp")


def get_rng_state() -> dict:
    """``{"python", "torch"[, "cuda"]}``: plain data that ``torch.load(weights_only=True)`` accepts."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (also after a round trip through a checkpoint).

    CUDA states are restored for the devices this machine has: a checkpoint from a machine with
    more GPUs restores the first ones and says so in one line; on a machine without CUDA they
    are left out.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    saved = state.get("cuda") or []
    if saved and torch.cuda.is_available():
        count = torch.cuda.device_count()
        for index, cuda_state in enumerate(saved[:count]):
            torch.cuda.set_rng_state(cuda_state, index)
        if len(saved) > count:
            logger.warning("the checkpoint holds the CUDA random states of %d GPUs and this machine has %d: "
                           "restored those of cuda:0 to cuda:%d", len(saved), count, count - 1)


class RNGState(Serializable):
    """Python and torch (CPU and CUDA) random states, so a resumed run draws the same numbers.

    In a process group every rank's states are kept (``ranks``, gathered on every rank: call
    ``state_dict`` on all of them) and each rank gets its own back; resumed on another number of
    processes, every rank starts from rank 0's."""

    _state_dict_all_req_keys = ("python", "torch")

    # ignite's Serializable says OrderedDict; a dict serves (Checkpoint and load_state_dict only read it)
    def state_dict(self) -> dict:  # type: ignore[override]
        state = get_rng_state()
        if is_distributed():
            ranks: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, state)
            state = dict(state, ranks=ranks)
        return state

    def load_state_dict(self, state_dict: Mapping) -> None:
        super().load_state_dict(state_dict)
        ranks = state_dict.get("ranks") or []
        if is_distributed() and len(ranks) == dist.get_world_size():
            state_dict = ranks[dist.get_rank()]
        set_rng_state(state_dict)
