"""FSDP2 against DDP on N CPU gloo processes: bytes per rank, time per step, and the weights they reach.

A stack of ``--blocks`` Linear(``--width``) blocks trains ``--steps`` AdamW steps through
``create_amp_trainer`` twice per repeat, sharded (:func:`ignite_amp.transforms.sharding.shard_model`) and
DDP-wrapped, interleaved, from the same initial weights on the same batches. Per rank it reports
the parameter and optimizer-state bytes each process holds (of the local tensors: a DTensor's
shard), the median time per optimizer step, and the largest relative difference of the final
weights (float32: the same sums in another order; bfloat16: the policy's bfloat16 parameters
against autocast, see docs/guides/distributed.md).

    python benchmarks/fsdp_cpu.py                          # 2 processes, float32 and bfloat16
    python benchmarks/fsdp_cpu.py --nproc 4 --width 2048 --blocks 8
"""
import argparse
import gc
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.functional import cross_entropy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ignite_amp import AmpEvents, create_amp_trainer  # noqa: E402
from ignite_amp.transforms.sharding import shard_model  # noqa: E402


def build(width: int, blocks: int) -> torch.nn.Module:
    torch.manual_seed(0)
    body = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                 for _ in range(blocks)])
    return torch.nn.Sequential(body, torch.nn.Linear(width, 10))


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def train(model, args, rank, dtype):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", dtype=dtype)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
               for _ in range(args.steps)]
    times = []

    trainer.add_event_handler(AmpEvents.OPTIMIZER_STEPPED, lambda _: times.append(time.perf_counter()))

    start = time.perf_counter()
    trainer.run(batches)
    steps = [b - a for a, b in zip([start] + times[:-1], times, strict=True)][1:]  # the first step warms up
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return statistics.median(steps), local_bytes(model.parameters()), local_bytes(state)


def body(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        measure(rank, args, out)
    finally:
        gc.collect()  # the sharded models (in reference cycles through the engines) go while the group exists
        dist.destroy_process_group()


def measure(rank, args, out):
    results = {}
    for dtype in args.dtypes:
        for _ in range(args.repeats):
            for strategy in ("fsdp", "ddp"):
                model = build(args.width, args.blocks)
                if strategy == "fsdp":
                    model = shard_model(model, dtype, device="cpu")
                    trained = model
                else:
                    trained = torch.nn.parallel.DistributedDataParallel(model)
                step, params, state = train(trained, args, rank, dtype)
                weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                           for k, v in model.state_dict().items()}
                entry = results.setdefault((dtype, strategy), {"times": [], "params": params, "state": state})
                entry["times"].append(step)
                entry["weights"] = weights
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp()
    torch.multiprocessing.spawn(body, args=(args.nproc, port, args, out), nprocs=args.nproc)
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(args.nproc)]
    n_params = sum(p.numel() for p in build(args.width, args.blocks).parameters())
    print(f"{args.nproc} gloo processes, {args.blocks} x Linear({args.width}) + head: "
          f"{n_params / 1e6:.1f} M parameters, AdamW, {args.batch} samples per process, "
          f"{args.steps} steps x {args.repeats} repeats, torch {torch.__version__}")
    print("| dtype | strategy | params MB per rank | optimizer state MB per rank | ms per step (median) |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes:
        for strategy in ("fsdp", "ddp"):
            r = ranks[0][(dtype, strategy)]
            print(f"| {dtype} | {strategy} | {r['params'] / 2**20:.1f} | {r['state'] / 2**20:.1f} | "
                  f"{1000 * statistics.median(r['times']):.1f} |")
    for dtype in args.dtypes:
        f, d = ranks[0][(dtype, "fsdp")], ranks[0][(dtype, "ddp")]
        diff = max(float((f["weights"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
                   for k, v in d["weights"].items())
        ratio = statistics.median(f["times"]) / statistics.median(d["times"])
        print(f"{dtype}: FSDP vs DDP final weights, max relative difference {diff:.2e}; time per step FSDP / DDP "
              f"{ratio:.2f}; bytes per rank FSDP / DDP: params {f['params'] / d['params']:.3f}, "
              f"optimizer state {f['state'] / d['state']:.3f}")


if __name__ == "__main__":
    main()
