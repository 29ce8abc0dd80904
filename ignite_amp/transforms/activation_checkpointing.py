"""Activation checkpointing: a model's repeated blocks keep only their inputs for the backward.

:func:`checkpoint_blocks` makes each block's forward run under non-reentrant
``torch.utils.checkpoint.checkpoint`` (in place: the module tree and its state dict are unchanged, so
a checkpoint of the model loads with or without it). The backward runs each block's forward again
(about one more forward of compute) under the autocast state and the RNG state of the first
(dropout draws the same masks), so gradients are those of the model without it; BatchNorm layers
update their running statistics once, in the forward, as without it.

Two policies: ``"full"`` (``activation_checkpointing=True``) recomputes every op of a block; ``"selective"``
(``activation_checkpointing="selective"``) keeps the outputs of the ops costly to recompute, :data:`SAVED_OPS`
(matmuls, convolutions, attention), and recomputes only the rest (norms, activations, dropout, additions), through
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (as torchtitan's selective checkpointing): more
memory than full, far less recompute.

Order of the model transforms (as torchtitan): float8 conversion, then activation checkpointing,
then FSDP2 sharding (:func:`ignite_amp.transforms.sharding.shard_model`) and ``torch.compile``: checkpointing
wraps the blocks' forwards as they will compute, and sharding and compile then see the wrapped
blocks (FSDP2 gathers a block's parameters again for its recompute; compile traces the checkpoint).
"""
import contextlib
import functools
import logging
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch.utils.checkpoint
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ignite_amp.transforms.blocks import block_names

__all__ = ["checkpoint_blocks", "checkpoint_modules", "checkpointed_blocks", "checkpoint_policies", "describe_blocks",
           "suspended", "POLICIES", "SAVED_OPS"]

logger = logging.getLogger("ignite_amp")
_MARK = "_ignite_amp_checkpointed"  # the block's policy
#: The checkpointing policies: every op of a block recomputed, or all but :data:`SAVED_OPS`.
POLICIES = ("full", "selective")
#: The ops (``torch.ops.aten`` names, every overload) whose outputs ``"selective"`` checkpointing keeps for the
#: backward: those whose recompute costs the most per byte kept. The rest of a block is recomputed.
SAVED_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",  # matmuls: nn.Linear, attention's products, float8's matmul
    "convolution", "_convolution", "cudnn_convolution", "convolution_overrideable",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
    "max",  # float8's scales are absolute maxima (a scalar each; torchtitan keeps them too)
)


@functools.lru_cache(maxsize=None)
def _saved_packets() -> frozenset:
    return frozenset(getattr(torch.ops.aten, name) for name in SAVED_OPS if hasattr(torch.ops.aten, name))


def _save_costly(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep the outputs of :data:`SAVED_OPS`, recompute the rest. MUST_SAVE: compile keeps
    them too."""
    if getattr(op, "overloadpacket", None) in _saved_packets():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _running_stats_kept(block: nn.Module) -> Iterator[None]:
    """BatchNorm layers in training mode update their running statistics at each forward: the backward's
    recompute must not update them a second time."""
    kept = [(buffer, buffer.clone()) for m in block.modules()
            if isinstance(m, _BatchNorm) and m.training and m.track_running_stats
            for buffer in (m.running_mean, m.running_var, m.num_batches_tracked) if buffer is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def _contexts(block: nn.Module, policy: str) -> tuple:
    """The forward's context and the recompute's (``checkpoint``'s ``context_fn``)."""
    if policy == "selective":  # the forward keeps SAVED_OPS' outputs; the recompute reads them back
        forward, recompute = create_selective_checkpoint_contexts(_save_costly)
        return forward, _both(_running_stats_kept(block), recompute)  # the statistics kept outside the replay
    return contextlib.nullcontext(), _running_stats_kept(block)


def _checkpointed_forward(block: nn.Module, forward: Callable, policy: str, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant: any inputs (keyword ones, inputs that need no grad), nesting, and autograd hooks work.
    if torch.compiler.is_compiling():
        # Traced: AOTAutograd's recompute replays no buffer update (they are functionalized into the forward's
        # graph), so no context is needed, and a context or any state kept outside the block would stop dynamo
        # from capturing the checkpoint ("HOP: Unsafe side effect"): the whole model would run eager. Selective:
        # torch's own contexts, which compile reads as the partitioner's save/recompute marks.
        if policy == "selective":
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_costly)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False,
                                             context_fn=functools.partial(_contexts, block, policy), **kwargs)


def _check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"Argument policy should be one of {', '.join(POLICIES)}, got {policy!r}.")
    return policy


def checkpoint_blocks(model: nn.Module, blocks: Optional[Sequence[str]] = None, policy: str = "full") -> List[str]:
    """Run each block of ``model`` (its repeated children: ``ignite_amp.transforms.blocks.block_names``) under
    activation checkpointing.

    In place, before sharding and compile; calling it again leaves checkpointed blocks as they are.
    A model without blocks is left as it is, with one warning.

    Args:
        model: the model (unwrapped: not DDP, not sharded).
        blocks: class names of the blocks (default: the repeated blocks, as FSDP2's sharding).
        policy: ``"full"`` (recompute every op of a block) or ``"selective"`` (keep the outputs of ``SAVED_OPS``:
            matmuls, convolutions, attention).

    Returns:
        The module paths of the checkpointed blocks.

    Example:
        >>> import torch
        >>> from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
        >>> checkpoint_blocks(model, policy="selective")
        ['0', '1', '2']
        >>> checkpoint_policies(model)
        {'0': 'selective', '1': 'selective', '2': 'selective'}
    """
    _check_policy(policy)
    names = block_names(model, blocks)
    if not names:
        warnings.warn(f"activation checkpointing: {type(model).__name__} has no repeated blocks (two or more "
                      f"children in a row of one class in a ModuleList or Sequential); nothing is checkpointed; "
                      f"name its block classes (distributed.blocks, or checkpoint_blocks(model, blocks=[...]))",
                      UserWarning, stacklevel=2)
    return checkpoint_modules(model, names, policy)


def checkpoint_modules(model: nn.Module, names: Sequence[str], policy: str = "full") -> List[str]:
    """Run the submodules of ``model`` at the module paths ``names`` under activation checkpointing, in place
    (those checkpointed already stay as they are): :func:`checkpoint_blocks` on chosen blocks, as
    ``activation_checkpointing: auto`` chooses them (:mod:`ignite_amp.memory_plan.auto_checkpoint`), with ``policy``
    (one of :data:`POLICIES`). Returns ``names``."""
    _check_policy(policy)
    names = list(names)
    if names:
        _no_kv_cache(model)
    for name in names:
        module = model.get_submodule(name)
        if not getattr(module, _MARK, False):
            module.forward = functools.partial(_checkpointed_forward, module, module.forward, policy)
            setattr(module, _MARK, policy)
    return names


def checkpointed_blocks(model: nn.Module) -> List[str]:
    """The module paths of ``model``'s blocks that :func:`checkpoint_blocks` checkpointed."""
    return list(checkpoint_policies(model))


def checkpoint_policies(model: nn.Module) -> dict:
    """``{module path: policy}`` of ``model``'s checkpointed blocks, in module order."""
    return {name: getattr(module, _MARK) for name, module in model.named_modules() if getattr(module, _MARK, False)}


def describe_blocks(names: Sequence[str]) -> str:
    """Module paths in short: ``["layers.0", "layers.1", "layers.2", "head"]`` -> ``"layers.0-2, head"``."""
    parts: List[List[Any]] = []  # [prefix, first index, last index] or [name]
    for name in names:
        prefix, _, last = name.rpartition(".")
        if last.isdigit():
            index = int(last)
            if parts and len(parts[-1]) == 3 and parts[-1][0] == prefix and parts[-1][2] == index - 1:
                parts[-1][2] = index
                continue
            parts.append([prefix, index, index])
        else:
            parts.append([name])
    return ", ".join(p[0] if len(p) == 1 else
                     f"{p[0] + '.' if p[0] else ''}{p[1]}{'' if p[1] == p[2] else f'-{p[2]}'}" for p in parts)


def _no_kv_cache(model: nn.Module) -> None:
    """A transformers model keeps a key/value cache while it trains unless told not to (``config.use_cache``, True
    by default): its blocks append to it in the forward, which a checkpointed block's recompute cannot replay
    (selective checkpointing fails in the backward). transformers turns it off itself when its own checkpointing
    trains; so does this, once, and says so."""
    configs: Dict[int, Any] = {id(c): c for m in model.modules()
                               if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    if configs:
        logger.info("activation checkpointing: %s's config.use_cache set to False (a key/value cache is for "
                    "generation; a checkpointed block cannot replay it in training, as transformers does too)",
                    type(model).__name__)


# -- checkpointing suspended (the split check) ---------------------------------------------------------------------
# torch.utils.checkpoint's own entry points look these names up in their module at each call, in every torch
# release this package supports (tests/split_check/test_by_construction.py is their canary): replaced for a
# while, every checkpoint call (this module's blocks, transformers' gradient checkpointing, a user's own call,
# reentrant or not) runs its function once, plainly, and saves what autograd saves without it.
_REENTRANT = "CheckpointFunction"
_NON_REENTRANT = ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")
_suspension = threading.Lock()


class _Plain:
    """``CheckpointFunction`` suspended: ``apply(function, preserve_rng_state, *args)`` calls the function."""

    @staticmethod
    def apply(function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
        return function(*args)


def _plain_hooks(*args: Any, **kwargs: Any) -> Iterator[None]:
    """The non-reentrant checkpoint's generator suspended: nothing before the function, nothing after."""
    yield


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Every ``torch.utils.checkpoint.checkpoint`` call inside runs its function once, as if not checkpointed:
    checkpointing does not change the math, so the split check compares gradients without it (on a part small
    enough to fit so). Process-wide while inside (one caller at a time); restored on exit."""
    import torch.utils.checkpoint as module

    names = [name for name in (_REENTRANT, *_NON_REENTRANT) if hasattr(module, name)]
    with _suspension:
        saved = {name: getattr(module, name) for name in names}
        for name in names:
            setattr(module, name, _Plain if name == _REENTRANT else _plain_hooks)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
