"""Section a: the GPU tests, ``pytest -m gpu`` in a subprocess, pass/fail/skip counts per test."""
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter

from .common import NEEDS_CUDA, ROOT, Context

SLOW_TEST = "resnet50_search"


def gpu_tests(ctx: Context) -> None:
    """Section a: every GPU test but issue 13's ResNet-50 search (section n)."""
    # Expected on one H100: ~45 s. pytest's start and collection ~10 s; the GPU tests: the search on
    # ResNet-18 under a memory cap (~10 s, 2026-11-27), real-OOM backoff (~5 s), torchrun with one GPU (~15 s).
    _pytest(ctx, ["-k", f"not {SLOW_TEST}"])


def resnet50_search_test(ctx: Context) -> None:
    """Section n (opt-in): issue 13's ResNet-50 search test (two searches, the true largest fit by bisection, a
    run with batch_size auto): ~90-120 s on one H100."""
    _pytest(ctx, ["-k", SLOW_TEST])


def _pytest(ctx: Context, selection: list) -> None:
    junit = os.path.join(ctx.workdir, "gpu_tests.xml")
    command = [sys.executable, "-m", "pytest", "-m", "gpu", *selection, "-v", "-p", "no:cacheprovider",
               f"--junitxml={junit}"]
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
