"""Best-validation checkpoints plus a ``last`` checkpoint per epoch, with full resume."""
import os
import re
from typing import Any, Mapping, Optional

import torch
from ignite.base.mixins import Serializable
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver, global_step_from_engine

from ignite_amp.errors import CheckpointError
from ignite_amp.rng import get_rng_state, set_rng_state

__all__ = ["BestCheckpoint", "CheckpointError", "RNGState", "StoredValue"]


class RNGState(Serializable):
    """Python and torch (CPU and CUDA) random states, so a resumed run draws the same numbers."""

    _state_dict_all_req_keys = ("python", "torch")

    def state_dict(self) -> dict:
        return get_rng_state()

    def load_state_dict(self, state_dict: Mapping) -> None:
        super().load_state_dict(state_dict)
        set_rng_state(state_dict)


class StoredValue(Serializable):
    """A plain value (e.g. the resolved config) that rides along in a checkpoint."""

    _state_dict_all_req_keys = ("value",)

    def __init__(self, value: Any = None):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state_dict: Mapping) -> None:
        super().load_state_dict(state_dict)
        self.value = state_dict["value"]


class BestCheckpoint:
    """Keep the ``n_saved`` best checkpoints by a validation metric, and a ``last`` one per evaluation.

    Built on Ignite's ``Checkpoint`` (policy) and ``DiskSaver`` (atomic writes: temp file, then
    ``os.replace``). Each checkpoint holds ``to_save`` (model, optimizer, the AMP step with its
    scaler, scheduler, trainer, stateful handlers...), the RNG states, the best-score table and,
    if given, the resolved ``config``. :meth:`resume` continues from the latest ``last``
    checkpoint, best-score table included, so a worse model after a resume never replaces a
    better one.

    Args:
        dirname: where checkpoints go (created if missing).
        to_save: objects with ``state_dict``/``load_state_dict``.
        metric: the evaluator metric to rank by.
        n_saved: how many best checkpoints to keep.
        mode: ``"max"`` or ``"min"``; default ``"min"`` for metrics named like a loss, else ``"max"``.
        config: the resolved config, stored in every checkpoint.

    Example:
        >>> import tempfile, torch
        >>> from ignite.engine import Engine, Events
        >>> from ignite_amp.handlers import BestCheckpoint
        >>> model = torch.nn.Linear(2, 2)
        >>> trainer, evaluator = Engine(lambda e, b: None), Engine(lambda e, b: None)
        >>> scores = iter([0.5, 0.9, 0.7])
        >>> @evaluator.on(Events.COMPLETED)
        ... def score(engine):
        ...     engine.state.metrics["accuracy"] = next(scores)
        >>> _ = trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run([0]))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     ckpt = BestCheckpoint(d, {"model": model}, metric="accuracy", n_saved=1)
        ...     ckpt.attach(trainer, evaluator)
        ...     _ = trainer.run([0, 1], max_epochs=3)
        ...     sorted(os.listdir(d))
        ['best_checkpoint_2_accuracy=0.9000.pt', 'last_checkpoint_3.pt']
    """

    LAST_PREFIX = "last"
    BEST_PREFIX = "best"

    def __init__(self, dirname: str, to_save: Mapping[str, Any], metric: str = "accuracy", n_saved: int = 2,
                 mode: Optional[str] = None, config: Optional[dict] = None):
        if not isinstance(n_saved, int) or n_saved < 1:
            raise ValueError(f"Argument n_saved should be a positive integer, got {n_saved!r}.")
        if mode is None:
            mode = "min" if "loss" in metric.lower() else "max"
        if mode not in ("max", "min"):
            raise ValueError(f"Argument mode should be 'max' or 'min', got {mode!r}.")
        for reserved in ("rng", "config", "best_table"):
            if reserved in to_save:
                raise ValueError(f"Argument to_save should not use the reserved key {reserved!r}.")
        self.dirname = str(dirname)
        self.metric, self.mode = metric, mode
        self.config = StoredValue(config)
        self.to_save = dict(to_save, rng=RNGState(), config=self.config)
        self.resumed_config: Optional[dict] = None
        self.best: Optional[Checkpoint] = None
        self.last: Optional[Checkpoint] = None
        self.n_saved = n_saved

    def _score(self, engine: Engine) -> float:
        value = float(engine.state.metrics[self.metric])
        return value if self.mode == "max" else -value

    def attach(self, trainer: Engine, evaluator: Engine) -> None:
        """Save on each evaluator completion: the best table first, then ``last`` (which stores the table)."""
        saver = DiskSaver(self.dirname, require_empty=False, atomic=True)
        step = global_step_from_engine(trainer)
        self.best = Checkpoint(self.to_save, saver, filename_prefix=self.BEST_PREFIX, score_function=self._score,
                               score_name=self.metric if self.mode == "max" else f"neg_{self.metric}",
                               n_saved=self.n_saved, global_step_transform=step)
        self.last = Checkpoint(dict(self.to_save, best_table=self.best), saver, filename_prefix=self.LAST_PREFIX,
                               n_saved=1, global_step_transform=step, include_self=True)
        evaluator.add_event_handler(Events.COMPLETED, self.best)
        evaluator.add_event_handler(Events.COMPLETED, self.last)

    @property
    def best_path(self) -> Optional[str]:
        """Path of the best checkpoint so far, or None."""
        return None if self.best is None or self.best.last_checkpoint is None else str(self.best.last_checkpoint)

    def latest(self) -> Optional[str]:
        """The newest ``last`` checkpoint in ``dirname`` (highest epoch), or None."""
        if not os.path.isdir(self.dirname):
            return None
        found = []
        for name in os.listdir(self.dirname):
            match = re.fullmatch(rf"{self.LAST_PREFIX}_checkpoint_(\d+)\.pt", name)
            if match:
                found.append((int(match.group(1)), name))
        return os.path.join(self.dirname, max(found)[1]) if found else None

    def resume(self, path: Optional[str] = None) -> Optional[str]:
        """Load the checkpoint at ``path`` (default: :meth:`latest`) into every saved object.

        Returns the path loaded, or None when ``path`` is None and there is nothing to resume.
        Raises :class:`CheckpointError` (one line) for a missing, truncated or incompatible file.
        """
        if self.best is None:
            raise RuntimeError("BestCheckpoint.resume() needs attach() first")
        if path is None:
            path = self.latest()
            if path is None:
                return None
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {path}: no such file")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated zip, foreign pickle...: whatever torch.load raised
            raise CheckpointError(f"checkpoint {path}: truncated or not a checkpoint file "
                                  f"({exc.__class__.__name__})") from None
        to_load = dict(self.to_save, best_table=self.best)
        missing = [k for k in [*to_load, "checkpointer"] if not isinstance(state, dict) or k not in state]
        if missing:
            raise CheckpointError(f"checkpoint {path}: not a checkpoint of this run (missing {', '.join(missing)})")
        # The stored config is kept apart: later checkpoints store the config of this run.
        self.resumed_config = state["config"].get("value") if isinstance(state["config"], dict) else None
        for key, obj in to_load.items():
            if key == "config":
                continue
            try:
                obj.load_state_dict(state[key])
            except Exception as exc:  # shape/key mismatch, wrong optimizer...: name the object, first line
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
                raise CheckpointError(f"checkpoint {path}: {key} does not fit this run ({first})") from None
        self.last.load_state_dict(state["checkpointer"])
        return path
