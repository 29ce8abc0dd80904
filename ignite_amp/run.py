"""Build a run from a config: data, model, optimizer, trainer, evaluator, handlers; then train.

This is the one module of ``ignite_amp`` that imports ``handlers``.
"""
import os
import random
import time
from typing import Any, Callable, Optional

import torch
from ignite.engine import Engine, Events
from ignite.metrics import Accuracy, Loss

from ignite_amp.config import ConfigError, load_config, save_config
from ignite_amp.data import build_loaders
from ignite_amp.models import build_model
from ignite_amp.step import create_amp_evaluator, create_amp_trainer, resolve_device

__all__ = ["train_from_config", "build_run", "Run"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(opt: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    cls = getattr(torch.optim, opt["name"], None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer.name: unknown torch.optim optimizer {opt['name']!r}")
    try:
        return cls(model.parameters(), lr=opt["lr"], **opt["kwargs"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"optimizer.kwargs: {opt['name']} refused its arguments ({exc})") from None


def build_scheduler(sched: dict, optimizer: torch.optim.Optimizer, lr: float, total_steps: int):
    from torch.optim import lr_scheduler

    try:
        if sched["name"] == "cosine":
            return lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps, **sched["kwargs"])
        if sched["name"] == "onecycle":
            return lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps, **sched["kwargs"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"scheduler.kwargs: {sched['name']} refused its arguments ({exc})") from None
    return None


def _check_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"output_dir: cannot write to {path} ({exc.strerror or exc})") from None


class Run:
    """Everything a config builds; ``run.train()`` trains it."""

    def __init__(self, cfg: dict, trainer: Engine, evaluator: Engine, model, optimizer, scheduler,
                 train_loader, val_loader, to_save: dict, print_fn: Callable):
        self.cfg, self.trainer, self.evaluator = cfg, trainer, evaluator
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_loader, self.val_loader = train_loader, val_loader
        self.to_save = to_save
        self.print = print_fn
        self.history = []

    @property
    def output_dir(self) -> str:
        return self.cfg["output_dir"]

    def train(self) -> dict:
        cfg = self.cfg
        self.trainer.run(self.train_loader, max_epochs=cfg["train"]["epochs"],
                         epoch_length=cfg["train"]["epoch_length"])
        return {"history": self.history, "final": self.history[-1] if self.history else {},
                "output_dir": self.output_dir}


class _EpochSummary:
    """Train loss (mean kept on device, one sync per epoch), samples/s, then validation."""

    def __init__(self, run: Run):
        self.run = run
        self.loss_sum: Optional[torch.Tensor] = None
        self.samples = 0
        self.start = 0.0

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.EPOCH_STARTED, self.started)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self.iteration)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self.completed)

    def started(self, engine: Engine) -> None:
        self.loss_sum, self.samples, self.start = None, 0, time.perf_counter()

    def iteration(self, engine: Engine) -> None:
        out = engine.state.output
        weighted = out["loss"] * out["batch_size"]
        self.loss_sum = weighted if self.loss_sum is None else self.loss_sum + weighted
        self.samples += out["batch_size"]

    def completed(self, engine: Engine) -> None:
        train_loss = (self.loss_sum / max(self.samples, 1)).item() if self.loss_sum is not None else float("nan")
        seconds = time.perf_counter() - self.start  # after the .item() sync above
        run = self.run
        run.evaluator.run(run.val_loader)
        metrics = dict(run.evaluator.state.metrics)
        epoch, epochs = engine.state.epoch, engine.state.max_epochs
        record = {"epoch": epoch, "train_loss": train_loss, "samples_per_sec": self.samples / max(seconds, 1e-9),
                  **{f"val_{k}": float(v) for k, v in metrics.items()}}
        run.history.append(record)
        width = len(str(epochs))
        run.print(f"epoch {epoch:>{width}}/{epochs}  train loss {train_loss:.4f}  "
                  f"val accuracy {metrics.get('accuracy', float('nan')):.4f}  "
                  f"val loss {metrics.get('loss', float('nan')):.4f}  "
                  f"{record['samples_per_sec']:.0f} samples/s  {seconds:.1f}s")


def build_run(cfg: Any, progress: bool = False, print_fn: Callable = print) -> Run:
    """Validate ``cfg`` (path, dict or loaded config) and build everything it describes."""
    cfg = load_config(cfg)
    seed_everything(cfg["seed"])
    try:
        device = resolve_device(cfg["device"])
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"device: {exc}") from None
    _check_output_dir(cfg["output_dir"])
    if cfg["data"]["batch_size"] == "auto":
        raise ConfigError("data.batch_size: \"auto\" needs the batch-size search, which needs a GPU")

    train_loader, val_loader, n_classes = build_loaders(cfg["data"], cfg["model"]["num_classes"], device,
                                                        cfg["seed"])
    if n_classes != cfg["model"]["num_classes"]:
        raise ConfigError(f"model.num_classes: {cfg['model']['num_classes']} but data set "
                          f"{cfg['data']['name']} has {n_classes} classes")
    model = build_model(cfg["model"]["name"], cfg["model"]["num_classes"], cfg["model"]["kwargs"])
    optimizer = build_optimizer(cfg["optimizer"], model)
    amp = cfg["amp"]
    loss_fn = torch.nn.functional.cross_entropy
    step_kwargs = dict(device=device, dtype=amp["dtype"], channels_last=amp["channels_last"],
                       compile=amp["compile"], fp32_modules=amp["fp32_modules"])
    try:
        trainer = create_amp_trainer(model, optimizer, loss_fn, accumulation_steps=amp["accumulation_steps"],
                                     micro_batches=amp["micro_batches"], **step_kwargs)
        evaluator = create_amp_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(loss_fn)}, **step_kwargs)
    except ValueError as exc:
        raise ConfigError(f"amp: {exc}") from None

    epoch_length = cfg["train"]["epoch_length"] or len(train_loader)
    total_steps = max(1, cfg["train"]["epochs"] * epoch_length // amp["accumulation_steps"])
    scheduler = build_scheduler(cfg["scheduler"], optimizer, cfg["optimizer"]["lr"], total_steps)
    if scheduler is not None:
        every = amp["accumulation_steps"]
        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=every), lambda _: scheduler.step())

    to_save = {"model": model, "optimizer": optimizer, "amp_step": trainer.amp_step, "trainer": trainer}
    if scheduler is not None:
        to_save["scheduler"] = scheduler
    run = Run(cfg, trainer, evaluator, model, optimizer, scheduler, train_loader, val_loader, to_save, print_fn)
    _EpochSummary(run).attach(trainer)
    if progress:
        from ignite.handlers import ProgressBar

        # No loss in the bar: showing it would sync the host with the device every iteration.
        ProgressBar(persist=False).attach(trainer)
    save_config(cfg, os.path.join(cfg["output_dir"], "config.yaml"))
    return run


def train_from_config(cfg: Any, progress: bool = False, print_fn: Callable = print) -> dict:
    """Train what ``cfg`` (a YAML path, a dict, or a loaded config) describes.

    Returns ``{"history": [per-epoch records], "final": last record, "output_dir": ...}``.
    """
    return build_run(cfg, progress=progress, print_fn=print_fn).train()
