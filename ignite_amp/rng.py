"""Random-number-generator state: Python's and torch's (CPU, and CUDA once it is initialised)."""
import random

import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict:
    """``{"python", "torch"[, "cuda"]}``: plain data that ``torch.load(weights_only=True)`` accepts."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`get_rng_state` returned (also after a round trip through a checkpoint)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
