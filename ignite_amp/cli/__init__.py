"""The command line: ignite-amp and its commands."""
