"""Section c: AMP against float32 on ResNet-50 at 224x224 (fake data on the GPU): throughput and peak memory of
float32 with TF32 off and on, float16 with the scaler, bfloat16; channels_last; torch.compile."""
import time

import torch
from bench_amp import measure_variant, resnet50

from .common import NEEDS_CUDA, Context, tiny_cnn

AMP_VARIANTS = (  # (label, bench_amp dtype, channels_last, torch.compile): section c, in the default suite
    ("float32, TF32 on", "float32+tf32", False, False),
    ("float16 + scaler", "float16", False, False),
    ("bfloat16", "bfloat16", False, False),
    ("float32, TF32 on, channels_last", "float32+tf32", True, False),
    ("float16 + scaler, channels_last", "float16", True, False),
    ("bfloat16, channels_last", "bfloat16", True, False),
)
# Section m (opt-in): IEEE float32 and torch.compile, the rows that did not fit c's budget on an H100.
MORE_VARIANTS = (
    ("float32, TF32 off", "float32", False, False),
    ("bfloat16, channels_last, torch.compile", "bfloat16", True, True),
)
FP32_REFERENCE = "float32, TF32 on"  # the >= 2x claim is held against float32 as PyTorch runs convolutions by default


def amp_vs_fp32(ctx: Context) -> None:
    """Section c: the six rows a user chooses between (float32 as torch runs it, float16, bfloat16; NCHW and
    channels_last)."""
    _variants(ctx, AMP_VARIANTS, targets=True)


def amp_more(ctx: Context) -> None:
    """Section m (opt-in): IEEE float32 (TF32 off) and bfloat16 + channels_last + torch.compile."""
    _variants(ctx, MORE_VARIANTS, targets=False)


def _variants(ctx: Context, variants: tuple, targets: bool) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~75 s for c. ResNet-50 at 224x224, batch 128, a step takes ~34-72 ms (NCHW,
        # 2026-11-27), ~136 ms in float32 with TF32 off. Each eager variant builds (~2 s), warms up 3 steps
        # (cudnn autotuning, a few seconds per dtype and layout) and times 3 x 8 steps: 10-17 s each (the
        # H100 run: 5 variants in 87 s); the compiled variant compiles forward and backward (~40-60 s).
        gpu=dict(factory=resnet50, model="torchvision resnet50", batch=128, image=224, steps=8, repeats=3,
                 warmup=3, compile_warmup=3, compile_estimate_s=40),
        smoke=dict(factory=tiny_cnn, model="small_cnn width 8", batch=8, image=16, steps=2, repeats=2, warmup=1,
                   compile_warmup=1, compile_estimate_s=60))
    device = ctx.device
    torch.backends.cudnn.benchmark = True
    ctx.result["data"].update(
        model=size["model"], batch=size["batch"], image=size["image"], cudnn_benchmark=True,
        steps=f"{size['repeats']} repeats x {size['steps']} steps after {size['warmup']} warm-up steps",
        loop="create_amp_trainer + default handlers")
    ctx.table("each variant alone on the device (peak: from before its model was built to its end)",
              ["variant", "step_ms", "images_per_s", "peak_mb", "before_mb", "cudnn_tf32", "matmul_tf32",
               "status"])
    measured, slowest = {}, 0.0
    for label, dtype_name, channels_last, compile in variants:
        if dtype_name == "bfloat16" and ctx.cuda and not torch.cuda.is_bf16_supported():
            ctx.row(variant=label, status="not run: this GPU has no bfloat16")
            continue
        if compile and not ctx.cuda:
            ctx.row(variant=label, status=f"skipped: {NEEDS_CUDA} (torch.compile is measured on the GPU only; "
                                          f"compiling on this CPU takes longer than the smoke run)")
            continue
        estimate = size["compile_estimate_s"] if compile else 1.2 * slowest
        if ctx.left() < estimate + 2:
            ctx.row(variant=label, status=f"not run: {ctx.left():.0f} s left of the section's budget, "
                                          f"~{estimate:.0f} s needed")
            continue
        begin = time.monotonic()
        r = measure_variant(size["factory"], dtype_name, "ignite-amp+handlers", size["batch"], size["image"],
                            device, steps=size["steps"], repeats=size["repeats"],
                            warmup=size["compile_warmup"] if compile else size["warmup"],
                            channels_last=channels_last, compile=compile)
        slowest = max(slowest, time.monotonic() - begin) if not compile else slowest
        measured[label] = r
        ctx.row(variant=label, step_ms=r["step_ms"], images_per_s=r["images_per_s"], peak_mb=r["peak_mb"],
                before_mb=r["baseline_mb"], cudnn_tf32=r["cudnn_tf32"], matmul_tf32=r["matmul_tf32"],
                status="measured")
        if targets and label == "bfloat16":  # the like-for-like rows are in: the targets now, before the others
            _amp_targets(ctx, measured)
    if targets and not ctx.result["targets"]:
        _amp_targets(ctx, measured)
    if not targets:
        ctx.target("rows measured (no target: compare with section c's rows of the same run or RESULTS.md)",
                   f"{len(measured)} of {len(variants)}", len(measured) == len(variants))
    ctx.note(f"The 2x claim compares against '{FP32_REFERENCE}' (TF32 convolutions are PyTorch's default, so this "
             f"is the float32 a user gets); 'float32, TF32 off' is IEEE float32. Memory saving: peaks less what was "
             f"allocated before each variant was built.")


def _amp_targets(ctx: Context, measured: dict) -> None:
    reference, strict = measured.get(FP32_REFERENCE), measured.get("float32, TF32 off")
    for label in ("float16 + scaler", "bfloat16"):
        r = measured.get(label)
        if r is None or reference is None:
            ctx.target(f"{label}: >= 2x the throughput of {FP32_REFERENCE}", "", None)
            ctx.target(f"{label}: >= 40% less peak memory than float32", "", None)
            continue
        speedup = r["images_per_s"] / reference["images_per_s"]
        vs_strict = f"; {r['images_per_s'] / strict['images_per_s']:.2f}x float32 with TF32 off" if strict else ""
        ctx.target(f"{label}: >= 2x the throughput of {FP32_REFERENCE}", f"{speedup:.2f}x{vs_strict}",
                   speedup >= 2.0)
        if r["peak_mb"] is None:
            ctx.target(f"{label}: >= 40% less peak memory than float32", "no memory figure off CUDA", None)
            continue
        saved = 1 - (r["peak_mb"] - r["baseline_mb"]) / (reference["peak_mb"] - reference["baseline_mb"])
        ctx.target(f"{label}: >= 40% less peak memory than float32", f"{saved * 100:.1f}% less", saved >= 0.40)
