"""float32 (TF32 off, on) vs float16 vs bfloat16; ignite-amp vs the hand-written loop vs Ignite's stock AMP trainer.

For each model and dtype, up to three training loops run on the same synthetic batches (already on
the device): the hand-written loop of the AMP tutorials, Ignite's
``create_supervised_trainer(amp_mode="amp", scaler=True)`` (float16 only: it has no dtype
argument; plain float32 for the float32 rows), and ``create_amp_trainer`` with the default
handlers (``overhead.attach_default_handlers``: the handlers a config attaches by default).

Each variant runs alone: its model copy, optimizer, scaler and batches are built, warmed up, timed
and freed before the next variant is built, so its peak memory (reset before it is built: weights,
gradients, optimizer state, batches, activations) is its own. Variants therefore run one after the
other, not interleaved. Step time is the median over repeats, each timed with CUDA events (wall
clock on CPU).

float32 runs twice: ``float32`` with TF32 off (IEEE float32 in convolutions and matmuls) and
``float32+tf32`` with TF32 on for both (PyTorch's default is TF32 on for cuDNN convolutions, off for
matmuls, so for a convolutional network ``float32+tf32`` is about what plain float32 gives a user).
The AMP rows leave PyTorch's TF32 defaults as they are. ``torch.backends.cudnn.benchmark`` is on
unless ``--no-cudnn-benchmark`` (shapes are fixed; the warm-up steps absorb its autotuning).

    python benchmarks/bench_amp.py --device cuda                       # the full GPU table
    python benchmarks/bench_amp.py --device cpu --models resnet18_32 --steps 5 --repeats 3
"""
import argparse
import contextlib
import statistics
import tempfile
import time
from typing import Callable, Optional

import torch
from ignite.engine import create_supervised_trainer
from overhead import attach_default_handlers, hand_written_loop
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer
from ignite_amp.core.device import free_memory, resolve_device


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
# name: (autocast dtype, TF32 for convolutions and matmuls: True, False, or None for PyTorch's default)
DTYPES = {"float32": (torch.float32, False), "float32+tf32": (torch.float32, True),
          "float16": (torch.float16, None), "bfloat16": (torch.bfloat16, None)}
LOOPS = ("hand-written", "ignite stock", "ignite-amp+handlers")


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


@contextlib.contextmanager
def tf32(enabled: Optional[bool]):
    """TF32 on or off for cuDNN convolutions and CUDA matmuls inside the block (None: leave as is)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    if enabled is not None:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def supports(loop: str, dtype_name: str, device: torch.device) -> bool:
    """Ignite's stock trainer has no bfloat16 (no dtype argument), and no float16 off CUDA."""
    if loop != "ignite stock":
        return True
    return dtype_name != "bfloat16" and not (dtype_name == "float16" and device.type != "cuda")


def _loop(loop: str, model, dtype: torch.dtype, device: torch.device, channels_last: bool, compile: bool,
          logdir: str) -> Callable[[list], None]:
    """``run(batches)`` for one loop over its own model and a fresh optimizer."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if compile and loop != "ignite-amp+handlers":
        raise ValueError("compile is measured with the ignite-amp loop only")
    if loop == "hand-written":
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        return lambda batches: hand_written_loop(model, optimizer, scaler, batches, device, dtype)
    if loop == "ignite stock":
        amp = dict(amp_mode="amp", scaler=True) if dtype == torch.float16 else {}
        stock = create_supervised_trainer(model, optimizer, cross_entropy, device=device, **amp)
        return lambda batches: stock.run(batches, max_epochs=1)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype=dtype,
                                 channels_last=channels_last, compile=compile)
    attach_default_handlers(trainer, model, optimizer, logdir)
    return lambda batches: trainer.run(batches, max_epochs=1)


def measure_variant(factory: Callable, dtype_name: str, loop: str, batch_size: int, image_size: int,
                    device: torch.device, steps: int = 20, repeats: int = 5, warmup: int = 5,
                    channels_last: bool = False, compile: bool = False, num_classes: int = 10,
                    seed: int = 0) -> dict:
    """Build one variant, warm it up, time it and free it: nothing of it stays alive afterwards.

    Returns ``step_ms`` (median over ``repeats`` of ``steps`` steps), ``images_per_s``,
    ``peak_mb`` (CUDA: peak allocated while the variant was alive, None on CPU), ``baseline_mb``
    (allocated before it was built: what other code left on the device; ~0 when isolated) and
    ``left_mb`` (allocated after it was freed), and the TF32 flags it ran with.
    """
    dtype, tf32_mode = DTYPES[dtype_name]
    cuda = device.type == "cuda"
    if cuda:  # a forked section may not have touched CUDA yet: the peak reset refuses an allocator not started
        torch.empty(0, device=device)  # ("Invalid device argument" on an H100, section c, 2026-11-27)
    free_memory(device)
    baseline = torch.cuda.memory_allocated(device) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def run() -> dict:  # everything the variant allocates is local to this function
        torch.manual_seed(seed)
        model = factory(num_classes).to(device)
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        model = model.to(memory_format=memory_format)
        distinct = [(torch.randn(batch_size, 3, image_size, image_size, device=device)
                     .contiguous(memory_format=memory_format),
                     torch.randint(0, num_classes, (batch_size,), device=device))
                    for _ in range(min(steps, 4))]
        batches = [distinct[i % len(distinct)] for i in range(steps)]
        with tempfile.TemporaryDirectory(prefix="bench-amp-") as logdir, tf32(tf32_mode):
            fn = _loop(loop, model, dtype, device, channels_last, compile, logdir)
            if warmup:  # cudnn.benchmark autotuning when it is on, the allocator's first blocks, compilation
                fn([batches[i % len(batches)] for i in range(warmup)])
            timer = Timer(device)
            times = [timer(lambda: fn(batches)) / steps for _ in range(repeats)]
            flags = {"cudnn_tf32": torch.backends.cudnn.allow_tf32,
                     "matmul_tf32": torch.backends.cuda.matmul.allow_tf32}
        step = statistics.median(times)
        return {"step_ms": step * 1e3, "images_per_s": batch_size / step, "step_ms_all": [t * 1e3 for t in times],
                **flags}

    result = run()
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    if compile:
        torch._dynamo.reset()  # compiled graphs hold the model's tensors
    free_memory(device)
    left = torch.cuda.memory_allocated(device) if cuda else None
    result.update(peak_mb=_mb(peak), baseline_mb=_mb(baseline), left_mb=_mb(left))
    return result


def _mb(nbytes: Optional[int]) -> Optional[float]:
    return None if nbytes is None else nbytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--loops", nargs="+", default=list(LOOPS), choices=list(LOOPS))
    parser.add_argument("--batch-size", type=int, default=None, help="override each model's batch size")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before the repeats")
    parser.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    device = resolve_device(args.device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# device {device} ({name}), torch {torch.__version__}, {args.steps} steps x {args.repeats} repeats "
          f"after {args.warmup} warm-up steps, each variant alone on the device, "
          f"cudnn.benchmark {args.cudnn_benchmark}")
    print(f"{'model':<13} {'dtype':<13} {'loop':<20} {'batch':>5} {'step ms':>9} {'images/s':>9} {'peak MB':>8} "
          f"{'before MB':>9}")
    for model_name in args.models:
        factory, size, batch = MODELS[model_name]
        batch = args.batch_size or batch
        for dtype_name in args.dtypes:
            if dtype_name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
                continue
            for loop in args.loops:
                if not supports(loop, dtype_name, device):
                    continue
                r = measure_variant(factory, dtype_name, loop, batch, size, device, steps=args.steps,
                                    repeats=args.repeats, warmup=args.warmup)
                peak, before = ("-" if v is None else f"{v:.0f}" for v in (r["peak_mb"], r["baseline_mb"]))
                print(f"{model_name:<13} {dtype_name:<13} {loop:<20} {batch:>5} {r['step_ms']:>9.2f} "
                      f"{r['images_per_s']:>9.0f} {peak:>8} {before:>9}", flush=True)
    print("# speedups over float32 are the images/s ratios within a model's rows; float32+tf32 is the "
          "baseline the AMP claim (>= 2x) is held against")


if __name__ == "__main__":
    main()
