"""One command that measures every GPU claim of ignite-amp, within 9 minutes on one H100 (issue 14).

    python benchmarks/gpu_suite.py --out gpu-results          # on a GPU: writes gpu_suite.json and gpu_suite.md
    python benchmarks/gpu_suite.py --smoke --out /tmp/smoke   # the same code on CPU with tiny sizes, under a minute

Sections (each a function below, with its sizes and the time it is expected to take on one H100):

a. the GPU tests: ``pytest -m gpu`` in a subprocess, pass/fail/skip counts per test;
b. overhead against the hand loop: ResNet-18 at 32x32, batch 256, bfloat16 and float16, interleaved repeats;
c. AMP against float32 on ResNet-50 at 224x224 (fake data on the GPU): throughput and peak memory of
   float32 with TF32 off and on, float16 with the scaler, bfloat16; channels_last; torch.compile;
d. the batch-size search (trials, seconds, size found), and a real out-of-memory error in the middle
   of an epoch recovered by OOMBackoff (memory cap sized from a probe step's measured peak);
e. numerics parity: CIFAR ResNet-18 on ``shapes`` at 32x32 in float32, float16 and bfloat16;
f. host syncs: one bfloat16 epoch with the default handlers under ``torch.cuda.set_sync_debug_mode``;
g. the data path: samples/s with num_workers 0, 4, 8 and pin_memory off/on, quickstart and CIFAR recipe;
h. activation checkpointing: peak activation memory and step time with and without it, on a GPT-style
   transformer (12 layers, width 1024, 1024 tokens) and on ResNet-50 at 224x224 (bfloat16).
j. the handlers' host cost: benchmarks/overhead.py's table (hand loop, Ignite bare and with its handlers, ours
   bare, with each default handler, with all) on the small CNN (host-bound) and ResNet-50 (device-bound), float16.

Opt-in, outside the 9 minutes (run with ``--only i``, alone: it takes about 7 minutes by itself):

i. float8 (torchao) against bfloat16 on a GPT-style model with torch.compile (``float8_gpt.py``).
k. the memory plan (fake tensors) against ``torch.cuda.max_memory_allocated`` for ResNet-50 and a GPT-style
   model, and the batch-size search's real trials from the plan (``memory_plan_gpu.py``; ``--only k``, ~2 min).
l. the split check's cost on the first step, and its extra peak memory (``split_check_cost.py``; ``--only l``).

Each section runs in its own process, forked from this one (which never touches CUDA), so its GPU
memory and CUDA settings are its own and a crash ends only it. Each has a time budget (SECTIONS);
a section still running at its budget is stopped, what it recorded before is kept, and it is
reported "over budget". The budgets add up to less than 9 minutes. Without CUDA (``--smoke``),
what needs CUDA is skipped and the JSON says so per section ("skipped", reason "needs CUDA ...");
the skipped sections still run their code on a CPU stand-in, so it cannot rot unnoticed.
"""
import argparse
import contextlib
import copy
import datetime
import gc
import json
import multiprocessing
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Callable, NamedTuple, Optional

import ignite
import torch
from ignite.engine import Events
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader

from bench_amp import measure_variant, resnet50, tf32
from float8_gpt import Block as GPTBlock, float8_section
import overhead as handler_table
from memory_plan_gpu import memory_plan_section
from split_check_cost import split_check_section
from overhead import attach_default_handlers, hand_written_loop, timed

import ignite_amp
from ignite_amp import create_amp_trainer
from ignite_amp.config.tree import load_config
from ignite_amp.data.datasets import EpochShuffleSampler, build_datasets
from ignite_amp.step.events import AmpEvents
from ignite_amp.handlers import OOMBackoff
from ignite_amp.transforms.activation_checkpointing import checkpointed_blocks
from ignite_amp.models import build_model, small_cnn
from ignite_amp.run.compose import build_run, train_from_config
from ignite_amp.core.device import free_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL_BUDGET_S = 540          # the whole suite on one H100: 9 minutes
STARTUP_ALLOWANCE_S = 10      # imports and the environment probe, before the first section
SMOKE_BUDGET_S = 120          # per section in --smoke (CPU, tiny sizes: each takes seconds)
NEEDS_CUDA = "needs CUDA"


# -- what a section's process records -----------------------------------------------------------
class Context:
    """A section's sizes, device and deadline, and the results it records (saved after every row,
    so a section stopped at its budget keeps what it measured)."""

    def __init__(self, key: str, title: str, smoke: bool, cuda: bool, budget_s: float, path: str, workdir: str):
        self.smoke, self.cuda = smoke, cuda
        self.device = torch.device("cuda:0" if cuda else "cpu")  # an index: the memory fraction calls need one
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.path, self.workdir = path, workdir
        self.result = {"key": key, "title": title, "status": "running", "reason": None, "tables": [],
                       "targets": [], "notes": [], "data": {}}

    def sizes(self, gpu: dict, smoke: dict) -> dict:
        return dict(smoke if self.smoke else gpu)

    def left(self) -> float:
        """Seconds left of this section's budget."""
        return self.deadline - time.monotonic()

    def table(self, name: str, columns: list) -> None:
        self.result["tables"].append({"name": name, "columns": columns, "rows": []})
        self.save()

    def row(self, **values) -> None:
        """A row of the table started last."""
        self.result["tables"][-1]["rows"].append(values)
        self.save()

    def target(self, name: str, value: str, ok: Optional[bool]) -> None:
        """A target of the issue beside its figure: PASS, MISS, or NOT MEASURED (``ok`` None, or no GPU)."""
        verdict = "NOT MEASURED" if ok is None or not self.cuda else ("PASS" if ok else "MISS")
        if not self.cuda:
            value = f"{value} (on CPU: not a GPU figure)" if value else "no GPU"
        self.result["targets"].append({"target": name, "value": value, "verdict": verdict})
        self.save()

    def note(self, text: str) -> None:
        self.result["notes"].append(text)
        self.save()

    def skip(self, reason: str) -> None:
        self.result.update(status="skipped", reason=reason)
        self.save()

    def save(self) -> None:
        _write_json(self.path, self.result)


def _write_json(path: str, value) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, default=str)
    os.replace(tmp, path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _recipe(path: str, **overrides) -> dict:
    """A seed config (``configs/...``) with ``key.path`` overrides, validated like ``--set``."""
    items = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    return load_config(os.path.join(ROOT, path), overrides=items)


def tiny_cnn(num_classes: int = 10) -> nn.Module:
    """The smoke runs' model: the quickstart's small CNN at width 8."""
    return small_cnn(num_classes, width=8)


# -- a. the GPU tests -----------------------------------------------------------------------------
def gpu_tests(ctx: Context) -> None:
    # Expected on one H100: ~170 s. pytest's start and collection ~5 s; the GPU tests: the search on
    # ResNet-18 under a memory cap (~20-30 s), real-OOM backoff (~5 s), issue 13's ResNet-50 search
    # test (two searches, the true largest fit, a run with batch_size auto: ~90-120 s), torchrun with
    # one GPU (~20 s). The slowest section: it gets the largest budget.
    junit = os.path.join(ctx.workdir, "gpu_tests.xml")
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if ctx.smoke:  # only the files that hold GPU tests: collecting the whole suite takes longer than running these
        command += _files_with_gpu_tests()
    ctx.result["data"]["command"] = " ".join(["python"] + command[1:])
    cut = False
    # Its own session: at the budget the whole group gets SIGTERM, torchrun's agent included, which
    # stops its workers (they run in sessions of their own); SIGKILL if that takes over 10 s.
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=max(ctx.left() - 3, 1))
        output, exit_code = stdout + stderr, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        output, exit_code, cut = _text(stdout) + _text(stderr), None, True
    cases = _junit_cases(junit) if not cut and os.path.exists(junit) else _verbose_cases(output)
    counts = Counter(case["outcome"] for case in cases)
    summary = {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")}
    ctx.result["data"].update(counts=summary, exit_code=exit_code, output_tail=output[-3000:])
    ctx.table("GPU tests", ["test", "outcome", "seconds", "detail"])
    for case in cases:
        ctx.row(**case)
    text = ", ".join(f"{n} {k}" for k, n in summary.items())
    bad = summary["failed"] + summary["error"]
    ctx.target("every GPU test passes", text, None if summary["passed"] == 0 and not bad else bad == 0)
    if cut:
        ctx.result.update(status="over budget", reason="pytest ran past the section's budget: the tests that "
                                                       "finished are counted")
    elif not cases or exit_code not in (0, 1):  # 1: tests failed; anything else: pytest itself did not run them
        last = (output.strip().splitlines() or [""])[-1][:300]
        ctx.result.update(status="failed", reason=f"pytest exited {exit_code} with {len(cases)} tests run: {last}")
    elif counts.get("skipped", 0) == len(cases):
        detail = cases[0]["detail"] or "no reason given"
        ctx.result.update(status="skipped", reason=f"{NEEDS_CUDA}: every GPU test was skipped ({detail})")


def _files_with_gpu_tests() -> list:
    """The test files under tests/ (its subfolders too) that hold a ``pytest.mark.gpu`` test, from ROOT."""
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "tests")):
        for name in names:
            path = os.path.join(folder, name)
            if name.startswith("test_") and name.endswith(".py") and "mark.gpu" in open(path, encoding="utf-8").read():
                found.append(os.path.relpath(path, ROOT))
    return sorted(found)


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _junit_cases(path: str) -> list:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                detail = (child.get("message") or "").strip().splitlines()[0][:200] if child.get("message") else ""
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail})
    return cases


def _verbose_cases(output: str) -> list:
    """Outcomes from ``pytest -v`` lines, for a run cut before it wrote its junit file."""
    found = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", output, flags=re.M)
    names = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error"}
    return [{"test": test, "outcome": names[word], "seconds": None, "detail": ""} for test, word in found]


# -- b. overhead against the hand-written loop ------------------------------------------------------
def overhead(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~25 s. torchvision's ResNet-18 at 32x32, batch 256, is launch-bound: a
        # step takes ~4-6 ms, so 3 variants x (2 warm-up + 11 timed) epochs of 50 iterations take
        # ~10 s per dtype, plus building the three models.
        gpu=dict(model="resnet18", kwargs={}, batch=256, image=32, iters=50, repeats=11, warmup=2),
        smoke=dict(model="ignite_amp.models:small_cnn", kwargs={"width": 8}, batch=8, image=16, iters=4,
                   repeats=3, warmup=1))
    device = ctx.device
    ctx.result["data"]["sizes"] = size
    ctx.table("median time per iteration; ratios are medians of per-repeat ratios",
              ["dtype", "variant", "ms_per_iter", "vs_hand_loop", "ratio_min", "ratio_max", "repeats"])
    dtypes = ("bfloat16", "float16")
    for i, dtype_name in enumerate(dtypes):
        share = (ctx.left() - 2) / (len(dtypes) - i)  # this dtype's share of what is left
        times = _overhead_times(size, getattr(torch, dtype_name), device, time.monotonic() + share)
        hand = times["hand-written loop"]
        for name, values in times.items():
            ratios = [a / b for a, b in zip(values, hand)]
            ctx.row(dtype=dtype_name, variant=name, ms_per_iter=statistics.median(values) * 1e3,
                    vs_hand_loop=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                    repeats=len(values))
        for name, limit in (("create_amp_trainer", 1.01), ("+ default handlers", 1.02)):
            ratio = statistics.median([a / b for a, b in zip(times[name], hand)])
            ctx.target(f"{dtype_name}: {name} within {(limit - 1) * 100:.0f}% of the hand loop",
                       f"{ratio:.4f} ({(ratio - 1) * 100:+.2f}%)", ratio <= limit)
    ctx.note("Default handlers: overhead.attach_default_handlers (the handlers a config attaches by default).")


def _overhead_times(size: dict, dtype: torch.dtype, device: torch.device, deadline: float) -> dict:
    """Seconds per iteration of each variant, per repeat; repeats stop early at ``deadline`` (3 at least)."""
    torch.manual_seed(0)
    base = build_model(size["model"], 10, size["kwargs"])
    batches = [(torch.randn(size["batch"], 3, size["image"], size["image"], device=device),
                torch.randint(0, 10, (size["batch"],), device=device)) for _ in range(size["iters"])]

    def fresh():
        model = copy.deepcopy(base).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    hand_model, hand_opt = fresh()
    hand_scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    amp_model, amp_opt = fresh()
    trainer = create_amp_trainer(amp_model, amp_opt, cross_entropy, device=device, dtype=dtype)
    full_model, full_opt = fresh()
    full = create_amp_trainer(full_model, full_opt, cross_entropy, device=device, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-overhead-") as logdir:
        attach_default_handlers(full, full_model, full_opt, logdir)
        variants = {
            "hand-written loop": lambda: hand_written_loop(hand_model, hand_opt, hand_scaler, batches, device, dtype),
            "create_amp_trainer": lambda: trainer.run(batches, max_epochs=1),
            "+ default handlers": lambda: full.run(batches, max_epochs=1),
        }
        for _ in range(size["warmup"]):
            for fn in variants.values():
                fn()
        times = {name: [] for name in variants}
        for repeat in range(size["repeats"]):
            begin = time.monotonic()
            for name, fn in variants.items():  # interleaved: drift hits every variant alike
                times[name].append(timed(fn, device) / size["iters"])
            if repeat >= 2 and time.monotonic() + (time.monotonic() - begin) > deadline:
                break
    return times


# -- j. the handlers' host cost --------------------------------------------------------------------
def handler_cost(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~20 s. benchmarks/overhead.py's table (issue 42), float16 (where Ignite's
        # amp_mode="amp" compares): the quickstart's small CNN at 32x32, batch 64, host-bound (a step of ~2-3 ms,
        # mostly launches: 19 variants x 4 epochs of 30 iterations ~7 s), and ResNet-50 at 224x224, batch 32,
        # device-bound (~12 ms a step: 19 x 3 epochs of 10 iterations ~7 s), plus building the 2 x 19 models.
        gpu=dict(cases=[("small CNN, 32x32, batch 64", "ignite_amp.models:small_cnn", {}, 64, 32, 30, 3),
                        ("ResNet-50, 224x224, batch 32", "resnet50", {}, 32, 224, 10, 2)]),
        smoke=dict(cases=[("small CNN (width 8), 16x16, batch 8", "ignite_amp.models:small_cnn", {"width": 8}, 8, 16,
                           4, 1),
                          ("ResNet-50 stand-in: small CNN (width 4)", "ignite_amp.models:small_cnn", {"width": 4}, 4,
                           16, 4, 1)]))
    device = ctx.device
    ctx.result["data"]["sizes"] = size
    ctx.table("float16, ms per iteration (wall clock, synchronized after each epoch; medians of interleaved repeats); "
              "over: the median per-repeat difference to the reference; between logs: the median iteration without "
              "a log", ["model", "variant", "ms_per_iter", "over", "reference", "between_logs", "work"])
    for name, model, kwargs, batch, image, iters, repeats in size["cases"]:
        if ctx.left() < 8:
            ctx.note(f"{name}: not run, {ctx.left():.0f} s left of the budget")
            continue
        torch.manual_seed(0)
        base = build_model(model, 10, kwargs)
        batches = [(torch.randn(batch, 3, image, image, device=device), torch.randint(0, 10, (batch,), device=device))
                   for _ in range(iters)]
        with tempfile.TemporaryDirectory(prefix="gpu-suite-handlers-") as logdir:
            fns = handler_table.variants(base, batches, device, torch.float16,
                                         lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), logdir,
                                         clock=time.perf_counter)
            table = handler_table.overhead_table(handler_table.measure(fns, repeats, time.perf_counter, device),
                                                 iters, unit="ms")
        del fns, base, batches
        for row in table["rows"]:
            ctx.row(model=name, variant=row["variant"], ms_per_iter=row["per_iter"], over=row["over"],
                    reference=row["reference"], between_logs=row.get("between_logs"), work=row.get("work"))
        for text, limit, value in table["ratios"]:
            ctx.target(f"{name}: {text} <= {limit}x", "" if value is None else f"{value:.2f}x",
                       None if value is None else value <= limit)
    ctx.note("Variants: benchmarks/overhead.py (each default handler alone on create_amp_trainer; Ignite's "
             "TerminateOnNan and TensorboardLogger on create_supervised_trainer(amp_mode='amp', scaler=True)).")


# -- c. AMP against float32 -------------------------------------------------------------------------
AMP_VARIANTS = (  # (label, bench_amp dtype, channels_last, torch.compile)
    ("float32, TF32 off", "float32", False, False),
    ("float32, TF32 on", "float32+tf32", False, False),
    ("float16 + scaler", "float16", False, False),
    ("bfloat16", "bfloat16", False, False),
    ("float32, TF32 on, channels_last", "float32+tf32", True, False),
    ("float16 + scaler, channels_last", "float16", True, False),
    ("bfloat16, channels_last", "bfloat16", True, False),
    ("bfloat16, channels_last, torch.compile", "bfloat16", True, True),
)
FP32_REFERENCE = "float32, TF32 on"  # the >= 2x claim is held against float32 as PyTorch runs convolutions by default


def amp_vs_fp32(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~100 s. ResNet-50 at 224x224, batch 128, a step takes ~40 ms (bfloat16)
        # to ~200 ms (float32, TF32 off). Each eager variant builds (~2 s), warms up 3 steps (cudnn
        # autotuning, a few seconds per dtype and layout) and times 3 x 8 steps: 6-10 s each, 7
        # variants ~55 s; the compiled variant compiles forward and backward in its warm-up (~40-60 s).
        gpu=dict(factory=resnet50, model="torchvision resnet50", batch=128, image=224, steps=8, repeats=3,
                 warmup=3, compile_warmup=3, compile_estimate_s=40),
        smoke=dict(factory=tiny_cnn, model="small_cnn width 8", batch=8, image=16, steps=2, repeats=2, warmup=1,
                   compile_warmup=1, compile_estimate_s=60))
    device = ctx.device
    torch.backends.cudnn.benchmark = True
    ctx.result["data"].update(
        model=size["model"], batch=size["batch"], image=size["image"], cudnn_benchmark=True,
        steps=f"{size['repeats']} repeats x {size['steps']} steps after {size['warmup']} warm-up steps",
        loop="create_amp_trainer + default handlers")
    ctx.table("each variant alone on the device (peak: from before its model was built to its end)",
              ["variant", "step_ms", "images_per_s", "peak_mb", "before_mb", "cudnn_tf32", "matmul_tf32",
               "status"])
    measured, slowest = {}, 0.0
    for label, dtype_name, channels_last, compile in AMP_VARIANTS:
        if dtype_name == "bfloat16" and ctx.cuda and not torch.cuda.is_bf16_supported():
            ctx.row(variant=label, status="not run: this GPU has no bfloat16")
            continue
        if compile and not ctx.cuda:
            ctx.row(variant=label, status=f"skipped: {NEEDS_CUDA} (torch.compile is measured on the GPU only; "
                                          f"compiling on this CPU takes longer than the smoke run)")
            continue
        estimate = size["compile_estimate_s"] if compile else 1.2 * slowest
        if ctx.left() < estimate + 2:
            ctx.row(variant=label, status=f"not run: {ctx.left():.0f} s left of the section's budget, "
                                          f"~{estimate:.0f} s needed")
            continue
        begin = time.monotonic()
        r = measure_variant(size["factory"], dtype_name, "ignite-amp+handlers", size["batch"], size["image"],
                            device, steps=size["steps"], repeats=size["repeats"],
                            warmup=size["compile_warmup"] if compile else size["warmup"],
                            channels_last=channels_last, compile=compile)
        slowest = max(slowest, time.monotonic() - begin) if not compile else slowest
        measured[label] = r
        ctx.row(variant=label, step_ms=r["step_ms"], images_per_s=r["images_per_s"], peak_mb=r["peak_mb"],
                before_mb=r["baseline_mb"], cudnn_tf32=r["cudnn_tf32"], matmul_tf32=r["matmul_tf32"],
                status="measured")
        if label == "bfloat16":  # the like-for-like rows are in: the targets now, before the longer variants
            _amp_targets(ctx, measured)
    if not ctx.result["targets"]:
        _amp_targets(ctx, measured)
    ctx.note(f"The 2x claim compares against '{FP32_REFERENCE}' (TF32 convolutions are PyTorch's default, so this "
             f"is the float32 a user gets); 'float32, TF32 off' is IEEE float32. Memory saving: peaks less what was "
             f"allocated before each variant was built.")


def _amp_targets(ctx: Context, measured: dict) -> None:
    reference, strict = measured.get(FP32_REFERENCE), measured.get("float32, TF32 off")
    for label in ("float16 + scaler", "bfloat16"):
        r = measured.get(label)
        if r is None or reference is None:
            ctx.target(f"{label}: >= 2x the throughput of {FP32_REFERENCE}", "", None)
            ctx.target(f"{label}: >= 40% less peak memory than float32", "", None)
            continue
        speedup = r["images_per_s"] / reference["images_per_s"]
        vs_strict = f"; {r['images_per_s'] / strict['images_per_s']:.2f}x float32 with TF32 off" if strict else ""
        ctx.target(f"{label}: >= 2x the throughput of {FP32_REFERENCE}", f"{speedup:.2f}x{vs_strict}",
                   speedup >= 2.0)
        if r["peak_mb"] is None:
            ctx.target(f"{label}: >= 40% less peak memory than float32", "no memory figure off CUDA", None)
            continue
        saved = 1 - (r["peak_mb"] - r["baseline_mb"]) / (reference["peak_mb"] - reference["baseline_mb"])
        ctx.target(f"{label}: >= 40% less peak memory than float32", f"{saved * 100:.1f}% less", saved >= 0.40)


# -- d. batch-size search and a real out-of-memory error mid-epoch -------------------------------------
class CappedCNN(nn.Module):
    """CPU stand-in for a capped GPU: a tiny CNN whose training forward raises torch.OutOfMemoryError
    above ``limit`` samples (``limit`` None: no cap)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(8, num_classes))
        self.limit: Optional[int] = None

    def forward(self, x):
        if self.training and self.limit is not None and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"stand-in cap: {x.shape[0]} samples > {self.limit}")
        return self.body(x)


def batch_size_and_oom(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~35 s. Recovery: torchvision ResNet-18 at 128x128, batch 256, bfloat16:
        # two probe steps each at 64 and 128 images, then an epoch of 12 batches with a memory cap from
        # iteration 5 on that the full batch exceeds (~5-10 s). Search: ResNet-50 at 224x224, bfloat16,
        # on the whole card: the memory-model search's few trials (issue 13's target: 5 trials, 30 s).
        gpu=dict(oom_model="resnet18", oom_image=128, oom_batch=256, oom_batches=12, cap_after=4,
                 search_model="resnet50", search_image=224, dtype="bfloat16", search_estimate_s=25),
        smoke=dict(oom_model="stand-in", oom_image=8, oom_batch=16, oom_batches=6, cap_after=2,
                   search_model="stand-in", search_image=8, dtype="bfloat16", search_estimate_s=5))
    ctx.result["data"]["sizes"] = size
    _oom_mid_epoch(ctx, size)
    if ctx.left() < size["search_estimate_s"]:
        ctx.note(f"batch-size search not run: {ctx.left():.0f} s left of the section's budget")
    else:
        _search(ctx, size)
    if not ctx.cuda:
        ctx.skip(f"{NEEDS_CUDA}: real out-of-memory errors and memory caps. The section's code ran on CPU with a "
                 f"stand-in model that raises torch.OutOfMemoryError above a size; its tables are not measurements")


def _oom_mid_epoch(ctx: Context, size: dict) -> None:
    device, n, image = ctx.device, size["oom_batch"], size["oom_image"]
    torch.manual_seed(0)
    model = build_model(size["oom_model"], 10, {}) if ctx.cuda else CappedCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = [(torch.randn(n, 3, image, image), torch.randint(0, 10, (n,))) for _ in range(size["oom_batches"])]
    if ctx.cuda:  # the data stays on the host (pinned), off the capped budget
        data = [(x.pin_memory(), y.pin_memory()) for x, y in data]
    ctx.table("out-of-memory error mid-epoch, recovered by OOMBackoff",
              ["what", "value"])
    if ctx.cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        model.to(device)
        peaks = {m: _probe_peak(model, optimizer, data[0], m, size["dtype"], device) for m in (n // 4, n // 2)}
        per_sample = (peaks[n // 2] - peaks[n // 4]) / (n // 4)
        cap = peaks[n // 2] + per_sample * n / 4  # between what half the batch needs and what the whole would
        for m, peak in peaks.items():
            ctx.row(what=f"probe: peak reserved at {m} images (MB)", value=peak / 2**20)
        ctx.row(what="cap (MB): half the batch fits, the whole does not", value=cap / 2**20)

        def apply_cap() -> None:
            torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), device)
            free_memory(device)  # cached blocks above the cap go back
    else:
        def apply_cap() -> None:
            model.limit = n // 2

    # check_split=False: the forward hook below counts every training forward, and the split check's own
    # forwards (once, at the first retry) are not samples trained
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype=size["dtype"],
                                 check_split=False)
    backoff = OOMBackoff()
    backoff.attach(trainer)
    seen = {"attempt": 0, "total": 0}
    durations, oom_at = [], []
    handle = model.register_forward_hook(
        lambda module, args, out: seen.__setitem__("attempt", seen["attempt"] + args[0].shape[0])
        if module.training else None)

    @trainer.on(Events.ITERATION_STARTED)
    def started(engine):
        seen["attempt"] = 0
        seen["start"] = time.perf_counter()

    @trainer.on(AmpEvents.OUT_OF_MEMORY)
    def out_of_memory(engine):  # the failed attempt's samples were not trained on: the retry runs them again
        seen["attempt"] = 0
        oom_at.append(engine.state.iteration)

    @trainer.on(Events.ITERATION_COMPLETED)
    def completed(engine):
        _sync(device)
        durations.append(time.perf_counter() - seen["start"])
        seen["total"] += seen["attempt"]

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=size["cap_after"]), lambda _: apply_cap())
    begin = time.perf_counter()
    try:
        trainer.run(data, max_epochs=1)
    finally:
        handle.remove()
        if ctx.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    seconds = time.perf_counter() - begin
    epoch_size = n * len(data)
    first = oom_at[0] if oom_at else None
    after = durations[first:] if first else []
    lost = durations[first - 1] - statistics.median(after) if first and after else None
    for what, value in (("epoch: batches x size", f"{len(data)} x {n}"),
                        ("cap applied after iteration", size["cap_after"]),
                        ("out-of-memory errors caught (iterations)", f"{len(oom_at)} ({oom_at})"),
                        ("backoff events", backoff.events), ("micro-batches after", trainer.amp_step.micro_batches),
                        ("iterations completed", trainer.state.iteration),
                        ("samples trained (forward passes kept)", seen["total"]), ("epoch size", epoch_size),
                        ("epoch seconds", seconds),
                        ("seconds lost at the error (its iteration less the median after)", lost)):
        ctx.row(what=what, value=value)
    recovered = bool(oom_at) and first > size["cap_after"] and seen["total"] == epoch_size \
        and trainer.state.iteration == len(data)
    ctx.target("a real out-of-memory error mid-epoch is recovered; samples trained == epoch size",
               f"{len(oom_at)} error(s) at iteration {first}; {seen['total']} of {epoch_size} samples; "
               f"{'-' if lost is None else f'{lost:.3f} s'} lost", recovered if oom_at else False)


def _probe_peak(model, optimizer, batch, m: int, dtype: str, device: torch.device) -> int:
    """Peak bytes the caching allocator reserved for two real steps at ``m`` images."""
    probe = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype=dtype)
    part = (batch[0][:m], batch[1][:m])
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe.run([part, part], max_epochs=1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    optimizer.zero_grad(set_to_none=True)
    free_memory(device)
    return peak


def _search(ctx: Context, size: dict) -> None:
    device, image = ctx.device, size["search_image"]
    torch.manual_seed(0)
    if ctx.cuda:
        model = build_model(size["search_model"], 10, {})
    else:
        model = CappedCNN()
        model.limit = 100
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def make_batch(n: int):
        return torch.randn(n, 3, image, image, device=device), torch.randint(0, 10, (n,), device=device)

    ctx.table(f"batch-size search: {size['search_model']} at {image}x{image}, {size['dtype']}",
              ["size", "fits", "peak_mb", "ms_per_step", "seconds", "stage"])
    ctx.note(f"batch-size search started with {ctx.left():.0f} s left of the section's budget")
    begin = time.perf_counter()
    result = ignite_amp.find_batch_size(model, optimizer, cross_entropy, make_batch, device=device,
                                        dtype=size["dtype"])
    seconds = time.perf_counter() - begin
    trials = list(getattr(result, "trials", None) or [])
    for t in trials:  # fields read defensively: the search's result and trials change shape
        peak = getattr(t, "peak_bytes", None)
        ctx.row(size=getattr(t, "size", None), fits=getattr(t, "fits", None),
                peak_mb=peak / 2**20 if peak is not None else getattr(t, "peak_mb", None),
                ms_per_step=getattr(t, "ms_per_step", None), seconds=getattr(t, "seconds", None),
                stage=getattr(t, "stage", None))
    found, largest = getattr(result, "batch_size", None), getattr(result, "largest_fit", None)
    ctx.result["data"]["search"] = {"batch_size": found, "largest_fit": largest, "trials": len(trials),
                                    "seconds": seconds, "strategy": getattr(result, "strategy", None),
                                    "reason": getattr(result, "reason", None)}
    ctx.note(f"search: chose {found} (largest fit {largest}) in {len(trials)} trials, {seconds:.1f} s"
             f"{'; ' + result.reason if getattr(result, 'reason', '') else ''}")
    ctx.target("batch-size search: at most 5 trials and 30 s (issue 13; ResNet-50/224, bfloat16, the whole card; "
               "'within 5% of the true largest fit' is section a's test)",
               f"{len(trials)} trials, {seconds:.1f} s, size {found}", len(trials) <= 5 and seconds <= 30)


# -- e. numerics parity -----------------------------------------------------------------------------
def numerics(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~30 s. CIFAR ResNet-18 on shapes at 32x32 (8000 training, 2000 validation
        # images), batch 128, 4 epochs, the quickstart's optimizer and schedule: ~5-10 s per dtype
        # (float32 with TF32 off is the slowest), with building the run and generating the data (~2 s).
        gpu=dict(model="ignite_amp.models:cifar_resnet18", kwargs={}, train=8000, val=2000, batch=128, epochs=4,
                 workers=4, image=32),
        smoke=dict(model="ignite_amp.models:small_cnn", kwargs={"width": 8}, train=256, val=128, batch=32, epochs=1,
                   workers=0, image=16))
    ctx.result["data"]["sizes"] = size
    ctx.table("the same training (seed, weights, batches) per dtype; final epoch",
              ["dtype", "val_accuracy", "val_loss", "train_loss", "accuracy_points_vs_float32", "samples_per_s",
               "seconds"])
    finals = {}
    for i, dtype in enumerate(("float32", "float16", "bfloat16")):
        if i and ctx.left() < 1.2 * max(r["seconds"] for r in finals.values()):
            ctx.note(f"{dtype} not run: {ctx.left():.0f} s left of the section's budget")
            continue
        cfg = _recipe("configs/quickstart.yaml", **{
            "name": f"parity-{dtype}", "device": ctx.device.type, "output_dir": os.path.join(ctx.workdir, dtype),
            "amp.dtype": dtype, "model.name": size["model"], "model.kwargs": size["kwargs"],
            "data.train_size": size["train"], "data.val_size": size["val"], "data.image_size": size["image"],
            "data.batch_size": size["batch"], "data.num_workers": size["workers"], "train.epochs": size["epochs"],
            "handlers.checkpoint.resume": "never", "handlers.tensorboard.enabled": False})
        begin = time.perf_counter()
        with tf32(False if dtype == "float32" else None):  # the reference is IEEE float32
            final = train_from_config(cfg, print_fn=lambda *a, **k: None)["final"]
        finals[dtype] = dict(final, seconds=time.perf_counter() - begin)
        reference = finals.get("float32")
        delta = None if reference is None else (final["val_accuracy"] - reference["val_accuracy"]) * 100
        ctx.row(dtype=dtype, val_accuracy=final["val_accuracy"], val_loss=final["val_loss"],
                train_loss=final["train_loss"], accuracy_points_vs_float32=delta,
                samples_per_s=final["samples_per_sec"], seconds=finals[dtype]["seconds"])
        if dtype != "float32":
            ctx.target(f"{dtype}: val accuracy within 0.5 points of float32",
                       "" if delta is None else f"{delta:+.2f} points", None if delta is None else abs(delta) <= 0.5)
    for dtype in ("float16", "bfloat16"):
        if dtype not in finals:
            ctx.target(f"{dtype}: val accuracy within 0.5 points of float32", "not run", None)
    ctx.note(f"{size['model']} on shapes {size['image']}x{size['image']}, {size['train']}/{size['val']} images, "
             f"batch {size['batch']}, {size['epochs']} epochs, the quickstart's AdamW and one-cycle schedule; "
             f"float32 with TF32 off.")


# -- f. host syncs ----------------------------------------------------------------------------------
def host_syncs(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~12 s. The CIFAR recipe (ResNet-18, batch 256, channels_last, clipping,
        # checkpoint, OOM backoff, non-finite guard, TensorBoard every 50) on fake 32x32 data, bfloat16:
        # one epoch of 120 iterations (~10-15 ms each with the debug mode's stack walks), one evaluation.
        gpu=dict(model="ignite_amp.models:cifar_resnet18", kwargs={}, train=30720, val=2560, batch=256, workers=4,
                 log_every=50, image=32),
        smoke=dict(model="ignite_amp.models:small_cnn", kwargs={"width": 8}, train=64, val=32, batch=8, workers=0,
                   log_every=4, image=16))
    cfg = _recipe("configs/cifar10_resnet18.yaml", **{
        "name": "host-syncs", "device": ctx.device.type, "output_dir": os.path.join(ctx.workdir, "syncs"),
        "amp.dtype": "bfloat16", "model.name": size["model"], "model.kwargs": size["kwargs"],
        "data.name": "fake", "data.download": False, "data.image_size": size["image"],
        "data.train_size": size["train"], "data.val_size": size["val"], "data.batch_size": size["batch"],
        "data.num_workers": size["workers"], "train.epochs": 1, "handlers.checkpoint.resume": "never",
        "handlers.tensorboard.log_every": size["log_every"]})
    ctx.result["data"]["sizes"] = size
    run = build_run(cfg, print_fn=lambda *a, **k: None)
    trainer, log_every = run.trainer, size["log_every"]
    phase = {"now": ("outside", 0)}
    syncs = []

    def into(engine):  # from fetching iteration i's batch to the end of its handlers: iteration i
        phase["now"] = ("iteration", engine.state.iteration + 1)

    def out(engine):
        phase["now"] = ("outside", engine.state.iteration)

    trainer.add_event_handler(Events.GET_BATCH_STARTED, into)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, out)  # attached last: runs after every other handler

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            syncs.append((phase["now"], f"{_short(filename)}:{lineno}"))

    # The debug mode warns at copies and stream syncs only; a host wait on an event or a device
    # (NonFiniteGuard's flush, a device clock) is counted by wrapping those calls.
    with warnings.catch_warnings(), _counting_waits(lambda site: syncs.append((phase["now"], site))):
        warnings.simplefilter("always")
        warnings.showwarning = show
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            run.train()
        finally:
            if ctx.cuda:
                torch.cuda.set_sync_debug_mode(0)
    iterations = trainer.state.iteration
    groups = {"iteration 1 (first: lazy set-up)": lambda p: p[0] == "iteration" and p[1] == 1,
              f"iterations 2-{iterations} outside log intervals": lambda p: p[0] == "iteration" and p[1] > 1
              and p[1] % log_every,
              f"log iterations (every {log_every})": lambda p: p[0] == "iteration" and p[1] > 1
              and not p[1] % log_every,
              "outside iterations (epoch end: summary, evaluation, checkpoint)": lambda p: p[0] == "outside"}
    counts = {"iteration 1 (first: lazy set-up)": 1, f"log iterations (every {log_every})": iterations // log_every}
    steady = f"iterations 2-{iterations} outside log intervals"
    counts[steady] = iterations - 1 - sum(1 for i in range(2, iterations + 1) if not i % log_every)
    ctx.table("synchronizing CUDA calls (torch.cuda.set_sync_debug_mode('warn')), one epoch",
              ["where", "iterations", "syncs", "per_iteration", "call_sites"])
    for name, test in groups.items():
        found = [site for p, site in syncs if test(p)]
        n = counts.get(name)
        top = ", ".join(f"{site} x{k}" for site, k in Counter(found).most_common(5))
        ctx.row(where=name, iterations=n, syncs=len(found), per_iteration=len(found) / n if n else None,
                call_sites=top)
    steady_syncs = sum(1 for p, _ in syncs if groups[steady](p))
    per_iteration = steady_syncs / counts[steady] if counts[steady] else None
    ctx.target("0 syncs per iteration outside the log intervals (bfloat16, default handlers)",
               "-" if per_iteration is None else f"{per_iteration:.2f} per iteration ({steady_syncs} in "
                                                 f"{counts[steady]} iterations)",
               None if per_iteration is None else per_iteration == 0)
    if not ctx.cuda:
        ctx.skip(f"{NEEDS_CUDA}: torch.cuda.set_sync_debug_mode counts CUDA synchronizations only. The epoch ran on "
                 f"CPU without counting, to keep the section's code checked")


@contextlib.contextmanager
def _counting_waits(record: Callable[[str], None]):
    """Call ``record("<call> at file:line")`` at each torch.cuda.synchronize, Event.synchronize and
    Stream.synchronize made inside."""
    targets = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in targets]

    def counted(fn: Callable, label: str) -> Callable:
        def wait(*args, **kwargs):
            caller = sys._getframe(1)
            record(f"{label} at {_short(caller.f_code.co_filename)}:{caller.f_lineno}")
            return fn(*args, **kwargs)
        return wait

    try:
        for owner, name, fn in originals:
            label = f"{getattr(owner, '__name__', 'cuda')}.{name}" if owner is not torch.cuda else "cuda.synchronize"
            setattr(owner, name, counted(fn, label))
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def _short(path: str) -> str:
    """``path`` from the repository root where it is inside it (ignite_amp/step/train.py), else its last two parts."""
    relative = os.path.relpath(os.path.abspath(path), ROOT)
    parts = path.replace("\\", "/").split("/")
    return relative.replace("\\", "/") if not relative.startswith("..") else "/".join(parts[-2:])


# -- g. the data path -------------------------------------------------------------------------------
def data_path(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100 machine (16 cores): ~25 s. Per loader, its second epoch is timed
        # (persistent workers, as the run's loaders): the quickstart's 8000 images in batches of 64
        # (~0.3-1 s) and the CIFAR recipe on 12800 fake images in batches of 256 with crop + flip
        # (~0.5-3 s), 6 loaders each; plus each config's training step rate on batches already on the
        # GPU, to say whether the loader keeps up (~3 s each).
        gpu=dict(workers=(0, 4, 8), quick_train=8000, recipe_train=12800, step_batch=None, steps=20, warmup=5),
        smoke=dict(workers=(0, 2), quick_train=256, recipe_train=512, step_batch=8, steps=2, warmup=1))
    ctx.result["data"]["sizes"] = size
    recipes = (
        ("quickstart", _recipe("configs/quickstart.yaml", **{"data.train_size": size["quick_train"]})),
        ("CIFAR recipe, fake data", _recipe("configs/cifar10_resnet18.yaml", **{
            "data.name": "fake", "data.download": False, "data.train_size": size["recipe_train"]})),
    )
    ctx.table("loader to device: samples/s of a loader's second epoch (batches copied to the device)",
              ["config", "num_workers", "pin_memory", "samples_per_s", "first_epoch_s", "keeps_up", "seed_setting",
               "status"])
    slowest = 0.0
    for name, cfg in recipes:
        data = cfg["data"]
        train_set, _, _ = build_datasets(data, cfg["model"]["num_classes"], cfg["seed"])
        rate = _step_rate(ctx, cfg, size)
        ctx.result["data"][f"{name}: training step samples/s"] = rate
        seed_row = None
        for workers in size["workers"]:
            for pin in (False, True):
                seed_setting = workers == data["num_workers"] and pin == ctx.cuda  # make_loader pins on CUDA
                if pin and not ctx.cuda:
                    ctx.row(config=name, num_workers=workers, pin_memory=pin, seed_setting=seed_setting,
                            status=f"skipped: {NEEDS_CUDA} (pinned memory)")
                    continue
                if ctx.left() < 2 * slowest + 2:
                    ctx.row(config=name, num_workers=workers, pin_memory=pin, seed_setting=seed_setting,
                            status=f"not run: {ctx.left():.0f} s left of the section's budget")
                    continue
                begin = time.monotonic()
                first, second = _loader_epochs(train_set, data["batch_size"], workers, pin, ctx.device, cfg["seed"])
                slowest = max(slowest, time.monotonic() - begin)
                samples = len(train_set) / second
                ctx.row(config=name, num_workers=workers, pin_memory=pin, samples_per_s=samples, first_epoch_s=first,
                        keeps_up=samples >= rate, seed_setting=seed_setting, status="measured")
                seed_row = samples if seed_setting else seed_row
        advice = f"{name}: its own num_workers ({data['num_workers']}) keeps up with its model"
        if seed_row is None:
            ctx.target(advice, "its setting was not in this run's grid", None)
        else:
            ctx.target(advice, f"{seed_row:.0f} samples/s loaded, {rate:.0f} trained", seed_row >= rate)
    ctx.note("keeps_up: the loader delivers at least the samples/s the config's model trains at (bfloat16, "
             "create_amp_trainer, batches already on the device; see data). seed_setting: the config's num_workers, "
             "pinned on CUDA as the run's loaders are. Not a target of the issue: it measures the seed configs' "
             "data-loading advice.")


def _loader_epochs(dataset, batch_size: int, workers: int, pin: bool, device: torch.device, seed: int) -> tuple:
    """Seconds of a loader's first and second epochs, each batch copied to ``device``."""
    loader = DataLoader(dataset, batch_size=batch_size, sampler=EpochShuffleSampler(len(dataset), seed),
                        num_workers=workers, pin_memory=pin, persistent_workers=workers > 0)
    seconds = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        begin = time.perf_counter()
        for x, y in loader:
            x, y = x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)
        _sync(device)
        seconds.append(time.perf_counter() - begin)
    del loader  # ends persistent workers
    return tuple(seconds)


def _step_rate(ctx: Context, cfg: dict, size: dict) -> float:
    """Samples/s the config's model trains at in bfloat16 on batches already on the device."""
    device, batch = ctx.device, size["step_batch"] or cfg["data"]["batch_size"]
    image = cfg["data"]["image_size"] or 32
    torch.manual_seed(0)
    model = build_model(cfg["model"]["name"], cfg["model"]["num_classes"], cfg["model"]["kwargs"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype="bfloat16",
                                 channels_last=cfg["amp"]["channels_last"])
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, cfg["model"]["num_classes"], (batch,), device=device)
    trainer.run([(x, y)] * size["warmup"], max_epochs=1)
    seconds = timed(lambda: trainer.run([(x, y)] * size["steps"], max_epochs=1), device)
    return batch * size["steps"] / seconds


# -- h. activation checkpointing ----------------------------------------------------------------------
class GPT(nn.Module):
    """Token and position embeddings, ``layers`` GPTBlocks (``blocks.N``), a final norm and the vocabulary head;
    returns the logits of every position flattened to ``(batch * tokens, vocab)``."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, tokens: int):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(tokens, width))
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).flatten(0, 1)


def activation_checkpointing(ctx: Context) -> None:
    size = ctx.sizes(
        # Expected on one H100: ~25 s. GPT (12 x 1024, 16 heads, 1024 tokens, batch 8, ~150 M parameters with
        # the 32k head) takes ~0.1-0.15 s a step; ResNet-50 (batch 128, 224x224) ~0.1 s after cudnn autotuning
        # (a few seconds). Each: 3 warm-up and 5 timed steps, with and without, one after the other.
        gpu=dict(layers=12, width=1024, heads=16, vocab=32768, tokens=1024, batch=8,
                 cnn=resnet50, cnn_name="torchvision resnet50", cnn_batch=128, image=224, warmup=3, steps=5),
        smoke=dict(layers=2, width=32, heads=4, vocab=64, tokens=16, batch=4,
                   cnn=lambda: build_model("resnet18", 10, {}), cnn_name="torchvision resnet18 (stand-in)",
                   cnn_batch=8, image=16, warmup=1, steps=2))
    device = ctx.device
    torch.backends.cudnn.benchmark = True
    ctx.result["data"]["sizes"] = {k: v for k, v in size.items() if k != "cnn"}
    ctx.table("bfloat16, create_amp_trainer, SGD; activation memory: peak allocated during the steps less what the "
              "weights, gradients and optimizer state hold", ["model", "checkpointing", "blocks", "step_ms",
                                                              "peak_activation_mb", "peak_mb", "status"])
    gpt = dict(factory=lambda: GPT(size["layers"], size["width"], size["heads"], size["vocab"], size["tokens"]),
               batch=lambda: (torch.randint(0, size["vocab"], (size["batch"], size["tokens"]), device=device),
                              torch.randint(0, size["vocab"], (size["batch"] * size["tokens"],), device=device)))
    cnn = dict(factory=size["cnn"],
               batch=lambda: (torch.randn(size["cnn_batch"], 3, size["image"], size["image"], device=device),
                              torch.randint(0, 10, (size["cnn_batch"],), device=device)))
    measured = {}
    for name, spec in ((f"GPT {size['layers']}x{size['width']}, {size['tokens']} tokens", gpt),
                       (size["cnn_name"], cnn)):
        for on in (False, True):
            if ctx.left() < 5:
                ctx.row(model=name, checkpointing=on, status=f"not run: {ctx.left():.0f} s left of the budget")
                continue
            r = _checkpointing_step(spec, on, size, device)
            measured[(name, on)] = r
            ctx.row(model=name, checkpointing=on, blocks=r["blocks"], step_ms=r["step_ms"],
                    peak_activation_mb=r["activation_mb"], peak_mb=r["peak_mb"], status="measured")
        plain, checkpointed = measured.get((name, False)), measured.get((name, True))
        transformer = name.startswith("GPT")
        if plain is None or checkpointed is None or plain["activation_mb"] is None:
            saved, slower, value = None, None, ""
        else:
            saved = 1 - checkpointed["activation_mb"] / plain["activation_mb"]
            slower = checkpointed["step_ms"] / plain["step_ms"] - 1
            value = f"{saved * 100:.1f}% less activation memory, {slower * 100:+.1f}% step time"
        ctx.target(f"{name}: >= 40% less peak activation memory for <= 35% more step time" if transformer else
                   f"{name}: less peak activation memory (no target; measured)", value,
                   None if saved is None else (saved >= 0.40 and slower <= 0.35) if transformer else saved > 0)
    ctx.note("Checkpointed blocks: the GPT's blocks.N and ResNet-50's Bottleneck blocks (layerN.M), by the rule FSDP2 "
             "shards by. Peaks are torch.cuda.max_memory_allocated; without CUDA there is no memory figure.")


def _checkpointing_step(spec: dict, on: bool, size: dict, device: torch.device) -> dict:
    """Median ms per step and peak memory of ``size['steps']`` bfloat16 steps, after the warm-up steps."""
    gc.collect()
    free_memory(device)
    torch.manual_seed(0)
    model = spec["factory"]().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype="bfloat16",
                                 activation_checkpointing=on)
    batches = [spec["batch"]() for _ in range(size["warmup"] + size["steps"])]
    trainer.run(batches[:size["warmup"]], max_epochs=1)  # gradients and optimizer state exist from here on
    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device) if cuda else None
    times = []
    for batch in batches[size["warmup"]:]:
        begin = time.perf_counter()
        trainer.run([batch], max_epochs=1)
        _sync(device)
        times.append(time.perf_counter() - begin)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    blocks = checkpointed_blocks(model)
    del trainer, optimizer, model, batches
    return {"step_ms": statistics.median(times) * 1e3, "blocks": len(blocks),
            "peak_mb": peak / 2**20 if cuda else None, "activation_mb": (peak - held) / 2**20 if cuda else None}


# -- the suite --------------------------------------------------------------------------------------
class Section(NamedTuple):
    key: str
    title: str
    run: Callable[[Context], None]
    budget_s: int      # on a GPU: the section is stopped here
    expected_s: int    # expected on one H100 (an estimate until a GPU run replaces it)


SECTIONS = (
    Section("a_gpu_tests", "a. GPU tests (pytest -m gpu)", gpu_tests, 185, 170),
    Section("b_overhead", "b. Overhead against the hand-written loop (ResNet-18, 32x32, batch 256)", overhead, 40, 25),
    Section("c_amp_vs_fp32", "c. AMP against float32 (ResNet-50, 224x224, batch 128)", amp_vs_fp32, 110, 100),
    Section("d_batch_size", "d. Batch-size search and out-of-memory recovery", batch_size_and_oom, 45, 35),
    Section("e_numerics", "e. Numerics parity (CIFAR ResNet-18 on shapes, 32x32)", numerics, 40, 30),
    Section("f_host_syncs", "f. Host syncs per iteration (bfloat16, default handlers)", host_syncs, 20, 12),
    Section("g_data_path", "g. Data path (num_workers, pin_memory)", data_path, 30, 25),
    Section("h_activation_checkpointing", "h. Activation checkpointing (GPT-style transformer, ResNet-50)",
            activation_checkpointing, 35, 25),
    # (budgets c, d, f and g gave 25 s to j: each keeps 5 s or more over its expected time)
    Section("j_handler_cost", "j. The handlers' host cost (small CNN, ResNet-50; benchmarks/overhead.py's table)",
            handler_cost, 25, 20),
)
# Run only when --only names them; their budgets are outside the 9 minutes of SECTIONS.
OPT_IN = (
    Section("i_float8", "i. float8 against bfloat16 (GPT 4 x 2048, sequence 1024, torch.compile)", float8_section,
            480, 330),
    Section("k_memory_plan", "k. Memory plan against max_memory_allocated (ResNet-50, GPT-style)",
            memory_plan_section, 240, 120),
    Section("l_split_check", "l. The split check's cost on the first step (GPT 8 x 1024, bfloat16, micro-batches 2)",
            split_check_section, 60, 30),
)


def probe_environment(smoke: bool) -> dict:
    """The report's header. Runs in a child process: it may initialise CUDA."""
    cuda = not smoke and torch.cuda.is_available()
    smi = _nvidia_smi()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "ignite": ignite.__version__, "python": platform.python_version(),
            "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "cuda_available": cuda,
            "driver": smi.get("driver") or "none (no NVIDIA driver here)"}
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    built = torch.version.cuda or "none"
    info["cuda"] = f"{built} (torch's build); driver's CUDA {smi.get('cuda') or 'none'}"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB)",
                    compute_capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version(),
                    bf16=torch.cuda.is_bf16_supported())
    else:
        info["device"] = f"cpu: {info['cpu']} ({info['cpu_count']} cores)"
    return info


def _nvidia_smi() -> dict:
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        plain = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    found = re.search(r"CUDA Version:\s*([\d.]+)", plain.stdout)
    driver = query.stdout.strip().splitlines()[0] if query.returncode == 0 and query.stdout.strip() else None
    return {"driver": driver, "cuda": found.group(1) if found else None}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^model name\s*:\s*(.+)$", f.read(), flags=re.M)
        return found.group(1).strip() if found else platform.processor()
    except OSError:
        return platform.processor() or "unknown"


def _seconds_since_start() -> float:
    """Seconds since this process started (Linux /proc; 0 where unknown)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _forked(target: Callable, path: str, timeout: float):
    """Run ``target()`` in a forked child in its own process group; stop the group at ``timeout``.

    Returns (finished, exit code). The child records its results in ``path`` itself.
    """
    sys.stdout.flush()
    sys.stderr.flush()

    def child():
        os.setsid()  # its subprocesses (pytest, loader workers) are stopped with it
        code = 0
        try:
            target()
        except BaseException:  # noqa: BLE001 - the parent reads what was recorded; the rest goes to stderr
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no atexit handlers, no waiting for the section's threads

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(timeout)
    finished = not process.is_alive()
    if not finished:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.join()
    return finished, process.exitcode


def run_section(section: Section, smoke: bool, cuda: bool, budget_s: float, workdir: str) -> dict:
    """Run one section in its own process and return what it recorded, cut at ``budget_s``."""
    path = os.path.join(workdir, f"{section.key}.json")
    ctx = Context(section.key, section.title, smoke, cuda, budget_s, path, workdir)
    ctx.save()

    def target():
        ctx.deadline = time.monotonic() + budget_s
        if smoke:  # tiny sizes run fastest on one thread, where a busy shared CPU does not stall them; and
            torch.set_num_threads(1)  # the library's gc.collect() per out-of-memory error (d) skips the
            gc.freeze()               # imports' objects. Not on a GPU: there that cost is part of the figures.
        try:
            section.run(ctx)
            if ctx.result["status"] == "running":
                ctx.result["status"] = "measured"
        except Exception as exc:
            ctx.result.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:500],
                              traceback=traceback.format_exc()[-4000:])
            traceback.print_exc()
        ctx.result["complete"] = True
        ctx.save()

    begin = time.monotonic()
    finished, code = _forked(target, path, budget_s)
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    result["seconds"] = time.monotonic() - begin
    result["budget_s"] = budget_s
    if not finished:
        result.update(status="over budget", reason=f"stopped at the section's budget of {budget_s:.0f} s; what it "
                                                   f"recorded before the cut is kept")
    elif not result.get("complete"):
        result.update(status="failed", reason=f"its process ended (exit code {code}) before the section finished")
    result.pop("complete", None)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the suite's code")
    parser.add_argument("--only", default="", help="section letters to run, e.g. 'ce' (default: a to h and j; i (float8) and k (memory plan) only when named)")
    args = parser.parse_args(argv)
    args.command = " ".join(["python benchmarks/gpu_suite.py"] + (sys.argv[1:] if argv is None else list(argv)))
    start = time.monotonic() - _seconds_since_start()  # the imports count against the 9 minutes too
    # This process only forks the sections (and the environment probe): it never touches CUDA itself.
    import torch.utils.tensorboard  # noqa: F401 - imported once here, not in each forked section
    import torchvision.models  # noqa: F401

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as workdir:
        return run_suite(args, out, start, workdir)


def run_suite(args: argparse.Namespace, out: str, start: float, workdir: str) -> int:
    header_path = os.path.join(workdir, "header.json")
    _forked(lambda: _write_json(header_path, probe_environment(args.smoke)), header_path, 60)
    try:
        with open(header_path, encoding="utf-8") as f:
            header = json.load(f)
    except OSError:  # the probe died: say so in the header rather than lose the run
        header = {key: "unknown (the environment probe failed)" for key in
                  ("date", "device", "driver", "cuda", "python", "cpu", "cpu_count", "torchvision")}
        header.update(torch=torch.__version__, ignite=ignite.__version__, cuda_available=False)
    cuda = header.pop("cuda_available")
    mode = "smoke (CPU, tiny sizes)" if args.smoke else "full"
    print(f"gpu_suite: {mode} on {header['device']}, torch {header['torch']}, ignite {header['ignite']}", flush=True)
    report = {"suite": "ignite-amp benchmarks/gpu_suite.py", "mode": "smoke" if args.smoke else "full",
              "command": args.command,
              "header": header, "total_budget_s": TOTAL_BUDGET_S, "startup_allowance_s": STARTUP_ALLOWANCE_S,
              "gpu_budgets_s": {s.key: {"budget_s": s.budget_s, "expected_h100_s": s.expected_s} for s in SECTIONS},
              "sections": {}}
    for section in SECTIONS + OPT_IN:
        if (args.only or section in OPT_IN) and section.key[0] not in args.only:
            continue
        print(f"{section.title} ...", flush=True)
        if args.smoke:
            budget = SMOKE_BUDGET_S
        else:
            budget = min(section.budget_s, TOTAL_BUDGET_S - (time.monotonic() - start) - 2)
        if not args.smoke and not cuda and section.key != "a_gpu_tests":
            result = _not_run(section, budget, "skipped", f"{NEEDS_CUDA}: no CUDA device here (--smoke checks "
                                                          f"the suite's code on CPU)")
        elif budget < 5:
            result = _not_run(section, budget, "over budget", f"not started: the suite's {TOTAL_BUDGET_S} s were spent")
        else:
            result = run_section(section, args.smoke, cuda, budget, workdir)
        result["expected_h100_s"] = section.expected_s
        report["sections"][section.key] = result
        report["seconds"] = time.monotonic() - start
        print(f"{section.title}: {result['status']}{': ' + result['reason'] if result.get('reason') else ''} "
              f"({result['seconds']:.1f} s)", flush=True)
        write_report(report, out)
    report["seconds"] = time.monotonic() - start
    write_report(report, out)
    print(f"gpu_suite: {report['seconds']:.1f} s; wrote {os.path.join(out, 'gpu_suite.json')} and gpu_suite.md",
          flush=True)
    return 1 if any(s["status"] == "failed" for s in report["sections"].values()) else 0


def _not_run(section: Section, budget: float, status: str, reason: str) -> dict:
    return {"key": section.key, "title": section.title, "status": status, "reason": reason, "tables": [],
            "targets": [], "notes": [], "data": {}, "seconds": 0.0, "budget_s": budget}


# -- the report -------------------------------------------------------------------------------------
def write_report(report: dict, out: str) -> None:
    _write_json(os.path.join(out, "gpu_suite.json"), report)
    tmp = os.path.join(out, "gpu_suite.md.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render_markdown(report))
    os.replace(tmp, os.path.join(out, "gpu_suite.md"))


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.4f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(columns: list, rows: list) -> list:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def render_markdown(report: dict) -> str:
    h = report["header"]
    lines = [f"# ignite-amp GPU suite: {h['device']}", "",
             "| device | driver | CUDA | torch | Ignite | date |", "|---|---|---|---|---|---|",
             f"| {h['device']} | {h['driver']} | {h['cuda']} | {h['torch']} | {h['ignite']} | {h['date']} |", "",
             f"Mode: {report['mode']}. `{report['command']}`: {report.get('seconds', 0):.0f} s in all "
             f"(budget on one H100: {report['total_budget_s']} s). Python {h['python']}, torchvision "
             f"{h.get('torchvision')}, CPU {h['cpu']} x {h['cpu_count']}.", ""]
    for s in report["sections"].values():
        status = s["status"] + (f": {s['reason']}" if s.get("reason") else "")
        lines += [f"## {s['title']}", "",
                  f"**{status}** ({s['seconds']:.1f} s; budget {s['budget_s']:.0f} s; expected on one H100 "
                  f"~{s['expected_h100_s']} s)", ""]
        for table in s["tables"]:
            caption = table["name"] + (" (CPU stand-in run, not a measurement)" if s["status"] == "skipped" else "")
            lines += [f"*{caption}*", ""] + _table(table["columns"], table["rows"]) + [""]
        if s["targets"]:
            lines += _table(["target", "value", "verdict"], s["targets"]) + [""]
        lines += [f"- {note}" for note in s["notes"]] + ([""] if s["notes"] else [])
        if s.get("traceback"):
            lines += ["```", s["traceback"].strip()[-1500:], "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
