"""The run from a config: the composition root, resume, the run's facts and checks."""
