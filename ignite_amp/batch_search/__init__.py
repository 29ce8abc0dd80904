"""The batch-size search, in three modules:

- :mod:`~ignite_amp.batch_search.policy`: which sizes to try and which to keep, a pure function of
  ``trial(size, stage)`` (tested and benchmarked without a device);
- :mod:`~ignite_amp.batch_search.runner`: real trials (AMP steps on the model, peak memory, step
  times) and :func:`find_batch_size`, which runs the policy on them;
- :mod:`~ignite_amp.batch_search.results`: the records (:class:`Trial`, :class:`BatchSizeResult`)
  and the trial table.
"""
from ignite_amp.batch_search.policy import OBJECTIVES, STRATEGIES, VERIFY_STAGES, fit_line, search_batch_size
from ignite_amp.batch_search.results import BatchSizeResult, Trial, format_trial, format_trials
from ignite_amp.batch_search.runner import (
    CudaMemoryMeter,
    MemoryMeter,
    TrialRunner,
    find_batch_size,
    memory_meter,
    print_progress,
)

__all__ = ["search_batch_size", "fit_line", "find_batch_size", "TrialRunner", "MemoryMeter", "CudaMemoryMeter",
           "memory_meter", "print_progress", "Trial", "BatchSizeResult", "format_trial", "format_trials",
           "STRATEGIES", "OBJECTIVES", "VERIFY_STAGES"]
