"""Sections m, n and o (opt-in, issue 51): what the GPU defaults and the CUDA graphs opt-in give.

m. Memory format and fused step: ResNet-50 at 224x224, batch 128, data on the GPU; float32 (TF32 on, NCHW, torch's
   foreach step: the reference of the issue's 1.30x) against float16 and bfloat16 with the defaults
   (``channels_last`` auto, the optimizer built as a config run builds it: fused on CUDA), and float16 with the
   defaults but an unfused step (what the fused step alone gives); the fused and the foreach step's parameters after
   the same steps, to ``torch.testing.assert_close``'s tolerance.
n. The input path: the quickstart config trained by ``build_run`` for two epochs with ``data.num_workers: auto``
   (pinned memory, non-blocking copies and the next batch prefetched on a side stream on CUDA) and with
   ``num_workers: 0``; the data-wait share its own health summary reports.
o. CUDA graphs: ResNet-18 (CIFAR stem) at 32x32, batch 256, bfloat16, eager against ``compile="reduce-overhead"``
   (after its compilation and parity check), both with the fused step; whether the parity check passed.
"""
import os
import re
import statistics
import time

import torch
from bench_amp import DTYPES, Timer, resnet18_32, resnet50, tf32
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer
from ignite_amp.config.run_keys import OptimizerConfig
from ignite_amp.run.builders import build_optimizer
from ignite_amp.run.compose import build_run
from ignite_amp.run.fused import fused_choice

from .common import NEEDS_CUDA, Context, recipe, tiny_cnn

SGD = OptimizerConfig(name="SGD", lr=0.01, kwargs={"momentum": 0.9})
VARIANTS = (  # label, bench_amp dtype, channels_last, optimizer built for the device (fused on CUDA)
    ("float32, TF32 on, NCHW, foreach step", "float32+tf32", False, False),
    ("float16, defaults", "float16", "auto", True),
    ("bfloat16, defaults", "bfloat16", "auto", True),
    ("float16, defaults, foreach step", "float16", "auto", False),
)
REFERENCE = VARIANTS[0][0]


def memory_format_and_fused(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~45 s. Each variant builds ResNet-50 (~2 s), warms up 3 steps (cudnn autotuning
        # per layout and dtype) and times 3 x 8 steps (40-200 ms each): 6-10 s per variant; the parity check
        # runs 4 steps twice.
        gpu=dict(factory=resnet50, model="torchvision resnet50", batch=128, image=224, steps=8, repeats=3, warmup=3),
        smoke=dict(factory=tiny_cnn, model="small_cnn width 8", batch=8, image=16, steps=2, repeats=2, warmup=1))
    device = ctx.device
    torch.backends.cudnn.benchmark = True
    ctx.result["data"].update(model=size["model"], batch=size["batch"], image=size["image"], optimizer="SGD momentum",
                              loop="create_amp_trainer, no handlers")
    ctx.table("each variant alone on the device", ["variant", "channels_last", "fused", "step_ms", "images_per_s",
                                                   "status"])
    measured = {}
    for label, dtype_name, layout, for_device in VARIANTS:
        if dtype_name == "bfloat16" and ctx.cuda and not torch.cuda.is_bf16_supported():
            ctx.row(variant=label, status="not run: this GPU has no bfloat16")
            continue
        if ctx.left() < 15:
            ctx.row(variant=label, status=f"not run: {ctx.left():.0f} s left of the section's budget")
            continue
        r = _measure(size, dtype_name, layout, for_device, device)
        measured[label] = r
        ctx.row(variant=label, status="measured", **r)
    reference, fast = measured.get(REFERENCE), measured.get("float16, defaults")
    ratio = fast["images_per_s"] / reference["images_per_s"] if reference and fast else None
    ctx.target(f"ResNet-50 float16 with the defaults: >= 1.5x {REFERENCE} (1.30x in NCHW before issue 51)",
               f"{ratio:.2f}x" if ratio else "", ratio >= 1.5 if ratio else None)
    unfused = measured.get("float16, defaults, foreach step")
    if fast and unfused:
        ctx.note(f"float16 with the defaults: {fast['step_ms']:.2f} ms per iteration with the optimizer built for the "
                 f"device, {unfused['step_ms']:.2f} ms with torch's default (foreach) step")
    diff = _fused_parity(size, device)
    ctx.target("fused step: the parameters of the foreach step after 4 float16 steps (assert_close)",
               "equal" if diff is None else diff, diff is None if ctx.cuda else None)
    choice = fused_choice("SGD", {}, device)
    ctx.note(f"SGD fused on {device.type}: {bool(choice.fused)} ({choice.why}); channels_last: what auto chose for "
             f"{size['model']}")


def _measure(size: dict, dtype_name: str, layout, for_device: bool, device: torch.device) -> dict:
    dtype, tf32_mode = DTYPES[dtype_name]
    torch.manual_seed(0)
    model = size["factory"](10)
    optimizer = build_optimizer(SGD, model, device if for_device else None)
    batches = [(torch.randn(size["batch"], 3, size["image"], size["image"], device=device),
                torch.randint(0, 10, (size["batch"],), device=device)) for _ in range(2)]
    with tf32(tf32_mode):
        trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype=dtype, channels_last=layout)
        trainer.run([batches[i % 2] for i in range(size["warmup"])], max_epochs=1)
        timer = Timer(device)
        steps = [batches[i % 2] for i in range(size["steps"])]
        step = statistics.median(timer(lambda t=trainer, s=steps: t.run(s, max_epochs=1)) / size["steps"]
                                 for _ in range(size["repeats"]))
    fused = any(bool(g.get("fused")) for g in optimizer.param_groups)
    return {"channels_last": trainer.amp_step.channels_last, "fused": fused, "step_ms": step * 1e3,
            "images_per_s": size["batch"] / step}


def _fused_parity(size: dict, device: torch.device):
    """None when the fused and the foreach step give the same parameters after 4 float16 steps, else the mismatch."""
    def train(fused: bool) -> list:
        torch.manual_seed(0)
        model = tiny_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=fused)
        trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype="float16")
        g = torch.Generator().manual_seed(1)
        trainer.run([(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))
                     for _ in range(4)], max_epochs=1)
        return [p.detach().float().cpu() for p in model.parameters()]

    try:
        for a, b in zip(train(True), train(False), strict=True):
            torch.testing.assert_close(a, b)
    except AssertionError as exc:
        return str(exc).splitlines()[0]
    return None


def input_path(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~60 s. The quickstart (small CNN, shapes 32x32, batch 64): two epochs of 8000
        # images (125 iterations each) and one evaluation of 512 per epoch, three times: the defaults (workers and
        # data.on_device auto: the data on the GPU), the host path with workers auto (on_device false), and 0.
        gpu=dict(train=8000, val=512, epochs=2),
        smoke=dict(train=128, val=32, epochs=1))
    ctx.table("the quickstart, trained by build_run (its health summary's figures)",
              ["num_workers", "on_device", "workers", "data_on_device", "why", "data_wait_pct", "samples_per_s",
               "seconds", "status"])
    waits = {}
    for workers, on_device in (("auto", "auto"), ("auto", False), (0, False)):
        cfg = recipe("configs/quickstart.yaml", **{
            "name": f"input-path-{workers}-{on_device}", "device": ctx.device.type,
            "output_dir": os.path.join(ctx.workdir, f"input-{workers}-{on_device}"), "data.num_workers": workers,
            "data.on_device": on_device,
            "data.train_size": size["train"], "data.val_size": size["val"], "train.epochs": size["epochs"],
            "scheduler.name": "none", "handlers.checkpoint.resume": "never"})
        begin = time.monotonic()
        run = build_run(cfg, print_fn=lambda line: None)
        run.train()
        text = " ".join(run.health_lines)
        wait = re.search(r"data wait:? ([0-9.]+)% of the time", text)
        speed = re.search(r"speed: ([0-9.e+]+) samples/s", text)
        waits[workers, on_device] = float(wait.group(1)) if wait else None
        ctx.row(num_workers=workers, on_device=on_device, workers=run.facts["num_workers"],
                data_on_device=run.facts["data_on_device"], why=run.facts["num_workers_why"],
                data_wait_pct=waits[workers, on_device], samples_per_s=float(speed.group(1)) if speed else None,
                seconds=time.monotonic() - begin, status="measured")
    wait = waits.get(("auto", "auto"))
    ctx.target("the quickstart's data wait with the defaults: under 5% of the time (26% with num_workers 0)",
               f"{wait:.1f}%" if wait is not None else "", wait < 5 if wait is not None else None)


def cuda_graphs(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~90 s. Eager: 5 warm-up and 3 x 20 timed steps of ~10 ms. Graphs: torch.compile of
        # the forward and backward (~40-60 s) and the graph recording in the warm-up, then the same timing.
        gpu=dict(factory=resnet18_32, model="CIFAR ResNet-18", batch=256, image=32, steps=20, repeats=3, warmup=5),
        smoke=dict(factory=tiny_cnn, model="small_cnn width 8", batch=8, image=16, steps=2, repeats=2, warmup=2))
    device = ctx.device
    ctx.result["data"].update(model=size["model"], batch=size["batch"], image=size["image"], dtype="bfloat16")
    ctx.table("eager against CUDA graphs (compile reduce-overhead)",
              ["variant", "step_ms", "parity", "fell_back", "status"])
    measured = {}
    for label, compile in (("eager", False), ("compile reduce-overhead", "reduce-overhead")):
        if compile and not ctx.cuda:
            ctx.row(variant=label, status=f"skipped: {NEEDS_CUDA} (compiling on this CPU takes longer than the smoke "
                                          f"run; tests/step/test_graphs.py compiles a small model)")
            continue
        torch.manual_seed(0)
        model = size["factory"](10)
        optimizer = build_optimizer(SGD, model, device)
        trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype="bfloat16",
                                     compile=compile)
        batches = [(torch.randn(size["batch"], 3, size["image"], size["image"], device=device),
                    torch.randint(0, 10, (size["batch"],), device=device)) for _ in range(2)]
        trainer.run([batches[i % 2] for i in range(size["warmup"])], max_epochs=1)
        timer, steps = Timer(device), [batches[i % 2] for i in range(size["steps"])]
        step = statistics.median(timer(lambda t=trainer, s=steps: t.run(s, max_epochs=1)) / size["steps"]
                                 for _ in range(size["repeats"]))
        guard = trainer.amp_step.graphs
        measured[label] = step
        ctx.row(variant=label, step_ms=step * 1e3, parity=guard.parity if guard else None,
                fell_back=guard.off if guard else None, status="measured")
    eager, graphed = measured.get("eager"), measured.get("compile reduce-overhead")
    ratio = eager / graphed if eager and graphed else None
    ctx.target("ResNet-18 32x32 batch 256 with CUDA graphs: >= 2x the eager step (about 10 ms an iteration before)",
               f"{ratio:.2f}x" if ratio else "", ratio >= 2 if ratio else None)
