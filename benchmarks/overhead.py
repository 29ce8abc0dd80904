"""Per-iteration time of ``create_amp_trainer`` against the hand-written AMP loop of the tutorials,
and of the trainer with the config's default handlers against the bare trainer.

Same model architecture and initial weights, same batches (already on the device), same dtype.
The variants run in interleaved repeats (hand, bare, handlers, hand, bare, ...) so drift in
clocks or load hits all alike; the reported figures are medians of the per-repeat ratios.
The handlers are the defaults a config attaches: GradientClipping(1.0), TensorBoardMetrics
(log_every=50), BestCheckpoint (saves at evaluation, so not inside the timed loop) and OOMBackoff.

    python benchmarks/overhead.py                                  # CPU, small CNN, batch 64
    python benchmarks/overhead.py --device cuda --model resnet18 --batch-size 256 --image-size 32
"""
import argparse
import copy
import statistics
import tempfile
import time

import torch
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer
from ignite_amp.models import build_model
from ignite_amp.step import resolve_device, resolve_dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_written_loop(model, optimizer, scaler, batches, device, dtype):
    """The loop every AMP tutorial ends with."""
    model.train()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="ignite_amp.models:small_cnn")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=30, help="iterations per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(0)
    base = build_model(args.model, 10, {})
    batches = [(torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device),
                torch.randint(0, 10, (args.batch_size,), device=device)) for _ in range(args.iters)]

    hand_model = copy.deepcopy(base).to(device)
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=0.01, momentum=0.9)
    hand_scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    amp_model = copy.deepcopy(base).to(device)
    amp_opt = torch.optim.SGD(amp_model.parameters(), lr=0.01, momentum=0.9)
    trainer = create_amp_trainer(amp_model, amp_opt, cross_entropy, device=device, dtype=dtype)
    full_model = copy.deepcopy(base).to(device)
    full_opt = torch.optim.SGD(full_model.parameters(), lr=0.01, momentum=0.9)
    full = create_amp_trainer(full_model, full_opt, cross_entropy, device=device, dtype=dtype)
    logdir = tempfile.mkdtemp(prefix="ignite-amp-overhead-")
    attach_default_handlers(full, full_model, full_opt, logdir)

    variants = {
        "hand-written loop": lambda: hand_written_loop(hand_model, hand_opt, hand_scaler, batches, device, dtype),
        "create_amp_trainer": lambda: trainer.run(batches, max_epochs=1),  # a fresh one-epoch run
        "+ default handlers": lambda: full.run(batches, max_epochs=1),
    }
    for _ in range(max(1, args.warmup // len(batches) + 1)):
        for fn in variants.values():
            fn()
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn, device) / args.iters)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, model {args.model}, batch {args.batch_size}, "
          f"image {args.image_size}, dtype {str(dtype)[6:]}, {args.iters} iters x {args.repeats} repeats")
    for name, values in times.items():
        print(f"{name:<20}: median {statistics.median(values) * 1e3:8.2f} ms/iter")
    for label, num, den in (("trainer vs hand loop", "create_amp_trainer", "hand-written loop"),
                            ("handlers vs trainer", "+ default handlers", "create_amp_trainer")):
        ratios = [a / b for a, b in zip(times[num], times[den])]
        ratio = statistics.median(ratios)
        print(f"{label:<20}: median ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%), "
              f"ratios min {min(ratios):.4f} max {max(ratios):.4f}")


def attach_default_handlers(trainer, model, optimizer, logdir):
    from ignite.metrics import Accuracy

    from ignite_amp.handlers import BestCheckpoint, GradientClipping, OOMBackoff, TensorBoardMetrics
    from ignite_amp import create_amp_evaluator

    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy()}, device=trainer.amp_step.device,
                                     dtype=trainer.amp_step.dtype)
    GradientClipping(max_norm=1.0).attach(trainer)
    TensorBoardMetrics(logdir, log_every=50).attach(trainer, evaluator=evaluator, optimizer=optimizer)
    BestCheckpoint(logdir, {"model": model, "optimizer": optimizer, "amp_step": trainer.amp_step}).attach(
        trainer, evaluator)
    OOMBackoff().attach(trainer)


if __name__ == "__main__":
    main()
