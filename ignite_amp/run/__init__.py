"""The run from a config: its plan (the config resolved once), the composition root, resume, the run's facts and
checks."""
from ignite_amp.core.exports import lazy_exports

_EXPORTS = {
    "train_from_config": "ignite_amp.run.compose",
    "build_run": "ignite_amp.run.compose",
    "Run": "ignite_amp.run.built_run",
    "RunPlan": "ignite_amp.run.plan",
    "resolve": "ignite_amp.run.plan",
    "probe_cpu_dtype": "ignite_amp.run.dtype_probe",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
