"""Pluggable Ignite handlers for ignite-amp trainers, one per module.

They reach inside a training step only through ``ignite_amp.AmpEvents``.
"""
from handlers.best_checkpoint import BestCheckpoint, CheckpointError
from handlers.gradient_clipping import GradientClipping
from handlers.non_finite_guard import NonFiniteError, NonFiniteGuard
from handlers.oom_backoff import BatchSizeFloorError, OOMBackoff
from handlers.profiler_capture import ProfilerCapture
from handlers.tensorboard_metrics import TensorBoardMetrics

__all__ = ["GradientClipping", "BestCheckpoint", "CheckpointError", "OOMBackoff", "BatchSizeFloorError",
           "NonFiniteGuard", "NonFiniteError", "ProfilerCapture", "TensorBoardMetrics"]
