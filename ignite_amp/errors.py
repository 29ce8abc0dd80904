"""The errors a user can act on: a leaf module that every layer may import.

Two families, told apart by the CLI:

- ``USER_ERRORS``: the user's to fix (a bad config, a checkpoint that does not fit, a run
  directory in use): one line on stderr, exit 2, nothing written.
- ``RUN_STOPPED``: the run stopped for a stated reason (out of memory at the smallest batch,
  a non-finite loss): one line, exit 1; the checkpoints on disk stay as they were.
"""

__all__ = ["first_line", "ConfigError", "CheckpointError", "RunDirInUseError", "BatchSizeFloorError",
           "OptimizerOutOfMemoryError", "NonFiniteError", "CheckpointWriteError", "UnreadableCheckpointError",
           "CheckpointTypeError", "RankDiedError", "BatchError", "SplitCheckError", "USER_ERRORS", "RUN_STOPPED"]


def first_line(exc: BaseException) -> str:
    """An error's first line, or its class name when it has no message: for one-line reports."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


class ConfigError(ValueError):
    """A user error in a config: the message is one line that names the key path."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated or does not fit the run: one line, nothing overwritten."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint whose stored bytes do not read back (a shard overwritten, say): a resume that chose it
    itself falls back to the previous one."""


class CheckpointTypeError(CheckpointError):
    """A sound checkpoint that holds a class this process cannot load (float8 weights without torchao, a class
    weights-only loading refuses): never taken for damage, never renamed; one line naming what it needs."""


class RunDirInUseError(ValueError):
    """Another run holds the run directory's lock: one line naming its PID."""


class BatchError(ValueError):
    """A batch the default rules cannot count or cut: one line naming the field and the hook to pass."""


class SplitCheckError(ValueError):
    """The split check found that a batch's weighted chunks do not give the full batch's gradient (or outputs):
    one line with the measured difference, the likely cause and the switch that accepts it."""


class BatchSizeFloorError(RuntimeError):
    """Out of memory even at the smallest micro-batch allowed: one line, the run stops."""


class OptimizerOutOfMemoryError(RuntimeError):
    """Out of memory inside ``optimizer.step()``: never retried, since the update may be half applied."""


class NonFiniteError(RuntimeError):
    """The loss or the weights went non-finite past what the guard allows: one line naming the iteration."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, say): the previous one is kept, the run stops."""


class RankDiedError(RuntimeError):
    """A spawned process ended without a result or an error of its own (killed: a signal, the out-of-memory
    killer): one line naming it; the checkpoints on disk are as its last save left them."""


USER_ERRORS = (ConfigError, CheckpointError, RunDirInUseError, BatchError, SplitCheckError)
RUN_STOPPED = (BatchSizeFloorError, OptimizerOutOfMemoryError, NonFiniteError, CheckpointWriteError, RankDiedError)
