"""Files on disk: crash-safe checkpoint files, the run directory, and the kept `dtype: auto` choices."""
