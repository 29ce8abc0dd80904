"""GPU suite section k (opt-in, issue 40): the memory plan against the GPU's own count.

For ResNet-50 (224x224) and a GPT-style decoder, at two batch sizes each, in bfloat16 and float16: the peak
``ignite_amp.estimate_memory`` predicts (fake tensors, nothing allocated) against ``torch.cuda.max_memory_allocated``
of the same step (the optimizer's state present, as the plan assumes: the run's first step after an optimizer
step, with its one-time loss check), and of the next one (steady state); then the batch-size search's real
trials when it starts from the plan (ResNet-50, bfloat16). Without CUDA the same code runs on CPU stand-ins
and prints NOT MEASURED.

    python benchmarks/gpu_suite.py --only k --out gpu-results
"""
import gc
import time

import torch
from float8_gpt import GPT, next_token_loss
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer, estimate_memory, find_batch_size
from ignite_amp.core.device import free_memory
from ignite_amp.memory_plan.fake_step import warm_optimizer
from ignite_amp.models import build_model


def memory_plan_section(ctx) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~120 s (8 plans of a few seconds, 16 real steps, one search of ~3 trials).
        gpu=dict(cnn="resnet50", image=224, cnn_batches=(32, 128), vocab=32768, width=1024, depth=12, heads=16,
                 seq=1024, gpt_batches=(2, 8), dtypes=("bfloat16", "float16")),
        smoke=dict(cnn="resnet18", image=32, cnn_batches=(2,), vocab=128, width=32, depth=2, heads=4, seq=16,
                   gpt_batches=(2,), dtypes=("bfloat16",)))
    device = ctx.device
    ctx.result["data"]["sizes"] = size
    ctx.table("predicted (fake tensors) against torch.cuda.max_memory_allocated, AdamW, create_amp_trainer",
              ["model", "dtype", "batch", "predicted_mb", "measured_mb", "error", "steady_mb", "plan_s", "status"])
    models = {
        f"torchvision {size['cnn']} {size['image']}x{size['image']}": (
            lambda: build_model(size["cnn"], 1000, {}), cross_entropy, size["cnn_batches"],
            lambda n: (torch.randn(n, 3, size["image"], size["image"], device=device),
                       torch.randint(0, 1000, (n,), device=device))),
        f"GPT {size['depth']}x{size['width']}, {size['seq']} tokens": (
            lambda: GPT(size["vocab"], size["width"], size["depth"], size["heads"], size["seq"]), next_token_loss,
            size["gpt_batches"],
            lambda n: (torch.randint(0, size["vocab"], (n, size["seq"]), device=device),
                       torch.randint(0, size["vocab"], (n, size["seq"]), device=device))),
    }
    errors = []
    for name, (factory, loss_fn, batches, make_batch) in models.items():
        for dtype in size["dtypes"]:
            for n in batches:
                if ctx.left() < 15:
                    ctx.row(model=name, dtype=dtype, batch=n, status=f"not run: {ctx.left():.0f} s left")
                    continue
                r = _compare(factory, loss_fn, make_batch, n, dtype, device)
                if r["measured_mb"]:
                    errors.append(abs(r["predicted_mb"] - r["measured_mb"]) / r["measured_mb"])
                ctx.row(model=name, dtype=dtype, batch=n, **r, status="measured" if ctx.cuda else "planned (CPU)")
    worst = max(errors) if errors else None
    ctx.target("predicted peak within 10% of max_memory_allocated (worst case)",
               f"{worst:.1%}" if worst is not None else "", None if worst is None else worst <= 0.10)
    if ctx.cuda and ctx.left() > 60:
        model = build_model(size["cnn"], 1000, {}).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        found = find_batch_size(model, optimizer, cross_entropy, models[next(iter(models))][3], device=device,
                                dtype="bfloat16")
        ctx.table("batch-size search from the plan (bfloat16)", ["model", "trials", "batch_size", "strategy"])
        ctx.row(model=size["cnn"], trials=len(found.trials), batch_size=found.batch_size, strategy=found.strategy)
        ctx.target("batch-size search from the plan: <= 3 real trials", str(len(found.trials)),
                   len(found.trials) <= 3)
    else:
        ctx.target("batch-size search from the plan: <= 3 real trials", "", None)
    if not ctx.cuda:
        ctx.skip("needs CUDA: torch.cuda.max_memory_allocated and the search's CUDA meter; the plans ran on CPU")


def _compare(factory, loss_fn, make_batch, n: int, dtype: str, device: torch.device) -> dict:
    gc.collect()
    free_memory(device)
    torch.manual_seed(0)
    model = factory().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    begin = time.perf_counter()
    plan = estimate_memory(model, optimizer, loss_fn, make_batch, [n], device=device, dtype=dtype, fit=False)
    seconds = time.perf_counter() - begin
    predicted = plan.peaks[0].peak / 2**20 if plan.peaks else None
    measured = steady = None
    if device.type == "cuda":
        trainer = create_amp_trainer(model, optimizer, loss_fn, device=device, dtype=dtype)
        batch = make_batch(n)
        warm_optimizer(optimizer)  # the state as after a first step, as the plan has it
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        trainer.run([batch], max_epochs=1)  # the run's first step: the one-time loss check included
        torch.cuda.synchronize(device)
        measured = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        trainer.run([batch], max_epochs=1)
        torch.cuda.synchronize(device)
        steady = torch.cuda.max_memory_allocated(device) / 2**20
        del trainer, batch
    del model, optimizer
    error = None if measured is None or predicted is None else f"{(predicted - measured) / measured:+.1%}"
    return {"predicted_mb": predicted, "measured_mb": measured, "error": error, "steady_mb": steady,
            "plan_s": seconds}
