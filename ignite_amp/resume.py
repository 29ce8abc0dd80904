"""What a resume may change: the checkpoint's stored config against this run's.

Pure functions, tested without a run. Three kinds of key:

- fixed: the run would not be the same run (model, optimizer class, data set and image size,
  accumulation, the schedule, the metric the best checkpoints are ranked by, the seed: it orders
  the data and makes the synthetic data sets);
- fixed under a schedule: a cosine or one-cycle schedule was made for a number of steps and a
  peak learning rate, so the epochs, the epoch length (batch size, train size) and the
  optimizer's settings cannot change under it; without a schedule they can;
- everything else (logging, handlers, devices, workers, learning rate without a schedule...)
  takes effect, and the resume names it.
"""
from typing import Any, Dict, List, NamedTuple, Tuple

from ignite_amp.config import default_config
from ignite_amp.errors import CheckpointError

__all__ = ["Change", "config_changes", "check_resume", "FIXED", "FIXED_UNDER_SCHEDULE"]

FIXED = ("model", "optimizer.name", "data.name", "data.image_size", "amp.accumulation_steps", "scheduler",
         "handlers.checkpoint.metric", "seed")
FIXED_UNDER_SCHEDULE = ("train.epochs", "train.epoch_length", "data.batch_size", "data.train_size", "optimizer.lr",
                        "optimizer.kwargs")
NOT_A_CHANGE = ("handlers.checkpoint.resume", "output_dir", "name")


class Change(NamedTuple):
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    return "null" if value is None else str(value)


def _flat(cfg: dict, prefix: str = "") -> Dict[str, Any]:
    """Leaves by key path; ``kwargs`` mappings and lists are leaves."""
    out = {}
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not key.endswith("kwargs"):
            out.update(_flat(value, path + "."))
        else:
            out[path] = value
    return out


def _under(key: str, prefixes: Tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_changes(old: dict, new: dict) -> List[Change]:
    """Every leaf whose value differs, in schema order (keys a newer schema added count at their default)."""
    defaults = _flat(default_config())
    before, after = {**defaults, **_flat(old or {})}, _flat(new)
    return [Change(k, before.get(k), v) for k, v in after.items()
            if before.get(k) != v and not _under(k, NOT_A_CHANGE)]


def check_resume(old: dict, new: dict, path: str) -> List[Change]:
    """The changes that take effect; raises CheckpointError (one line) listing those that cannot."""
    changes = config_changes(old, new)
    schedule = new["scheduler"]["name"]
    refused = [c for c in changes if _under(c.key, FIXED)]
    if schedule != "none":
        refused += [c for c in changes if _under(c.key, FIXED_UNDER_SCHEDULE)]
    if refused:
        why = f" (the {schedule} schedule was made for the old values)" if schedule != "none" and any(
            _under(c.key, FIXED_UNDER_SCHEDULE) for c in refused) else ""
        raise CheckpointError(
            f"cannot resume {path}: {', '.join(map(str, refused))} cannot change under a resume{why}; put "
            f"{'it' if len(refused) == 1 else 'them'} back, or start over with --set "
            f"handlers.checkpoint.resume=never (the old run is moved aside)")
    return [c for c in changes if c not in refused]
