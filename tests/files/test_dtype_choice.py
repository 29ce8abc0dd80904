"""dtype auto on a CPU decided once per machine and model, then kept: the same choice on a busy and a quiet (fake)
clock, the file it is kept in (never the user's home in tests), ``plan`` and ``train`` sharing it, and a resume
keeping the checkpoint's precision."""
import glob
import json
import os

import pytest
import torch
import yaml

import ignite_amp.core.device
from helpers import CLOCK, ClockedCNN, tiny_config
from ignite_amp.config.tree import load_config
from ignite_amp.files.dtype_choice import CACHE_ENV, choices_path, keep_choice, kept_choice, shown_path
from ignite_amp.run import dtype_probe
from ignite_amp.run import plan as run_plan
from ignite_amp.run.compose import build_run
from ignite_amp.run.dtype_probe import PROBE_ENV, config_dtype, probe_cpu_dtype
from ignite_amp.run.resume import Plan, resumed_dtype, with_precision

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")


class Loaded(ClockedCNN):
    """A model whose steps take ``load`` times their quiet cost, and three times more again on the steps in
    ``spikes`` (other work on the machine), on the fake clock."""

    def __init__(self, float32: float, bfloat16: float, load: float = 1.0, spikes=()):
        super().__init__(10, float32 * load, bfloat16 * load)
        self.spikes, self.calls = set(spikes), 0

    def forward(self, x):
        self.calls += 1
        if self.calls in self.spikes:
            dtype = BF16 if torch.is_autocast_enabled("cpu") else F32
            CLOCK.now += 3 * self.costs[dtype]
        return super().forward(x)


@pytest.fixture(autouse=True)
def avx512_without_a_fixed_outcome(monkeypatch, tmp_path):
    """The CPU where the probe decides (AVX512-BF16, no AMX), nothing fixing its outcome, the kept choices in a
    folder of the test's own, and the probe on the fake clock."""
    monkeypatch.setattr(ignite_amp.core.device, "_cpu_flags", lambda: "model name\t: Fake EPYC\nflags: avx512_bf16")
    monkeypatch.delenv(PROBE_ENV)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    real = dtype_probe.probe_cpu_dtype
    monkeypatch.setattr(dtype_probe, "probe_cpu_dtype", lambda model, xy: real(model, xy, clock=CLOCK))


def quickstart_like(tmp_path, kwargs=None, **over):
    from ignite_amp import load_config

    model = {"name": "helpers:clocked_cnn", "num_classes": 10, "kwargs": kwargs or {}}
    return load_config(tiny_config(tmp_path, model=model, **over))


# The quickstart's own figures (issue 53): a bfloat16 step at 0.84x float32's time in a 0.2 s probe on a quiet
# 2-core machine; on a busy one the probe ran 3.6 s and a bfloat16 step measured 1.92x.
QUIET = dict(float32=0.0625, bfloat16=0.0525)
BUSY = dict(QUIET, load=9.0, spikes={4})  # every step 9x slower, and a bfloat16 step 4x slower again


def test_the_quickstarts_figures_give_float32_on_a_busy_and_a_quiet_clock_and_say_why():
    quiet = probe_cpu_dtype(Loaded(**QUIET), (torch.randn(4, 3, 8, 8), torch.arange(4)), clock=CLOCK)
    busy = probe_cpu_dtype(Loaded(**BUSY), (torch.randn(4, 3, 8, 8), torch.arange(4)), clock=CLOCK)
    assert quiet.dtype == busy.dtype == F32
    assert quiet.words() == ("a bfloat16 step took 0.84x float32's time in a 0.5 s probe on this CPU: a close call "
                             "(bfloat16 must take at most 0.8x float32's time), so float32, the safe choice")
    assert busy.words() == ("a bfloat16 step took 3.36x float32's time in a 3.5 s probe on this CPU: over its 2 s "
                            "budget after 1 of 3 timed pairs, so float32, the safe choice")  # its one pair spiked


@pytest.mark.parametrize("first, then", [(QUIET, BUSY), (BUSY, QUIET)])
def test_a_clear_win_is_kept_whatever_the_clock_of_the_runs_after(tmp_path, first, then):
    cfg = quickstart_like(tmp_path)
    clear = {"float32": 0.0625, "bfloat16": 0.03125}  # bfloat16 at 0.5x: a clear win on a quiet clock
    chosen, why = config_dtype(load_config(cfg), Loaded(**{**first, **clear}), CPU)
    assert why.endswith(f"; kept in {choices_path()}")
    for _ in range(2):  # later runs, on the other clock: the probe does not run again
        model = Loaded(**{**then, **clear})
        again, said = config_dtype(load_config(cfg), model, CPU)
        assert again == chosen and not model.ran
        assert said.startswith("this machine's choice for this model since ")
        assert said.endswith(f"({why.split(';')[0]}); kept in {choices_path()}: delete it to probe again")
    assert chosen == ("bfloat16" if first is QUIET else "float32")  # a busy first probe could not tell: float32


@pytest.mark.slow
def test_the_choice_is_kept_per_machine_and_model_in_the_cache_folder_never_the_home(tmp_path, monkeypatch):
    cfg = quickstart_like(tmp_path)
    config_dtype(load_config(cfg), Loaded(0.25, 0.125), CPU)
    entries = json.loads((tmp_path / "cache" / "dtype-choices.json").read_text())
    (entry,) = entries.values()
    assert entry["dtype"] == "bfloat16" and "Fake EPYC" in entry["for"] and "clocked_cnn" in entry["for"]
    other = load_config(cfg, ["model.kwargs={float32: 1.0, bfloat16: 2.0}"])  # another model: probed
    assert config_dtype(load_config(other), Loaded(1.0, 2.0), CPU)[0] == "float32"
    assert len(json.loads((tmp_path / "cache" / "dtype-choices.json").read_text())) == 2
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch: probed again
    assert config_dtype(load_config(cfg), Loaded(1.0, 2.0), CPU)[0] == "float32"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert choices_path() == str(tmp_path / "xdg" / "ignite-amp" / "dtype-choices.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert choices_path() == str(tmp_path / "home" / ".cache" / "ignite-amp" / "dtype-choices.json")
    assert shown_path(choices_path()) == "~/.cache/ignite-amp/dtype-choices.json"


@pytest.mark.slow
def test_a_cache_that_cannot_be_read_or_written_does_not_stop_the_run(tmp_path, monkeypatch):
    cfg = quickstart_like(tmp_path)
    path = tmp_path / "cache" / "dtype-choices.json"
    path.parent.mkdir()
    path.write_text("{not json")  # a damaged file: read as empty, then rewritten
    assert config_dtype(load_config(cfg), Loaded(0.25, 0.125), CPU)[0] == "bfloat16"
    assert kept_choice(next(iter(json.loads(path.read_text())))).dtype == "bfloat16"
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file" / "below"))  # a folder that cannot be made
    dtype, why = config_dtype(load_config(cfg), Loaded(0.25, 0.125), CPU)
    assert dtype == "bfloat16" and why.endswith(f"; not kept: {tmp_path / 'file'} is a file, not a folder")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file"))  # the folder itself a file: said in one line (issue 59)
    assert config_dtype(load_config(cfg), Loaded(0.25, 0.125), CPU)[1].endswith(
        f"; not kept: {CACHE_ENV} names a file, {tmp_path / 'file'}, not a folder")
    assert not glob.glob(str(tmp_path / "**" / "*.tmp"), recursive=True)
    with pytest.raises(OSError):
        keep_choice("k", "float32", "why", "what")


@pytest.mark.slow
@pytest.mark.fake_trace
def test_plan_runs_no_probe_and_plans_in_the_dtype_train_keeps(tmp_path, monkeypatch, capsys):
    """Issue 59.3: ``plan`` with dtype auto where the probe runs built the model for real and ran training steps (over
    5 minutes for a 100M-parameter MLP whose float32 plan takes 25 s), under a table that says "fake tensors: nothing
    allocated". It plans in float32 and says that train's probe decides; after train kept its choice, the plan
    reads it back."""
    from torch._subclasses.fake_tensor import FakeTensor

    from ignite_amp.cli.main import main

    cfg = quickstart_like(tmp_path, kwargs={"float32": 0.25, "bfloat16": 0.125})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    planned, probed, built = [], [], []
    real_estimate, real_probe, real_build = run_plan.estimate_memory, dtype_probe.probe_cpu_dtype, run_plan.build_model
    monkeypatch.setattr(run_plan, "estimate_memory",
                        lambda *a, **k: planned.append(k["dtype"]) or real_estimate(*a, **k))
    monkeypatch.setattr(dtype_probe, "probe_cpu_dtype", lambda *a: probed.append(a) or real_probe(*a))

    def build(*args, **kwargs):  # what the plan builds: under fake tensors only
        model = real_build(*args, **kwargs)
        built.append(isinstance(next(model.parameters()), FakeTensor))
        return model

    monkeypatch.setattr(run_plan, "build_model", build)
    assert main(["plan", str(path), "--batch-sizes", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (lines wrapped at 80 columns)
    assert "u: helpers:clocked_cnn, dtype auto (float32), batch sizes per process" in out
    assert ("dtype auto: no choice kept for this model on this machine yet: train's probe decides at its start "
            "(float32 or bfloat16, timed on the model's own step); planned in float32") in out
    assert probed == [] and planned == ["float32"] and built == [True]  # no probe, nothing built for real
    assert not os.path.exists(choices_path())
    run = build_run(cfg)  # train probes once, and keeps its choice
    assert run.trainer.amp_step.dtype == BF16 and len(probed) == 1
    run.close()
    assert main(["plan", str(path), "--batch-sizes", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "u: helpers:clocked_cnn, dtype auto (bfloat16), batch sizes per process" in out
    assert "dtype auto: this machine's choice for this model since " in out
    assert planned == ["float32", "bfloat16"] and len(probed) == 1  # the plan traced the step in train's dtype


@pytest.mark.slow
def test_a_resume_keeps_the_checkpoints_precision_or_names_the_change(tmp_path, monkeypatch):
    cfg = quickstart_like(tmp_path, kwargs={"float32": 0.25, "bfloat16": 0.125})
    run = build_run(cfg)
    assert run.trainer.amp_step.dtype == BF16
    run.train()
    os.remove(choices_path())  # the kept choice gone, and the machine now says float32
    monkeypatch.setattr(dtype_probe, "probe_cpu_dtype", lambda *a: dtype_probe.DtypeProbe(F32, 1.5, 0.2, 3))
    lines = []
    run = build_run(load_config(cfg, ["train.epochs=2"]), print_fn=lines.append)
    assert run.trainer.amp_step.dtype == BF16 and run.evaluator.amp_step.dtype == BF16
    run.train()
    resumed = next(line for line in lines if line.startswith("resumed from"))
    start = next(line for line in lines if line.startswith("training "))
    assert "amp.dtype" not in resumed and "(dtype auto: the resumed checkpoint's precision, kept)" in start
    for file in glob.glob(str(tmp_path / "run" / "checkpoints" / "*.pt")):  # checkpoints of 0.2.0 say no dtype
        state = torch.load(file, weights_only=True)
        del state["amp_step"]["dtype"]
        torch.save(state, file)
    lines = []
    run = build_run(load_config(cfg, ["train.epochs=3"]), print_fn=lines.append)
    assert run.trainer.amp_step.dtype == F32
    assert "now in effect: train.epochs 2 -> 3, amp.dtype auto unrecorded -> float32)" in lines[0], lines
    run.close()


def test_only_dtype_auto_names_what_it_resolved_to():
    state = {"amp_step": {"dtype": "bfloat16"}}
    plan = Plan("p.pt", state, [])
    auto, named = load_config({"amp": {"dtype": "auto"}}), load_config({"amp": {"dtype": "float32"}})
    assert with_precision(plan, auto, "bfloat16") == plan and with_precision(Plan(), auto, "float32") == Plan()
    assert with_precision(plan, named, "float32") == plan  # the config's own change says it (amp.dtype auto -> ...)
    assert [str(c) for c in with_precision(plan, auto, "float16").changes] == ["amp.dtype auto bfloat16 -> float16"]


def test_a_checkpoint_that_records_no_dtype_reads_its_stored_configs():
    """A 0.2.0 checkpoint of an explicit bfloat16 run, resumed with auto, said "auto unrecorded -> float32" though
    its stored config records bfloat16."""
    stored = {"config": {"value": {"amp": {"dtype": "bfloat16"}}}, "amp_step": {"micro_batches": 1}}
    assert resumed_dtype(stored) == "bfloat16"
    assert resumed_dtype(dict(stored, amp_step={"dtype": "float32"})) == "float32"  # the step's record first
    assert resumed_dtype({"config": {"value": {"amp": {"dtype": "auto"}}}}) is None  # auto records nothing
    assert resumed_dtype({"config": {"value": {"amp": {"dtype": "float8"}}}}) is None
    assert resumed_dtype({"config": "not a mapping"}) is None and resumed_dtype(None) is None


def test_a_020_checkpoint_of_a_bfloat16_run_resumed_with_auto_keeps_bfloat16(tmp_path):
    cfg = quickstart_like(tmp_path, amp={"dtype": "bfloat16"})
    build_run(cfg).train()
    for file in glob.glob(str(tmp_path / "run" / "checkpoints" / "*.pt")):  # checkpoints of 0.2.0 say no dtype
        state = torch.load(file, weights_only=True)
        del state["amp_step"]["dtype"]
        torch.save(state, file)
    lines = []
    run = build_run(load_config(cfg, ["amp.dtype=auto", "train.epochs=2"]), print_fn=lines.append)
    assert run.trainer.amp_step.dtype == BF16
    resumed = next(line for line in lines if line.startswith("resumed from"))
    assert "unrecorded" not in resumed and "amp.dtype bfloat16 -> auto" in resumed, resumed
    run.close()
