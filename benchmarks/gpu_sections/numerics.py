"""Section e: numerics parity, CIFAR ResNet-18 on ``shapes`` at 32x32 in float32, float16 and bfloat16."""
import os
import time

from bench_amp import tf32

from ignite_amp.run.compose import train_from_config

from .common import Context, recipe


def numerics(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~30 s. CIFAR ResNet-18 on shapes at 32x32 (6000 training, 1500 validation
        # images), batch 128, 4 epochs, the quickstart's optimizer and schedule: ~8-11 s per dtype (8000
        # images took 10.6 s in float32 and 15 s in float16 on 2026-11-27, leaving no time for bfloat16).
        gpu=dict(model="ignite_amp.models:cifar_resnet18", kwargs={}, train=6000, val=1500, batch=128, epochs=4,
                 workers=4, image=32),
        smoke=dict(model="ignite_amp.models:small_cnn", kwargs={"width": 8}, train=256, val=128, batch=32, epochs=1,
                   workers=0, image=16))
    ctx.result["data"]["sizes"] = size
    ctx.table("the same training (seed, weights, batches) per dtype; final epoch",
              ["dtype", "val_accuracy", "val_loss", "train_loss", "accuracy_points_vs_float32", "samples_per_s",
               "seconds"])
    finals = {}
    for i, dtype in enumerate(("float32", "float16", "bfloat16")):
        if i and ctx.left() < 1.2 * max(r["seconds"] for r in finals.values()):
            ctx.note(f"{dtype} not run: {ctx.left():.0f} s left of the section's budget")
            continue
        cfg = recipe("configs/quickstart.yaml", **{
            "name": f"parity-{dtype}", "device": ctx.device.type, "output_dir": os.path.join(ctx.workdir, dtype),
            "amp.dtype": dtype, "model.name": size["model"], "model.kwargs": size["kwargs"],
            "data.train_size": size["train"], "data.val_size": size["val"], "data.image_size": size["image"],
            "data.batch_size": size["batch"], "data.num_workers": size["workers"], "train.epochs": size["epochs"],
            "handlers.checkpoint.resume": "never", "handlers.tensorboard.enabled": False})
        begin = time.perf_counter()
        with tf32(False if dtype == "float32" else None):  # the reference is IEEE float32
            final = train_from_config(cfg, print_fn=lambda *a, **k: None)["final"]
        finals[dtype] = dict(final, seconds=time.perf_counter() - begin)
        reference = finals.get("float32")
        delta = None if reference is None else (final["val_accuracy"] - reference["val_accuracy"]) * 100
        ctx.row(dtype=dtype, val_accuracy=final["val_accuracy"], val_loss=final["val_loss"],
                train_loss=final["train_loss"], accuracy_points_vs_float32=delta,
                samples_per_s=final["samples_per_sec"], seconds=finals[dtype]["seconds"])
        if dtype != "float32":
            ctx.target(f"{dtype}: val accuracy within 0.5 points of float32",
                       "" if delta is None else f"{delta:+.2f} points", None if delta is None else abs(delta) <= 0.5)
    for dtype in ("float16", "bfloat16"):
        if dtype not in finals:
            ctx.target(f"{dtype}: val accuracy within 0.5 points of float32", "not run", None)
    ctx.note(f"{size['model']} on shapes {size['image']}x{size['image']}, {size['train']}/{size['val']} images, "
             f"batch {size['batch']}, {size['epochs']} epochs, the quickstart's AdamW and one-cycle schedule; "
             f"float32 with TF32 off.")
