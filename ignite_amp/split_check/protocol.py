"""What the split check reads of a step: :class:`CheckedStep`, a structural type (``AmpStep`` is one, which the
type checker confirms where the step hands itself to its check). The check imports nothing of ``ignite_amp.step``:
the step sits above it and builds it."""
from typing import Any, Callable, List, Optional, Protocol, Tuple

import torch
from torch import nn

from ignite_amp.transforms.float8 import Float8Report

__all__ = ["CheckedStep"]


class CheckedStep(Protocol):
    """A training step as the split check sees it: its settings and hooks (read, never set), the batch counted and
    cut as the step counts and cuts it, and one call that tells the step the check ran passes of its own."""

    @property
    def module(self) -> nn.Module:
        """The model without its DDP wrapper: what the check differentiates."""

    @property
    def device(self) -> torch.device: ...

    @property
    def batch_size(self) -> int:
        """Samples in the batch in progress."""

    @property
    def micro_batches(self) -> int: ...

    @property
    def oom_count(self) -> int: ...

    @property
    def float8(self) -> Optional[Float8Report]: ...

    @property
    def fsdp(self) -> Any:
        """The FSDP2 model, or None (the check does not run on one)."""

    @property
    def loss_fn(self) -> Callable: ...

    @property
    def num_items(self) -> Optional[Callable[[Any, Any], Any]]: ...

    @property
    def model_fn(self) -> Callable[[nn.Module, Any], Any]: ...

    @property
    def model_transform(self) -> Callable[[Any], Any]: ...

    @property
    def split_batch(self) -> Callable[[Any, Any, int], list]:
        """The step's ``split_batch`` hook (``ignite_amp.batching.split_batch`` by default)."""

    def count_samples(self, x: Any, y: Any) -> int:
        """The samples of a prepared ``(x, y)``, by the step's ``batch_size`` hook."""

    def split(self, x: Any, y: Any, n: int, chunks: int) -> List[Tuple[Any, Any]]:
        """``(x, y)`` of ``n`` samples cut into ``chunks`` ``(x, y)`` pieces, as the step cuts a batch."""

    def note_extra_pass(self) -> None:
        """The check ran a forward and backward of its own in this iteration (a FLOP count skips it)."""
