"""Build a run from a config: data, model, optimizer, trainer, evaluator, handlers; then train.

This is the one module of ``ignite_amp`` that imports ``handlers``.
"""
import os
import time
from typing import Any, Callable, Optional

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.metrics import Accuracy, Loss

from ignite_amp.batch_size import find_batch_size
from ignite_amp.builders import build_optimizer, build_scheduler, config_device, input_shape, seed_everything
from ignite_amp.collectives import is_distributed
from ignite_amp.config import flatten_config, load_config, save_config
from ignite_amp.data import build_loaders
from ignite_amp.errors import CheckpointError, ConfigError
from ignite_amp.events import AmpEvents
from ignite_amp.handlers import (BestCheckpoint, GradientClipping, NonFiniteGuard, OOMBackoff, ProfilerCapture,
                                 TensorBoardMetrics)
from ignite_amp.launcher import launch
from ignite_amp.models import build_model
from ignite_amp.step import create_amp_evaluator, create_amp_trainer

__all__ = ["train_from_config", "build_run", "Run", "search_from_config"]


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
        self.checkpoint: Optional[BestCheckpoint] = None
        self.closers: list = []
        self.resumed_from: Optional[str] = None

    @property
    def output_dir(self) -> str:
        return self.cfg["output_dir"]

    @property
    def tensorboard_dir(self) -> str:
        return os.path.join(self.output_dir, "tensorboard")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.output_dir, "checkpoints")

    def train(self) -> dict:
        cfg = self.cfg
        state = self.trainer.state
        if self.resumed_from and state.epoch >= cfg["train"]["epochs"]:
            self.print(f"already trained {state.epoch} epochs (checkpoint {self.resumed_from}); "
                       f"raise train.epochs to train more")
        else:
            step, world = self.trainer.amp_step, idist.get_world_size()
            where = f"{world} processes ({idist.backend()}), {step.device.type}" if world > 1 else str(step.device)
            self.print(f"training {cfg['name']} on {where} with {str(step.dtype)[6:]} autocast; "
                       f"output in {self.output_dir}")
            try:
                self.trainer.run(self.train_loader, max_epochs=cfg["train"]["epochs"],
                                 epoch_length=cfg["train"]["epoch_length"])
            finally:  # also after an exception: stop the profiler, flush TensorBoard
                for close in self.closers:
                    close()
        return {"history": self.history, "final": self.history[-1] if self.history else {},
                "output_dir": self.output_dir,
                "best_checkpoint": self.checkpoint.best_path if self.checkpoint else None,
                "tensorboard_dir": self.tensorboard_dir if self.writes_tensorboard else None}

    @property
    def writes_tensorboard(self) -> bool:
        handlers = self.cfg["handlers"]
        return handlers["tensorboard"]["enabled"] or handlers["profiler"]["enabled"]


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
        samples = self.samples
        if self.loss_sum is None:
            train_loss = float("nan")
        else:  # over every rank's samples (all_reduce returns the tensor as it is in one process)
            totals = torch.stack([self.loss_sum.double(),
                                  torch.tensor(samples, dtype=torch.float64, device=self.loss_sum.device)])
            loss_sum, samples = idist.all_reduce(totals).tolist()
            train_loss = loss_sum / max(samples, 1)
        seconds = time.perf_counter() - self.start  # after the .tolist() sync above
        run = self.run
        run.evaluator.run(run.val_loader)
        metrics = dict(run.evaluator.state.metrics)
        epoch, epochs = engine.state.epoch, engine.state.max_epochs
        record = {"epoch": epoch, "train_loss": train_loss, "samples_per_sec": samples / max(seconds, 1e-9),
                  **{f"val_{k}": float(v) for k, v in metrics.items()}}
        run.history.append(record)
        width = len(str(epochs))
        run.print(f"epoch {epoch:>{width}}/{epochs}  train loss {train_loss:.4f}  "
                  f"val accuracy {metrics.get('accuracy', float('nan')):.4f}  "
                  f"val loss {metrics.get('loss', float('nan')):.4f}  "
                  f"{record['samples_per_sec']:.0f} samples/s  {seconds:.1f}s")


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


def build_run(cfg: Any, progress: bool = False, print_fn: Callable = print) -> Run:
    """Validate ``cfg`` (path, dict or loaded config) and build everything it describes.

    Inside a process group of N > 1 ranks (``torchrun``, or :func:`train_from_config` with
    ``distributed.nproc_per_node``) the model is wrapped by ``idist.auto_model`` (DDP), the
    loaders shard the global batch, and rank 0 alone prints and writes files.
    """
    cfg = load_config(cfg)
    seed_everything(cfg["seed"])
    device = config_device(cfg)
    main = idist.get_rank() == 0
    if not main:
        print_fn, progress = _silent, False
    if main:
        _check_output_dir(cfg["output_dir"])
    _check_backoff_mode(cfg)
    model = build_model(cfg["model"]["name"], cfg["model"]["num_classes"], cfg["model"]["kwargs"])
    optimizer = build_optimizer(cfg["optimizer"], model)
    if cfg["data"]["batch_size"] == "auto":
        result = search_for_config(cfg, model, optimizer, device)
        world = idist.get_world_size()
        cfg["data"]["batch_size"] = result.batch_size * world
        per_rank = f" per process x {world} processes" if world > 1 else ""
        print_fn(f"batch-size search: largest fit {result.largest_fit}, using {result.batch_size}{per_rank} "
                 f"({len(result.trials)} trials)")

    train_loader, val_loader, n_classes = build_loaders(cfg["data"], cfg["model"]["num_classes"], device,
                                                        cfg["seed"])
    if n_classes != cfg["model"]["num_classes"]:
        raise ConfigError(f"model.num_classes: {cfg['model']['num_classes']} but data set "
                          f"{cfg['data']['name']} has {n_classes} classes")
    amp = cfg["amp"]
    loss_fn = torch.nn.functional.cross_entropy
    step_kwargs = dict(device=device, dtype=amp["dtype"], channels_last=amp["channels_last"],
                       compile=amp["compile"], fp32_modules=amp["fp32_modules"])
    trained = model
    if is_distributed():  # DDP wraps the model in its final place and memory format
        model.to(device, memory_format=torch.channels_last if amp["channels_last"] else torch.preserve_format)
        trained = idist.auto_model(model)
        optimizer = idist.auto_optim(optimizer)
    try:
        trainer = create_amp_trainer(trained, optimizer, loss_fn, accumulation_steps=amp["accumulation_steps"],
                                     micro_batches=amp["micro_batches"], **step_kwargs)
        evaluator = create_amp_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(loss_fn)}, **step_kwargs)
    except ValueError as exc:
        raise ConfigError(f"amp: {exc}") from None

    epoch_length = cfg["train"]["epoch_length"] or len(train_loader)
    # An accumulation cycle ends at the epoch's end: ceil(epoch_length / accumulation) steps per epoch.
    total_steps = cfg["train"]["epochs"] * -(-epoch_length // amp["accumulation_steps"])
    scheduler = build_scheduler(cfg["scheduler"], optimizer, cfg["optimizer"]["lr"], total_steps)
    if scheduler is not None:  # per optimizer step taken: a step the scaler skipped does not count
        trainer.add_event_handler(AmpEvents.OPTIMIZER_STEPPED, lambda _: scheduler.step())

    sampler = train_loader.sampler
    if hasattr(sampler, "set_epoch"):  # each epoch's order follows from its number, also after a resume
        trainer.add_event_handler(Events.EPOCH_STARTED, lambda engine: sampler.set_epoch(engine.state.epoch))

    to_save = {"model": model, "optimizer": optimizer, "amp_step": trainer.amp_step, "trainer": trainer}
    if scheduler is not None:
        to_save["scheduler"] = scheduler
    run = Run(cfg, trainer, evaluator, model, optimizer, scheduler, train_loader, val_loader, to_save, print_fn)
    _EpochSummary(run).attach(trainer)
    _attach_handlers(run)
    if progress:
        from ignite.handlers import ProgressBar

        # No loss in the bar: showing it would sync the host with the device every iteration.
        ProgressBar(persist=False).attach(trainer)
    if main:
        save_config(cfg, os.path.join(cfg["output_dir"], "config.yaml"))
    return run


def _check_backoff_mode(cfg: dict) -> None:
    backoff = cfg["handlers"]["oom_backoff"]
    if not (backoff["enabled"] and backoff["mode"] == "batch"):
        return
    if cfg["scheduler"]["name"] != "none":
        raise ConfigError(f"handlers.oom_backoff.mode: batch changes the steps per epoch, which a "
                          f"{cfg['scheduler']['name']} schedule cannot follow; use micro_batch")
    if cfg["train"]["epoch_length"] is not None:
        raise ConfigError("handlers.oom_backoff.mode: batch changes the epoch length; leave train.epoch_length null")


def search_for_config(cfg: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      device: torch.device):
    """Run :func:`~ignite_amp.batch_size.find_batch_size` for a config's model, dtype and input shape."""
    if device.type != "cuda":
        raise ConfigError(f"data.batch_size: the batch-size search needs a GPU, and this run is on {device}")
    shape, classes = input_shape(cfg["data"]), cfg["model"]["num_classes"]

    def make_batch(n: int):
        return (torch.randn(n, *shape, device=device), torch.randint(0, classes, (n,), device=device))

    amp = cfg["amp"]
    return find_batch_size(model, optimizer, torch.nn.functional.cross_entropy, make_batch, device=device,
                           dtype=amp["dtype"], channels_last=amp["channels_last"], fp32_modules=amp["fp32_modules"])


def search_from_config(cfg: dict):
    """``ignite-amp find-batch-size``: ``(result, device name, processes)``; the size is per process."""
    device = config_device(cfg)
    if device.type != "cuda":
        raise ConfigError(f"the batch-size search needs a GPU; CUDA is not available here ({device})")
    seed_everything(cfg["seed"])
    model = build_model(cfg["model"]["name"], cfg["model"]["num_classes"], cfg["model"]["kwargs"])
    result = search_for_config(cfg, model, build_optimizer(cfg["optimizer"], model), device)
    return result, torch.cuda.get_device_name(device), idist.get_world_size()


def _attach_handlers(run: Run) -> None:
    """Build the handlers of the config's ``handlers:`` section and resume if asked."""
    cfg, trainer, evaluator = run.cfg["handlers"], run.trainer, run.evaluator
    backoff = cfg["oom_backoff"]
    if backoff["enabled"]:
        train_backoff = OOMBackoff(backoff["min_batch_size"], mode=backoff["mode"], grow_after=backoff["grow_after"])
        train_backoff.attach(trainer)
        run.to_save["oom_backoff"] = train_backoff
        OOMBackoff(backoff["min_batch_size"]).attach(evaluator)
    clip = cfg["clipping"]
    if clip["max_norm"] is not None and clip["clip_value"] is not None:
        raise ConfigError("handlers.clipping: set max_norm or clip_value, not both")
    if clip["max_norm"] is not None or clip["clip_value"] is not None:
        GradientClipping(max_norm=clip["max_norm"], norm_type=clip["norm_type"],
                         clip_value=clip["clip_value"]).attach(trainer)
    if cfg["non_finite"]["enabled"]:
        NonFiniteGuard(cfg["non_finite"]["max_consecutive"]).attach(trainer)
    if cfg["tensorboard"]["enabled"]:
        tb = TensorBoardMetrics(run.tensorboard_dir, log_every=cfg["tensorboard"]["log_every"],
                                hparams=flatten_config(run.cfg))
        tb.attach(trainer, evaluator=evaluator, optimizer=run.optimizer)
        run.closers.append(tb.close)
    prof = cfg["profiler"]
    if prof["enabled"]:
        profiler = ProfilerCapture(run.tensorboard_dir, wait=prof["wait"], warmup=prof["warmup"],
                                   active=prof["active"], repeat=prof["repeat"])
        profiler.attach(trainer)
        run.closers.append(profiler.stop)
    ckpt = cfg["checkpoint"]
    run.checkpoint = BestCheckpoint(run.checkpoint_dir, run.to_save, metric=ckpt["metric"],
                                    n_saved=ckpt["n_saved"], config=run.cfg)
    run.checkpoint.attach(trainer, evaluator)
    if ckpt["resume"]:
        path = ckpt["resume"]
        if path == "auto":
            path = run.checkpoint.latest()
            if is_distributed():  # every rank resumes from rank 0's choice (output_dir must be shared)
                path = idist.broadcast(path or "", src=0) or None
        run.resumed_from = run.checkpoint.resume(path) if path else None
        if run.resumed_from:
            _check_schedule_fits(run.cfg, run.checkpoint.resumed_config or {}, run.resumed_from)
            run.print(f"resumed from {run.resumed_from} at epoch {trainer.state.epoch}")


SCHEDULE_KEYS = (("train", "epochs"), ("train", "epoch_length"), ("amp", "accumulation_steps"),
                 ("data", "batch_size"))


def _check_schedule_fits(cfg: dict, stored: dict, path: str) -> None:
    """A cosine/one-cycle schedule has a fixed length: refuse a resume that would change it."""
    if cfg["scheduler"]["name"] == "none":
        return
    for section, key in SCHEDULE_KEYS:
        old = stored.get(section, {}).get(key)
        if old != cfg[section][key]:
            raise CheckpointError(
                f"{section}.{key}: the {cfg['scheduler']['name']} schedule in {path} was made for "
                f"{section}.{key}={old}, not {cfg[section][key]}; keep it, or use a new output_dir")


def _train(cfg: dict, progress: bool, print_fn: Callable) -> dict:
    return build_run(cfg, progress=progress, print_fn=print_fn).train()


def train_from_config(cfg: Any, progress: bool = False, print_fn: Callable = print) -> dict:
    """Train what ``cfg`` (a YAML path, a dict, or a loaded config) describes.

    With ``distributed.nproc_per_node: N > 1`` it spawns N processes (``idist.Parallel``; then
    ``print_fn`` must be picklable, like ``print``); under ``torchrun`` this process is one rank.
    Returns rank 0's ``{"history": [per-epoch records], "final": last record, "output_dir": ...,
    "best_checkpoint": ..., "tensorboard_dir": ...}``.
    """
    cfg = load_config(cfg)
    return launch(cfg, _train, cfg, progress, print_fn)
