"""Best-validation checkpoints plus a ``last`` checkpoint per epoch, crash-safe, with full resume (which file, a
sharded one's shards, the directory tidied: ``ignite_amp.handlers.resumable``)."""
import dataclasses
import logging
import math
import os
import re
from typing import Any, List, Literal, Mapping, Optional, Tuple, Union

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, global_step_from_engine

from ignite_amp.core.collectives import any_rank, broadcast_text, is_distributed
from ignite_amp.core.config_keys import FIXED, NOT_COMPARED, POSITIVE_INT, Choice, ResumeValue, argument, setting
from ignite_amp.core.config_values import Section
from ignite_amp.core.metric_modes import metric_mode, require_metric
from ignite_amp.core.rng import RNGState
from ignite_amp.errors import CheckpointError, NonFiniteError, UnreadableCheckpointError, first_line
from ignite_amp.files.checkpoints import (
    SHARDED_KEYS,
    SafeDiskSaver,
    ShardedDiskSaver,
    StoredValue,
    load_checkpoint,
    remove_path,
)
from ignite_amp.handlers.resumable import (
    checkpoint_files,
    find_resumable,
    load_shards,
    move_newer_aside,
    remove_replaced_lasts,
)
from ignite_amp.transforms.sharding import is_sharded, sharded_objects

__all__ = ["CheckpointConfig", "BestCheckpoint", "CheckpointError", "all_finite"]


@dataclasses.dataclass(frozen=True, eq=False)
class CheckpointConfig(Section):
    """handlers.checkpoint: the best checkpoints by a validation metric, a last one, and resume (BestCheckpoint)."""

    metric: str = setting("accuracy", Choice("accuracy", "loss"), "the validation metric that ranks checkpoints",
                          FIXED)
    n_saved: int = setting(2, POSITIVE_INT, "best checkpoints kept")
    resume: Union[str, Literal[False]] = setting(
        "auto", ResumeValue(),
        "auto: the newest checkpoint in output_dir; never: start over (the old run is moved "
        "aside); or a checkpoint path", NOT_COMPARED)

logger = logging.getLogger("ignite_amp")

def _load_table(checkpoint: Checkpoint, items: List[Tuple[float, str]]) -> None:
    """Give an Ignite Checkpoint its table of saved files, in the shape its state_dict has."""
    key, = checkpoint.state_dict()  # "_saved" in Ignite 0.5 (its docstring says "saved")
    checkpoint.load_state_dict({key: items})


def all_finite(modules: List[torch.nn.Module]) -> bool:
    """Whether every floating-point parameter and buffer is finite: one reduction, one host sync.

    Of a sharded model each rank checks its shards, and the ranks agree (one all-reduce)."""
    tensors, shards = [], False
    for t in (t.detach() for m in modules for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()):
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard
            t, shards = t.to_local(), True
        tensors.append(t)
    # The max-abs norm is inf or NaN exactly when some element is.
    finite = bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)).item()) if tensors \
        else True
    return not any_rank(not finite) if shards and is_distributed() else finite


class BestCheckpoint:
    """Keep the ``n_saved`` best checkpoints by a validation metric, and a ``last`` one per evaluation.

    Built on Ignite's ``Checkpoint`` (policy) with a ``SafeDiskSaver`` (storage): a new file is
    written, flushed and renamed into place before the one it replaces is removed, so at every
    instant at least one complete checkpoint is on disk. Each checkpoint holds ``to_save``
    (model, optimizer, the AMP step with its scaler, scheduler, trainer, stateful handlers...),
    the RNG states and, if given, the resolved ``config``. Nothing is saved when an evaluated
    metric or a parameter is non-finite: the run stops with
    :class:`~ignite_amp.errors.NonFiniteError` and the files on disk stay as they were.

    :meth:`resume` continues from the newest checkpoint that loads (an unreadable one is
    renamed ``*.unreadable`` and named in a warning) and rebuilds the best table from the best
    files present with the exact scores the checkpoint stored, so a worse model after a resume
    never replaces a better one, and a best file that is gone is simply not in the table.
    Checkpoints saved after the one resumed (an older checkpoint resumed on purpose) belong to a
    run this one does not continue: they are moved to ``<dirname>.replaced-<time>``, never deleted.
    A finished run resumed and run again to the same ``max_epochs`` trains nothing and says so in a warning
    (as ``ignite-amp train`` does), so one script serves the first run, a repeated one and a longer one.

    Args:
        dirname: where checkpoints go (created if missing).
        to_save: objects with ``state_dict``/``load_state_dict``.
        metric: the evaluator metric to rank by.
        n_saved: how many best checkpoints to keep.
        mode: ``"max"`` or ``"min"``: whether a larger or a smaller value is better. Default
            (``ignite_amp.core.metric_modes.metric_mode``): ``"min"`` for names containing loss,
            perplexity, error, nll, mse, mae, rmse, wer or cer, else ``"max"``. Pass it for any other
            lower-is-better metric, and give ``TensorBoardMetrics`` the same (``modes=``).
        config: the resolved config, stored in every checkpoint.
        sharded: save sharded checkpoints (directories written by every rank with
            ``torch.distributed.checkpoint``, loadable on any number of processes; see
            :func:`ignite_amp.shard_model`). Default: when ``to_save["model"]`` is sharded (FSDP2).

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

    #: File-name prefix of the checkpoint saved after every evaluation (``last_checkpoint_<epoch>.pt``).
    LAST_PREFIX = "last"
    #: File-name prefix of the ``n_saved`` best checkpoints (``best_checkpoint_<epoch>_<metric>=<score>.pt``).
    BEST_PREFIX = "best"
    #: Suffix given to a checkpoint that does not load, so that resume passes over it.
    UNREADABLE = ".unreadable"

    def __init__(self, dirname: str, to_save: Mapping[str, Any], metric: str = "accuracy", n_saved: int = 2,
                 mode: Optional[str] = None, config: Optional[dict] = None, sharded: Optional[bool] = None):
        argument(CheckpointConfig, "n_saved", n_saved)
        mode = metric_mode(metric, mode)
        for reserved in ("rng", "config", "best_table"):
            if reserved in to_save:
                raise ValueError(f"Argument to_save should not use the reserved key {reserved!r}.")
        self.dirname = str(dirname)
        if os.path.lexists(self.dirname) and not os.path.isdir(self.dirname):  # found now, not after an epoch
            raise ValueError(f"Argument dirname should be a directory (or not exist yet), {self.dirname} is "
                             f"{'a symbolic link that leads nowhere' if os.path.islink(self.dirname) else 'a file'}.")
        self.metric, self.mode = metric, mode
        self.score_name = metric if mode == "max" else f"neg_{metric}"
        self.config = StoredValue(config)
        self.sharded = is_sharded(to_save.get("model")) if sharded is None else bool(sharded)
        if self.sharded:
            to_save = sharded_objects(to_save)
        self.to_save = dict(to_save, rng=RNGState(), config=self.config)
        self.resumed_config: Optional[dict] = None
        self.resumed_path: Optional[str] = None
        self._attached: Optional[_Attached] = None  # made by attach: what resume and the saves read
        self.n_saved = n_saved
        self._finished: Optional[Tuple[int, int, str]] = None  # (epoch, iteration, path) of a finished run resumed

    def attach(self, trainer: Engine, evaluator: Engine) -> None:
        """On each evaluator completion: refuse non-finite state, then save the best table, then ``last``.

        Temp files that killed saves left in ``dirname`` are removed first.
        """
        for name in SafeDiskSaver.remove_temp_files(self.dirname) if idist.get_rank() == 0 else ():  # rank 0 says so
            logger.warning("removed %s in %s: the temp file of a save that was killed", name, self.dirname)
        saver = (ShardedDiskSaver if self.sharded else SafeDiskSaver)(self.dirname)
        step = global_step_from_engine(trainer)
        score = Checkpoint.get_default_score_fn(self.metric, 1.0 if self.mode == "max" else -1.0)
        best = Checkpoint(self.to_save, saver, filename_prefix=self.BEST_PREFIX, score_function=score,
                          score_name=self.score_name, n_saved=self.n_saved, global_step_transform=step)
        last = Checkpoint(dict(self.to_save, best_table=best), saver, filename_prefix=self.LAST_PREFIX,
                          n_saved=1, global_step_transform=step, include_self=True)
        if self.sharded:  # a directory per checkpoint
            best.ext = last.ext = "dcp"
        self._attached = _Attached(trainer, best, last)
        trainer.add_event_handler(Events.STARTED, self._nothing_to_train)
        evaluator.add_event_handler(Events.COMPLETED, self._refuse_non_finite, trainer)
        evaluator.add_event_handler(Events.COMPLETED, best)
        evaluator.add_event_handler(Events.COMPLETED, last)

    @property
    def best(self) -> Optional[Checkpoint]:
        """The Ignite ``Checkpoint`` of the best files, once attached (None before)."""
        return self._attached.best if self._attached is not None else None

    @property
    def last(self) -> Optional[Checkpoint]:
        """The Ignite ``Checkpoint`` of the ``last`` file, once attached (None before)."""
        return self._attached.last if self._attached is not None else None

    def _nothing_to_train(self, trainer: Engine) -> None:
        """A finished run resumed, then ``run(data, max_epochs=<its epochs>)``: Ignite would start it over from
        epoch 0 (its rule for a run that is done), train again and let those scores compete with the best files.
        As ``ignite-amp train`` does, it says so and trains nothing: the trainer's state is put back and the run
        ends where it starts (``TERMINATE`` fires, ``COMPLETED`` does not)."""
        finished, self._finished = self._finished, None
        state = trainer.state
        if finished is None or state.epoch or state.iteration:  # not started over: more epochs continue the run
            return
        epoch, iteration, path = finished
        state.epoch, state.iteration = epoch, iteration
        logger.warning("already trained %d epoch%s (checkpoint %s); nothing to train; to train more: "
                       "trainer.run(data, max_epochs=%d) (or more)", epoch, "" if epoch == 1 else "s", path,
                       epoch + 1)
        trainer.terminate(skip_completed=True)

    def _refuse_non_finite(self, evaluator: Engine, trainer: Engine) -> None:
        require_metric(evaluator.state.metrics, self.metric, "BestCheckpoint")
        epoch = trainer.state.epoch
        bad = sorted(k for k, v in evaluator.state.metrics.items()
                     if isinstance(v, (int, float)) and not math.isfinite(v))
        if bad:
            raise NonFiniteError(f"validation {', '.join(bad)} non-finite after epoch {epoch}: stopping without "
                                 f"saving; the checkpoints on disk are kept")
        modules = [getattr(obj, "module", obj) for obj in self.to_save.values()]
        modules = [m for m in modules if isinstance(m, torch.nn.Module)]
        if not all_finite(modules):
            raise NonFiniteError(f"non-finite parameters after epoch {epoch}: stopping without saving; the "
                                 f"checkpoints on disk are kept")

    @property
    def best_path(self) -> Optional[str]:
        """Path of the best checkpoint so far, or None."""
        best = self.best
        return None if best is None or best.last_checkpoint is None else str(best.last_checkpoint)

    _files = staticmethod(checkpoint_files)

    def latest(self) -> Optional[str]:
        """The newest ``last`` checkpoint in ``dirname`` (highest epoch), or None; not opened."""
        found = self._files(self.dirname, self.LAST_PREFIX)
        return os.path.join(self.dirname, found[-1][1]) if found else None

    @classmethod
    def find_resumable(cls, dirname: str, of_a_config: bool = True) -> Tuple[Optional[str], Optional[dict]]:
        """``(path, state)`` of the newest checkpoint in ``dirname`` that loads, or ``(None, None)`` if none is there.

        The newest epoch comes first, whichever file holds it: its ``last`` file, else its ``best`` file (each
        holds the full run state; a save stopped between the two leaves the best one alone). Files that do not
        load (truncated, not a checkpoint) and are newer than the one chosen are renamed ``<name>.unreadable``
        (kept, never picked again) and named in a warning. When files are there but none loads, it raises a
        CheckpointError naming them and the way out (nothing is renamed). A sound file that holds a class this
        process cannot load is not damage: ``CheckpointTypeError`` (one line) at once, nothing renamed. Callable
        before the run is built, so the stored config can be compared with the new one first. ``of_a_config``:
        only files that hold a trainer and a config, as a config run's do (a script's may hold any subset of its
        objects).
        """
        return find_resumable(dirname, of_a_config, cls.LAST_PREFIX, cls.BEST_PREFIX, cls.UNREADABLE)

    def _check_keys(self, path: str, state: dict) -> None:
        """A config run's checkpoint holds every object; a script's may hold any of them (said in a warning)."""
        # A last file also has best_table and checkpointer; a sharded one keeps SHARDED_KEYS in its shards.
        missing = [k for k in self.to_save if k not in state and not (os.path.isdir(path) and k in SHARDED_KEYS)]
        if missing and self.config.value is not None:
            raise CheckpointError(f"checkpoint {path}: not a checkpoint of this run (missing {', '.join(missing)})")
        yours = [k for k in self.to_save if k not in ("rng", "config")]
        if missing and all(k in missing for k in yours):
            raise CheckpointError(f"checkpoint {path}: holds none of {', '.join(yours)} (its keys: "
                                  f"{', '.join(map(str, list(state)[:8]))})")
        if missing:
            logger.warning("resumed from %s: loaded %s; it holds no %s, which start%s as built", path,
                           ", ".join(k for k in self.to_save if k not in missing and k != "config"),
                           ", ".join(missing), "s" if len(missing) == 1 else "")

    def resume(self, path: Optional[str] = None, state: Optional[dict] = None,
               fall_back: Optional[bool] = None) -> Optional[str]:
        """Load the checkpoint at ``path`` (default: :meth:`find_resumable`) into every saved object.

        ``state`` is the already loaded file, if the caller read it (to compare configs first).
        Returns the path loaded, or None when ``path`` is None and there is nothing to resume.
        Raises :class:`CheckpointError` (one line) for a missing, truncated or incompatible file.
        ``fall_back`` (default: when ``path`` is None): a sharded checkpoint whose shards do not read
        back (bytes overwritten) is renamed ``*.unreadable``, named in a warning, and the previous
        checkpoint that loads is resumed instead, as :meth:`find_resumable` does for truncated files.
        """
        on = self._attached
        if on is None:
            raise RuntimeError("BestCheckpoint.resume() needs attach() first")
        fall_back = path is None if fall_back is None else fall_back
        if path is None:
            if state is not None:
                raise ValueError("BestCheckpoint.resume: state= is the file at path=; give both, or neither")
            path, state = self.find_resumable(self.dirname, of_a_config=self.config.value is not None)
            if path is None or state is None:  # nothing to resume (it finds both, or neither)
                return None
        elif state is None:
            state = load_checkpoint(path)
        while True:
            try:
                return self._load(on, path, state)
            except UnreadableCheckpointError as exc:
                if not fall_back:
                    raise
                path, state = self._fall_back(path, str(exc).split(": ", 1)[-1])

    def _fall_back(self, bad: str, why: str) -> Tuple[str, dict]:
        """Rank 0 renames ``bad`` ``*.unreadable`` and chooses the newest checkpoint that loads; every rank loads it."""
        path = None
        if idist.get_rank() == 0:
            os.replace(bad, bad + self.UNREADABLE)
            path, _ = self.find_resumable(self.dirname, of_a_config=self.config.value is not None)
            logger.warning("skipped %s (%s): resuming from the older %s; renamed it %s%s", bad, why,
                           os.path.basename(path) if path else "nothing", os.path.basename(bad), self.UNREADABLE)
        path = broadcast_text(path or "") or None
        if path is None:
            raise CheckpointError(f"no checkpoint in {self.dirname} loads ({os.path.basename(bad)}: {why}); to start "
                                  f"over, set handlers.checkpoint.resume: never (the old files are moved aside)")
        return path, load_checkpoint(path)

    def _load(self, on: "_Attached", path: str, state: dict) -> str:
        self._check_keys(path, state)
        self.resumed_path = path
        # The stored config is kept apart: later checkpoints store the config of this run.
        stored = state.get("config")
        self.resumed_config = stored.get("value") if isinstance(stored, dict) else None
        for key, obj in self.to_save.items():
            if key == "config" or key not in state:  # a sharded checkpoint's model and optimizer: below
                continue
            try:
                Checkpoint.load_objects({key: obj}, {key: state[key]})
            except Exception as exc:  # shape/key mismatch, wrong optimizer...: name the object, first line
                first = first_line(exc)
                raise CheckpointError(f"checkpoint {path}: {key} does not fit this run ({first})") from None
        if os.path.isdir(path):
            if not self.sharded:
                raise CheckpointError(f"checkpoint {path}: a sharded checkpoint, and this run's model is not sharded "
                                      f"(distributed.strategy: fsdp)")
            load_shards(path, {key: self.to_save[key] for key in SHARDED_KEYS})
        elif self.sharded:
            raise CheckpointError(f"checkpoint {path}: a single-file checkpoint, and this run saves sharded ones "
                                  f"(distributed.strategy: fsdp)")
        # The file's number is the trainer's epoch when it was saved (global_step_from_engine).
        match = re.fullmatch(r"(last|best)_checkpoint_(\d+)(?:_.+)?\.(?:pt|dcp)", os.path.basename(path))
        epoch = int(match.group(2)) if match else None
        in_dir = os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.dirname)
        if match and epoch is not None and in_dir:
            last = match.group(1) == self.LAST_PREFIX
            if last:
                _load_table(on.last, [(epoch, os.path.basename(path))])
            remove_replaced_lasts(self.dirname, epoch, self.LAST_PREFIX, "" if last else os.path.basename(path))
        if epoch is not None:
            move_newer_aside(self.dirname, epoch, path, (self.LAST_PREFIX, self.BEST_PREFIX))
        _load_table(on.best, self._best_table(epoch, state.get("best_table")))
        trained = on.trainer.state
        done = "trainer" in state and trained.max_epochs is not None and trained.epoch >= trained.max_epochs
        self._finished = (trained.epoch, trained.iteration, path) if done else None
        return path

    def _best_table(self, epoch: Optional[int], stored: Any = None) -> List[Tuple[float, str]]:
        """The best files present up to ``epoch``, as (priority, name), in Ignite's order: the exact scores
        the resumed checkpoint stored with its best table (``stored``), else the scores in the file names
        (rounded to 4 decimals: a best file resumed from, or files the stored table does not name)."""
        exact = {}
        for item in (stored or {}).get("_saved", []) if isinstance(stored, Mapping) else []:
            if isinstance(item, (tuple, list)) and len(item) == 2:
                exact[str(item[1])] = float(item[0])
        table = []
        for file_epoch, name, match in self._files(self.dirname, self.BEST_PREFIX,
                                                   rf"_{re.escape(self.score_name)}=(\S+?)"):
            if epoch is not None and file_epoch > epoch:
                continue  # moved aside by rank 0 (move_newer_aside)
            try:
                table.append((exact[name] if name in exact else float(match.group(2)), name))
            except ValueError:
                continue
        order = list(exact)  # ties keep the stored order (Ignite's stable sort); unnamed files come first
        table.sort(key=lambda item: (item[0], order.index(item[1]) if item[1] in order else -1, item[1]))
        while len(table) > self.n_saved:  # left by a removal that failed (or a smaller n_saved now)
            _, name = table.pop(0)
            remove_path(os.path.join(self.dirname, name))
            logger.warning("removed %s: more best checkpoints than n_saved %d", name, self.n_saved)
        return table


@dataclasses.dataclass(frozen=True)
class _Attached:
    """What :meth:`BestCheckpoint.attach` made, read by resume and the handlers it registers."""

    trainer: Engine
    best: Checkpoint  # the n_saved best files, by the metric
    last: Checkpoint  # the file of the last evaluation (holds the best one's table)
