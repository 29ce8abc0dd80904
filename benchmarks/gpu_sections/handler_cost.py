"""Section j: the handlers' host cost, benchmarks/overhead.py's table on the small CNN (host-bound) and
ResNet-50 (device-bound), float16."""
import tempfile
import time

import overhead as handler_table
import torch

from ignite_amp.models import build_model

from .common import Context


def handler_cost(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~20 s. benchmarks/overhead.py's table (issue 42), float16 (where Ignite's
        # amp_mode="amp" compares): the quickstart's small CNN at 32x32, batch 64, host-bound (a step of ~2-3 ms,
        # mostly launches: 19 variants x 4 epochs of 30 iterations ~7 s), and ResNet-50 at 224x224, batch 32,
        # device-bound (~12 ms a step: 19 x 3 epochs of 10 iterations ~7 s), plus building the 2 x 19 models.
        gpu=dict(cases=[("small CNN, 32x32, batch 64", "ignite_amp.models:small_cnn", {}, 64, 32, 30, 3),
                        ("ResNet-50, 224x224, batch 32", "resnet50", {}, 32, 224, 10, 2)]),
        smoke=dict(cases=[("small CNN (width 8), 16x16, batch 8", "ignite_amp.models:small_cnn", {"width": 8}, 8, 16,
                           4, 1),
                          ("ResNet-50 stand-in: small CNN (width 4)", "ignite_amp.models:small_cnn", {"width": 4}, 4,
                           16, 4, 1)]))
    device = ctx.device
    ctx.result["data"]["sizes"] = size
    ctx.table("float16, ms per iteration (wall clock, synchronized after each epoch; medians of interleaved repeats); "
              "over: the median per-repeat difference to the reference; between logs: the median iteration without "
              "a log", ["model", "variant", "ms_per_iter", "over", "reference", "between_logs", "work"])
    for name, model, kwargs, batch, image, iters, repeats in size["cases"]:
        if ctx.left() < 8:
            ctx.note(f"{name}: not run, {ctx.left():.0f} s left of the budget")
            continue
        torch.manual_seed(0)
        base = build_model(model, 10, kwargs)
        batches = [(torch.randn(batch, 3, image, image, device=device), torch.randint(0, 10, (batch,), device=device))
                   for _ in range(iters)]
        with tempfile.TemporaryDirectory(prefix="gpu-suite-handlers-") as logdir:
            fns = handler_table.variants(base, batches, device, torch.float16,
                                         lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), logdir,
                                         clock=time.perf_counter)
            table = handler_table.overhead_table(handler_table.measure(fns, repeats, time.perf_counter, device),
                                                 iters, unit="ms")
        del fns, base, batches
        for row in table["rows"]:
            ctx.row(model=name, variant=row["variant"], ms_per_iter=row["per_iter"], over=row["over"],
                    reference=row["reference"], between_logs=row.get("between_logs"), work=row.get("work"))
        for text, limit, value in table["ratios"]:
            ctx.target(f"{name}: {text} <= {limit}x", "" if value is None else f"{value:.2f}x",
                       None if value is None else value <= limit)
    ctx.note("Variants: benchmarks/overhead.py (each default handler alone on create_amp_trainer; Ignite's "
             "TerminateOnNan and TensorboardLogger on create_supervised_trainer(amp_mode='amp', scaler=True)).")
