"""Sharded data parallel (FSDP2): shard a model, and checkpoint its state shard by shard.

:func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to the model's repeated blocks
(:func:`ignite_amp.transforms.blocks.block_names`, optionally activation-checkpointed first),
then to the whole model, with a ``MixedPrecisionPolicy``: parameters are all-gathered in the run's
dtype (bfloat16: half the bytes of float32) and gradients reduce-scattered in float32. The step
keeps autocast on over it, for the operators autocast runs in float32 (softmax, norms, losses).

A sharded model's checkpoint is a directory (``*.dcp``) written with ``torch.distributed.checkpoint``:
each rank writes its shards of the model and optimizer state, rank 0 the rest (``state.pt``).
It loads on any number of processes, one included (DCP reshards).
"""
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed.checkpoint as dcp
from ignite.base.mixins import Serializable
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.modules.batchnorm import _BatchNorm

from ignite_amp.core.collectives import is_distributed, is_sharded
from ignite_amp.core.device import resolve_dtype
from ignite_amp.files.checkpoints import (
    SHARDED_KEYS,
    dcp_cause,
    refused_class,
    single_process_quiet,
    type_error,
    with_types,
)
from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks
from ignite_amp.transforms.blocks import block_names

__all__ = ["shard_model", "check_shardable", "is_sharded", "block_names", "ShardedModelState", "ShardedOptimizerState",
           "sharded_objects", "SHARDED_KEYS", "load_sharded", "load_full_model_state", "unreadable_shards"]


def check_shardable(model: nn.Module, blocks: Optional[Sequence[str]] = None,
                    fp32_modules: Iterable[str] = ()) -> List[str]:
    """What :func:`shard_model` checks before sharding, also usable on one process: the blocks exist, the
    ``fp32_modules`` too, and no parameter is shared by two of the units sharded on their own (tied weights
    across blocks: each unit gathers and frees its own parameters). Returns ``block_names(model)``; raises
    ValueError naming the key (``blocks:`` or ``fp32_modules:``)."""
    units = block_names(model, blocks)
    fp32 = list(fp32_modules)
    for name in fp32:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"fp32_modules: the model has no submodule {name!r}") from None
    roots = sorted(set(units) | set(fp32), key=lambda n: n.count("."), reverse=True)  # innermost first
    owners: Dict[int, tuple] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        unit = next((u for u in roots if path == u or path.startswith(f"{u}.")), "")
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            first = owners.setdefault(id(param), (unit, f"{path}.{name}" if path else name))
            if first[0] != unit:
                a, b = (f"block {u!r}" if u else "the model outside the blocks" for u in (first[0], unit))
                raise ValueError(f"blocks: {a} and {b} share a parameter ({first[1]} is "
                                 f"{f'{path}.{name}' if path else name}): FSDP shards each block on its own, so "
                                 f"tied weights must sit in one block; untie them, or set distributed.blocks to "
                                 f"blocks that hold both")
    return units


def shard_model(model: nn.Module, dtype: Union[str, torch.dtype] = "bfloat16",
                blocks: Optional[Sequence[str]] = None, reshard_after_forward: bool = True,
                fp32_modules: Iterable[str] = (), device: Union[str, torch.device, None] = None,
                activation_checkpointing: Union[bool, str] = False) -> nn.Module:
    """Shard ``model`` over the process group with FSDP2 and return it (sharded in place).

    Call it inside a process group (``torchrun``, ``idist.Parallel``) before building the optimizer
    (sharding replaces the parameters). Each block of ``block_names(model)`` is sharded on its own (its
    parameters are gathered just before its forward and freed after), then the whole model.

    Args:
        dtype: the parameters' dtype in forward and backward (``MixedPrecisionPolicy.param_dtype``):
            ``bfloat16``, ``float16`` or ``float32`` (no policy). Gradients are reduced in float32
            and the optimizer updates float32 shards.
        blocks: class names of the blocks to shard one by one (default: the repeated blocks).
        reshard_after_forward: free each block's gathered parameters after its forward (least
            memory; the backward gathers them again); False keeps them until the backward.
        fp32_modules: names of submodules kept in float32 (their own float32 policy); BatchNorm
            layers always are (their running statistics are float32).
        device: where the model goes first (default: ``idist.device()``).
        activation_checkpointing: checkpoint the same blocks first
            (:func:`ignite_amp.transforms.activation_checkpointing.checkpoint_blocks`): they keep only their inputs
            for the backward (``"selective"``: their matmuls', convolutions' and attention's outputs too).
    """
    import ignite.distributed as idist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing not in (False, True, "selective"):
        raise ValueError(f"Argument activation_checkpointing should be True, False or 'selective', got "
                         f"{activation_checkpointing!r}.")
    device = torch.device(device) if device is not None else idist.device()
    dtype = resolve_dtype(dtype, device)
    if is_sharded(model):
        raise ValueError("shard_model: this model is sharded already")
    model.to(device)
    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    full_precision = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    units = check_shardable(model, blocks, fp32_modules)  # before any fully_shard: it renames the classes
    if activation_checkpointing:  # before sharding (see ignite_amp.transforms.activation_checkpointing for the order)
        checkpoint_blocks(model, blocks, "selective" if activation_checkpointing == "selective" else "full")
    fp32 = set(fp32_modules)
    if policy.param_dtype is not None:  # BatchNorm computes with float32 running statistics: float32 parameters
        fp32.update(name for name, m in model.named_modules() if isinstance(m, _BatchNorm))

    def in_fp32(name: str) -> bool:
        return name in fp32 or any(name.startswith(f"{parent}.") for parent in fp32)

    # Innermost first (FSDP2 shards a module's own parameters, those its sharded children do not hold);
    # a block inside a float32 module is float32 too.
    for name in sorted(set(units) | fp32, key=lambda n: n.count("."), reverse=True):
        fully_shard(model.get_submodule(name), mp_policy=full_precision if in_fp32(name) else policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


class ShardedModelState(Serializable):
    """A model's state by parameter name, sharded if the model is (``get_model_state_dict``): what a
    sharded checkpoint stores, loadable into the same model sharded over any number of processes."""

    def __init__(self, model: nn.Module):
        self.module = model

    # ignite's Serializable says OrderedDict; a dict serves (Checkpoint and load_state_dict only read it)
    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: Mapping) -> None:
        set_model_state_dict(self.module, dict(state_dict))


class ShardedOptimizerState(Serializable):
    """An optimizer's state keyed by parameter name (``get_optimizer_state_dict``), so that it reshards."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = model, optimizer

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]  # (a dict: see ShardedModelState's)
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: Mapping) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, dict(state_dict))


def sharded_objects(to_save: Mapping[str, Any]) -> Dict[str, Any]:
    """``to_save`` with its ``model`` and ``optimizer`` wrapped for a sharded checkpoint."""
    model, optimizer = to_save.get("model"), to_save.get("optimizer")
    if not isinstance(model, nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("a sharded checkpoint needs to_save['model'] (the model) and to_save['optimizer'] (its "
                         "optimizer)")
    return dict(to_save, model=ShardedModelState(model), optimizer=ShardedOptimizerState(model, optimizer))


def load_sharded(path: str, objects: Mapping[str, Any]) -> None:
    """Load the DCP shards of the checkpoint directory ``path`` into ``objects`` (every rank calls it)."""
    template = {key: obj.state_dict() for key, obj in objects.items()}
    with single_process_quiet():
        with_types(lambda: dcp.load(template, checkpoint_id=path, no_dist=not is_distributed()))
    for key, obj in objects.items():
        obj.load_state_dict(template[key])


def load_full_model_state(path: str) -> Dict[str, torch.Tensor]:
    """The full (unsharded) model state dict of the sharded checkpoint directory ``path``, in one
    process without a process group: e.g. to export it, ``torch.save(load_full_model_state(p), "model.pt")``.
    A float8 run's shards import torchao's float8 first (:func:`ignite_amp.files.checkpoints.with_types`); without
    torchao that is a one-line :class:`~ignite_amp.errors.CheckpointTypeError`."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    try:
        with single_process_quiet():
            with_types(lambda: dcp.load(state, checkpoint_id=path, no_dist=True))
    except (Exception, CheckpointException) as exc:
        refused = type_error(path, exc)
        if refused is None:
            raise
        raise refused from None
    return {key[len("model."):]: value for key, value in state.items()}


def unreadable_shards(path: str) -> Optional[str]:
    """Why the sharded checkpoint directory ``path`` does not read back, or None when every item it stores does.

    Reads the whole checkpoint in this process (on the CPU, without a process group): called only after a
    load failed, to tell a damaged checkpoint (shard bytes overwritten: the file sizes are right) from one
    that does not fit the run. A shard that reads as a sound pickle of a class this process cannot load (float8
    weights without torchao) is not damaged: None."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
                 if isinstance(meta, TensorStorageMetadata) else None
                 for key, meta in metadata.state_dict_metadata.items()}
        with single_process_quiet():
            with_types(lambda: dcp.load(state, checkpoint_id=path, no_dist=True))
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return None if refused_class(exc) else dcp_cause(exc).__class__.__name__
    return None
