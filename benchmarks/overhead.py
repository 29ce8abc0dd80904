"""Per-iteration time of ``create_amp_trainer`` against the hand-written AMP loop of the tutorials.

Same model architecture and initial weights, same batches (already on the device), same dtype.
The two are run in interleaved repeats (hand, ignite-amp, hand, ignite-amp, ...) so drift in
clocks or load hits both alike; the reported figure is the median of the per-repeat ratios.

    python benchmarks/overhead.py                                  # CPU, small CNN, batch 64
    python benchmarks/overhead.py --device cuda --model resnet18 --batch-size 256 --image-size 32
"""
import argparse
import copy
import statistics
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

    def run_hand():
        hand_written_loop(hand_model, hand_opt, hand_scaler, batches, device, dtype)

    def run_amp():
        trainer.run(batches, max_epochs=1)  # a fresh run of one epoch over the same batches

    for _ in range(max(1, args.warmup // len(batches) + 1)):
        run_hand()
        run_amp()
    hand, amp, ratios = [], [], []
    for _ in range(args.repeats):
        h = timed(run_hand, device) / args.iters
        a = timed(run_amp, device) / args.iters
        hand.append(h)
        amp.append(a)
        ratios.append(a / h)
    ratio = statistics.median(ratios)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, model {args.model}, batch {args.batch_size}, "
          f"image {args.image_size}, dtype {str(dtype)[6:]}, {args.iters} iters x {args.repeats} repeats")
    print(f"hand-written loop : median {statistics.median(hand) * 1e3:8.2f} ms/iter")
    print(f"create_amp_trainer: median {statistics.median(amp) * 1e3:8.2f} ms/iter")
    print(f"overhead          : median ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%), "
          f"ratios min {min(ratios):.4f} max {max(ratios):.4f}")


if __name__ == "__main__":
    main()
