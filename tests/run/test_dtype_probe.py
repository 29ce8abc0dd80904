"""dtype auto on a CPU: the timed probe's decision (driven by a fake clock, no wall time), the state it leaves
untouched, and what a config run does with it (trainer, evaluator, start line, run facts, train.log)."""
import random

import numpy
import pytest
import torch

import ignite_amp.core.device
from helpers import CLOCK, ClockedCNN, tiny_config
from ignite_amp import probe_cpu_dtype
from ignite_amp.config.tree import load_config
from ignite_amp.errors import ConfigError
from ignite_amp.files.dtype_choice import CACHE_ENV
from ignite_amp.run import dtype_probe
from ignite_amp.run.compose import build_run
from ignite_amp.run.dtype_probe import PROBE_ENV, config_dtype

F32, BF16 = torch.float32, torch.bfloat16


def batch(n: int = 4, classes: int = 10):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=generator), torch.randint(0, classes, (n,), generator=generator)


@pytest.mark.parametrize("float32, bfloat16, chosen, close", [
    (1.0, 0.5, BF16, False), (1.0, 0.75, BF16, False), (1.0, 0.78125, BF16, False),  # at most 0.8x: bfloat16
    (1.0, 0.875, F32, True), (1.0, 1.0, F32, True), (1.0, 1.125, F32, True),  # 0.8x-1.25x: a close call, float32
    (0.5, 1.0, F32, False)])  # float32 clearly faster
def test_the_faster_dtype_wins_by_the_margin_and_a_close_call_is_float32(float32, bfloat16, chosen, close):
    probe = probe_cpu_dtype(ClockedCNN(10, float32, bfloat16), batch(), budget_s=100, clock=CLOCK)
    assert probe.dtype == chosen and probe.ratio == pytest.approx(bfloat16 / float32)
    assert bool(probe.inconclusive) == close
    assert probe.words().endswith(": a close call (bfloat16 must take at most 0.8x float32's time), so float32, "
                                  "the safe choice") == close
    assert probe.pairs == 3 and probe.seconds == pytest.approx(4 * (float32 + bfloat16))  # a warm-up, three pairs


class Spiked(ClockedCNN):
    """bfloat16 is really 0.8x float32's time, but other work on the machine slows some bfloat16 steps 3x."""

    def __init__(self, slowed: set):
        super().__init__(10, 1.0, 0.8)
        self.slowed, self.calls = slowed, 0

    def forward(self, x):
        self.calls += 1
        if self.calls in self.slowed:
            CLOCK.now += 1.6  # 0.8 + 1.6: this step took 2.4 s
        return super().forward(x)


def test_load_on_some_steps_does_not_decide_each_dtypes_fastest_step_does():
    # Forward calls: 1-2 warm-up (float32, bfloat16), then pairs F B | B F | F B: bfloat16 is calls 4, 5 and 8.
    probe = probe_cpu_dtype(Spiked({4, 8}), batch(), budget_s=100, clock=CLOCK)
    assert probe.dtype == BF16 and probe.ratio == pytest.approx(0.8)  # a median would say 2.4x: float32


@pytest.mark.slow
def test_the_two_run_interleaved_after_a_warm_up_each_within_the_budget():
    model = ClockedCNN(10, 0.125, 0.0625)
    probe_cpu_dtype(model, batch(), clock=CLOCK)
    assert [dtype for dtype, _ in model.ran] == [F32, BF16, F32, BF16, BF16, F32, F32, BF16]  # the order alternates
    model = ClockedCNN(10, 1.0, 0.5)  # the warm-up alone spends 1.5 of the 2 s budget: one timed pair,
    probe = probe_cpu_dtype(model, batch(), clock=CLOCK)  # too few to tell: float32, the safe choice
    assert probe.pairs == 1 and probe.dtype == F32 and len(model.ran) == 4 and probe.ratio == pytest.approx(0.5)
    probe = probe_cpu_dtype(ClockedCNN(10, 10.0, 1.0), batch(), clock=CLOCK)  # over budget: still one pair
    assert probe.pairs == 1 and probe.dtype == F32 and probe.words() == (
        "a bfloat16 step took 0.10x float32's time in a 22.0 s probe on this CPU: over its 2 s budget after 1 of 3 "
        "timed pairs, so float32, the safe choice")
    assert dtype_probe.DtypeProbe(F32, 1.5, 0.04, 3).words().endswith("1.50x float32's time in a 0.04 s probe "
                                                                      "on this CPU")
    with pytest.raises(ValueError, match="max_pairs"):
        probe_cpu_dtype(model, batch(), max_pairs=0)


def test_the_probe_leaves_the_model_and_every_generator_as_they_were():
    torch.manual_seed(3)
    model = ClockedCNN(10)
    x, y = batch(8)
    torch.nn.functional.cross_entropy(model(x), y).backward()  # .grad set: the probe must not add to it
    model.body[1].running_mean.add_(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    torch_state, numpy_state, python_state = torch.get_rng_state(), numpy.random.get_state(), random.getstate()
    probe = probe_cpu_dtype(model, (x, y))  # the real clock: its choice does not matter here
    assert probe.dtype in (F32, BF16) and probe.pairs >= 1
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    assert all(numpy.array_equal(a, b) for a, b in zip(numpy.random.get_state(), numpy_state, strict=True))
    model.eval()
    probe_cpu_dtype(model, (x, y), max_pairs=1)
    assert not any(m.training for m in model.modules())


CPUS = {"none": "", "avx512": "avx512f avx512_bf16", "amx": "avx512_bf16 amx_bf16 amx_tile"}


@pytest.fixture
def cpu(monkeypatch):
    def set_cpu(name):
        monkeypatch.setattr(ignite_amp.core.device, "_cpu_flags", lambda: CPUS[name])
    return set_cpu


@pytest.fixture(autouse=True)
def kept(monkeypatch, tmp_path):
    """Each test keeps its choices in a folder of its own: the path of the file."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "dtype-choices.json"


def test_a_config_run_probes_only_where_the_choice_is_open(cpu, monkeypatch, tmp_path, kept):
    cfg = tiny_config(tmp_path, amp={"dtype": "auto", "micro_batches": 2}, seed=0)
    probed = []
    monkeypatch.setattr(dtype_probe, "probe_cpu_dtype", lambda model, xy: probed.append(xy) or dtype_probe.DtypeProbe(
        BF16, 0.5, 0.25, 3))
    model = ClockedCNN(10)
    monkeypatch.delenv(PROBE_ENV)
    cpu("amx")
    assert config_dtype(load_config(cfg), model, torch.device("cpu")) == ("bfloat16", "AMX bfloat16 tiles, no probe")
    cpu("none")
    assert config_dtype(load_config(cfg), model, torch.device("cpu")) == \
        ("float32", "no bfloat16 instructions on this CPU (emulated, bfloat16 is slower), no probe")
    cpu("avx512")
    named = load_config(dict(cfg, amp={"dtype": "bfloat16"}))
    assert config_dtype(named, model, torch.device("cpu")) == ("bfloat16", "")
    assert config_dtype(load_config(cfg), model, torch.device("meta")) == ("auto", "")  # off a CPU: the engines' rule
    assert not probed
    assert config_dtype(load_config(cfg), model, torch.device("cpu")) == (
        "bfloat16", f"a bfloat16 step took 0.50x float32's time in a 0.2 s probe on this CPU; kept in {kept}")
    (x, y), = probed  # the config's batch (32) per micro-batch (2), its image shape, its classes, seeded
    assert x.shape == (16, 3, 16, 16) and y.shape == (16,) and int(y.max()) < 10
    assert torch.equal(x, dtype_probe._batch(load_config(cfg), torch.device("cpu"))[0])
    monkeypatch.setattr(dtype_probe.idist, "get_world_size", lambda: 2)
    assert config_dtype(load_config(cfg), model, torch.device("cpu"))[0] == "float32"
    assert len(probed) == 1  # ranks agree
    monkeypatch.undo()
    monkeypatch.setattr(ignite_amp.core.device, "_cpu_flags", lambda: CPUS["avx512"])
    for fixed in ("float32", "bfloat16"):
        monkeypatch.setenv(PROBE_ENV, fixed)
        assert config_dtype(load_config(cfg), model, torch.device("cpu")) == (fixed, f"fixed by {PROBE_ENV}, no probe")
    monkeypatch.delenv(PROBE_ENV)  # a model the probe's batch does not fit: float32, and check_model_runs says why
    other = dict(cfg, model=dict(cfg["model"], name="torch.nn:Linear"))  # another model: not the kept choice
    assert config_dtype(load_config(other), torch.nn.Linear(5, 10), torch.device("cpu")) == (
        "float32", "the probe could not run the model (RuntimeError)")
    assert config_dtype(load_config(other), torch.nn.Linear(5, 10), torch.device("cpu"))[1].startswith(
        "the probe could not")
    monkeypatch.setenv(PROBE_ENV, "fp16")
    with pytest.raises(ConfigError, match=f"{PROBE_ENV} should be float32 or bfloat16; got 'fp16'"):
        config_dtype(load_config(cfg), model, torch.device("cpu"))


@pytest.mark.slow
def test_the_run_trains_and_evaluates_in_the_probed_dtype_and_says_why(cpu, monkeypatch, tmp_path, kept):
    cpu("avx512")
    monkeypatch.delenv(PROBE_ENV)
    real = dtype_probe.probe_cpu_dtype
    monkeypatch.setattr(dtype_probe, "probe_cpu_dtype", lambda model, xy: real(model, xy, clock=CLOCK))
    cfg = tiny_config(tmp_path, model={"name": "helpers:clocked_cnn", "num_classes": 10,
                                       "kwargs": {"float32": 0.25, "bfloat16": 0.125}},
                      handlers={"tensorboard": {"enabled": True}})
    lines = []
    run = build_run(cfg, print_fn=lines.append)
    assert run.trainer.amp_step.dtype == BF16 and run.evaluator.amp_step.dtype == BF16
    assert {shape for _, shape in run.model.ran[:4]} == {(32, 3, 16, 16)}  # the config's batch and image size
    why = f"a bfloat16 step took 0.50x float32's time in a 1.5 s probe on this CPU; kept in {kept}"
    assert run.facts["dtype_auto"] == why
    run.train()
    start = next(line for line in lines if line.startswith("training "))
    assert "with bfloat16 autocast (dtype auto: bfloat16 took 0.50x float32's time in a 1.5 s probe), " \
           "batch 32; output in" in start
    assert len(start.replace(cfg["output_dir"], "runs/quickstart")) <= 160
    assert f"dtype auto: {why}" in open(tmp_path / "run" / "train.log").read()  # where it is kept, in full
    assert start in open(tmp_path / "run" / "train.log").read()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ignite_amp.handlers.tensorboard.metrics import FACTS_TAG

    events = EventAccumulator(run.tensorboard_dir, size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors(FACTS_TAG)[0].tensor_proto.string_val[0].decode()
    assert "**bfloat16 autocast" in texts and f"| dtype_auto | {why} |" in texts
    assert config_dtype(run.cfg, run.model, torch.device("cpu"))[0] == "bfloat16" and run.cfg.amp.dtype == "auto"


def test_the_kept_choice_is_keyed_by_the_models_config_whatever_its_keys_order():
    """A loaded config's model section keys the kept choice as its plain dict did (a YAML file's sorted kwargs and a
    script's own order are one model): a typed section's repr keyed them apart, so a plan never found train's choice."""
    from ignite_amp.run.dtype_probe import choice_key

    one = load_config({"model": {"kwargs": {"float32": 0.25, "bfloat16": 0.125}}})
    other = load_config({"model": {"kwargs": {"bfloat16": 0.125, "float32": 0.25}}})
    assert choice_key(one) == choice_key(other)
    assert '"kwargs": {"bfloat16": 0.125, "float32": 0.25}' in choice_key(one)[1]  # the JSON of 0.2.0's key
    assert choice_key(one) != choice_key(load_config({"model": {"kwargs": {"float32": 0.5}}}))
