"""Trials the batch-size search needs: from a memory plan, the memory model, doubling and bisection.

On the CPU, with a simulated device: peak memory follows ``a + b * batch`` with measurement
noise, a trial runs out of memory when the true peak passes the capacity, and each draw of
(a, b, capacity) puts the largest fit under the budget ((1 - margin) x capacity) between
``--smallest`` and ``--largest`` (log-uniform). Both strategies run the same policy code as
``ignite-amp find-batch-size`` (:func:`ignite_amp.batch_search.search_batch_size`), aiming at
the same budget; a draw counts as reached when the size kept is within 5% (or 1 sample) of the
true largest fit under the budget and no larger than the largest that runs. The memory plan
(``ignite-amp plan``, fake tensors) of a device's model is its true peak divided by an allocator
overhead the search does not know, drawn between 1.00 and 1.25 (``--overhead``): the ``plan``
strategy starts from it. With
``--objective fastest`` the sizes kept are smaller on purpose: read the trial counts only.

    python benchmarks/search_trials.py --draws 50 --seed 0
"""
import argparse
import math
import random
import statistics
import sys
from typing import Callable, Dict, List

from ignite_amp.batch_search import Trial, search_batch_size

GIB = 2.0 ** 30


def draw(rng: random.Random, smallest: float, largest: float, margin: float) -> Dict[str, float]:
    """One simulated device and model: capacity 8-80 GiB, a fixed part 1-60% of the budget."""
    capacity = rng.uniform(8, 80) * GIB
    budget = (1 - margin) * capacity
    fixed = budget * math.exp(rng.uniform(math.log(0.01), math.log(0.6)))
    target = math.exp(rng.uniform(math.log(smallest), math.log(largest)))
    per_sample = (budget - fixed) / target
    n_half = math.exp(rng.uniform(math.log(8), math.log(512)))  # samples/s reaches half its best at n_half
    return {"capacity": capacity, "a": fixed, "b": per_sample, "n_half": n_half}


def simulated_trial(device: Dict[str, float], rng: random.Random, noise: float,
                    time_noise: float) -> Callable[[int, str], Trial]:
    """``trial(size, stage)`` on the simulated device: the measured peak strays from the line by a
    Gaussian share (sd ``noise``); samples/s saturates as size / (size + n_half)."""

    def trial(size: int, stage: str) -> Trial:
        true_peak = device["a"] + device["b"] * size
        if true_peak > device["capacity"]:
            return Trial(size, False, None, 0.0, stage)
        peak = true_peak * (1 + max(-3 * noise, min(3 * noise, rng.gauss(0, noise))))
        ms = (size + device["n_half"]) * 0.01 * (1 + rng.gauss(0, time_noise))
        return Trial(size, True, peak, 0.0, stage, ms)

    return trial


def planned(device: Dict[str, float]) -> Callable[[int], float]:
    """The memory plan's peak: the true one less the allocator's overhead (which the search does not know)."""
    return lambda size: (device["a"] + device["b"] * size) / device["overhead"]


def run(draws: int, seed: int, noise: float, margin: float, smallest: float, largest: float,
        objective: str = "largest", overhead: float = 1.25) -> Dict[str, List[dict]]:
    rng = random.Random(seed)
    devices = [draw(rng, smallest, largest, margin) for _ in range(draws)]
    plan_rng = random.Random(seed + 2)  # apart: the devices are those of the runs before the plan existed
    for device in devices:
        device["overhead"] = plan_rng.uniform(1.0, overhead)
    results: Dict[str, List[dict]] = {"plan": [], "model": [], "bisect": []}
    for strategy, start in (("plan", 16), ("model", 16), ("bisect", 32)):
        trial_rng = random.Random(seed + 1)
        for device in devices:
            budget = (1 - margin) * device["capacity"]
            best = math.floor((budget - device["a"]) / device["b"])
            runs = math.floor((device["capacity"] - device["a"]) / device["b"])
            result = search_batch_size(simulated_trial(device, trial_rng, noise, 0.01), capacity=device["capacity"],
                                       margin=margin, strategy=strategy, objective=objective, start=start,
                                       max_size=65536, planned=planned(device))
            results[strategy].append({
                "trials": len(result.trials), "chosen": result.batch_size, "best": best,
                "reached": abs(result.batch_size - best) <= max(1, 0.05 * best) and result.batch_size <= runs,
                "strategy": result.strategy, "ooms": sum(not t.fits for t in result.trials),
                "kept_oom": result.batch_size > runs})
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.01, help="sd of a peak reading, as a share (default 0.01)")
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--smallest", type=float, default=16)
    parser.add_argument("--largest", type=float, default=20000)
    parser.add_argument("--objective", choices=["largest", "fastest"], default="largest")
    parser.add_argument("--overhead", type=float, default=1.25,
                        help="the largest allocator overhead over the plan drawn (default 1.25)")
    parser.add_argument("--verbose", action="store_true", help="one line per draw")
    args = parser.parse_args(argv)
    results = run(args.draws, args.seed, args.noise, args.margin, args.smallest, args.largest, args.objective,
                  args.overhead)
    if args.verbose:
        for i, (p, m, b) in enumerate(zip(results["plan"], results["model"], results["bisect"], strict=True)):
            print(f"{i:>3} best {m['best']:>6}  plan {p['trials']} trials -> {p['chosen']:>6} {p['strategy']:<16} "
                  f"model {m['trials']} trials -> {m['chosen']:>6} {m['strategy']:<18} "
                  f"ooms {m['ooms']}  bisect {b['trials']:>2} trials -> {b['chosen']:>6}")
    print(f"{args.draws} draws, seed {args.seed}, peak noise sd {args.noise:.1%}, margin {args.margin:.0%}, "
          f"largest fit {args.smallest:g}-{args.largest:g}, objective {args.objective}")
    print("| strategy | median trials | worst | mean | reached (within 5%) | OOM trials (all draws) | kept sizes that "
          "OOM | fell back |")
    print("|---|---|---|---|---|---|---|---|")
    for name, label in (("plan", f"from the memory plan (overhead 1.00-{args.overhead:.2f} unknown)"),
                        ("model", "memory model (start 16)"), ("bisect", "doubling + bisection (start 32)")):
        rows = results[name]
        counts = [r["trials"] for r in rows]
        print(f"| {label} | {statistics.median(counts):g} | {max(counts)} | {statistics.mean(counts):.2f} | "
              f"{sum(r['reached'] for r in rows)}/{len(rows)} | {sum(r['ooms'] for r in rows)} | "
              f"{sum(r['kept_oom'] for r in rows)} | {sum(r['strategy'] != name for r in rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
