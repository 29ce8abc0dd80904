"""What the trainer costs over the hand-written AMP loop of the tutorials.

Two cases, the same variants, interleaved repeats (hand, ignite, amp, handlers, hand, ...) so
drift in clocks or load hits all alike; the figures are medians over the repeats.

The hand loop runs twice: bare, and with the clipping the default handlers do (unscale_, then
``clip_grad_norm_(1.0)``), so the handlers' overhead can be read against the same work.

- ``--case host`` (the default): host overhead per iteration. A tiny MLP (batch 32, float32) whose
  kernels take microseconds, so the time per iteration is the Python work around them: what a
  small or fast model waits on, on a GPU too. Timed in CPU time of this thread
  (``time.thread_time``), with torch on one thread, so other processes on the machine do not
  count. Reports microseconds per iteration over the hand loop for Ignite's
  ``create_supervised_trainer``, ``create_amp_trainer`` and the trainer with the default handlers.
- ``--case model``: a real model (default the small CNN at 32x32, batch 64, autocast dtype "auto"),
  timed in wall clock (device-synchronized on CUDA); ratios to the hand loop.

The default handlers are those a config attaches: NonFiniteGuard, GradientClipping(1.0),
TensorBoardMetrics(log_every=50), BestCheckpoint (it saves at evaluation, so not inside the timed
loop) and OOMBackoff.

    python benchmarks/overhead.py                                  # host overhead, tiny MLP
    python benchmarks/overhead.py --case model                     # small CNN, batch 64
    python benchmarks/overhead.py --case model --device cuda --model resnet18 --batch-size 256 --image-size 32
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
from ignite_amp.device import resolve_device, resolve_dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_written_loop(model, optimizer, scaler, batches, device, dtype, max_norm=None):
    """The loop every AMP tutorial ends with; with ``max_norm``, the clipping step on unscaled gradients."""
    model.train()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if max_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        scaler.step(optimizer)
        scaler.update()


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def attach_default_handlers(trainer, model, optimizer, logdir):
    """The handlers a config attaches by default, in the order build_run attaches them."""
    from ignite.metrics import Accuracy

    from ignite_amp import create_amp_evaluator
    from ignite_amp.handlers import BestCheckpoint, GradientClipping, NonFiniteGuard, OOMBackoff, TensorBoardMetrics

    step = trainer.amp_step
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy(device=step.device)}, device=step.device,
                                     dtype=step.dtype)
    NonFiniteGuard().attach(trainer)
    OOMBackoff().attach(trainer)
    GradientClipping(max_norm=1.0).attach(trainer)
    TensorBoardMetrics(logdir, log_every=50).attach(trainer, evaluator=evaluator, optimizer=optimizer)
    BestCheckpoint(logdir, {"model": model, "optimizer": optimizer, "amp_step": step}).attach(trainer, evaluator)
    return evaluator


def variants(base, batches, device, dtype, optimizer_fn, logdir):
    """name -> a function running one epoch over ``batches``; each variant has its own copy of the model."""
    from ignite.engine import create_supervised_trainer

    hand_model = copy.deepcopy(base).to(device)
    hand_opt = optimizer_fn(hand_model)
    hand_scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    out = {"hand-written loop": lambda: hand_written_loop(hand_model, hand_opt, hand_scaler, batches, device, dtype)}
    clip_model = copy.deepcopy(base).to(device)
    clip_opt = optimizer_fn(clip_model)
    clip_scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    out["hand-written loop + clipping"] = lambda: hand_written_loop(clip_model, clip_opt, clip_scaler, batches, device,
                                                                    dtype, max_norm=1.0)
    if dtype == torch.float32:  # Ignite's stock trainer has no autocast dtype argument
        ignite_model = copy.deepcopy(base).to(device)
        stock = create_supervised_trainer(ignite_model, optimizer_fn(ignite_model), cross_entropy, device=device)
        out["ignite create_supervised_trainer"] = lambda: stock.run(batches, max_epochs=1)
    amp_model = copy.deepcopy(base).to(device)
    trainer = create_amp_trainer(amp_model, optimizer_fn(amp_model), cross_entropy, device=device, dtype=dtype)
    out["create_amp_trainer"] = lambda: trainer.run(batches, max_epochs=1)  # a fresh one-epoch run
    full_model = copy.deepcopy(base).to(device)
    full_opt = optimizer_fn(full_model)
    full = create_amp_trainer(full_model, full_opt, cross_entropy, device=device, dtype=dtype)
    attach_default_handlers(full, full_model, full_opt, logdir)
    out["+ default handlers"] = lambda: full.run(batches, max_epochs=1)
    return out


def measure(fns: dict, repeats: int, clock) -> dict:
    for fn in fns.values():  # warm up: allocator, kernels, first-run work
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def host_case(args) -> None:
    torch.set_num_threads(1)  # the kernels stay in this thread: thread CPU time is all of it
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    batches = [(torch.randn(32, 32), torch.randint(0, 10, (32,))) for _ in range(args.iters)]
    device = torch.device("cpu")
    fns = variants(base, batches, device, torch.float32, lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
                   tempfile.mkdtemp(prefix="ignite-amp-overhead-"))
    times = measure(fns, args.repeats, time.thread_time)
    per_iter = {name: [t / args.iters * 1e6 for t in values] for name, values in times.items()}
    hand = per_iter["hand-written loop"]
    print(f"host overhead: tiny MLP 32-64-10, batch 32, float32, CPU (1 thread), {args.iters} iterations x "
          f"{args.repeats} interleaved repeats, thread CPU time; torch {torch.__version__}")
    print(f"{'variant':<34} {'us/iter':>8} {'over hand loop':>15}   (median; min-max of the per-repeat difference)")
    for name, values in per_iter.items():
        diffs = [v - h for v, h in zip(values, hand)]
        print(f"{name:<34} {statistics.median(values):8.1f} {statistics.median(diffs):+14.1f}   "
              f"({min(diffs):+.1f} .. {max(diffs):+.1f})")
    if "ignite create_supervised_trainer" in per_iter:
        ignite = [v - h for v, h in zip(per_iter["ignite create_supervised_trainer"], hand)]
        for name in ("create_amp_trainer", "+ default handlers"):
            ours = [v - h for v, h in zip(per_iter[name], hand)]
            print(f"{name} overhead / Ignite's: {statistics.median(ours) / statistics.median(ignite):.2f}x")
        # The default handlers clip (max_norm 1.0): the same work in the hand loop is not overhead.
        clipped = per_iter["hand-written loop + clipping"]
        ours = [v - c for v, c in zip(per_iter["+ default handlers"], clipped)]
        print(f"+ default handlers over the hand loop that also clips: {statistics.median(ours):+.1f} us/iter, "
              f"{statistics.median(ours) / statistics.median(ignite):.2f}x Ignite's overhead")


def model_case(args) -> None:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(0)
    base = build_model(args.model, 10, {})
    batches = [(torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device),
                torch.randint(0, 10, (args.batch_size,), device=device)) for _ in range(args.iters)]
    fns = variants(base, batches, device, dtype,
                   lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                   tempfile.mkdtemp(prefix="ignite-amp-overhead-"))
    # Each variant ends synchronized, so the next one's clock starts on an idle device.
    times = measure({name: (lambda fn=fn: (fn(), sync(device))) for name, fn in fns.items()}, args.repeats,
                    time.perf_counter)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, model {args.model}, batch {args.batch_size}, "
          f"image {args.image_size}, dtype {str(dtype)[6:]}, {args.iters} iters x {args.repeats} repeats")
    hand = times["hand-written loop"]
    for name, values in times.items():
        ratios = [v / h for v, h in zip(values, hand)]
        print(f"{name:<34}: median {statistics.median(values) / args.iters * 1e3:8.2f} ms/iter, "
              f"ratio to hand loop {statistics.median(ratios):.4f} (min {min(ratios):.4f} max {max(ratios):.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["host", "model"], default="host")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="ignite_amp.models:small_cnn")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=None, help="iterations per repeat (host 256, model 30)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (host 15, model 7)")
    args = parser.parse_args()
    if args.case == "host":
        args.iters, args.repeats = args.iters or 256, args.repeats or 15
        host_case(args)
    else:
        args.iters, args.repeats = args.iters or 30, args.repeats or 7
        model_case(args)


if __name__ == "__main__":
    main()
