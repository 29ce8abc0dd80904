"""``ignite-amp compare``: float32 against autocast float16 (with and without GradScaler) and bfloat16 (on a CPU:
bfloat16 alone unless ``--modes`` asks, and the run says so).

The check every AMP tutorial recommends, as a command: the same initial weights and the same
batches in each mode, a table of how far each mode's loss strays from float32, what it costs
and saves, and, when a mode goes non-finite, which layer's output did so first.
"""
import copy
import math
import os
import statistics
import time
from typing import Any, Callable, Iterator, List, NamedTuple, Optional

import torch
from ignite.engine import Engine, Events

from ignite_amp.config.tree import Config, load_config
from ignite_amp.data.datasets import build_loaders
from ignite_amp.engine import create_amp_trainer
from ignite_amp.errors import ConfigError
from ignite_amp.files.run_directory import RunLayout, check_writable, move_aside
from ignite_amp.handlers.tensorboard.metrics import TensorBoardMetrics
from ignite_amp.models import build_model
from ignite_amp.run.builders import build_optimizer, check_classes, check_model_runs, config_device, seed_everything
from ignite_amp.step.events import AmpEvents

__all__ = ["compare", "ModeResult", "format_table", "supported_modes"]

MODES = (("float32", "float32", False), ("float16", "float16", False),
         ("float16+scaler", "float16", True), ("bfloat16", "bfloat16", False), ("float8", "float8", False))


class ModeResult(NamedTuple):
    mode: str
    losses: List[float]
    skipped: int
    step_ms: float
    peak_mb: Optional[float]
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    first_non_finite: Optional[str] = None  # "layer <name> at step <k>", "the loss at step <k>"...
    flag: str = ""


MODE_NAMES = tuple(m[0] for m in MODES)


def supported_modes(device: torch.device) -> list:
    """The modes worth running by default: all on CUDA (bfloat16 where supported); on CPU float32 and
    bfloat16, since CPU float16 has no fast kernels (a ResNet step ran ~100x slower than bfloat16).
    float8 runs only when asked for (``--modes ... float8``): it needs torchao."""
    if device.type == "cuda":
        return [m for m in MODES if m[1] != "float8" and (m[1] != "bfloat16" or torch.cuda.is_bf16_supported())]
    return [m for m in MODES if m[1] not in ("float16", "float8")]


class _NonFinite(Exception):
    pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors in a module's inputs or outputs (tensors, tuples, lists, dicts)."""
    if torch.is_tensor(value):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors(value))  # a host sync per tensor


def _find_non_finite_layer(make_trainer: Callable, batches: list) -> Optional[str]:
    """Replay with hooks (only here: each check is a host sync) to name where the first non-finite value
    appeared: the input batch, a layer, the model's own forward code around its layers, the loss or the
    backward. A module's input is checked when it is called and its output when it returns: a non-finite
    input means the code that ran since (the calling module's own forward) made it."""
    trainer = make_trainer()
    step = trainer.amp_step
    running: List[str] = []  # the modules being called, outermost first

    def where(name: str) -> str:
        return f"layer {name}" if name else "the model's own forward (outside its layers)"

    def found(what: str) -> None:
        raise _NonFinite(f"{what} at step {trainer.state.iteration}")

    def before(name: str):
        def hook(module, args):
            if not _finite(args):
                found(where(running[-1]) if running else "the input batch")
            running.append(name)
        return hook

    def after(name: str):
        def hook(module, args, out):
            running.pop()
            if not _finite(out):
                found(where(name))
        return hook

    def loss_and_gradients(engine, gradients: bool) -> None:
        if step.loss is not None and not _finite(step.loss):
            found("the loss")
        if gradients and not _finite([p.grad for p in step.model.parameters() if p.grad is not None]):
            found("the backward pass (gradients)")

    handles = []
    for name, module in step.model.named_modules():  # the model itself too: name ""
        handles += [module.register_forward_pre_hook(before(name)), module.register_forward_hook(after(name))]
    trainer.add_event_handler(AmpEvents.GRADS_READY, loss_and_gradients, True)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, loss_and_gradients, False)
    try:
        trainer.run(batches, max_epochs=1)
    except _NonFinite as first:
        return str(first)
    finally:
        for handle in handles:
            handle.remove()
    return None


def compare(cfg, steps: int = 50, tolerance: float = 0.1, modes: Optional[List[str]] = None,
            print_fn: Callable = print) -> List[ModeResult]:
    """Train ``steps`` steps per mode from the same weights and batches; return one result per mode.

    ``modes``: names from ``MODE_NAMES`` (float32 always runs first, as the reference);
    default :func:`supported_modes`.
    """
    cfg = load_config(cfg)
    device = config_device(cfg)
    compare_dir = RunLayout(cfg.output_dir).compare_dir
    moved = move_aside(compare_dir)  # a new comparison draws fresh curves
    if moved:
        print_fn(f"moved the previous comparison's TensorBoard runs to {moved}")
    check_writable(compare_dir)  # before minutes of training, not after
    seed_everything(cfg.seed)
    loader, _, n_classes = build_loaders(cfg.data.replace(num_workers=0), cfg.model.num_classes, device,
                                         cfg.seed)
    check_classes(cfg, n_classes)
    batches: List[Any] = []
    it = iter(loader)
    while len(batches) < steps:
        try:
            batches.append(next(it))
        except StopIteration:
            it = iter(loader)
    initial = copy.deepcopy(build_model(cfg.model.name, cfg.model.num_classes,
                                        cfg.model.kwargs).state_dict())
    if modes is None:
        chosen = supported_modes(device)
    else:
        chosen = [m for m in MODES if m[0] == "float32" or m[0] in modes]
    if device.type == "cpu":
        print_fn("comparing on CPU: timings show CPU behaviour, not a GPU's")
        if not modes:
            print_fn("float16 modes left out (slow on a CPU; add: --modes float16 float16+scaler)")

    results = [_run_mode(cfg, device, initial, loader, batches, compare_dir, mode, dtype, use_scaler)
               for mode, dtype, use_scaler in chosen]

    reference = results[0].losses
    # Steps compared: those before the reference went non-finite (after it, there is nothing to compare with).
    compared = next((i for i, loss in enumerate(reference) if not math.isfinite(loss)), len(reference))
    finished = []
    for r in results:
        if r is results[0]:  # the reference: no difference from itself, even when it went non-finite
            flag = "NON-FINITE (the reference)" if compared < len(reference) else ""
            if r.first_non_finite:
                flag = f"NON-FINITE (the reference; first: {r.first_non_finite})"
            finished.append(r._replace(flag=flag))
            continue
        # the first `compared` steps: zip stops there, with the reference longer
        abs_diffs = [abs(a - b) for a, b in zip(r.losses[:compared], reference, strict=False)]
        rel_diffs = [d / max(abs(b), 1e-8) for d, b in zip(abs_diffs, reference, strict=False)]
        max_abs = (max(abs_diffs) if all(map(math.isfinite, abs_diffs)) else math.inf) if abs_diffs else math.nan
        max_rel = (max(rel_diffs) if all(map(math.isfinite, rel_diffs)) else math.inf) if rel_diffs else math.nan
        flags = []
        if r.first_non_finite or not all(map(math.isfinite, r.losses)):
            flags.append("NON-FINITE" + (f" (first: {r.first_non_finite})" if r.first_non_finite else ""))
        elif max_rel > tolerance:
            flags.append(f"DIVERGES (> {tolerance:g} relative)")
        if compared < len(reference):
            flags.append(f"compared on steps 1-{compared} only: float32 went non-finite at step {compared + 1}"
                         if compared else "not compared: float32 went non-finite at step 1")
        finished.append(r._replace(max_abs_diff=max_abs, max_rel_diff=max_rel, flag="; ".join(flags)))
    return finished

def _run_mode(cfg: Config, device: torch.device, initial: dict, loader: Any, batches: List[Any], compare_dir: str,
              mode: str, dtype: str, use_scaler: bool) -> ModeResult:
    """Train ``batches`` from the ``initial`` weights in one mode; its losses, step times, skips and peak memory."""
    from torch.utils.tensorboard import SummaryWriter

    def make_trainer():
        seed_everything(cfg.seed)
        model = build_model(cfg.model.name, cfg.model.num_classes, cfg.model.kwargs)
        model.load_state_dict(initial)
        amp = cfg.amp
        try:
            return create_amp_trainer(model, build_optimizer(cfg.optimizer, model, device),
                                      torch.nn.functional.cross_entropy, device=device, dtype=dtype,
                                      scaler=use_scaler, channels_last=amp.channels_last,
                                      fp32_modules=amp.fp32_modules, float8_recipe=amp.float8_recipe)
        except ValueError as exc:
            raise ConfigError(f"amp: {exc}") from None

    trainer = make_trainer()
    check_model_runs(cfg, trainer.amp_step)  # a shape or head the model cannot take: one line, now
    losses, times, skipped = [], [], [0]

    @trainer.on(Events.ITERATION_STARTED)
    def started(_: Engine) -> None:
        _sync(device)
        times.append(time.perf_counter())

    @trainer.on(Events.ITERATION_COMPLETED)
    def record(engine):
        losses.append(engine.amp_step.loss.item())  # a sync per step: measuring is the point here
        times[-1] = time.perf_counter() - times[-1]

    trainer.add_event_handler(AmpEvents.STEP_SKIPPED, lambda _: skipped.__setitem__(0, skipped[0] + 1))
    # What a training run of this dtype logs (loss scale and skipped steps with a scaler...), every step.
    tb = TensorBoardMetrics(os.path.join(compare_dir, mode), log_every=1,
                            facts={"mode": mode, "batch_size": loader.batch_size})
    tb.attach(trainer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        trainer.run(batches, max_epochs=1)
    finally:
        tb.close()
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    where = _find_non_finite_layer(make_trainer, batches) if not all(map(math.isfinite, losses)) else None
    result = ModeResult(mode, losses, skipped[0], statistics.median(times[1:] or times) * 1e3, peak,
                        first_non_finite=where)
    with SummaryWriter(os.path.join(compare_dir, mode)) as writer:
        for i, (loss, seconds) in enumerate(zip(losses, times, strict=True), start=1):
            writer.add_scalar("compare/loss", loss if math.isfinite(loss) else float("nan"), i)
            writer.add_scalar("compare/step_ms", seconds * 1e3, i)
    return result


def format_table(results: List[ModeResult]) -> str:
    """The modes side by side, within 80 columns (a long flag aside): ``loss`` is the final one, ``max |dL|`` and
    ``max rel`` the largest per-step differences from float32, ``skip`` the skipped steps; the memory columns
    (``peak MB``, ``saved``) only where a peak was measured (a GPU)."""
    base, memory = results[0], any(r.peak_mb is not None for r in results)
    width = max(len(r.mode) for r in results)
    head = (f"{'mode':<{width}} {'loss':>7} {'max |dL|':>8} {'max rel':>7} {'skip':>4} {'ms/step':>7} "
            f"{'speedup':>7}" + (f" {'peak MB':>7} {'saved':>5}" if memory else "") + "  flag")
    rows = [head]
    for r in results:
        peak = "-" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        saved = "-" if r.peak_mb is None or not base.peak_mb else f"{(1 - r.peak_mb / base.peak_mb) * 100:.0f}%"
        rows.append(f"{r.mode:<{width}} {r.losses[-1]:>7.4f} {r.max_abs_diff:>8.4f} {r.max_rel_diff:>7.3f} "
                    f"{r.skipped:>4} {r.step_ms:>7.1f} {base.step_ms / r.step_ms:>6.2f}x"
                    + (f" {peak:>7} {saved:>5}" if memory else "") + f"  {r.flag or 'ok'}")
    return "\n".join(rows)
