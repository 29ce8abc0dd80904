"""The memory plan: a step's peak memory from fake tensors, before anything runs."""
