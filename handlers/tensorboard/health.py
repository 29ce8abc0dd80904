"""The end-of-run health summary: is this mixed-precision run healthy, and if not, what to change.

:func:`health_lines` turns the run's figures (:class:`Health`, read from the TensorBoard windows
and the step) into short lines: first a one-line verdict (healthy, or how many warnings follow), then
precision (skipped steps, final loss scale), clipping (with a warning when most steps clip), speed
(samples/s and step time, the medians of the logged windows), data wait (with a warning when the loader
is the bottleneck), compute (achieved TFLOP/s, MFU), memory, and out-of-memory retries. Each line fits 80
columns where its figures allow. Pure: tested without a run.
"""
import math
import statistics
from typing import List, NamedTuple, Optional, Sequence

__all__ = ["Health", "health_lines", "CLIP_WARN_SHARE", "DATA_WAIT_WARN_SHARE", "SKIP_WARN_SHARE"]

CLIP_WARN_SHARE = 0.5  # most optimizer steps clipped: the bound is the learning rate's real limit
DATA_WAIT_WARN_SHARE = 0.2  # a fifth of the wall time waiting for batches: the loader is the bottleneck
SKIP_WARN_SHARE = 0.05  # float16: a healthy scaler skips a step now and then, not one in twenty


class Health(NamedTuple):
    dtype: str
    scaler: bool
    windows: Sequence[dict]  # TrainWindow.history
    optimizer_steps: int
    skipped_steps: int
    loss_scale: Optional[float] = None
    max_norm: Optional[float] = None  # None: no norm clipping
    peak_memory_mb: Optional[float] = None
    memory_kind: str = "allocated"  # "allocated" (CUDA) or "RSS" (CPU)
    max_rank_memory_mb: Optional[float] = None  # the largest rank's peak, when the ranks were asked
    planned_memory_mb: Optional[float] = None  # the memory plan's peak (fake tensors, ignite_amp.memory_plan.plan)
    oom_retries: int = 0
    micro_batches: int = 1
    micro_batch_size: Optional[int] = None
    flops_per_sample: Optional[float] = None
    peak_name: Optional[str] = None
    since: str = ""  # " since the resume at iteration N" when the counts are of this process's part of the run
    processes: int = 1  # speed and compute are this process's: said when there are several
    from_config: bool = False  # advice names config keys (a config run), else Python arguments
    split_check: Optional[str] = None  # what the split check did (AmpStep.split_check.summary()); None: not run
    split_checked: bool = True  # False: it ran and never concluded


def _setting(h: "Health", config_key: str, python: str) -> str:
    return config_key if h.from_config else python


def _median(windows: Sequence[dict], key: str) -> Optional[float]:
    values = [w[key] for w in windows if key in w and math.isfinite(w[key])]
    return statistics.median(values) if values else None


def _share(windows: Sequence[dict], key: str, weight: str) -> Optional[float]:
    total = sum(w.get(weight, 0) for w in windows if key in w)
    return sum(w[key] * w.get(weight, 0) for w in windows if key in w) / total if total else None


def health_lines(h: Health) -> List[str]:
    """The summary, one finding per line, after a verdict line; lines starting with ``warning:`` ask for a change."""
    lines, checked = [], []
    steps = h.optimizer_steps + h.skipped_steps
    if h.scaler:
        share = h.skipped_steps / steps if steps else 0.0
        scale = f", final loss scale {h.loss_scale:g}" if h.loss_scale is not None else ""
        lines.append(f"precision: {h.dtype} with GradScaler, {h.skipped_steps} of {steps} optimizer steps skipped "
                     f"({share:.1%}){scale}{h.since}")
        checked.append("skipped steps")
        if steps and share > SKIP_WARN_SHARE:
            dtype = _setting(h, "amp.dtype bfloat16", 'dtype="bfloat16"')
            lines.append(f"warning: {share:.0%} of float16 steps skipped for inf/NaN gradients: try {dtype} where "
                         f"the device has it, or lower the lr")
    else:
        what = f"{h.dtype} (autocast off)" if h.dtype == "float32" else f"{h.dtype} autocast (no GradScaler needed)"
        lines.append(f"precision: {what}, {h.optimizer_steps} optimizer steps{h.since}")
    clipped = _share(h.windows, "optimizer/clip_share", "clip_steps")
    if h.max_norm is not None and clipped is not None:
        norm = _median(h.windows, "optimizer/grad_norm")
        median = f", median grad norm {norm:.3g}" if norm is not None else ""
        lines.append(f"clipping: {clipped:.0%} of optimizer steps clipped at max_norm {h.max_norm:g}{median}")
        checked.append("clipping")
        if clipped > CLIP_WARN_SHARE:
            bound = _setting(h, "handlers.clipping.max_norm", "GradientClipping's max_norm")
            lines.append(f"warning: most steps are clipped, so the bound, not the lr, sets the step size: raise "
                         f"{bound}" + (f" (to about {2 * norm:.2g})" if norm else "") + " or lower the lr")
    speed, step_ms = _median(h.windows, "throughput/samples_per_sec"), _median(h.windows, "throughput/step_time_ms")
    if speed is not None and step_ms is not None:  # (logged together: scalars.TrainWindow)
        wait = _share(h.windows, "throughput/data_wait_share", "iterations") or 0.0
        each = f" per process ({h.processes} processes)" if h.processes > 1 else ""
        windows = sum(1 for w in h.windows if "throughput/samples_per_sec" in w)
        lines.append(f"speed: {_figure(speed)} samples/s{each}, {_figure(step_ms)} ms per iteration (medians of "
                     f"{windows} logged window{'' if windows == 1 else 's'})")
        lines.append(f"data wait: {wait:.1%} of the time")
        checked.append("data wait")
        if wait > DATA_WAIT_WARN_SHARE:
            lines.append(f"warning: {wait:.0%} of the time goes to waiting for batches: the loader is the "
                         f"bottleneck; raise {_setting(h, 'data.num_workers', 'the DataLoader num_workers')} or make "
                         f"the dataset cheaper")
    tflops = _median(h.windows, "throughput/tflops")
    if tflops is not None and h.flops_per_sample is not None:  # (TFLOP/s are logged when the FLOPs are known)
        mfu = _median(h.windows, "throughput/mfu")
        of_peak = f"; MFU {mfu:.1%} of the {h.peak_name}" if mfu is not None else ""
        mfu_float8 = _median(h.windows, "throughput/mfu_float8")
        if mfu_float8 is not None:
            of_peak += f", {mfu_float8:.1%} of the float8 dense peak"
        each = " per process" if h.processes > 1 else ""
        lines.append(f"compute: {tflops:.3g} TFLOP/s{each} ({h.flops_per_sample / 1e9:.3g} GFLOP per "
                     f"sample, forward + backward){of_peak}")
    if h.peak_memory_mb:
        largest = f"; the largest rank's {h.max_rank_memory_mb:.0f} MB" if h.max_rank_memory_mb else ""
        planned = ""
        if h.planned_memory_mb and h.memory_kind == "allocated":  # the plan counts tensors, as allocated does
            over = h.peak_memory_mb / h.planned_memory_mb - 1
            planned = f"; planned {h.planned_memory_mb:.0f} MB ({over:+.0%}: what the plan does not count)"
        lines.append(f"memory: peak {h.peak_memory_mb:.0f} MB ({h.memory_kind}){largest}{planned}")
    if h.oom_retries:
        size = f", micro-batches of {h.micro_batch_size}" if h.micro_batch_size else ""
        lines.append(f"out of memory: {h.oom_retries} retries; now {h.micro_batches} micro-batches per batch{size}")
    if h.split_check:
        lines.append(h.split_check if h.split_checked else f"warning: {h.split_check}")
        checked.append("split check")
    return [_verdict(lines, checked)] + lines


def _figure(value: float) -> str:
    """Four significant digits, or the whole number from 10000 on (no exponent: ``123456``, not ``1.235e+05``)."""
    return f"{value:.4g}" if value < 1e4 else f"{value:.0f}"


def _verdict(lines: List[str], checked: List[str]) -> str:
    """One line: healthy (and what was checked), or how many warnings follow."""
    warnings = sum(line.startswith("warning:") for line in lines)
    if warnings:
        return f"verdict: {warnings} warning{'' if warnings == 1 else 's'} below, each with the change to make"
    if not checked:
        return "verdict: healthy, nothing to warn about"
    listed = ", ".join(checked[:-1]) + (" and " if len(checked) > 1 else "") + checked[-1]
    return f"verdict: healthy ({listed} within bounds)"
