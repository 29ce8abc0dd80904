"""Section b: create_amp_trainer, bare and with the default handlers, against the hand-written loop
(ResNet-18 at 32x32, batch 256, bfloat16 and float16, interleaved repeats)."""
import copy
import statistics
import tempfile
import time

import torch
from torch.nn.functional import cross_entropy

from overhead import attach_default_handlers, hand_written_loop, timed

from ignite_amp import create_amp_trainer
from ignite_amp.models import build_model

from .common import Context


def overhead(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~25 s. torchvision's ResNet-18 at 32x32, batch 256, is launch-bound: a
        # step takes ~4-6 ms, so 3 variants x (2 warm-up + 11 timed) epochs of 50 iterations take
        # ~10 s per dtype, plus building the three models.
        gpu=dict(model="resnet18", kwargs={}, batch=256, image=32, iters=50, repeats=11, warmup=2),
        smoke=dict(model="ignite_amp.models:small_cnn", kwargs={"width": 8}, batch=8, image=16, iters=4,
                   repeats=3, warmup=1))
    device = ctx.device
    ctx.result["data"]["sizes"] = size
    ctx.table("median time per iteration; ratios are medians of per-repeat ratios",
              ["dtype", "variant", "ms_per_iter", "vs_hand_loop", "ratio_min", "ratio_max", "repeats"])
    dtypes = ("bfloat16", "float16")
    for i, dtype_name in enumerate(dtypes):
        share = (ctx.left() - 2) / (len(dtypes) - i)  # this dtype's share of what is left
        times = _overhead_times(size, getattr(torch, dtype_name), device, time.monotonic() + share)
        hand = times["hand-written loop"]
        for name, values in times.items():
            ratios = [a / b for a, b in zip(values, hand)]
            ctx.row(dtype=dtype_name, variant=name, ms_per_iter=statistics.median(values) * 1e3,
                    vs_hand_loop=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                    repeats=len(values))
        for name, limit in (("create_amp_trainer", 1.01), ("+ default handlers", 1.02)):
            ratio = statistics.median([a / b for a, b in zip(times[name], hand)])
            ctx.target(f"{dtype_name}: {name} within {(limit - 1) * 100:.0f}% of the hand loop",
                       f"{ratio:.4f} ({(ratio - 1) * 100:+.2f}%)", ratio <= limit)
    ctx.note("Default handlers: overhead.attach_default_handlers (the handlers a config attaches by default).")


def _overhead_times(size: dict, dtype: torch.dtype, device: torch.device, deadline: float) -> dict:
    """Seconds per iteration of each variant, per repeat; repeats stop early at ``deadline`` (3 at least)."""
    torch.manual_seed(0)
    base = build_model(size["model"], 10, size["kwargs"])
    batches = [(torch.randn(size["batch"], 3, size["image"], size["image"], device=device),
                torch.randint(0, 10, (size["batch"],), device=device)) for _ in range(size["iters"])]

    def fresh():
        model = copy.deepcopy(base).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    hand_model, hand_opt = fresh()
    hand_scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    amp_model, amp_opt = fresh()
    trainer = create_amp_trainer(amp_model, amp_opt, cross_entropy, device=device, dtype=dtype)
    full_model, full_opt = fresh()
    full = create_amp_trainer(full_model, full_opt, cross_entropy, device=device, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-overhead-") as logdir:
        attach_default_handlers(full, full_model, full_opt, logdir)
        variants = {
            "hand-written loop": lambda: hand_written_loop(hand_model, hand_opt, hand_scaler, batches, device, dtype),
            "create_amp_trainer": lambda: trainer.run(batches, max_epochs=1),
            "+ default handlers": lambda: full.run(batches, max_epochs=1),
        }
        for _ in range(size["warmup"]):
            for fn in variants.values():
                fn()
        times = {name: [] for name in variants}
        for repeat in range(size["repeats"]):
            begin = time.monotonic()
            for name, fn in variants.items():  # interleaved: drift hits every variant alike
                times[name].append(timed(fn, device) / size["iters"])
            if repeat >= 2 and time.monotonic() + (time.monotonic() - begin) > deadline:
                break
    return times
