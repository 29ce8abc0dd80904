"""One command that measures every GPU claim of ignite-amp, within 6 minutes on one H100 (issues 14, 48).

    python benchmarks/gpu_suite.py --out gpu-results          # on a GPU: writes gpu_suite.json and gpu_suite.md
    python benchmarks/gpu_suite.py --smoke --out /tmp/smoke   # the same code on CPU with tiny sizes, under a minute

A GPU is lent for about 15 minutes, start included: the default sections fit 6, so the suite can run once,
be fixed and run again. Sections (each a module in ``gpu_sections/``, named for what it measures, with its
sizes and the time it is expected to take on one H100; ``gpu_sections/catalog.py`` lists them):

a. the GPU tests: ``pytest -m gpu`` in a subprocess (but issue 13's ResNet-50 search test: n), per test;
b. overhead against the hand loop: a launch-bound model (ResNet-18 at 32x32, batch 256, bfloat16 and float16)
   and a device-bound one (ResNet-50 at 224x224, batch 64), CUDA events, rotating interleaved rounds, the
   median ratio with a 95% bootstrap interval;
c. AMP against float32 on ResNet-50 at 224x224 (fake data on the GPU): throughput and peak memory of
   float32 (TF32, as torch runs it), float16 with the scaler and bfloat16, NCHW and channels_last;
d. the batch-size search (trials, seconds, size found), and a real out-of-memory error in the middle
   of an epoch recovered by OOMBackoff (a ballast leaves less than the step's allocated peak);
e. numerics parity: CIFAR ResNet-18 on ``shapes`` at 32x32 in float32, float16 and bfloat16;
f. host syncs: one bfloat16 epoch with the default handlers under ``torch.cuda.set_sync_debug_mode``;
g. the data path: samples/s with num_workers 0, 4, 8 and pin_memory off/on, quickstart and CIFAR recipe;
h. activation checkpointing: peak activation memory and step time with and without it, on a GPT-style
   transformer (12 layers, width 1024, 1024 tokens) and on ResNet-50 at 224x224 (bfloat16).
j. the handlers' host cost: benchmarks/overhead.py's table (hand loop, Ignite bare and with its handlers, ours
   bare, with each default handler, with all) on the small CNN (host-bound) and ResNet-50 (device-bound), float16.

Opt-in, outside the 6 minutes, each named with ``--only`` (expected times on one H100):

i. float8 (torchao) against bfloat16 on a GPT-style model with torch.compile (``float8_gpt.py``; ~5.5 min).
k. the memory plan (fake tensors) against ``torch.cuda.max_memory_allocated`` for ResNet-50 and a GPT-style
   model, and the batch-size search's real trials from the plan (``memory_plan_gpu.py``; ~1 min: 56 s on an H100).
l. the split check's cost on the first step, and its extra peak memory (``split_check_cost.py``; ~30 s).
m. section c's other rows: IEEE float32 (TF32 off) and bfloat16 + channels_last + torch.compile (~1.5 min).
n. issue 13's ResNet-50 search test (``pytest -m gpu -k resnet50_search``; ~2 min).
s. activation checkpointing policies: none, selective and full on section h's models, and auto in a memory limit
   between none's and full's peaks (``gpu_sections/activation_checkpointing.py``; ``--only s``, ~1 min).
m. issue 51: ResNet-50 float16 with the defaults (channels_last auto, fused step) against float32 TF32 in NCHW, and
   the fused step's parity with the foreach one (``--only p``, ~45 s).
q. issue 51: the quickstart's data wait with ``num_workers: auto`` against 0 (``--only q``, ~40 s).
r. issue 51: ResNet-18 32x32 batch 256 with ``compile: reduce-overhead`` (CUDA graphs) against eager (``--only r``,
   ~90 s, most of it compiling).

Each section runs in its own process, forked from this one (which never touches CUDA), so its GPU
memory and CUDA settings are its own and a crash ends only it (``gpu_sections/runner.py``). Each has a
time budget (``catalog.SECTIONS``); a section still running at its budget is stopped, what it recorded
before is kept, and it is reported "over budget". The default budgets add up to 6 minutes. Without CUDA (``--smoke``),
what needs CUDA is skipped and the JSON says so per section ("skipped", reason "needs CUDA ...");
the skipped sections still run their code on a CPU stand-in, so it cannot rot unnoticed.
"""
import argparse
import os
import sys
import tempfile
import time

from gpu_sections.catalog import OPT_IN, SECTIONS
from gpu_sections.runner import run_suite, seconds_since_start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the suite's code")
    parser.add_argument("--only", default="", help="section letters to run, e.g. 'ce' (default: a to h and j; "
                                                   "the opt-in i, k, l, m, n, p, q, r and s only when named)")
    args = parser.parse_args(argv)
    args.command = " ".join(["python benchmarks/gpu_suite.py"] + (sys.argv[1:] if argv is None else list(argv)))
    start = time.monotonic() - seconds_since_start()  # the imports count against the 6 minutes too
    # This process only forks the sections (and the environment probe): it never touches CUDA itself.
    import torch.utils.tensorboard  # noqa: F401 - imported once here, not in each forked section
    import torchvision.models  # noqa: F401

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as workdir:
        return run_suite(args, out, start, workdir, SECTIONS, OPT_IN)


if __name__ == "__main__":
    sys.exit(main())
