"""Files on disk: crash-safe checkpoint files and the run directory."""
