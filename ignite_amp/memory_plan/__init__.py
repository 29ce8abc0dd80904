"""The memory plan: a step's peak memory from fake tensors, before anything runs."""
from ignite_amp.core.exports import lazy_exports

_EXPORTS = {
    "estimate_memory": "ignite_amp.memory_plan.plan",
    "MemoryPlan": "ignite_amp.memory_plan.plan",
    # 0.2.0's ignite_amp.memory_plan (a module then) named these too
    "StepPeak": "ignite_amp.memory_plan.plan",
    "KINDS": "ignite_amp.memory_plan.plan",
    "NOT_COUNTED": "ignite_amp.memory_plan.plan",
    "DEFAULT_MARGIN": "ignite_amp.memory_plan.plan",
    "parse_bytes": "ignite_amp.memory_plan.plan",
    "format_bytes": "ignite_amp.memory_plan.plan",
    "checkpoint_to_fit": "ignite_amp.memory_plan.auto_checkpoint",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
