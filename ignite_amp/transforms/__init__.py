"""Model transforms, block by block: float8, activation checkpointing, FSDP2 sharding, the block rule."""
