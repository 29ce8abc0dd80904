"""Resume, in one place: which checkpoint, what its stored config allows, loading it, saying what changed.

What a resume may change is each key's ``resume`` rule, declared with the key
(:mod:`ignite_amp.core.config_keys`):

- fixed: the run would not be the same run (model, optimizer class, data set and image size,
  accumulation, the schedule, the metric the best checkpoints are ranked by, the seed: it orders
  the data and makes the synthetic data sets);
- fixed under a schedule: a cosine or one-cycle schedule was made for a number of steps and a
  peak learning rate, so the epochs, the epoch length (batch size, train size) and the
  optimizer's settings cannot change under it; without a schedule they can;
- applied: everything else (logging, handlers, devices, workers, learning rate without a
  schedule...) takes effect, and the resume names it;
- not compared: the run's name, its directory and the resume setting itself.
"""
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from ignite_amp.config.limits import brief, same
from ignite_amp.config.tree import Config, default_config, flatten_config
from ignite_amp.core.collectives import any_rank, broadcast_text, is_distributed
from ignite_amp.core.config_keys import FIXED, FIXED_UNDER_SCHEDULE, NOT_COMPARED, leaves
from ignite_amp.core.device import dtype_name
from ignite_amp.errors import CheckpointError
from ignite_amp.files.checkpoints import load_checkpoint
from ignite_amp.files.run_directory import RunLayout, move_previous_run
from ignite_amp.handlers.best_checkpoint import BestCheckpoint

__all__ = ["Change", "Plan", "config_changes", "check_resume", "plan_resume", "resume_run", "choose_checkpoint",
           "stored_config", "apply_changes", "RULES", "rerun_of_a_finished_run", "epochs_done", "resumed_dtype",
           "with_precision"]

RULES: Dict[str, str] = {path: f.metadata["resume"] for path, f in leaves(Config)}


class Plan(NamedTuple):
    """What a run resumes: the checkpoint's path and loaded state, and the config changes that take effect."""

    path: Optional[str] = None
    state: Optional[dict] = None
    changes: List["Change"] = []
    auto: bool = False  # chosen by resume: auto: one that turns out unreadable falls back to the previous one
    batch_size: Optional[int] = None  # data.batch_size: auto: the resumed run's global batch (no new search)


def plan_resume(cfg: Config, main: bool, say: Callable) -> Plan:
    """Before the run is built: choose the checkpoint (or move an earlier run aside) and compare its
    stored config with ``cfg``; a change that cannot be resumed is a one-line CheckpointError.
    ``data.batch_size: auto`` takes the resumed run's batch size (no new search)."""
    path, state = choose_checkpoint(cfg, main, say)
    if state is None or path is None:  # (a state is read from a path)
        return Plan()
    stored = stored_config(state, path)
    if cfg.handlers.checkpoint.resume == "auto" and _starts_a_new_run(stored, state, cfg, main, say):
        return Plan()
    cfg, batch_size = _with_stored_batch_size(cfg, stored)
    if batch_size is not None:
        say(f"data.batch_size: auto: using {batch_size}, the batch size of the resumed run (no new search)")
    return Plan(path, state, check_resume(stored, cfg.to_dict(), path), cfg.handlers.checkpoint.resume == "auto",
                batch_size)


def _with_stored_batch_size(cfg: Config, stored: dict) -> Tuple[Config, Optional[int]]:
    """``data.batch_size: auto`` resumed means the global batch the checkpoint's run trained at (its stored config's):
    ``(cfg with it, it)``; ``(cfg, None)`` where the config names a size or the checkpoint does not say."""
    size = stored.get("data", {}).get("batch_size")
    if cfg.data.batch_size != "auto" or not isinstance(size, int):
        return cfg, None
    return cfg.replace(data=cfg.data.replace(batch_size=size)), size


def resume_run(chosen: Plan, checkpoint: Any, trainer: Any, optimizer: Any, micro_batches: int, epoch_length: int,
               scheduled: bool) -> str:
    """Load the chosen checkpoint into the built run, put the applied changes in effect; returns the line to print."""
    step = (chosen.state or {}).get("amp_step")
    if isinstance(step, dict) and isinstance(step.get("dtype"), str):  # a change of precision: in the line below
        step["dtype"] = dtype_name(trainer.amp_step.dtype)  # (not the step's own line too; the record only says)
    path = checkpoint.resume(chosen.path, chosen.state, fall_back=chosen.auto)
    # The epoch length is the loader's in use now (a changed data.train_size or batch_size).
    trainer.state.epoch_length = epoch_length
    trainer.state.iteration = trainer.state.epoch * epoch_length
    apply_changes(chosen.changes, optimizer, trainer.amp_step, micro_batches)
    kept = "weights, optimizer, scaler, " + ("schedule, " if scheduled else "") + "RNG and data order"
    changed = f"; now in effect: {', '.join(map(str, chosen.changes))}" if chosen.changes else ""
    return f"resumed from {path} at epoch {trainer.state.epoch} (keeps {kept}{changed})"


def resumed_dtype(state: Optional[dict]) -> Optional[str]:
    """The dtype a checkpoint's run trained in: its step's record; for a checkpoint saved before 0.3.0, which did not
    record it, its stored config's ``amp.dtype`` where that names one (float16, bfloat16, float32); else None."""
    step = (state or {}).get("amp_step")
    if isinstance(step, dict) and isinstance(step.get("dtype"), str):
        return step["dtype"]
    stored = (state or {}).get("config")
    config = stored.get("value") if isinstance(stored, dict) else None
    amp = config.get("amp") if isinstance(config, dict) else None
    dtype = amp.get("dtype") if isinstance(amp, dict) else None
    return dtype if dtype in ("float16", "bfloat16", "float32") else None


def with_precision(chosen: Plan, cfg: Config, now: str) -> Plan:
    """``dtype: auto`` resumed in another dtype than its checkpoint trained in (another device, or a checkpoint
    that does not say): the change named in the resume line, as a change of ``amp.dtype`` itself is."""
    if chosen.path is None or cfg.amp.dtype != "auto":
        return chosen
    before = resumed_dtype(chosen.state)
    if before == now:
        return chosen
    return chosen._replace(changes=[*chosen.changes, Change("amp.dtype auto", before or "unrecorded", now)])


class Change(NamedTuple):
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    return "null" if value is None else brief(value)  # bounded: a kwargs mapping may alias itself many times over


def _rule(key: str) -> str:
    """The rule of a leaf path (a key inside a free mapping follows its mapping's rule)."""
    while key not in RULES and "." in key:
        key = key.rpartition(".")[0]
    return RULES.get(key, FIXED)  # a key no declaration knows cannot be judged: refuse it


def config_changes(old: dict, new: dict) -> List[Change]:
    """Every leaf whose value differs, in schema order (keys a newer schema added count at their default).

    Linear in the configs as written: a kwargs value that YAML aliases repeat is compared once, not once per use."""
    defaults = flatten_config(default_config())
    before, after = {**defaults, **flatten_config(old or {})}, flatten_config(new)
    return [Change(k, before.get(k), v) for k, v in after.items()
            if not same(before.get(k), v) and _rule(k) != NOT_COMPARED]


def check_resume(old: dict, new: dict, path: str) -> List[Change]:
    """The changes that take effect; raises CheckpointError (one line) listing those that cannot."""
    changes = config_changes(old, new)
    schedule = new["scheduler"]["name"]
    refused = [c for c in changes if _rule(c.key) == FIXED]
    if schedule != "none":
        refused += [c for c in changes if _rule(c.key) == FIXED_UNDER_SCHEDULE]
    if refused:
        why = f" (the {schedule} schedule was made for the old values)" if schedule != "none" and any(
            _rule(c.key) == FIXED_UNDER_SCHEDULE for c in refused) else ""
        raise CheckpointError(
            f"cannot resume {path}: {', '.join(map(str, refused))} cannot change under a resume{why}; put "
            f"{'it' if len(refused) == 1 else 'them'} back, or start over with --set "
            f"handlers.checkpoint.resume=never (the old run is moved aside)")
    return [c for c in changes if c not in refused]


def choose_checkpoint(cfg: Config, main: bool, say: Callable) -> Tuple[Optional[str], Optional[dict]]:
    """Rank 0 picks the checkpoint to resume (or moves an earlier run aside); every rank loads it."""
    resume = cfg.handlers.checkpoint.resume
    path, state = None, None
    if main:
        if resume == "auto":
            path, state = BestCheckpoint.find_resumable(RunLayout(cfg.output_dir).checkpoint_dir)
        elif resume:
            path = os.path.expanduser(resume)
            state = load_checkpoint(path)  # a missing or unreadable file is a one-line error
        if path is None:
            moved = move_previous_run(cfg.output_dir)
            if moved:
                why = "resume: never" if not resume else "nothing to resume"
                say(f"starting over in {cfg.output_dir} ({why}): moved the previous run's files to {moved}")
    if is_distributed():  # every rank resumes from rank 0's choice (output_dir must be shared)
        path = broadcast_text(path or "") or None
        failed = None
        if not main and path:
            try:
                state = load_checkpoint(path)
            except CheckpointError as exc:  # raised after the barrier: the other ranks are not left waiting in it
                failed = exc
        # A barrier: rank 0 may move a finished run aside next (rerun with another config), and must not before
        # every rank has read its checkpoint (rank 1 read a moved file: "no such file").
        any_rank(failed is not None)
        if failed is not None:
            raise failed
    return path, state


def stored_config(state: dict, path: str) -> dict:
    """The config a checkpoint was saved with (one-line CheckpointError if it has none)."""
    stored = state.get("config")
    value = stored.get("value") if isinstance(stored, dict) else None
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint {path}: not a checkpoint of an ignite-amp config run (no stored config)")
    return value


def apply_changes(changes: List[Change], optimizer: Any, amp_step: Any, micro_batches: int) -> None:
    """After loading: put the new config's applied changes in effect over what the checkpoint restored.

    The optimizer's state brought back its old settings; the new config's are the defaults of the
    optimizer built from it (a kwarg the config no longer sets is back at the optimizer's default).
    """
    keys = {c.key for c in changes}
    defaults = optimizer.defaults
    for group in optimizer.param_groups:
        if "optimizer.lr" in keys:
            group["lr"] = defaults["lr"]
        if any(k.startswith("optimizer.kwargs") for k in keys):
            for name, value in defaults.items():
                if name not in ("params", "lr") and name in group:
                    group[name] = value
    if "amp.micro_batches" in keys:
        amp_step.micro_batches = micro_batches


# --- A finished run and a changed config -----------------------------------------------------------------------
# What rerunning ``output_dir`` means once its run has trained all its epochs (``resume: auto`` only: an explicit
# checkpoint path asks to continue that checkpoint, and an interrupted run resumes under the rules above).


def epochs_done(state: dict) -> Optional[int]:
    """The whole epochs a checkpoint's trainer state has trained (None if it does not say)."""
    trainer = state.get("trainer")
    if not isinstance(trainer, dict) or not trainer.get("epoch_length") or "iteration" not in trainer:
        return None
    return int(trainer["iteration"]) // int(trainer["epoch_length"])


def rerun_of_a_finished_run(stored: dict, done: Optional[int], cfg: Config) -> Tuple[str, List[Change]]:
    """``("resume" | "extend" | "new", changes)``: what running ``cfg`` over a checkpoint of ``stored``'s run,
    ``done`` epochs trained, means.

    - the run is not finished (or the config is the same): ``resume`` (the rules of :func:`check_resume`);
    - more epochs, and nothing a resume refuses (no schedule: continuing equals a run that long from the
      start): ``extend``, "train longer";
    - any other change to a finished run: ``new``: there is nothing left to resume, so the config asks for
      another run (fewer epochs, a longer scheduled run, another dtype, ...).
    """
    changes = config_changes(stored, cfg.to_dict())
    finished = done is not None and done >= stored.get("train", {}).get("epochs", float("inf"))
    if not finished or not changes:
        return "resume", changes
    longer = any(c.key == "train.epochs" and isinstance(c.old, int) and c.new > c.old for c in changes)
    if longer:
        try:
            check_resume(stored, cfg.to_dict(), "")
            return "extend", changes
        except CheckpointError:
            pass
    return "new", changes


def _starts_a_new_run(stored: dict, state: dict, cfg: Config, main: bool, say: Callable) -> bool:
    """Rerunning a finished run with another config: move it aside and say so in one line (rank 0); every rank
    decides alike from the same checkpoint."""
    wanted, _ = _with_stored_batch_size(cfg, stored)  # auto on resume means the stored size (plan_resume)
    verdict, changes = rerun_of_a_finished_run(stored, epochs_done(state), wanted)
    if verdict != "new":
        return False
    if main:
        moved = move_previous_run(cfg.output_dir)
        shown = ", ".join(map(str, changes[:3])) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")
        say(f"starting a new run in {cfg.output_dir}: its run had finished, and the config changed ({shown}); "
            f"moved the finished run's files to {moved}")
    return True
