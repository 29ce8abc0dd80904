"""The block rule, defined once: which submodules of a model are its repeated blocks.

Activation checkpointing (:mod:`ignite_amp.checkpointing`) and FSDP2 sharding
(:mod:`ignite_amp.sharding`) both work block by block, and on the same blocks.
"""
from typing import List, Optional, Sequence

from torch import nn

__all__ = ["block_names"]


def block_names(model: nn.Module, blocks: Optional[Sequence[str]] = None) -> List[str]:
    """The submodules checkpointed and sharded one by one, outermost first, as module paths.

    ``blocks``: class names (``["TransformerEncoderLayer"]``): every submodule of one of these
    classes that is not inside another. ``None``: the repeated blocks, i.e. each child of an
    ``nn.ModuleList`` or ``nn.Sequential`` whose two or more children all share one class and hold
    parameters (a transformer's layers, a ResNet stage's residual blocks).
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
        children = list(module.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and \
                all(any(True for _ in c.parameters()) for c in children):
            prefix = f"{name}." if name else ""
            chosen.extend(f"{prefix}{child}" for child, _ in module.named_children())
    return chosen
