"""Section b: create_amp_trainer, bare and with the default handlers, against the hand-written loop, on a
launch-bound model (ResNet-18 at 32x32, batch 256: the GPU waits for kernel launches, so host overhead shows
in full) and a device-bound one (ResNet-50 at 224x224, batch 64), in bfloat16 and (launch-bound) float16.

How it can see 1% (issue 48: epochs of 50 iterations timed with perf_counter gave per-repeat ratios of
0.87-1.44): many short blocks of iterations, each timed with CUDA events from an idle device; the variants
interleaved in a rotating order (each variant runs first, second and third equally often, so a trend or a
warm cache favours none); the overhead of a variant is the median of its per-round ratios to the hand loop
of the same round, given with a 95% bootstrap interval (seeded). A target passes when the interval's upper
end is within it, misses when its lower end is past it, and is inconclusive otherwise (the noise was larger
than the difference asked about).
"""
import copy
import random
import statistics
import tempfile
import time
from typing import Dict, List, Tuple

import torch
from bench_amp import Timer
from overhead import attach_default_handlers, hand_written_loop
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer
from ignite_amp.models import build_model

from .common import Context, sync

HAND, BARE, FULL = "hand-written loop", "create_amp_trainer", "+ default handlers"
LIMITS = {BARE: 1.01, FULL: 1.02}


def overhead(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~35 s. Launch-bound: ResNet-18 at 32x32, batch 256, ~10 ms an iteration;
        # blocks of 10 iterations, 3 variants a round, up to 40 rounds a dtype (~12 s each). Device-bound:
        # ResNet-50 at 224x224, batch 64, ~20 ms an iteration; blocks of 5, up to 25 rounds (~8 s).
        gpu=dict(cases=[("launch-bound", "resnet18", {}, 256, 32, 10, 40, ("bfloat16", "float16")),
                        ("device-bound", "resnet50", {}, 64, 224, 5, 25, ("bfloat16",))], warmup=2),
        smoke=dict(cases=[("launch-bound", "ignite_amp.models:small_cnn", {"width": 8}, 8, 16, 2, 6,
                           ("bfloat16", "float16"))], warmup=1))
    device = ctx.device
    ctx.result["data"]["sizes"] = size
    ctx.table("median ms per iteration (CUDA events); overhead: median of per-round ratios to the hand loop, "
              "95% bootstrap interval",
              ["model", "dtype", "variant", "ms_per_iter", "vs_hand_loop", "ci_low", "ci_high", "rounds"])
    runs = [(case, dtype) for case in size["cases"] for dtype in case[7]]
    for i, (case, dtype_name) in enumerate(runs):
        label, model, kwargs, batch, image, block, rounds, _ = case
        share = (ctx.left() - 2) / (len(runs) - i)  # this run's share of what is left
        times = _interleaved(model, kwargs, batch, image, block, rounds, size["warmup"], getattr(torch, dtype_name),
                             device, time.monotonic() + share)
        for name, values in times.items():
            median, low, high = ratio_interval(values, times[HAND])
            ctx.row(model=f"{label}: {model} {image}x{image}, batch {batch}", dtype=dtype_name, variant=name,
                    ms_per_iter=statistics.median(values) * 1e3, vs_hand_loop=median, ci_low=low, ci_high=high,
                    rounds=len(values))
        for name, limit in LIMITS.items():
            median, low, high = ratio_interval(times[name], times[HAND])
            verdict = verdict_of(low, high, limit)
            ctx.target(f"{label} {dtype_name}: {name} within {(limit - 1) * 100:.0f}% of the hand loop",
                       f"{(median - 1) * 100:+.2f}% (95% CI {(low - 1) * 100:+.2f}% to {(high - 1) * 100:+.2f}%, "
                       f"{len(times[name])} rounds)"
                       f"{': inconclusive at this noise' if verdict == 'inconclusive' else ''}",
                       verdict)
    ctx.note("Default handlers: overhead.attach_default_handlers (the handlers a config attaches by default). "
             "Each round times one block per variant, in a rotating order; batches stay on the device.")


def ratio_interval(values: List[float], reference: List[float], draws: int = 2000,
                   seed: int = 0) -> Tuple[float, float, float]:
    """The median of the per-round ratios ``values[i] / reference[i]`` and its 95% bootstrap interval.

    >>> ratio_interval([1.0] * 9, [1.0] * 9)
    (1.0, 1.0, 1.0)
    >>> m, lo, hi = ratio_interval([1.1, 1.0, 1.2, 1.05, 1.1], [1.0] * 5); lo <= m <= hi
    True
    """
    ratios = [a / b for a, b in zip(values, reference, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.median(ratios), medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def verdict_of(low: float, high: float, limit: float):
    """True when the interval lies within ``limit``, False when it lies past it, "inconclusive" when it straddles
    it."""
    return True if high <= limit else False if low > limit else "inconclusive"


def _interleaved(model_name: str, kwargs: dict, batch: int, image: int, block: int, rounds: int, warmup: int,
                 dtype: torch.dtype, device: torch.device, deadline: float) -> Dict[str, List[float]]:
    """Seconds per iteration of each variant, one block per variant a round, rounds until ``rounds`` or
    ``deadline`` (6 at least)."""
    torch.manual_seed(0)
    base = build_model(model_name, 10, kwargs)
    batches = [(torch.randn(batch, 3, image, image, device=device),
                torch.randint(0, 10, (batch,), device=device)) for _ in range(block)]

    def fresh():
        model = copy.deepcopy(base).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    hand_model, hand_opt = fresh()
    hand_scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    amp_model, amp_opt = fresh()
    trainer = create_amp_trainer(amp_model, amp_opt, cross_entropy, device=device, dtype=dtype,
                                 channels_last=False)  # the hand loop's layout: overhead, not layout
    full_model, full_opt = fresh()
    full = create_amp_trainer(full_model, full_opt, cross_entropy, device=device, dtype=dtype, channels_last=False)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-overhead-") as logdir:
        attach_default_handlers(full, full_model, full_opt, logdir)
        variants = {
            HAND: lambda: hand_written_loop(hand_model, hand_opt, hand_scaler, batches, device, dtype),
            BARE: lambda: trainer.run(batches, max_epochs=1),
            FULL: lambda: full.run(batches, max_epochs=1),
        }
        for _ in range(warmup):
            for fn in variants.values():
                fn()
        names = list(variants)
        times: Dict[str, List[float]] = {name: [] for name in names}
        for r in range(rounds):
            begin = time.monotonic()
            for k in range(len(names)):  # rotating order: each variant first, second and third alike
                name = names[(r + k) % len(names)]
                times[name].append(_block_seconds(variants[name], device) / block)
            if r >= 5 and time.monotonic() + (time.monotonic() - begin) > deadline:
                break
    return times


def _block_seconds(fn, device: torch.device) -> float:
    """Seconds ``fn`` takes from an idle device to its last kernel (bench_amp's Timer: CUDA events; the wall clock
    on a CPU)."""
    sync(device)
    return Timer(device)(fn)
