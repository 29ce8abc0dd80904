"""Samples/s against batch size with the search's own trials: the evidence for the default objective.

Runs :class:`ignite_amp.batch_search.TrialRunner` (real AMP steps on the config's model, dtype and
input shape; ``--steps`` timed steps after one warmup step) at each size, ``--repeats`` times in
a shuffled order, and prints per size the median ms/step and samples/s with their spread over
the repeats; then, for each repeat, the batch ``--objective fastest`` would keep (the smallest
within 3% of that repeat's best samples/s).

    python benchmarks/search_objective.py configs/quickstart.yaml --device cpu --repeats 5
"""
import argparse
import random
import statistics
import sys

import torch

from ignite_amp.batch_search import TrialRunner
from ignite_amp.config.tree import load_config
from ignite_amp.models import build_model
from ignite_amp.run.builders import build_optimizer, input_shape, seed_everything


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--speed-tolerance", type=float, default=0.03)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    seed_everything(cfg.seed)
    device = torch.device(args.device)
    model = build_model(cfg.model.name, cfg.model.num_classes, cfg.model.kwargs)
    optimizer = build_optimizer(cfg.optimizer, model)
    shape, classes = input_shape(cfg.data), cfg.model.num_classes

    def make_batch(n):
        return torch.randn(n, *shape, device=device), torch.randint(0, classes, (n,), device=device)

    rng = random.Random(0)
    speeds = {n: [] for n in args.sizes}
    picks = []
    amp = cfg.amp
    with TrialRunner(model, optimizer, torch.nn.functional.cross_entropy, make_batch, device=device,
                     dtype=amp.dtype, warmup=1, steps=args.steps, channels_last=amp.channels_last,
                     fp32_modules=amp.fp32_modules) as runner:
        dtype = runner.engine.amp_step.dtype
        for _ in range(args.repeats):
            order = list(args.sizes)
            rng.shuffle(order)
            this = {}
            for n in order:
                speed = runner(n, "probe").samples_per_s  # None: the size ran out of memory
                if speed is not None:
                    this[n] = speed
                    speeds[n].append(speed)
            if not this:
                print(f"every size ran out of memory on {device}: try smaller --sizes", file=sys.stderr)
                return 2
            best = max(this.values())
            picks.append(min(n for n, v in this.items() if v >= (1 - args.speed_tolerance) * best))
    print(f"{cfg.model.name} {shape}, {dtype} on {device} ({torch.get_num_threads()} threads), "
          f"{args.steps} timed steps per trial, {args.repeats} repeats (shuffled order)")
    print("| batch | median ms/step | median samples/s | min-max samples/s | spread |")
    print("|---|---|---|---|---|")
    for n in args.sizes:
        values = speeds[n]
        if not values:
            print(f"| {n} | out of memory | | | |")
            continue
        median = statistics.median(values)
        print(f"| {n} | {n * 1000 / median:.1f} | {median:.0f} | {min(values):.0f}-{max(values):.0f} | "
              f"{(max(values) - min(values)) / median:.0%} |")
    print(f"fastest (smallest within {args.speed_tolerance:.0%} of the best) per repeat: {picks}; "
          f"largest that ran: {max(n for n in args.sizes if speeds[n])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
