"""The block rule, defined once: which submodules of a model are its repeated blocks.

Activation checkpointing (:mod:`ignite_amp.transforms.activation_checkpointing`) and FSDP2 sharding
(:mod:`ignite_amp.transforms.sharding`) both work block by block, and on the same blocks.
"""
from typing import List, Optional, Sequence, Tuple

from torch import nn

__all__ = ["block_names"]


def block_names(model: nn.Module, blocks: Optional[Sequence[str]] = None) -> List[str]:
    """The submodules checkpointed and sharded one by one, outermost first, as module paths.

    ``blocks``: class names (``["TransformerEncoderLayer"]``): every submodule of one of these
    classes that is not inside another. ``None``: the repeated blocks, i.e. the children of an
    ``nn.ModuleList`` or ``nn.Sequential`` that come in runs of two or more in a row of one class, each
    holding parameters (a transformer's layers, a ResNet stage's residual blocks, the six blocks between
    a stem and a head in one ``nn.Sequential``); in such a mixed container a run of stages (containers
    that hold runs of blocks themselves) is not one: the blocks inside them are.

    >>> from torch import nn
    >>> block = lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> model = nn.Sequential(nn.Linear(2, 4), *[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)],
    ...                       nn.ReLU(), nn.Linear(4, 1))
    >>> block_names(model)
    ['1', '2', '3']
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.f = nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         return x + self.f(x)
    >>> block_names(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), *[Block() for _ in range(3)], nn.Linear(4, 1)))
    ['2', '3', '4']
    """
    chosen: List[str] = []

    def inside(name: str) -> bool:
        return any(name.startswith(parent + ".") for parent in chosen)

    if blocks is not None:
        wanted = set(blocks)
        known = {type(m).__name__ for m in model.modules()}
        missing = sorted(wanted - known)
        if missing:
            raise ValueError(f"blocks: the model has no submodule of class {', '.join(map(repr, missing))}")
        for name, module in model.named_modules():
            if name and type(module).__name__ in wanted and not inside(name):
                chosen.append(name)
        return chosen
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or inside(name):
            continue
        prefix = f"{name}." if name else ""
        chosen.extend(f"{prefix}{child}" for child in _runs(list(module.named_children())))
    return chosen


def _runs(children: List[Tuple[str, nn.Module]]) -> List[str]:
    """The names of the children in runs of two or more in a row of one class holding parameters; in a mixed
    container, a run of stages (containers holding runs of blocks themselves) is not one."""
    found: List[str] = []
    start = 0
    for end in range(1, len(children) + 1):
        if end < len(children) and type(children[end][1]) is type(children[start][1]):
            continue
        run = children[start:end]
        # in a mixed container, containers that hold runs of blocks themselves are stages: their blocks count
        stage = len(run) < len(children) and any(isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) and
                                                 _runs(list(m.named_children())) for _, m in run)
        if len(run) >= 2 and not stage and all(any(True for _ in m.parameters()) for _, m in run):
            found.extend(n for n, _ in run)
        start = end
    return found
