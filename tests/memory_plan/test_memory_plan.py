"""The memory plan: a step traced under fake tensors peaks where the real step does (MemTracker on both)."""
import copy
import os
import re

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

import ignite_amp.memory_plan.plan as memory_plan
from helpers import assert_doctests_pass
from helpers.memory import Transformer, measured_peak, tokens
from ignite_amp.batch_search import MemoryMeter
from ignite_amp.memory_plan.plan import estimate_memory, parse_bytes
from ignite_amp.models import small_cnn

pytestmark = pytest.mark.fake_trace  # runs after the tests that fork (see conftest)


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def images(n):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def features(n):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


CASES = {
    "cnn": (cnn, images, 8, {"dtype": "bfloat16", "channels_last": True}),
    "transformer": (Transformer, tokens, 8, {"dtype": "bfloat16"}),
    "transformer, checkpointed": (Transformer, tokens, 8, {"dtype": "bfloat16", "activation_checkpointing": True}),
    "transformer, selective": (Transformer, tokens, 8, {"dtype": "bfloat16", "activation_checkpointing": "selective"}),
    "small cnn, selective, float32": (lambda: small_cnn(10, 8), images, 8,
                                      {"dtype": "float32", "activation_checkpointing": "selective"}),
    "transformer, 4 micro-batches, float16": (Transformer, tokens, 8, {"dtype": "float16", "micro_batches": 4}),
    "transformer, accumulation 2": (Transformer, tokens, 8, {"dtype": "bfloat16", "accumulation_steps": 2}),
    "float8 (emulated)": (mlp, features, 16, {"dtype": "float8"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_peaks_where_the_real_step_peaks_and_leaves_the_model_as_it_was(case):
    if case.startswith("float8"):
        pytest.importorskip("torchao")
    make, make_batch, n, kwargs = CASES[case]
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before, types = copy.deepcopy(model.state_dict()), [type(m) for m in model.modules()]
    plan = estimate_memory(model, optimizer, cross_entropy, make_batch, [n], device="cpu", **kwargs)
    assert plan.untraced is None and [p.batch_size for p in plan.peaks] == [n]
    # The user's model and optimizer are as they were: no state, no gradients, no transform, same values.
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert [type(m) for m in model.modules()] == types
    assert "forward" not in vars(model) and all("forward" not in vars(m) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    real = measured_peak(model, optimizer, make_batch, n, **kwargs)
    assert abs(plan.peaks[0].peak - real) <= 0.001 * real, (plan.peaks[0].peak, real)
    kinds = plan.peaks[0].kinds
    assert kinds["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert kinds["batch"] > 0 and plan.peaks[0].peak == sum(kinds.values())


@pytest.fixture(scope="module")
def transformer_plans():
    torch.manual_seed(0)
    model = Transformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {name: estimate_memory(model, opt, cross_entropy, tokens, [16], device="cpu", dtype="bfloat16", **kw)
            for name, kw in {"plain": {}, "checkpointed": {"activation_checkpointing": True},
                             "selective": {"activation_checkpointing": "selective"},
                             "micro": {"micro_batches": 4}}.items()}


@pytest.mark.slow
def test_checkpointing_and_micro_batches_lower_the_planned_activations(transformer_plans):
    act = {name: plan.peaks[0].kinds["activations"] for name, plan in transformer_plans.items()}
    assert act["checkpointed"] < act["plain"] / 2 and act["micro"] < act["plain"] / 2
    assert act["checkpointed"] < act["selective"] < act["plain"]  # selective keeps the matmuls' outputs
    assert transformer_plans["checkpointed"].checkpointed == ["layers.0", "layers.1", "layers.2"]
    lines = "\n".join(transformer_plans["plain"].lines())
    assert re.search(r"^ *16  ", lines, re.M) and "not counted: the CUDA caching allocator" in lines


def test_the_largest_fit_is_the_largest_traced_size_under_the_budget():
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = estimate_memory(model, opt, cross_entropy, images, [4, 64], device="cpu", dtype="bfloat16")
    per_sample = (probe.peaks[1].peak - probe.peaks[0].peak) / 60
    memory = int((probe.peaks[1].peak + 50 * per_sample) / (1 - memory_plan.DEFAULT_MARGIN))  # ~114 fit
    traced = []
    plan = estimate_memory(model, opt, cross_entropy, images, [4, 64], device="cpu", dtype="bfloat16",
                           memory=memory, progress=traced.append)
    fit = plan.largest_fit
    assert 100 <= fit <= 130 and len(traced) <= 6, [t.batch_size for t in traced]
    assert plan.peak_at(fit) <= plan.budget
    peaks = {t.batch_size: t.peak for t in traced}
    assert all(p > plan.budget for n, p in peaks.items() if n > fit)
    assert any(n <= fit * 1.02 + 1 for n in peaks if n > fit)  # a miss within the tolerance above it
    # Too little memory for batch 1: 0, said so.
    tiny = estimate_memory(model, opt, cross_entropy, images, [4], device="cpu", dtype="bfloat16", memory=1000)
    assert tiny.largest_fit == 0 and "no batch size" in "\n".join(tiny.lines())


class Masked(nn.Module):
    """Shapes that depend on values: the samples with a positive first feature go through the head."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x):
        h = self.body(x)
        return self.head(h[h[:, 0] > 0]).sum(0, keepdim=True).expand(len(x), 10)


def test_a_model_that_cannot_be_traced_fake_gets_weights_gradients_and_optimizer_state(caplog):
    caplog.set_level("INFO", logger="ignite_amp")
    model = Masked()
    opt = torch.optim.Adam(model.parameters())
    plan = estimate_memory(model, opt, cross_entropy, features, [8], device="cpu", dtype="bfloat16", memory="1GiB")
    assert plan.untraced and plan.peaks == [] and plan.largest_fit is None
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert plan.fixed == {"parameters": weights, "buffers": 0, "gradients": weights,
                          "optimizer state": 2 * weights + 4 * len(list(model.parameters()))}
    assert "cannot be traced with fake tensors" in caplog.text
    assert "could not be traced fake" in "\n".join(plan.lines())


def test_an_example_batch_is_resized_and_bad_arguments_are_refused():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    by_example = estimate_memory(model, opt, cross_entropy, features(3), [8], device="cpu", dtype="bfloat16")
    by_function = estimate_memory(model, opt, cross_entropy, features, [8], device="cpu", dtype="bfloat16")
    assert by_example.peaks[0].peak == by_function.peaks[0].peak
    with pytest.raises(ValueError, match="batch_sizes"):
        estimate_memory(model, opt, cross_entropy, features, [0], device="cpu")
    with pytest.raises(ValueError, match="margin"):
        estimate_memory(model, opt, cross_entropy, features, [2], device="cpu", margin=1.5)
    assert parse_bytes("80GiB") == 80 * 2 ** 30 and parse_bytes("24 GB") == 24 * 10 ** 9 and parse_bytes(512) == 512
    for bad in ("eighty", "80XB", "-1GiB", "0", "GiB"):
        with pytest.raises(ValueError, match="expected a size such as 80GiB"):
            parse_bytes(bad)


def test_docstring_examples():
    assert_doctests_pass(memory_plan)


@pytest.mark.slow
def test_the_plan_command_prints_the_table_and_writes_json(tmp_path, capsys):
    import json

    import yaml

    from helpers import tiny_config
    from ignite_amp.cli.main import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, amp={"dtype": "bfloat16"})))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--memory", "64MiB", "--batch-sizes", "4", "16", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert re.search(r"^ *4  ", printed.out, re.M) and re.search(r"^ *16  ", printed.out, re.M)
    assert "largest batch that fits 64.0 MiB" in printed.out
    assert "planned batch 16: peak" in printed.err
    data = json.loads(out.read_text())
    fit = data["largest_fit"]
    assert fit > 16 and data["memory"] == 64 * 2 ** 20 and "CUDA caching allocator" in data["not_counted"]
    assert max(p["peak"] for p in data["peaks"] if p["batch_size"] <= fit) <= data["budget"]
    batch = tiny_config(tmp_path)["data"]["batch_size"]  # the run's plan, as train resolves it
    assert data["run"] == {"device": "cpu", "processes": 1, "batch_size": batch, "batch_size_per_process": batch,
                           "eval_batch_size_per_process": batch}
    for bad, why in ((["--memory", "lots"], "--memory: memory: expected a size"), (["--margin", "2"], "--margin"),
                     (["--batch-sizes", "0"], "--batch-sizes"),
                     (["--memory", "80"], "--memory: 80 has no unit; write 80GiB or 80GB (units: B, KB, MB")):
        assert main(["plan", str(path), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err


def test_the_plans_json_on_stdout_and_a_failed_write_that_leaves_nothing(tmp_path, monkeypatch, capsys,
                                                                         file_size_limit):
    """Issue 59.8: ``plan --json -`` wrote a file named ``-``, and ``/dev/stdout`` was refused as "not an earlier
    plan". Issue 59.4: a write that failed left a 0-byte (or cut) FILE, which the retry refused."""
    import json
    import sys

    import yaml

    from conftest import tiny_config
    from ignite_amp.cli.main import main

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, amp={"dtype": "float32"})))
    argv = ["plan", str(path), "--memory", "64MiB", "--batch-sizes", "4"]
    builtin = ["plan", "quickstart", "--set", "device=cpu", "--set", "data.image_size=16", "--set",
               "model.kwargs={width: 8}", *argv[2:]]  # a built-in's name: its "config: the built-in ..." note too
    assert main([*builtin, "--json", "-"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["memory"] == 64 * 2 ** 20  # the JSON alone on stdout; the rest on stderr
    assert re.search(r"^ *4 ", printed.err, re.M) and "config: the built-in quickstart" in printed.err  # the table
    assert not os.path.exists("-")
    redirected = tmp_path / "stdout.txt"  # `plan --json /dev/stdout > stdout.txt`: printed, not written over
    with open(redirected, "w") as stdout:
        real, sys.stdout = sys.stdout, stdout
        try:
            assert main([*argv, "--json", str(redirected)]) == 0
        finally:
            sys.stdout = real
    assert json.loads(redirected.read_text())["peaks"][0]["batch_size"] == 4
    out = tmp_path / "plan.json"
    with file_size_limit(100):
        assert main([*argv, "--json", str(out)]) == 2
    assert capsys.readouterr().err.endswith(f"ignite-amp: error: --json {out}: cannot write (File too large)\n")
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", "stdout.txt"]
    assert main([*argv, "--json", str(out)]) == 0  # the retry
    assert json.loads(out.read_text())["peaks"][0]["batch_size"] == 4


class TrackedMeter(MemoryMeter):
    """A CPU stand-in for a GPU: a trial holds what MemTracker counts of its real tensors times an allocator
    overhead the search is not told; a step that would hold more than the capacity raises out of memory."""

    def __init__(self, model, optimizer, capacity, overhead):
        from ignite_amp.memory_plan.fake_step import StepTracker

        meter = self

        class OutOfMemoryTracker(StepTracker):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = super().__torch_dispatch__(func, types, args, kwargs)
                if meter.held(self) > capacity:
                    raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
                return result

        self.make, self.model, self.optimizer = OutOfMemoryTracker, model, optimizer
        self.capacity, self.overhead, self.tracker, self.trials = capacity, overhead, None, 0

    def held(self, tracker) -> float:
        return self.overhead * sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())

    def release(self):  # a trial starts (before its batch is made): MemTracker sees only what it tracks
        self._close()
        self.trials += 1
        self.tracker = self.make()
        self.tracker.track_external(self.model, self.optimizer)
        self.tracker.__enter__()

    def reset(self):  # after the warm-up: the tracker's peak runs on (no autotuning workspaces here)
        pass

    def _close(self):
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker = None

    def peak_bytes(self):
        peak = self.held(self.tracker)
        self._close()
        return peak

    def capacity_bytes(self):
        return self.capacity


@pytest.mark.slow
def test_the_batch_size_search_starts_from_the_plan():
    from ignite_amp.batch_search import find_batch_size

    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.AdamW(model.parameters())
    plan = estimate_memory(model, opt, cross_entropy, images, [8, 64], device="cpu", dtype="bfloat16")
    per_sample = (plan.peaks[1].peak - plan.peaks[0].peak) / 56
    capacity = 1.15 * (plan.peaks[1].peak + 40 * per_sample) / 0.95  # the best batch ~100 with the overhead
    meter = TrackedMeter(model, opt, capacity, overhead=1.15)
    result = find_batch_size(model, opt, cross_entropy, images, device="cpu", dtype="bfloat16", meter=meter,
                             plan=True, warmup=1, steps=1, verify_steps=1)
    meter._close()
    assert result.strategy == "plan" and len(result.trials) <= 3, result.trials
    kept = [t for t in result.trials if t.size == result.batch_size][-1]
    assert kept.fits and kept.peak_bytes <= 0.95 * capacity
    best = max(n for n in range(1, 400) if 1.15 * plan.peak_at(n) <= 0.95 * capacity)  # the plan's line
    assert 0.95 * best <= result.batch_size <= 1.05 * best, (best, result.trials)


def test_the_health_summary_sets_the_planned_peak_beside_the_measured_one():
    from ignite_amp.handlers.tensorboard.health import Health, health_lines

    def memory_line(**kwargs):
        return next(line for line in health_lines(Health("bfloat16", False, [], 10, 0, **kwargs))
                    if line.startswith("memory:"))

    assert memory_line(peak_memory_mb=1150.0, planned_memory_mb=1000.0) == \
        "memory: peak 1150 MB (allocated); planned 1000 MB (+15%: what the plan does not count)"
    # a CPU run's RSS counts the whole process, not tensors: nothing to compare
    assert memory_line(peak_memory_mb=900.0, memory_kind="RSS", planned_memory_mb=100.0) == "memory: peak 900 MB (RSS)"


def test_the_plan_counts_cublas_workspaces_through_torchs_one_private_handle(monkeypatch):
    """On a GPU the plan adds what cuBLAS holds from the first matmul on (measured there); the one private call
    it takes must exist in this torch, or the plan would silently stop counting them (issue 48: plans were a
    near-constant 65-90 MB under max_memory_allocated on an H100)."""
    from ignite_amp.memory_plan import cuda_extras, plan

    assert callable(getattr(torch._C, "_cuda_clearCublasWorkspaces", None)), "torch moved its cuBLAS workspace handle"
    assert cuda_extras.library_workspace_bytes("cpu") == 0
    monkeypatch.setattr(plan, "library_workspace_bytes", lambda device: 64 * 2 ** 20)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    make = lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 10, (n,)))  # noqa: E731
    with_libraries = plan.estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, make,
                                          batch_sizes=[4], device="cpu", dtype="float32")
    monkeypatch.setattr(plan, "library_workspace_bytes", lambda device: 0)
    without = plan.estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, make,
                                   batch_sizes=[4], device="cpu", dtype="float32")
    assert with_libraries.peaks[0].peak == without.peaks[0].peak + 64 * 2 ** 20
    assert with_libraries.peaks[0].kinds[cuda_extras.LIBRARIES] == 64 * 2 ** 20
    assert "cuBLAS" in with_libraries.lines()[2].split() and "64.0" in with_libraries.lines()[3].split()
    assert cuda_extras.LIBRARIES not in without.peaks[0].kinds


def test_the_quickstarts_plan_fits_80_columns_names_each_column_once_and_says_the_data_caps_the_batch(
        tmp_path, monkeypatch, capsys):
    """`plan --memory 16GiB` on the quickstart: a batch of 21341 would fit, but the set holds 8,000 samples."""
    from ignite_amp.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "quickstart", "--memory", "16GiB", "--batch-sizes", "64"]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    heading = next(line for line in out.splitlines() if line.split()[:2] == ["batch", "peak"])
    assert len(set(heading.split())) == len(heading.split()), heading
    assert "largest batch that fits 16.00 GiB less 15%: all the data set's 8,000 training samples; the memory " \
           "would fit batch " in " ".join(out.split())
