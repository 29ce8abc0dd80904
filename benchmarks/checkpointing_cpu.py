"""Activation checkpointing policies on CPU (issue 52): none, selective and full on a GPT-style decoder.

For each policy: the plan's peak and recompute (``ignite_amp.memory_plan.choices``: the step on fake tensors, its FLOPs
counted), the real step's peak under the same ``MemTracker`` the plan uses, and the real step's median wall time
and process CPU time (all of torch's threads; less moved by other processes on a shared machine than the wall
clock), the policies interleaved round by round. float32, SGD with momentum. ``auto``: ``checkpoint_to_fit`` with a
memory halfway between none's and full's planned peaks (margin 0), as GPU section s does with measured peaks.

    python benchmarks/checkpointing_cpu.py [--rounds 5]
"""
import argparse
import copy
import statistics
import time

import torch
from float8_gpt import GPT, next_token_loss

from ignite_amp import create_amp_trainer
from ignite_amp.memory_plan.auto_checkpoint import checkpoint_to_fit
from ignite_amp.memory_plan.choices import OptionPlanner
from ignite_amp.memory_plan.fake_step import step_tracker, warm_optimizer

POLICIES = {"none": False, "selective": "selective", "full": True, "auto": False}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    vocab = 512
    base = GPT(vocab, args.width, args.depth, heads=8, seq=args.tokens)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, vocab, (args.batch, args.tokens), generator=g),
             torch.randint(0, vocab, (args.batch, args.tokens), generator=g))
    planner = OptionPlanner(base, torch.optim.SGD(base.parameters(), lr=0.01, momentum=0.9), next_token_loss,
                            lambda n: (torch.randint(0, vocab, (n, args.tokens)),
                                       torch.randint(0, vocab, (n, args.tokens))),
                            args.batch, device="cpu", dtype="float32")
    n = len(planner.names)
    planned = {"none": planner(0, 0), "selective": planner(0, n), "full": planner(n, 0)}
    steps, measured = {}, {}
    for name, on in POLICIES.items():
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name == "auto":
            limit = (planned["none"].peak + planned["full"].peak) // 2
            choice = checkpoint_to_fit(model, optimizer, next_token_loss, batch, args.batch, memory=limit, margin=0.0,
                                       device="cpu", dtype="float32")
            planned["auto"] = next(o for o in choice.options if o.peak == choice.peak)
            print(choice.line())
        trainer = create_amp_trainer(model, optimizer, next_token_loss, device="cpu", dtype="float32",
                                     activation_checkpointing=on)
        warm_optimizer(optimizer)
        tracker = step_tracker()
        tracker.track_external(model, optimizer, *batch)
        with tracker:
            trainer.amp_step(trainer, batch)
        measured[name] = sum(v for per in tracker.get_tracker_snapshot("peak").values() for k, v in per.items()
                             if k != "Total")
        steps[name] = trainer
    times = {name: [] for name in POLICIES}
    cpu = {name: [] for name in POLICIES}
    for _ in range(args.rounds):  # interleaved
        for name, trainer in steps.items():
            begin, begin_cpu = time.perf_counter(), time.process_time()
            trainer.amp_step(trainer, batch)
            times[name].append(time.perf_counter() - begin)
            cpu[name].append(time.process_time() - begin_cpu)
    none_ms = statistics.median(times["none"]) * 1e3
    none_cpu = statistics.median(cpu["none"]) * 1e3
    print(f"GPT {args.depth} x {args.width}, {args.tokens} tokens, batch {args.batch}, float32, CPU "
          f"({torch.get_num_threads()} threads), {args.rounds} interleaved rounds")
    print("| policy | planned peak MiB | MemTracker peak MiB | plan error | planned recompute (% FLOPs) | "
          "step ms (median) | vs none | CPU ms (median) | vs none |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in POLICIES:
        ms, cpu_ms = statistics.median(times[name]) * 1e3, statistics.median(cpu[name]) * 1e3
        plan, real = planned[name].peak, measured[name]
        print(f"| {name} | {plan / 2**20:.1f} | {real / 2**20:.1f} | {(plan - real) / real:+.2%} | "
              f"{planned[name].recompute:.2%} | {ms:.0f} | {ms / none_ms - 1:+.1%} | {cpu_ms:.0f} | "
              f"{cpu_ms / none_cpu - 1:+.1%} |")


if __name__ == "__main__":
    main()
