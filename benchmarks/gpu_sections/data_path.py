"""Section g: the data path, samples/s with num_workers 0, 4, 8 and pin_memory off/on, quickstart and CIFAR
recipe."""
import time

import torch
from overhead import timed
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader

from ignite_amp import create_amp_trainer
from ignite_amp.config.tree import Config
from ignite_amp.data.datasets import EpochShuffleSampler, build_datasets, data_workers
from ignite_amp.models import build_model

from .common import NEEDS_CUDA, Context, recipe, sync


def data_path(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100 machine (16 cores): ~25 s. Per loader, its second epoch is timed
        # (persistent workers, as the run's loaders): the quickstart's 8000 images in batches of 64
        # (~0.3-1 s) and the CIFAR recipe on 12800 fake images in batches of 256 with crop + flip
        # (~0.5-3 s), 6 loaders each; plus each config's training step rate on batches already on the
        # GPU, to say whether the loader keeps up (~3 s each).
        gpu=dict(workers=(0, 4, 8), quick_train=8000, recipe_train=12800, step_batch=None, steps=20, warmup=5),
        smoke=dict(workers=(0, 2), quick_train=256, recipe_train=512, step_batch=8, steps=2, warmup=1))
    ctx.result["data"]["sizes"] = size
    recipes = (
        ("quickstart", recipe("configs/quickstart.yaml", **{"data.train_size": size["quick_train"]})),
        ("CIFAR recipe, fake data", recipe("configs/cifar10_resnet18.yaml", **{
            "data.name": "fake", "data.download": False, "data.train_size": size["recipe_train"]})),
    )
    ctx.table("loader to device: samples/s of a loader's second epoch (batches copied to the device)",
              ["config", "num_workers", "pin_memory", "samples_per_s", "first_epoch_s", "keeps_up", "seed_setting",
               "status"])
    slowest = 0.0
    for name, cfg in recipes:
        data = cfg.data
        train_set, _, _ = build_datasets(data, cfg.model.num_classes, cfg.seed)
        rate = _step_rate(ctx, cfg, size)
        ctx.result["data"][f"{name}: training step samples/s"] = rate
        seed_row = None
        own = data_workers(data, ctx.device).workers  # num_workers auto (issue 51): what it gives on this machine
        for workers in sorted(set(size["workers"]) | {own}):
            for pin in (False, True):
                seed_setting = workers == own and pin == ctx.cuda  # make_loader pins on CUDA
                if pin and not ctx.cuda:
                    ctx.row(config=name, num_workers=workers, pin_memory=pin, seed_setting=seed_setting,
                            status=f"skipped: {NEEDS_CUDA} (pinned memory)")
                    continue
                if ctx.left() < 2 * slowest + 2:
                    ctx.row(config=name, num_workers=workers, pin_memory=pin, seed_setting=seed_setting,
                            status=f"not run: {ctx.left():.0f} s left of the section's budget")
                    continue
                begin = time.monotonic()
                first, second = _loader_epochs(train_set, data.batch_size, workers, pin, ctx.device, cfg.seed)
                slowest = max(slowest, time.monotonic() - begin)
                samples = len(train_set) / second
                ctx.row(config=name, num_workers=workers, pin_memory=pin, samples_per_s=samples, first_epoch_s=first,
                        keeps_up=samples >= rate, seed_setting=seed_setting, status="measured")
                seed_row = samples if seed_setting else seed_row
        advice = f"{name}: its own num_workers ({data.num_workers}: {own} here) keeps up with its model"
        if seed_row is None:
            ctx.target(advice, "its setting was not in this run's grid", None)
        else:
            ctx.target(advice, f"{seed_row:.0f} samples/s loaded, {rate:.0f} trained", seed_row >= rate)
    ctx.note("keeps_up: the loader delivers at least the samples/s the config's model trains at (bfloat16, "
             "create_amp_trainer, batches already on the device; see data). seed_setting: the config's num_workers, "
             "pinned on CUDA as the run's loaders are. Not a target of the issue: it measures the seed configs' "
             "data-loading advice.")


def _loader_epochs(dataset, batch_size: int, workers: int, pin: bool, device: torch.device, seed: int) -> tuple:
    """Seconds of a loader's first and second epochs, each batch copied to ``device``."""
    loader = DataLoader(dataset, batch_size=batch_size, sampler=EpochShuffleSampler(len(dataset), seed),
                        num_workers=workers, pin_memory=pin, persistent_workers=workers > 0)
    seconds = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        begin = time.perf_counter()
        for x, y in loader:
            x, y = x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)
        sync(device)
        seconds.append(time.perf_counter() - begin)
    del loader  # ends persistent workers
    return tuple(seconds)


def _step_rate(ctx: Context, cfg: Config, size: dict) -> float:
    """Samples/s the config's model trains at in bfloat16 on batches already on the device."""
    device, batch = ctx.device, size["step_batch"] or cfg.data.batch_size
    image = cfg.data.image_size or 32
    torch.manual_seed(0)
    model = build_model(cfg.model.name, cfg.model.num_classes, cfg.model.kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype="bfloat16",
                                 channels_last=cfg.amp.channels_last)
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, cfg.model.num_classes, (batch,), device=device)
    trainer.run([(x, y)] * size["warmup"], max_epochs=1)
    seconds = timed(lambda: trainer.run([(x, y)] * size["steps"], max_epochs=1), device)
    return batch * size["steps"] / seconds
