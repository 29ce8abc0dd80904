"""float32 vs float16 vs bfloat16, and ignite-amp vs the hand-written loop vs Ignite's stock AMP trainer.

For each model and dtype, three training loops run on the same synthetic batches (already on the
device), interleaved over repeats: the hand-written loop of the AMP tutorials, Ignite's
``create_supervised_trainer(amp_mode="amp", scaler=True)`` (float16 only: it has no dtype
argument; plain float32 for the float32 row), and ``create_amp_trainer`` with the default
handlers (clipping, TensorBoard every 50, best checkpoint, OOM backoff). Step time is timed with
CUDA events around each repeat (wall clock on CPU); the median over repeats is reported with
images/s and peak memory.

    python benchmarks/bench_amp.py --device cuda                       # the full GPU table
    python benchmarks/bench_amp.py --device cpu --models resnet18_32 --steps 5 --repeats 3
"""
import argparse
import copy
import statistics
import tempfile
import time

import torch
from ignite.engine import create_supervised_trainer
from torch.nn.functional import cross_entropy

from overhead import attach_default_handlers, hand_written_loop

from ignite_amp import create_amp_trainer
from ignite_amp.step import resolve_device


def small_vit(num_classes: int = 10):
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=224, patch_size=16, num_layers=6, num_heads=6, hidden_dim=384,
                             mlp_dim=1536, num_classes=num_classes)


def resnet50(num_classes: int = 10):
    from torchvision.models import resnet50 as build

    return build(num_classes=num_classes)


def resnet18_32(num_classes: int = 10):
    from ignite_amp.models import cifar_resnet18

    return cifar_resnet18(num_classes)


MODELS = {  # name: (factory, image size, batch size)
    "resnet18_32": (resnet18_32, 32, 256),
    "resnet50_224": (resnet50, 224, 128),
    "vit_s16_224": (small_vit, 224, 128),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


def loops(base, dtype_name, batches, device, logdir):
    """The three loops for one model and dtype, each with its own copy of the model and optimizer."""
    dtype = DTYPES[dtype_name]

    def fresh():
        model = copy.deepcopy(base).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    out = {}
    model, opt = fresh()
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    out["hand-written"] = (model, lambda m=model, o=opt: hand_written_loop(m, o, scaler, batches, device, dtype))
    if dtype_name != "bfloat16" and not (dtype_name == "float16" and device.type != "cuda"):
        model, opt = fresh()
        amp = dict(amp_mode="amp", scaler=True) if dtype_name == "float16" else {}
        stock = create_supervised_trainer(model, opt, cross_entropy, device=device, **amp)
        out["ignite stock"] = (model, lambda t=stock: t.run(batches, max_epochs=1))
    model, opt = fresh()
    trainer = create_amp_trainer(model, opt, cross_entropy, device=device, dtype=dtype)
    attach_default_handlers(trainer, model, opt, logdir)
    out["ignite-amp+handlers"] = (model, lambda t=trainer: t.run(batches, max_epochs=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--batch-size", type=int, default=None, help="override each model's batch size")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    device = resolve_device(args.device)
    timer = Timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# device {device} ({name}), torch {torch.__version__}, {args.steps} steps x {args.repeats} repeats")
    print(f"{'model':<13} {'dtype':<9} {'loop':<20} {'batch':>5} {'step ms':>9} {'images/s':>9} {'peak MB':>8}")
    fp32_speed = {}
    for model_name in args.models:
        factory, size, batch = MODELS[model_name]
        batch = args.batch_size or batch
        torch.manual_seed(0)
        base = factory()
        batches = [(torch.randn(batch, 3, size, size, device=device), torch.randint(0, 10, (batch,), device=device))
                   for _ in range(args.steps)]
        for dtype_name in args.dtypes:
            if dtype_name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
                continue
            variants = loops(base, dtype_name, batches, device, tempfile.mkdtemp(prefix="bench-amp-"))
            times = {k: [] for k in variants}
            peaks = {}
            for label, (_, fn) in variants.items():  # warm-up (cudnn autotune, allocator)
                fn()
            for _ in range(args.repeats):
                for label, (_, fn) in variants.items():
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    times[label].append(timer(fn) / args.steps)
                    if device.type == "cuda":
                        peaks[label] = max(peaks.get(label, 0), torch.cuda.max_memory_allocated(device) / 2**20)
            for label, values in times.items():
                step = statistics.median(values)
                peak = f"{peaks[label]:.0f}" if label in peaks else "-"
                print(f"{model_name:<13} {dtype_name:<9} {label:<20} {batch:>5} {step * 1e3:>9.2f} "
                      f"{batch / step:>9.0f} {peak:>8}", flush=True)
                if dtype_name == "float32" and label == "hand-written":
                    fp32_speed[model_name] = batch / step
            del variants
            torch.cuda.empty_cache() if device.type == "cuda" else None
    if fp32_speed:
        print("# speedups over float32 are the images/s ratios within a model's rows")


if __name__ == "__main__":
    main()
