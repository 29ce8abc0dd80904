"""dtype float8: which layers torchao converts (and why not the others), the step it runs, resume, compare."""
import logging
import math
import os
import sys

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

import ignite_amp.transforms.float8 as f8
from helpers import assert_doctests_pass, free_port, in_group, recording_backend, three_blocks, tiny_config
from ignite_amp import create_amp_evaluator, create_amp_trainer, train_from_config
from ignite_amp.step.facts import step_facts, summary_line
from ignite_amp.transforms.float8 import convert_to_float8, float8_plan

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def mlp(num_classes: int = 10, width: int = 64, in_features: int = 32) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 32, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def plan_of(model, **kwargs) -> dict:
    return {layer.name: layer.reason for layer in float8_plan(model, **kwargs)}


def converted(model) -> list:
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def test_mlp_keeps_its_first_and_last_linear_and_fp32_modules():
    plan = plan_of(mlp(), fp32_modules=["5"])
    assert plan == {"1": "first Linear", "3": None, "5": "in fp32_modules", "7": "last Linear"}
    model = mlp()
    report = convert_to_float8(model)
    assert converted(model) == ["3", "5"] == list(report.converted)
    assert dict(report.skipped) == {"1": "first Linear", "7": "last Linear"}


def test_transformer_skips_attention_out_proj_and_converts_the_feed_forward():
    model = TinyTransformer()
    report = convert_to_float8(model)
    assert converted(model) == ["encoder.layers.0.linear2", "encoder.layers.1.linear1", "encoder.layers.1.linear2"]
    skipped = dict(report.skipped)
    assert skipped["encoder.layers.0.linear1"] == "first Linear" and skipped["head"] == "last Linear"
    assert "MultiheadAttention" in skipped["encoder.layers.0.self_attn.out_proj"]
    assert "MultiheadAttention" in skipped["encoder.layers.1.self_attn.out_proj"]


def test_cnn_with_one_head_changes_nothing_and_says_so_once(caplog):
    model = cnn()
    with caplog.at_level(logging.WARNING, "ignite_amp"):
        trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                                     device="cpu", dtype="float8")
        create_amp_evaluator(model, device="cpu", dtype="float8")
    lines = [r.getMessage() for r in caplog.records if "float8" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("float8 changes nothing here"), lines
    assert converted(model) == [] and trainer.amp_step.float8.skipped == (("4", "first Linear"),)


def test_on_cuda_small_layers_are_skipped_as_too_small_to_gain():
    big = nn.Sequential(nn.Linear(64, 64, device="meta"), nn.Linear(8192, 4096, device="meta"),
                        nn.Linear(2048, 2048, device="meta"), nn.Linear(64, 64, device="meta"))
    assert plan_of(big, device_type="cpu") == {"0": "first Linear", "1": None, "2": None, "3": "last Linear"}
    on_gpu = plan_of(big, device_type="cuda")
    assert on_gpu["1"] is None and on_gpu["2"] is None  # tensorwise: out_features > 1024
    rowwise = plan_of(big, device_type="cuda", recipe="rowwise")
    assert rowwise["1"] is None and rowwise["2"].startswith("too small to gain on CUDA")
    assert plan_of(mlp(), device_type="cuda")["3"].startswith("too small to gain on CUDA (64x64")


def test_a_user_filter_replaces_the_choice_but_not_what_float8_cannot_do():
    plan = plan_of(mlp(in_features=30), module_filter=lambda module, name: name != "5")
    assert plan == {"1": "30x64: float8 needs multiples of 16", "3": None, "5": "float8_filter said no",
                    "7": "64x10: float8 needs multiples of 16"}
    with pytest.raises(TypeError, match="float8_filter"):
        float8_plan(mlp(), module_filter="3")
    with pytest.raises(ValueError, match="float8_recipe should be one of tensorwise"):
        float8_plan(mlp(), recipe="blockwise")


def test_trainer_runs_bfloat16_autocast_without_scaler_and_states_the_layers(caplog):
    model = mlp()
    with caplog.at_level(logging.WARNING, "ignite_amp"):
        trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                                     device="cpu", dtype="float8", float8_recipe="rowwise")
    assert converted(model) == ["3", "5"]  # before the first step
    step = trainer.amp_step
    assert step.dtype == torch.bfloat16 and not step.scaler.is_enabled() and step.float8.recipe == "rowwise"
    assert any("emulated by torchao" in r.getMessage() for r in caplog.records)
    facts = step_facts(step)
    assert facts["float8_converted"] == "3, 5" and facts["float8_skipped"] == "1 (first Linear), 7 (last Linear)"
    assert summary_line(facts).startswith("float8 rowwise Linear layers (emulated) in bfloat16 autocast, no GradScaler")
    state = trainer.run([(torch.randn(8, 32), torch.randint(0, 10, (8,)))] * 2)
    assert torch.isfinite(state.output)


def _losses(dtype: str, steps: int = 60, **kwargs) -> list:
    torch.manual_seed(0)
    model = mlp()
    data = [(torch.randn(32, 32), torch.randint(0, 10, (32,))) for _ in range(4)]
    trainer = create_amp_trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), nn.functional.cross_entropy,
                                 device="cpu", dtype=dtype, **kwargs)
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.amp_step.loss.item()))
    trainer.run(data, max_epochs=steps // len(data))
    return losses


@pytest.mark.slow
def test_emulated_float8_trains_within_5_percent_of_bfloat16():
    # Measured on a 2-core CPU VM: loss 2.288 -> 0.268 (float8) vs 0.259 (bfloat16) after 60 steps, 3.4% apart.
    bf16, fp8 = _losses("bfloat16"), _losses("float8")
    assert fp8[-1] < 0.2 * fp8[0]  # it learns
    assert abs(fp8[-1] - bf16[-1]) / bf16[-1] < 0.05, (fp8[-1], bf16[-1])


def test_float8_with_micro_batches_accumulation_clipping_and_num_items():
    from ignite_amp.handlers import GradientClipping

    torch.manual_seed(0)
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                                 device="cpu", dtype="float8", micro_batches=2, accumulation_steps=2,
                                 num_items=lambda x, y: y.numel())
    clipping = GradientClipping(max_norm=0.01)
    clipping.attach(trainer)
    before = model[3].weight.detach().clone()
    trainer.run([(torch.randn(8, 32), torch.randint(0, 10, (8,)))] * 4)
    moved = (model[3].weight - before).norm()
    assert 0 < moved <= 2 * 0.1 * 0.01 + 1e-6  # two optimizer steps of clipped gradients


def test_missing_torchao_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    model = mlp()
    with pytest.raises(ValueError,
                       match=r'^dtype float8 needs torchao, which is not installed: pip install -e "\.\[fp8\]"'):
        create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                           device="cpu", dtype="float8")


def test_gpu_below_capability_8_9_is_refused_naming_bfloat16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="A100-SXM4-80GB is 8.0: use dtype bfloat16"):
        f8.check_float8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert f8.check_float8_device(torch.device("cuda", 0)) is False  # not emulated


def test_on_a_gpu_float8_turns_compile_on_unless_turned_off(monkeypatch, caplog):
    monkeypatch.setattr(f8, "check_float8_device", lambda device: False)  # as on an H100: not emulated
    for compile_arg, compiled in (({}, True), ({"compile": False}, False)):
        model = mlp()
        caplog.clear()
        with caplog.at_level(logging.WARNING, "ignite_amp"):
            trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         nn.functional.cross_entropy, device="cpu", dtype="float8", **compile_arg)
        step = trainer.amp_step
        assert (step.forward is not step.model) == compiled  # torch.compile is lazy: nothing compiles here
        assert any("compile turned on" in r.getMessage() for r in caplog.records) == compiled


def _trainer(dtype: str, seed: int = 0):
    torch.manual_seed(seed)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, create_amp_trainer(model, opt, nn.functional.cross_entropy, device="cpu", dtype=dtype)


def test_resume_is_bit_identical_and_a_dtype_change_is_explained(caplog):
    data = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(4)]
    model, _, trainer = _trainer("float8")
    trainer.run(data, max_epochs=2)
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, trainer = _trainer("float8")
    trainer.run(data, max_epochs=1)
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "step": trainer.amp_step.state_dict(),
             "trainer": trainer.state_dict()}
    model, opt, trainer = _trainer("float8", seed=1)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    trainer.load_state_dict(saved["trainer"])
    with caplog.at_level(logging.WARNING, "ignite_amp"):
        trainer.amp_step.load_state_dict(saved["step"])
    assert not any("resuming" in r.getMessage() for r in caplog.records)
    trainer.run(data, max_epochs=2)
    assert all(torch.equal(straight[k], v) for k, v in model.state_dict().items())

    _, _, bf16 = _trainer("bfloat16")
    with caplog.at_level(logging.WARNING, "ignite_amp"):
        bf16.amp_step.load_state_dict(saved["step"])
    lines = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("resuming a checkpoint trained with float8 tensorwise Linear layers in a run "
                               "without float8")


def image_mlp(num_classes: int = 10) -> nn.Module:
    return mlp(num_classes, width=64, in_features=3 * 16 * 16)


@pytest.mark.slow
def test_config_float8_run_states_its_layers(tmp_path):
    printed = []
    cfg = tiny_config(tmp_path, amp={"dtype": "float8", "float8_recipe": "tensorwise"},
                      model={"name": f"{__name__}:image_mlp", "num_classes": 10, "kwargs": {}})
    result = train_from_config(cfg, print_fn=printed.append)
    assert result["history"]
    assert "float8 tensorwise (emulated on CPU): converted 2 of 4 Linear layers (3, 5); skipped: 1 (first Linear), " \
           "7 (last Linear)" in printed
    assert any(line.startswith("training u on cpu") and "float8 tensorwise Linear layers in bfloat16 autocast" in line
               for line in printed), printed


@pytest.mark.slow
def test_a_model_with_no_converted_layer_does_not_claim_float8_layers_in_its_start_line(tmp_path):
    printed = []
    cfg = tiny_config(tmp_path, amp={"dtype": "float8"})  # small_cnn: one Linear, the head, never converted
    train_from_config(cfg, print_fn=printed.append)
    (start,) = [line for line in printed if line.startswith("training u on cpu")]
    assert "with bfloat16 autocast (float8: no Linear layer converted)" in start and "Linear layers in" not in start


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_importing_torchao_prints_no_torch_warning_the_user_cannot_act_on(tmp_path):
    """torch logs torchao's deprecated register_constant() on import (``W1126 ... KernelPreference``): filtered
    where ignite-amp imports torchao. A fresh process: the line is printed on the first import only."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c",
                           "from ignite_amp.transforms.float8 import _torchao; _torchao(); print('ok')"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert "register_constant" not in proc.stderr and "KernelPreference" not in proc.stderr, proc.stderr


def test_config_refuses_an_unknown_recipe(tmp_path):
    from ignite_amp.config.tree import load_config
    from ignite_amp.errors import ConfigError

    with pytest.raises(ConfigError, match="amp.float8_recipe: expected one of tensorwise, rowwise, rowwise_with_gw_hp"):
        load_config(tiny_config(tmp_path, amp={"dtype": "float8", "float8_recipe": "delayed"}))


def test_compare_runs_float8_beside_bfloat16(tmp_path):
    from ignite_amp.cli.compare import compare

    cfg = tiny_config(tmp_path, model={"name": f"{__name__}:image_mlp", "num_classes": 10, "kwargs": {}})
    results = compare(cfg, steps=4, modes=["bfloat16", "float8"], print_fn=lambda *_: None)
    assert [r.mode for r in results] == ["float32", "bfloat16", "float8"]
    assert all(len(r.losses) == 4 for r in results)


def test_docstring_examples():
    assert_doctests_pass(f8)


def test_mfu_peaks_for_float8_are_labelled_beside_bfloat16(monkeypatch):
    from ignite_amp.core.device import peak_tflops

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_tflops(cuda, torch.bfloat16) == (989.4, "H100 bfloat16 dense peak")
    assert peak_tflops(cuda, torch.bfloat16, float8=True) == (1978.9, "H100 float8 dense peak")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_tflops(cuda, torch.bfloat16, float8=True) == (1978.9, "H200 float8 dense peak")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_tflops(cuda, torch.bfloat16, float8=True) is None  # no float8 tensor cores


@pytest.mark.slow
def test_batch_size_search_trains_the_float8_model_it_will_run():
    from ignite_amp import find_batch_size

    model = mlp()
    result = find_batch_size(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                             lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))), device="cpu",
                             dtype="float8", float8_recipe="rowwise", max_size=64)
    assert result.batch_size == 60 and converted(model) == ["3", "5"]
    assert model._ignite_amp_float8.recipe == "rowwise"  # the run's create_amp_trainer finds this conversion
    with pytest.raises(ValueError, match="already converted with rowwise, tensorwise was asked for"):
        create_amp_evaluator(model, device="cpu", dtype="float8")


@pytest.mark.slow
def test_config_resume_from_float8_in_bfloat16_loads_and_says_so(tmp_path, caplog):
    model = {"name": f"{__name__}:image_mlp", "num_classes": 10, "kwargs": {}}
    train_from_config(tiny_config(tmp_path, amp={"dtype": "float8"}, model=model), print_fn=lambda *_: None)
    printed = []
    with caplog.at_level(logging.WARNING, "ignite_amp"):
        result = train_from_config(tiny_config(tmp_path, amp={"dtype": "bfloat16"}, model=model, train={"epochs": 2}),
                                   print_fn=printed.append)
    assert [r["epoch"] for r in result["history"]] == [2]
    assert any("amp.dtype float8 -> bfloat16" in line for line in printed), printed
    assert any(r.getMessage().startswith("resuming a checkpoint trained with float8 tensorwise Linear layers in a run "
                                         "without float8") for r in caplog.records)


def _fsdp_float8(rank, out):
    import ignite_amp.engine as engine_module
    from ignite_amp.transforms.sharding import shard_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
                          nn.Sequential(nn.Linear(64, 64), nn.ReLU()), nn.Linear(64, 10))
    report = convert_to_float8(model, device="cpu", fsdp_all_gather=True)
    model = shard_model(model, "bfloat16", device="cpu")
    calls, precompute = [], engine_module.precompute_float8_scales
    engine_module.precompute_float8_scales = lambda m: (calls.append(1), precompute(m))
    try:
        trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                                     device="cpu", dtype="float8", accumulation_steps=2)
        g = torch.Generator().manual_seed(rank)
        trainer.run([(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)])
    finally:
        engine_module.precompute_float8_scales = precompute
    weight = model[1][0].weight
    torch.save({"line": report.line(), "calls": len(calls), "loss": float(trainer.amp_step.loss),
                "kind": type(weight.to_local()).__name__, "scale": weight._local_tensor._precomputed_scale is not None,
                "full": {k: v.full_tensor() for k, v in model.state_dict().items()}},
               os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_all_gathers_float8_weights_with_scales_precomputed_after_each_optimizer_step(tmp_path):
    torch.multiprocessing.spawn(in_group, args=(2, free_port(), _fsdp_float8, str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for r in results:
        assert "FSDP2 all-gathers them in float8: converted 2 of 4" in r["line"]
        assert r["kind"] == "WeightWithDynamicFloat8CastTensor" and r["scale"]
        assert r["calls"] == 2 and math.isfinite(r["loss"])  # 4 iterations, accumulation 2: 2 optimizer steps
    assert all(torch.equal(v, results[1]["full"][k]) for k, v in results[0]["full"].items())


@pytest.mark.slow
def test_cli_float8_without_torchao_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    import yaml

    from helpers import error_lines
    from ignite_amp.cli.main import main

    monkeypatch.setitem(sys.modules, "torchao", None)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, amp={"dtype": "float8"}, model={
        "name": f"{__name__}:image_mlp", "num_classes": 10, "kwargs": {}})))
    assert main(["train", str(path)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        'ignite-amp: error: amp: dtype float8 needs torchao, which is not installed: pip install -e ".[fp8]" '
        '(or pip install "torchao>=0.17"); other dtypes run without it']


@pytest.mark.slow
def test_float8_and_activation_checkpointing_compose_exactly():
    """The model transforms in their order (float8, then activation checkpointing): the same weights with
    checkpointing on as off, under float8 with micro-batches."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(4)]
    weights = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(*[Block() for _ in range(3)]), nn.Linear(32, 4))
        trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                                     device="cpu",
                                     dtype="float8", activation_checkpointing=checkpointing, micro_batches=2)
        trainer.run(data, max_epochs=1)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])


FRESH_PROCESS_LOAD = r"""
import os, sys, torch
from ignite.engine import Engine
from torch import nn
from ignite_amp.errors import CheckpointTypeError
from ignite_amp.handlers import BestCheckpoint
from ignite_amp.transforms.sharding import load_full_model_state

ckpts, last = sys.argv[1], os.path.join(sys.argv[1], "last_checkpoint_1.dcp")
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def resume():
    checkpoint = BestCheckpoint(ckpts, {"model": model, "optimizer": optimizer}, sharded=True)
    checkpoint.attach(Engine(lambda e, b: None), Engine(lambda e, b: None))
    return checkpoint.resume()


sys.modules["torchao"] = None  # first as if torchao were not installed
for load in (lambda: load_full_model_state(last), resume):
    try:
        load()
        print("loaded without torchao")
    except CheckpointTypeError as exc:
        print(exc)
del sys.modules["torchao"]
full = load_full_model_state(last)
print("resumed", resume(), all(torch.equal(v, full[k]) for k, v in model.state_dict().items()))
print(sorted(os.listdir(ckpts)))
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_float8_sharded_checkpoint_loads_in_a_process_without_torchao_imported_and_is_never_renamed(tmp_path):
    """Issue 39.1: the shards hold torchao's WeightWithDynamicFloat8CastTensor, which weights_only loading allows
    only once torchao.float8 is imported: a bfloat16 resume renamed every sound checkpoint .unreadable, and
    load_full_model_state was a raw UnpicklingError. Without torchao it is one line, and nothing is renamed."""
    import subprocess

    from helpers import ROOT
    from ignite_amp.handlers import BestCheckpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    convert_to_float8(model, device="cpu", fsdp_all_gather=True)  # the weights FSDP2 all-gathers in float8
    assert type(model[2].weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_amp_trainer(model, optimizer, nn.functional.cross_entropy, device="cpu", dtype="float8")
    evaluator = Engine(lambda e, b: None)
    evaluator.add_event_handler(Events.COMPLETED, lambda e: e.state.metrics.update(accuracy=0.5))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run([0]))
    BestCheckpoint(str(tmp_path), {"model": model, "optimizer": optimizer}, sharded=True).attach(trainer, evaluator)
    g = torch.Generator().manual_seed(0)
    trainer.run([(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(2)])

    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS_LOAD, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    needs = ('torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor, which needs torchao to load: pip install '
             '-e ".[fp8]" (or pip install "torchao>=0.17")')
    assert lines[0] == f"checkpoint {tmp_path}/last_checkpoint_1.dcp: holds {needs}", lines
    assert lines[1] == f"checkpoint {tmp_path}/last_checkpoint_1.dcp: holds {needs}", lines
    assert lines[2] == f"resumed {tmp_path}/last_checkpoint_1.dcp True", lines
    assert lines[3] == str(["best_checkpoint_1_accuracy=0.5000.dcp", "last_checkpoint_1.dcp"])


@pytest.mark.slow
def test_float8_with_activation_checkpointing_compiles_in_one_graph():
    """Issue 39: on a GPU float8 turns compile on, and the checkpoint wrapper's side effect made dynamo capture
    nothing: float8 + activation checkpointing ran eager. fullgraph=True: a graph break is an error."""
    from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks, checkpointed_blocks

    backend, graphs = recording_backend()
    torch.manual_seed(0)
    model = three_blocks()
    convert_to_float8(model)
    checkpoint_blocks(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(model, backend=backend, fullgraph=True)(torch.randn(8, 16))
    out.float().sum().backward()
    assert len(graphs) == 1 and converted(model) == ["1.0.0", "1.1.0", "1.2.0"]
    assert checkpointed_blocks(model) == ["1.0", "1.1", "1.2"]
    assert all(p.grad is not None for p in model.parameters())

def image_linear_blocks(num_classes: int = 10) -> nn.Module:
    """Blocks that are plain ``nn.Linear`` layers (the inner Sequential's children): float8 converts them."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 32),
                         nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]), nn.Linear(32, num_classes))


@pytest.mark.slow
def test_a_config_run_converts_to_float8_before_it_checkpoints_the_blocks(tmp_path):
    """Issue 39: the config path checkpointed first, then float8 replaced the Linear blocks by Float8Linear
    layers without the checkpoint (checkpointed_blocks: none); the Python path had the right order."""
    cfg = tiny_config(tmp_path, amp={"dtype": "float8", "activation_checkpointing": True},
                      model={"name": f"{__name__}:image_linear_blocks", "num_classes": 10, "kwargs": {}})
    from ignite_amp.run.compose import build_run
    from ignite_amp.transforms.activation_checkpointing import checkpointed_blocks

    run = build_run(cfg, print_fn=lambda line: None)
    try:
        assert converted(run.model) == ["2.0", "2.1", "2.2"]
        assert checkpointed_blocks(run.model) == ["2.0", "2.1", "2.2"]
        assert step_facts(run.trainer.amp_step)["checkpointed_blocks"] == "2.0-2"
    finally:
        run.close()


def test_a_float8_evaluator_never_converts_the_layers_a_bfloat16_trainer_trains():
    """Issue 39: it converted them in place, and only its own line said so: the trainer went on in float8."""
    model = mlp()
    create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, device="cpu",
                       dtype="bfloat16")
    with pytest.raises(ValueError, match=r"^Argument dtype: float8 converts the model's Linear layers in place, and "
                                         r"its trainer runs torch.bfloat16: that trainer would then train them in "
                                         r"float8; evaluate in the trainer's dtype, or give the trainer "
                                         r'dtype="float8" too$'):
        create_amp_evaluator(model, device="cpu", dtype="float8")
    assert converted(model) == []
    create_amp_evaluator(model, device="cpu", dtype="bfloat16")
    alone, trained = mlp(), mlp()  # a model evaluated alone, or trained in float8: the evaluator's float8 is fine
    create_amp_evaluator(alone, device="cpu", dtype="float8")
    create_amp_trainer(trained, torch.optim.SGD(trained.parameters(), lr=0.1), nn.functional.cross_entropy,
                       device="cpu", dtype="float8")
    create_amp_evaluator(trained, device="cpu", dtype="float8")
    assert converted(alone) == converted(trained) == ["3", "5"]
