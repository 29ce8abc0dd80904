"""Section f: host syncs, one bfloat16 epoch with the default handlers under ``torch.cuda.set_sync_debug_mode``, plus
the host waits that mode does not see."""
import contextlib
import os
import sys
import warnings
from collections import Counter
from typing import Callable

import torch
from ignite.engine import Events

from ignite_amp.run.compose import build_run

from .common import NEEDS_CUDA, ROOT, Context, recipe


def host_syncs(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~12 s. The CIFAR recipe (ResNet-18, batch 256, channels_last, clipping,
        # checkpoint, OOM backoff, non-finite guard, TensorBoard every 50) on fake 32x32 data, bfloat16:
        # one epoch of 120 iterations (~10-15 ms each with the debug mode's stack walks), one evaluation.
        gpu=dict(model="ignite_amp.models:cifar_resnet18", kwargs={}, train=30720, val=2560, batch=256, workers=4,
                 log_every=50, image=32),
        smoke=dict(model="ignite_amp.models:small_cnn", kwargs={"width": 8}, train=64, val=32, batch=8, workers=0,
                   log_every=4, image=16))
    cfg = recipe("configs/cifar10_resnet18.yaml", **{
        "name": "host-syncs", "device": ctx.device.type, "output_dir": os.path.join(ctx.workdir, "syncs"),
        "amp.dtype": "bfloat16", "model.name": size["model"], "model.kwargs": size["kwargs"],
        "data.name": "fake", "data.download": False, "data.image_size": size["image"],
        "data.train_size": size["train"], "data.val_size": size["val"], "data.batch_size": size["batch"],
        "data.num_workers": size["workers"], "train.epochs": 1, "handlers.checkpoint.resume": "never",
        "handlers.tensorboard.log_every": size["log_every"]})
    ctx.result["data"]["sizes"] = size
    run = build_run(cfg, print_fn=lambda *a, **k: None)
    trainer, log_every = run.trainer, size["log_every"]
    phase = {"now": ("outside", 0)}
    syncs = []

    def into(engine):  # from fetching iteration i's batch to the end of its handlers: iteration i
        phase["now"] = ("iteration", engine.state.iteration + 1)

    def out(engine):
        phase["now"] = ("outside", engine.state.iteration)

    trainer.add_event_handler(Events.GET_BATCH_STARTED, into)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, out)  # attached last: runs after every other handler

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            syncs.append((phase["now"], f"{_short(filename)}:{lineno}"))

    # The debug mode warns at copies and stream syncs only; a host wait on an event or a device
    # (NonFiniteGuard's flush, a device clock) is counted by wrapping those calls.
    with warnings.catch_warnings(), _counting_waits(lambda site: syncs.append((phase["now"], site))):
        warnings.simplefilter("always")
        warnings.showwarning = show
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            run.train()
        finally:
            if ctx.cuda:
                torch.cuda.set_sync_debug_mode(0)
    iterations = trainer.state.iteration
    groups = {"iteration 1 (first: lazy set-up)": lambda p: p[0] == "iteration" and p[1] == 1,
              f"iterations 2-{iterations} outside log intervals": lambda p: p[0] == "iteration" and p[1] > 1
              and p[1] % log_every,
              f"log iterations (every {log_every})": lambda p: p[0] == "iteration" and p[1] > 1
              and not p[1] % log_every,
              "outside iterations (epoch end: summary, evaluation, checkpoint)": lambda p: p[0] == "outside"}
    counts = {"iteration 1 (first: lazy set-up)": 1, f"log iterations (every {log_every})": iterations // log_every}
    steady = f"iterations 2-{iterations} outside log intervals"
    counts[steady] = iterations - 1 - sum(1 for i in range(2, iterations + 1) if not i % log_every)
    ctx.table("synchronizing CUDA calls (torch.cuda.set_sync_debug_mode('warn')), one epoch",
              ["where", "iterations", "syncs", "per_iteration", "call_sites"])
    for name, test in groups.items():
        found = [site for p, site in syncs if test(p)]
        n = counts.get(name)
        top = ", ".join(f"{site} x{k}" for site, k in Counter(found).most_common(5))
        ctx.row(where=name, iterations=n, syncs=len(found), per_iteration=len(found) / n if n else None,
                call_sites=top)
    steady_syncs = sum(1 for p, _ in syncs if groups[steady](p))
    per_iteration = steady_syncs / counts[steady] if counts[steady] else None
    ctx.target("0 syncs per iteration outside the log intervals (bfloat16, default handlers)",
               "-" if per_iteration is None else f"{per_iteration:.2f} per iteration ({steady_syncs} in "
                                                 f"{counts[steady]} iterations)",
               None if per_iteration is None else per_iteration == 0)
    if not ctx.cuda:
        ctx.skip(f"{NEEDS_CUDA}: torch.cuda.set_sync_debug_mode counts CUDA synchronizations only. The epoch ran on "
                 f"CPU without counting, to keep the section's code checked")


@contextlib.contextmanager
def _counting_waits(record: Callable[[str], None]):
    """Call ``record("<call> at file:line")`` at each torch.cuda.synchronize, Event.synchronize and
    Stream.synchronize made inside."""
    targets = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in targets]

    def counted(fn: Callable, label: str) -> Callable:
        def wait(*args, **kwargs):
            caller = sys._getframe(1)
            record(f"{label} at {_short(caller.f_code.co_filename)}:{caller.f_lineno}")
            return fn(*args, **kwargs)
        return wait

    try:
        for owner, name, fn in originals:
            label = f"{getattr(owner, '__name__', 'cuda')}.{name}" if owner is not torch.cuda else "cuda.synchronize"
            setattr(owner, name, counted(fn, label))
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def _short(path: str) -> str:
    """``path`` from the repository root where it is inside it (ignite_amp/step/train.py), else its last two parts."""
    relative = os.path.relpath(os.path.abspath(path), ROOT)
    parts = path.replace("\\", "/").split("/")
    return relative.replace("\\", "/") if not relative.startswith("..") else "/".join(parts[-2:])
