"""Is one process under torchrun as fast as a plain run? And what do N processes give?

Runs ``ignite-amp train CONFIG`` plainly and under ``torchrun --standalone --nproc_per_node=1``
(and, with ``--nproc N``, N processes), interleaved, each in a fresh output_dir, and reads the
samples/s of each epoch (``data.train_size`` over its line's seconds; the first epoch left out: warm-up).
Prints the medians and the ratio torchrun / plain; the target on one GPU is within 1%.

    python benchmarks/launch_overhead.py                          # the quickstart, on this machine
    python benchmarks/launch_overhead.py --set data.name=fake --set model.name=resnet18 \\
        --set data.train_size=25600 --set data.batch_size=256 --set train.epochs=4 --repeats 5
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(variant: str, config: str, overrides: list, output_dir: str) -> list:
    train = ["-m", "ignite_amp", "train", config, "--set", f"output_dir={output_dir}",
             "--set", "handlers.checkpoint.resume=never", *sum((["--set", o] for o in overrides), [])]
    if variant == "plain":
        command = [sys.executable, *train]
    else:
        nproc = 1 if variant == "torchrun" else int(variant.split("x")[1])
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *train]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"{variant} failed:\n{out.stderr[-2000:]}")
    from ignite_amp.config.tree import load_config

    path = config if os.path.isfile(config) else os.path.join(ROOT, config)
    samples = load_config(path, overrides).data.train_size  # an epoch line's seconds: its samples' time
    if not samples:
        sys.exit("set data.train_size: the samples/s are the epoch's samples over the epoch line's seconds")
    seconds = [float(s) for s in re.findall(r"^epoch \d+/\d+ .*\s([\d.]+)s$", out.stdout, flags=re.M)]
    return [samples / s for s in seconds[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=None, help="also run N processes under torchrun")
    args = parser.parse_args()
    variants = ["plain", "torchrun"] + ([f"torchrun x{args.nproc}"] if args.nproc else [])
    rates = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for i, variant in enumerate(variants):
                found = run(variant, args.config, args.overrides, os.path.join(tmp, f"{repeat}-{i}"))
                rates[variant].extend(found)
                print(f"repeat {repeat + 1}: {variant:<12} samples/s per epoch {[round(r) for r in found]}",
                      flush=True)
    medians = {v: statistics.median(r) for v, r in rates.items()}
    for variant, median in medians.items():
        print(f"{variant:<12} median {median:.0f} samples/s over {len(rates[variant])} epochs")
    print(f"torchrun (1 process) / plain: {medians['torchrun'] / medians['plain']:.4f}")
    if args.nproc:
        print(f"torchrun x{args.nproc} / plain: {medians[f'torchrun x{args.nproc}'] / medians['plain']:.4f}")


if __name__ == "__main__":
    main()
