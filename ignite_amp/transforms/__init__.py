"""Model transforms, block by block: float8, activation checkpointing, FSDP2 sharding, the block rule."""
from ignite_amp.core.exports import lazy_exports

_EXPORTS = {
    "convert_to_float8": "ignite_amp.transforms.float8",
    "checkpoint_blocks": "ignite_amp.transforms.activation_checkpointing",
    "shard_model": "ignite_amp.transforms.sharding",
    "load_full_model_state": "ignite_amp.transforms.sharding",
    "block_names": "ignite_amp.transforms.blocks",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
