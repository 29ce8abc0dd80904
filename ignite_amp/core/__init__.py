"""What every layer uses: device and dtype, collectives, RNG state, config keys, nested batches."""
