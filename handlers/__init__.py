"""Pluggable Ignite handlers for ignite-amp trainers, one per module.

They reach inside a training step only through ``ignite_amp.AmpEvents``.
"""
from ignite_amp.errors import BatchSizeFloorError, CheckpointError, NonFiniteError
from ignite_amp.handlers.best_checkpoint import BestCheckpoint
from ignite_amp.handlers.gradient_clipping import GradientClipping
from ignite_amp.handlers.non_finite_guard import NonFiniteGuard
from ignite_amp.handlers.oom_backoff import OOMBackoff
from ignite_amp.handlers.profiler_capture import ProfilerCapture
from ignite_amp.handlers.step_schedule import StepSchedule
from ignite_amp.handlers.tensorboard.metrics import TensorBoardMetrics

__all__ = ["GradientClipping", "BestCheckpoint", "CheckpointError", "OOMBackoff", "BatchSizeFloorError",
           "NonFiniteGuard", "NonFiniteError", "ProfilerCapture", "StepSchedule",
           "TensorBoardMetrics"]
