"""A real TensorBoard over a run made here: what its HTTP data API serves is what the TensorBoard guide's
"Which tab shows what" (docs/guides/tensorboard.md) promises (the run's name, the dashboard, the run facts,
the tags)."""
import os
import shutil
import subprocess

import pytest

from helpers.tensorboard import fetch, serve_tensorboard
from ignite_amp import train_from_config
from ignite_amp.files.run_directory import dashboard_command


@pytest.fixture
def served(quick_cfg, tmp_path):
    """A one-epoch CPU run with the profiler on, under tmp/runs/quick, served by TensorBoard."""
    runs = tmp_path / "runs"
    cfg = dict(quick_cfg, name="quick", output_dir=str(runs / "quick"), train={"epochs": 1},
               amp={"dtype": "bfloat16"},  # by name: auto is float32 on a CPU without bfloat16 instructions
               data=dict(quick_cfg["data"], train_size=128, val_size=32),
               handlers={"tensorboard": {"log_every": 2}, "clipping": {"max_norm": 1.0},
                         "profiler": {"enabled": True, "wait": 0, "warmup": 1, "active": 2}})
    result = train_from_config(cfg, print_fn=lambda *a: None)
    # What the CLI prints: the run alone (runs moved aside and other experiments under runs/ stay out).
    shutil.copytree(runs / "quick", runs / "quick.replaced-20261126-000000")
    with serve_tensorboard(dashboard_command(cfg["output_dir"]), {".", "train", "val", "profiler"}) as base:
        yield base, result


@pytest.mark.slow
def test_tensorboard_serves_the_run_the_dashboard_the_facts_and_the_tags(served):
    base, result = served
    # The run's own files are ".", one run per split under it (as Keras's), the profiler's text beside;
    # nothing else under runs/ (the copy of a run moved aside) is read.
    assert sorted(fetch(base, "/data/runs")) == [".", "profiler", "train", "val"]

    scalars = fetch(base, "/data/plugin/scalars/tags")
    assert {"loss", "optimizer/grad_norm",
            "optimizer/clip_share", "optimizer/lr/group_0", "throughput/samples_per_sec",
            "throughput/median_samples_per_sec", "throughput/data_wait_share", "throughput/step_time_ms",
            "throughput/tflops", "memory/rss_mb", "memory/rss_growth_mb"} == set(scalars["train"])
    assert set(scalars["val"]) == {"loss", "accuracy", "loss/best", "accuracy/best"}
    # bfloat16: no GradScaler, so no precision/ tags; constant batch values live in the facts; no hparam/* dots.

    layout = fetch(base, "/data/plugin/custom_scalars/layout")
    assert [c["title"] for c in layout["category"]] == ["AMP health", "AMP details"]
    first = layout["category"][0]
    assert [c["title"] for c in first["chart"]] == [
        "loss: train (window mean), val", "accuracy: train (when measured), val", "best val accuracy so far",
        "best val loss so far", "share of optimizer steps clipped (1.0: every step)", "samples/s of each window",
        "samples/s: the median of the windows so far"]
    assert first["chart"][0]["multiline"]["tag"] == ["^loss$"]

    text_tags = {run: sorted(tags) for run, tags in fetch(base, "/data/plugin/text/tags").items()}
    assert text_tags == {".": ["run/facts", "run/health"],
                         "profiler": ["profiler/step_breakdown", "profiler/top_ops"]}
    facts = fetch(base, "/data/plugin/text/text?run=.&tag=run/facts")[0]["text"]
    assert "bfloat16 autocast, no GradScaler, on cpu" in facts and "1 process, batch 32" in facts
    assert "<td>grad_scaler</td>\n<td>false</td>" in facts and "<td>batch_size_search</td>" in facts
    health = fetch(base, "/data/plugin/text/text?run=.&tag=run/health")[0]["text"]
    assert "precision: bfloat16 autocast" in health and "(medians of " in health
    assert health.count("<li>") == len(result["health"])
    breakdown = fetch(base, "/data/plugin/text/text?run=profiler&tag=profiler/step_breakdown")[0]["text"]
    assert "Iterations 2-3: the trace is" in breakdown and "<td>backward</td>" in breakdown

    # The HParams tab under the printed command: one row, named after the run (not "."), every column filled.
    (group,) = check_hparams(base, result)
    assert group["name"].startswith("quick 20") and [s["name"] for s in group["sessions"]] == ["."]

    # HParams compares runs: over runs/ (as the TensorBoard guide says), a session per run, each with the
    # metric columns read from its own run. The copy keeps the run's trial name: TensorBoard makes one row of
    # the two (a run moved aside by a later one started at another time, and so has a row of its own).
    runs = os.path.dirname(result["output_dir"])
    with serve_tensorboard(f"tensorboard --logdir {runs}", {"quick", "quick/val", "quick.replaced-20261126-000000"}) \
            as base:
        (copied,) = check_hparams(base, result)
    assert copied["name"] == group["name"]
    assert [s["name"] for s in copied["sessions"]] == ["quick", "quick.replaced-20261126-000000"]


def check_hparams(base, result):
    """The HParams experiment and its session groups, each with every metric column's value; the groups."""
    experiment = fetch(base, "/data/plugin/hparams/experiment", {"experimentName": ""})
    types = {h["displayName"]: h["type"] for h in experiment["hparamInfos"]}
    metrics = [(m["name"].get("group", ""), m["name"]["tag"]) for m in experiment["metricInfos"]]
    assert metrics == [("", "run/val_accuracy"), ("", "run/val_accuracy_best"), ("", "run/val_loss"),
                       ("", "run/val_loss_best"), ("", "run/median_samples_per_sec")]
    assert list(types)[:5] == ["dtype", "device_type", "grad_scaler", "batch_size", "lr"]
    assert types["grad_scaler"] == "DATA_TYPE_BOOL" and types["dtype"] == "DATA_TYPE_STRING"
    assert types["lr"] == "DATA_TYPE_FLOAT64" and "torch" not in types  # open strings: text facts only
    # whole numbers are strings, shown as written (a number 32 is "32.000" in the table), without a domain
    whole = {h["displayName"] for h in experiment["hparamInfos"] if h["type"] == "DATA_TYPE_STRING"
             and not h.get("domainDiscrete")}
    assert {"batch_size", "epochs", "seed", "micro_batches", "accumulation_steps", "world_size"} == whole
    groups = fetch(base, "/data/plugin/hparams/session_groups", {
        "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                                  "STATUS_RUNNING"],
        "colParams": [], "startIndex": 0, "sliceSize": 10})["sessionGroups"]
    (group,) = groups
    assert group["sessions"][0]["status"] == "STATUS_SUCCESS"
    assert group["hparams"]["02 grad_scaler"] is False and group["hparams"]["00 dtype"] == "bfloat16"
    assert group["hparams"]["03 batch_size"] == "32"
    best_loss = min(record["val_loss"] for record in result["history"])
    for session in group["sessions"]:  # every column filled, in every session
        values = {m["name"]["tag"]: m["value"] for m in session["metricValues"]}
        assert set(values) == {tag for _, tag in metrics}, session["name"]
        assert values["run/val_accuracy"] == pytest.approx(result["final"]["val_accuracy"])
        assert values["run/val_loss_best"] == pytest.approx(best_loss, rel=1e-6)
        assert values["run/median_samples_per_sec"] > 0
    return groups


@pytest.mark.slow
@pytest.mark.subprocess
def test_in_a_real_browser_the_dashboard_renders_without_console_warnings(served, tmp_path):
    """Headless Chromium (from the OS packages; skipped without it) opens the URL the CLI prints and the
    HParams tab: pages render, and the console has no HParams domain warning."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium: install it from the OS packages to run this check")
    base, _ = served
    for view in ("custom_scalars&_smoothingWeight=0", "hparams"):
        shot = tmp_path / f"{view.split('&')[0]}.png"
        proc = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                               "--v=0", "--window-size=1400,1000", "--virtual-time-budget=15000",
                               f"--screenshot={shot}", f"{base}/#{view}"], capture_output=True, text=True, timeout=180)
        console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
        assert shot.exists() and shot.stat().st_size > 20_000, (view, proc.stderr[-2000:])  # a page, not a blank
        # the whole-number columns (strings without a domain: no filter) warn; nothing else about domains
        assert not [line for line in console if "domain" in line.lower()
                    and "without discrete domain values" not in line], console
