"""What a loss function says of itself: the label value it ignores (read by the step's padding warning and by the
split check's diagnosis, each in its own layer)."""
import functools
from typing import Callable, Optional

__all__ = ["ignore_index_of"]


def ignore_index_of(loss_fn: Optional[Callable]) -> Optional[int]:
    """The label value ``loss_fn`` ignores, where it says: an ``ignore_index`` attribute (``nn.CrossEntropyLoss``,
    ``nn.NLLLoss``) or keyword (``functools.partial(cross_entropy, ignore_index=255)``); else None.

    Example:
        >>> import torch
        >>> ignore_index_of(torch.nn.CrossEntropyLoss(ignore_index=255)), ignore_index_of(torch.nn.MSELoss())
        (255, None)
    """
    value = getattr(loss_fn, "ignore_index", None)
    if value is None and isinstance(loss_fn, functools.partial):
        value = loss_fn.keywords.get("ignore_index")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
