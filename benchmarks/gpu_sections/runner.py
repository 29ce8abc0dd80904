"""The GPU suite's runner: each section in a forked process under its time budget, the report written after each."""
import argparse
import gc
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from typing import Callable

import ignite
import torch

from .common import NEEDS_CUDA, Context, Section, write_json
from .environment import probe_environment
from .report import write_report

TOTAL_BUDGET_S = 360          # the whole default suite on one H100: 6 minutes (a GPU is lent for ~15)
STARTUP_ALLOWANCE_S = 10      # imports and the environment probe, before the first section
SMOKE_BUDGET_S = 120          # per section in --smoke (CPU, tiny sizes: each takes seconds)


def seconds_since_start() -> float:
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


def run_suite(args: argparse.Namespace, out: str, start: float, workdir: str, sections: tuple, opt_in: tuple) -> int:
    """Run ``sections`` (or those of ``sections + opt_in`` that ``args.only`` names) and write the report into
    ``out`` after each; ``start``: the monotonic time the suite's budget counts from. Returns the exit code."""
    header_path = os.path.join(workdir, "header.json")
    _forked(lambda: write_json(header_path, probe_environment(args.smoke)), header_path, 60)
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
              "gpu_budgets_s": {s.key: {"budget_s": s.budget_s, "expected_h100_s": s.expected_s} for s in sections},
              "sections": {}}
    for section in sections + opt_in:
        if (args.only or section in opt_in) and section.key[0] not in args.only:
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
