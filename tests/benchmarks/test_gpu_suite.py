"""benchmarks/gpu_suite.py cannot rot before a GPU shows up: its smoke mode runs here, on CPU."""
import datetime
import json
import os
import subprocess
import time
from types import SimpleNamespace

import ignite
import pytest
import torch

from helpers import ROOT

SUITE = os.path.join(ROOT, "benchmarks", "gpu_suite.py")
SECTIONS = ["a_gpu_tests", "b_overhead", "c_amp_vs_fp32", "d_batch_size", "e_numerics", "f_host_syncs",
            "g_data_path", "h_activation_checkpointing", "j_handler_cost"]
HEADER = ("device", "driver", "cuda", "torch", "ignite", "date")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, forks):
    """The default sections' smoke run, forked from the suite's fork server (``helpers.forks``): the suite's own
    start is not what these tests test."""
    out = tmp_path_factory.mktemp("gpu_suite")
    proc = forks.run([SUITE, "--smoke", "--out", str(out)], ROOT, limit=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "gpu_suite.json", encoding="utf-8") as f:
        report = json.load(f)
    return report, (out / "gpu_suite.md").read_text(encoding="utf-8")


def rows(section: dict, index: int = 0) -> list:
    return section["tables"][index]["rows"]


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_smoke_report_has_the_header_and_every_section_measured_or_skipped_with_a_reason(smoke):
    report, _ = smoke
    header = report["header"]
    assert all(isinstance(header[key], str) and header[key] for key in HEADER), header
    assert header["torch"] == torch.__version__ and header["ignite"] == ignite.__version__
    datetime.datetime.strptime(header["date"], "%Y-%m-%d %H:%M UTC")
    assert report["mode"] == "smoke" and list(report["sections"]) == SECTIONS
    for key, section in report["sections"].items():
        assert section["status"] in ("measured", "skipped"), (key, section["status"], section.get("reason"))
        if section["status"] == "skipped":
            assert section["reason"].startswith("needs CUDA"), (key, section["reason"])
        assert section["tables"] and all(table["rows"] for table in section["tables"]), key
        assert section["targets"], key
        # On CPU no GPU target can pass or miss.
        assert {t["verdict"] for t in section["targets"]} == {"NOT MEASURED"}, (key, section["targets"])
        assert section["seconds"] <= section["budget_s"]


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_gpu_budgets_add_up_to_six_minutes_at_most(smoke):
    """A GPU is lent for about 15 minutes, start included: the default suite runs, is fixed, and runs again."""
    report, _ = smoke
    budgets = report["gpu_budgets_s"]
    assert list(budgets) == SECTIONS
    assert sum(b["budget_s"] for b in budgets.values()) + report["startup_allowance_s"] <= 6 * 60
    assert all(0 < b["expected_h100_s"] <= b["budget_s"] for b in budgets.values())


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_smoke_sections_ran_their_code_and_skipped_only_what_needs_cuda(smoke):
    report, _ = smoke
    s = report["sections"]
    counts = s["a_gpu_tests"]["data"]["counts"]
    assert counts["passed"] == counts["failed"] == counts["error"] == 0 and counts["skipped"] >= 1
    assert len(rows(s["a_gpu_tests"])) == counts["skipped"]

    overhead = rows(s["b_overhead"])
    assert {r["dtype"] for r in overhead} == {"bfloat16", "float16"}
    assert all(r["ms_per_iter"] > 0 and r["ci_low"] <= r["vs_hand_loop"] <= r["ci_high"] for r in overhead)
    assert all(r["rounds"] >= 6 for r in overhead)

    amp = {r["variant"]: r for r in rows(s["c_amp_vs_fp32"])}
    assert len(amp) == 6 and amp["float32, TF32 on"]["cudnn_tf32"] is True
    assert all(r["images_per_s"] > 0 and r["status"] == "measured" for r in amp.values())

    oom = {r["what"]: r["value"] for r in rows(s["d_batch_size"], 0)}
    assert oom["backoff events"] >= 1 and oom["samples trained (forward passes kept)"] == oom["epoch size"]
    assert oom["iterations completed"] == 6 and oom["micro-batches after"] == 2
    trials = rows(s["d_batch_size"], 1)
    assert any(t["fits"] is False for t in trials)  # the stand-in raises torch.OutOfMemoryError above 100
    assert 90 <= s["d_batch_size"]["data"]["search"]["largest_fit"] <= 100

    assert [r["dtype"] for r in rows(s["e_numerics"])] == ["float32", "float16", "bfloat16"]
    assert all(0 <= r["val_accuracy"] <= 1 for r in rows(s["e_numerics"]))

    phases = rows(s["f_host_syncs"])
    assert len(phases) == 4 and sum(r["iterations"] or 0 for r in phases) == 8

    loaders = rows(s["g_data_path"])
    assert all(r["status"].startswith("skipped: needs CUDA") for r in loaders if r["pin_memory"])
    assert all(r["samples_per_s"] > 0 for r in loaders if not r["pin_memory"])

    checkpointing = rows(s["h_activation_checkpointing"])  # the GPT's 2 blocks, the stand-in ResNet's 8
    assert [(r["checkpointing"], r["blocks"]) for r in checkpointing] == [(False, 0), (True, 2), (False, 0), (True, 8)]
    assert all(r["step_ms"] > 0 and r["peak_activation_mb"] is None for r in checkpointing)

    handlers = rows(s["j_handler_cost"])  # overhead.py's table on both models (no Ignite rows: float16 on a CPU)
    assert len({r["model"] for r in handlers}) == 2 and all(r["ms_per_iter"] > 0 for r in handlers)
    assert {"hand-written loop", "create_amp_trainer", "+ GradientClipping(max_norm=1.0)",
            "+ TensorBoardMetrics(log_every=50)", "+ NonFiniteGuard", "+ all default handlers"} <= {
        r["variant"] for r in handlers}
    assert len(s["j_handler_cost"]["targets"]) == 12


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_smoke_markdown_has_the_header_and_one_part_per_section(smoke):
    report, md = smoke
    header = report["header"]
    assert md.startswith("# ignite-amp GPU suite")
    assert "| device | driver | CUDA | torch | Ignite | date |" in md
    assert f"| {header['device']} | {header['driver']} | {header['cuda']} | {header['torch']} | {header['ignite']} | " \
           f"{header['date']} |" in md
    for section in report["sections"].values():
        assert f"## {section['title']}" in md
        assert f"**{section['status']}" in md
    targets = sum(len(s["targets"]) for s in report["sections"].values())
    assert md.count("| NOT MEASURED |") == targets


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (killed, waiting for a parent that may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def suite(monkeypatch):
    """The suite's parts as the command imports them (benchmarks/ on sys.path): the runner, the section
    table, and the sections these tests call."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import gpu_suite  # noqa: F401 - the command and everything it imports load
    from gpu_sections import catalog, common, gpu_tests, host_syncs, runner

    return SimpleNamespace(Context=common.Context, Section=common.Section, run_section=runner.run_section,
                           SECTIONS=catalog.SECTIONS, OPT_IN=catalog.OPT_IN, gpu_tests=gpu_tests.gpu_tests,
                           _counting_waits=host_syncs._counting_waits,
                           split_check_section=catalog.split_check_section)


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_a_section_past_its_budget_is_stopped_with_its_subprocesses_and_keeps_what_it_recorded(suite, tmp_path):
    def slow(ctx):
        child = subprocess.Popen(["sleep", "120"])
        ctx.result["data"]["pid"] = child.pid
        ctx.table("rows", ["i"])
        ctx.row(i=1)
        time.sleep(120)
        ctx.row(i=2)

    begin = time.monotonic()
    result = suite.run_section(suite.Section("z_slow", "z. slow", slow, 2, 1), smoke=True, cuda=False, budget_s=2,
                               workdir=str(tmp_path))
    assert time.monotonic() - begin < 30
    assert result["status"] == "over budget" and "budget of 2 s" in result["reason"]
    assert result["tables"][0]["rows"] == [{"i": 1}]
    time.sleep(0.2)
    assert not alive(result["data"]["pid"])  # the section's own subprocess went with it


def test_a_section_that_raises_or_dies_is_reported_failed(suite, tmp_path):
    def raises(ctx):
        raise RuntimeError("boom")

    def dies(ctx):
        ctx.note("about to die")
        os._exit(3)

    result = suite.run_section(suite.Section("z_raises", "z.", raises, 20, 1), True, False, 20, str(tmp_path))
    assert result["status"] == "failed" and result["reason"] == "RuntimeError: boom" and "boom" in result["traceback"]
    result = suite.run_section(suite.Section("z_dies", "z.", dies, 20, 1), True, False, 20, str(tmp_path))
    assert result["status"] == "failed" and "exit code 3" in result["reason"]
    assert result["notes"] == ["about to die"]


def test_gpu_tests_that_pytest_could_not_run_are_a_failed_section_not_a_measurement(suite, tmp_path, monkeypatch):
    broken = tmp_path / "site" / "pytest"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('pytest is broken here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    result = suite.run_section(suite.Section("a_gpu_tests", "a.", suite.gpu_tests, 60, 1), True, False, 60,
                               str(tmp_path))
    assert result["status"] == "failed" and "with 0 tests run" in result["reason"], result
    assert "pytest is broken here" in result["reason"]


def test_host_syncs_counts_waits_the_debug_mode_cannot_see(suite, monkeypatch):
    """set_sync_debug_mode warns at copies and stream syncs, not at Event.synchronize (NonFiniteGuard's
    flush) or torch.cuda.synchronize: section f wraps those and names the caller."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("device"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: calls.append("event"))
    seen = []
    with suite._counting_waits(seen.append):
        torch.cuda.synchronize()
        torch.cuda.Event.synchronize(None)
    torch.cuda.synchronize()  # restored: not counted
    assert calls == ["device", "event", "device"]
    assert [s.split(" at ")[0] for s in seen] == ["cuda.synchronize", "Event.synchronize"]
    assert all(s.split(" at ")[1].startswith("tests/benchmarks/test_gpu_suite.py:") for s in seen), seen


@pytest.mark.slow
@pytest.mark.subprocess
def test_gpu_tests_past_the_budget_stop_with_everything_they_started(suite, tmp_path, monkeypatch):
    slow = tmp_path / "site" / "pytest"
    slow.mkdir(parents=True)
    (slow / "__init__.py").write_text(  # a test run that starts a process of its own, then hangs
        "import subprocess, sys, time\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(subprocess.Popen(['sleep', '120']).pid))\n"
        "time.sleep(120)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    begin = time.monotonic()
    result = suite.run_section(suite.Section("a_gpu_tests", "a.", suite.gpu_tests, 8, 1), True, False, 8,
                               str(tmp_path))
    assert time.monotonic() - begin < 30
    assert result["status"] == "over budget" and "pytest ran past the section's budget" in result["reason"], result
    time.sleep(0.2)
    assert not alive(int((tmp_path / "child.pid").read_text()))


@pytest.fixture(scope="module")
def opt_in(tmp_path_factory, forks):
    """The opt-in sections i, k, p, q and r in one smoke run of the suite (one process start, not five): the
    report and its folder."""
    out = tmp_path_factory.mktemp("opt_in")
    proc = forks.run([SUITE, "--smoke", "--only", "ikpqr", "--out", str(out)], ROOT, limit=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_suite.json").read_text(encoding="utf-8"))
    assert list(report["sections"]) == ["i_float8", "k_memory_plan", "p_memory_format_fused", "q_input_path",
                                        "r_cuda_graphs"]
    assert not set(report["sections"]) & set(report["gpu_budgets_s"])  # outside the default budget
    return report, out


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_float8_section_is_opt_in_and_not_measured_without_a_gpu(opt_in):
    pytest.importorskip("torchao")
    report, _ = opt_in
    section = report["sections"]["i_float8"]
    assert section["status"] == "skipped" and section["reason"].startswith("needs CUDA")
    table = rows(section)
    assert [r["variant"] for r in table] == ["bfloat16", "float8 tensorwise", "float8 rowwise",
                                             "float8 rowwise_with_gw_hp"]
    assert all(r["status"] == "measured" and r["tokens_per_s"] > 0 for r in table), table
    assert [r["float8_layers"] for r in table] == [0, 7, 7, 7]  # 2 blocks x 4 Linear, less the first; head kept
    assert len(section["targets"]) == 6 and {t["verdict"] for t in section["targets"]} == {"NOT MEASURED"}


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_memory_plan_section_is_opt_in_and_not_measured_without_a_gpu(opt_in):
    report, out = opt_in
    section = report["sections"]["k_memory_plan"]
    assert section["status"] == "skipped" and section["reason"].startswith("needs CUDA")
    table = rows(section)
    assert len(table) == 2 and all(r["predicted_mb"] > 0 and r["measured_mb"] is None for r in table), table
    assert [t["verdict"] for t in section["targets"]] == ["NOT MEASURED", "NOT MEASURED"]
    assert "NOT MEASURED" in (out / "gpu_suite.md").read_text(encoding="utf-8")


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_split_check_section_is_opt_in_and_not_measured_without_a_gpu(suite, tmp_path):
    """Issue 37: the check's first-step cost, on the CPU stand-in: measured there, NOT MEASURED as a GPU figure."""
    assert "l_split_check" in [s.key for s in suite.OPT_IN] and "l_split_check" not in [s.key for s in suite.SECTIONS]
    ctx = suite.Context("l_split_check", "l", smoke=True, cuda=False, budget_s=120, path=str(tmp_path / "l.json"),
                        workdir=str(tmp_path))
    suite.split_check_section(ctx)
    on, off = ctx.result["tables"][0]["rows"]
    assert on["check_split"] and on["checked"] and not off["checked"] and on["first_step_ms"] > 0
    assert [t["verdict"] for t in ctx.result["targets"]] == ["NOT MEASURED"]


def test_section_b_reads_an_interval_and_a_verdict_from_its_rounds(monkeypatch):
    """The GPU suite's overhead section (b): the median per-round ratio with a bootstrap interval, and a verdict
    only where the interval is on one side of the target (the H100's per-repeat ratios ran 0.87-1.44)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from gpu_sections.hand_loop_overhead import ratio_interval, verdict_of

    rng = torch.Generator().manual_seed(0)
    hand = (1 + 0.1 * torch.rand(60, generator=rng)).tolist()
    same = [h * (1 + 0.002 * (i % 3 - 1)) for i, h in enumerate(hand)]  # within 0.2%, round by round
    slower = [h * 1.05 for h in hand]
    median, low, high = ratio_interval(same, hand)
    assert low <= median <= high and high - low < 0.01 and verdict_of(low, high, 1.01) is True
    assert verdict_of(*ratio_interval(slower, hand)[1:], 1.01) is False
    noisy = [h * (0.8 if i % 2 else 1.22) for i, h in enumerate(hand)]  # +-20% a round: can't tell 1%
    assert verdict_of(*ratio_interval(noisy, hand)[1:], 1.01) == "inconclusive"


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_checkpointing_policies_section_is_opt_in_and_not_measured_without_a_gpu(suite, tmp_path):
    """Issue 52: none, selective and full on section h's models (CPU stand-ins); auto needs measured GPU peaks."""
    assert "s_checkpointing_policies" in [s.key for s in suite.OPT_IN]
    assert "s_checkpointing_policies" not in [s.key for s in suite.SECTIONS]
    from gpu_sections.activation_checkpointing import checkpointing_policies

    ctx = suite.Context("s_checkpointing_policies", "s", smoke=True, cuda=False, budget_s=120,
                        path=str(tmp_path / "m.json"), workdir=str(tmp_path))
    checkpointing_policies(ctx)
    rows = ctx.result["tables"][0]["rows"]
    assert [(r["checkpointing"], r.get("blocks")) for r in rows] == [
        (False, 0), ("selective", 2), (True, 2), ("auto", None), (False, 0), ("selective", 8), (True, 8)]
    assert rows[3]["status"].startswith("skipped: needs CUDA") and all(r["step_ms"] > 0 for r in rows if "step_ms" in r)
    assert [t["verdict"] for t in ctx.result["targets"]] == ["NOT MEASURED"] * 3


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_the_fast_default_sections_are_opt_in_and_not_measured_without_a_gpu(opt_in):
    """Issue 51: sections p (memory format, fused step), q (input path) and r (CUDA graphs) run their code on the CPU
    stand-in (o's compiled variant needs CUDA) and say NOT MEASURED; they are outside the default budget."""
    report, _ = opt_in
    m, n = report["sections"]["p_memory_format_fused"], report["sections"]["q_input_path"]
    assert m["status"] == n["status"] == "measured", (m.get("reason"), n.get("reason"))
    table = rows(m)
    assert [r["status"] for r in table] == ["measured"] * 4 and all(r["images_per_s"] > 0 for r in table)
    assert not any(r["channels_last"] or r["fused"] for r in table)  # on CPU: NCHW, torch's default step
    assert [t["value"] for t in m["targets"]][1] == "equal (on CPU: not a GPU figure)"  # the parity, run on CPU
    assert [(r["num_workers"], r["on_device"], r["workers"], r["data_on_device"]) for r in rows(n)] == [
        ("auto", "auto", 0, False), ("auto", False, 0, False), (0, False, 0, False)]  # on CPU: the host path
    assert all(r["data_wait_pct"] is not None for r in rows(n))
    o = report["sections"]["r_cuda_graphs"]
    assert [r["status"][:8] for r in rows(o)] == ["measured", "skipped:"] and rows(o)[0]["step_ms"] > 0
    assert {t["verdict"] for t in m["targets"] + n["targets"] + o["targets"]} == {"NOT MEASURED"}


def test_overhead_measure_says_its_progress_on_stderr(monkeypatch, capsys):
    """`python benchmarks/overhead.py` ran minutes without a word: a line before the rounds, then one a round."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import overhead

    times = overhead.measure({"a": lambda: None, "b": lambda: None}, 3, time.perf_counter, torch.device("cpu"))
    err = capsys.readouterr().err.splitlines()
    assert [len(v) for v in times.values()] == [3, 3]
    assert err[0] == "measuring 2 variants: 1 warm-up round, then 3 timed"
    assert [line.split(" (")[0] for line in err[1:]] == ["  round 1/3", "  round 2/3", "  round 3/3"]
