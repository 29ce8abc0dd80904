"""Resuming from the checkpoint files :class:`~ignite_amp.handlers.BestCheckpoint` wrote: which file (the newest epoch
first, its ``last`` file before its ``best`` one, the first that loads; newer files that do not load renamed aside,
kept, and named in a warning), a sharded checkpoint's shards loaded (a failure told apart: damage, a type this
process cannot load, shards that do not fit), and the directory made that run's (older ``last`` files a killed save
left removed, newer files moved aside). ``BestCheckpoint.find_resumable`` is its public name.
"""
import logging
import os
import re
from typing import List, Optional, Tuple

import ignite.distributed as idist
from torch.distributed.checkpoint.api import CheckpointException

from ignite_amp.core.collectives import broadcast_text
from ignite_amp.errors import CheckpointError, CheckpointTypeError, UnreadableCheckpointError, first_line
from ignite_amp.files.checkpoints import dcp_cause, load_checkpoint, remove_path, type_error
from ignite_amp.files.run_directory import move_files_aside
from ignite_amp.transforms.sharding import load_sharded, unreadable_shards

__all__ = ["checkpoint_files", "find_resumable", "load_shards", "remove_replaced_lasts", "move_newer_aside"]

logger = logging.getLogger("ignite_amp")


def checkpoint_files(dirname: str, prefix: str, pattern: str = "") -> List[Tuple[int, str, re.Match]]:
    """``(epoch, name, match)`` of each ``<prefix>_checkpoint_<epoch><pattern>.pt`` (or ``.dcp``) in ``dirname``,
    oldest first; [] when there is no such folder."""
    if not os.path.isdir(dirname):
        return []
    found = []
    for name in os.listdir(dirname):
        match = re.fullmatch(rf"{prefix}_checkpoint_(\d+){pattern}\.(?:pt|dcp)", name)
        if match:
            found.append((int(match.group(1)), name, match))
    return sorted(found)


def find_resumable(dirname: str, of_a_config: bool, last_prefix: str, best_prefix: str,
                   unreadable: str) -> Tuple[Optional[str], Optional[dict]]:
    """``(path, state)`` of the newest checkpoint in ``dirname`` that loads, or ``(None, None)`` if none is there
    (``BestCheckpoint.find_resumable`` says how)."""
    # Newest epoch first, whichever file holds it (a save stopped after best_2, before last_2, leaves the state of
    # epoch 2 in best_2 alone); at the same epoch the last file (it also holds the best table).
    candidates = [(e, 1, n) for e, n, _ in checkpoint_files(dirname, last_prefix)]
    candidates += [(e, 0, n) for e, n, _ in checkpoint_files(dirname, best_prefix, r"_.+")]
    candidates.sort(reverse=True)
    skipped = []
    for _, _, name in candidates:
        path = os.path.join(dirname, name)
        try:
            state = load_checkpoint(path)
            if of_a_config and ("trainer" not in state or "config" not in state):
                raise CheckpointError(f"checkpoint {path}: not a checkpoint of this run (missing "
                                      f"{', '.join(k for k in ('trainer', 'config') if k not in state)})")
        except CheckpointTypeError:  # sound, but not loadable here: never renamed, and no older one is taken
            raise
        except CheckpointError as exc:
            skipped.append((path, str(exc).split(": ", 1)[-1]))
            continue
        for bad, why in skipped:
            os.replace(bad, bad + unreadable)
            logger.warning("skipped %s (%s): resuming from the older %s; renamed it %s%s", bad, why, name,
                           os.path.basename(bad), unreadable)
        return path, state
    if skipped:
        listed = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped[:3])
        way_out = ("set handlers.checkpoint.resume: never (the old files are moved aside)" if of_a_config else
                   "move them out of the directory, or give BestCheckpoint another one")
        raise CheckpointError(f"no checkpoint in {dirname} loads ({listed}); to start over, {way_out}")
    return None, None


def load_shards(path: str, objects: dict) -> None:
    """Load a sharded checkpoint's shards into ``objects`` (every rank), or raise what the failure is: a shard that
    does not read back (damage, ``UnreadableCheckpointError``), a sound file this process cannot load (its type
    error), or shards that do not fit the objects (``CheckpointError``)."""
    try:
        load_sharded(path, objects)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        first = first_line(dcp_cause(exc))
        # Damaged bytes, or a checkpoint that does not fit? Rank 0 reads it back to tell, for every rank.
        unreadable = broadcast_text((unreadable_shards(path) or "") if idist.get_rank() == 0 else "")
        refused = type_error(path, exc)
        if refused is not None and not unreadable:  # a sound file this process cannot load: not damage
            raise refused from None
        if unreadable:
            raise UnreadableCheckpointError(f"checkpoint {path}: a shard does not read back "
                                            f"({unreadable})") from None
        raise CheckpointError(f"checkpoint {path}: its model or optimizer shards do not load ({first})") \
            from None


def remove_replaced_lasts(dirname: str, epoch: int, last_prefix: str, resumed: str = "") -> None:
    """Older ``last`` checkpoints than the one resumed (``resumed``: its name, default the ``last`` file of
    ``epoch``): a save stopped after its rename (or after the best file of that epoch), before the last one
    replaced the old. Rank 0 finishes that save (nothing would remove them later)."""
    older = [name for file_epoch, name, _ in checkpoint_files(dirname, last_prefix) if file_epoch < epoch]
    for name in older if idist.get_rank() == 0 else ():
        remove_path(os.path.join(dirname, name))
        logger.warning("removed %s: replaced by %s (a save stopped before removing it)", name,
                       resumed or f"last_checkpoint_{epoch}")


def move_newer_aside(dirname: str, epoch: int, resumed: str, prefixes: Tuple[str, str]) -> None:
    """Checkpoints saved after ``epoch`` belong to a run this one does not continue (an older
    checkpoint resumed, or a kill between a best and a last save): rank 0 moves them to a sibling
    folder, so that ``resume: auto`` continues this run and nothing is deleted."""
    resumed = os.path.abspath(resumed)
    newer = [name for prefix, pattern in ((prefixes[0], ""), (prefixes[1], r"_.+"))
             for file_epoch, name, _ in checkpoint_files(dirname, prefix, pattern)
             if file_epoch > epoch and os.path.abspath(os.path.join(dirname, name)) != resumed]
    if not newer or idist.get_rank() != 0:
        return
    target = move_files_aside([os.path.join(dirname, name) for name in newer], dirname)
    logger.warning("moved %s to %s: saved after the checkpoint resumed from (epoch %d); this run continues "
                   "from that checkpoint", ", ".join(newer), target, epoch)
