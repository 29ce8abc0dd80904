"""The speed defaults of a config run (issue 51): fused optimizer steps (the rule, the parity with the unfused step
under a float16 GradScaler), and what a config run chose and why (the run facts and the start line)."""
import os

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

import ignite_amp.run.fused as fused
from helpers import assert_doctests_pass, tiny_config
from ignite_amp.config.run_keys import OptimizerConfig
from ignite_amp.config.tree import load_config
from ignite_amp.data.prefetch import DevicePrefetcher
from ignite_amp.engine import create_amp_trainer
from ignite_amp.errors import ConfigError
from ignite_amp.run.builders import build_optimizer
from ignite_amp.run.fast_path import config_channels_last, speed_facts, speed_words
from ignite_amp.run.fused import fused_choice, fused_devices
from ignite_amp.step.events import AmpEvents

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_the_docstring_examples_run():
    assert_doctests_pass(fused)


def test_torch_still_lists_its_fused_devices_where_we_read_them():
    """The one private read (torch.utils._foreach_utils): this fails loudly when torch moves it."""
    assert {"cuda", "cpu"} <= set(fused_devices())


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_fused_is_on_by_default_on_cuda_for_the_optimizers_that_have_it(name):
    assert fused_choice(name, {}, CUDA) == (True, "auto: on CUDA")
    assert fused_choice(name, {}, CPU) == (None, "auto: CUDA only")  # torch's default step, as before


def test_fused_is_skipped_with_the_reason_where_it_does_not_apply(monkeypatch):
    assert fused_choice("RMSprop", {}, CUDA) == (None, f"torch {torch.__version__} has no fused RMSprop")
    assert fused_choice("AdamW", {"foreach": True}, CUDA) == (None, "optimizer.kwargs.foreach")
    assert fused_choice("AdamW", {"differentiable": True}, CUDA) == (None, "optimizer.kwargs.differentiable")
    assert fused_choice("AdamW", {}, CUDA, sharded=True) == (None, "auto: not under FSDP2")
    monkeypatch.setattr(fused, "fused_devices", lambda: ("cpu",))
    assert fused_choice("AdamW", {}, CUDA) == (None, "torch has no fused kernels on cuda")


def test_the_configs_value_wins():
    assert fused_choice("AdamW", {"fused": False}, CUDA) == (False, "optimizer.kwargs.fused")
    assert fused_choice("AdamW", {"fused": True}, CPU) == (True, "optimizer.kwargs.fused")


@pytest.mark.parametrize("name, key, word, takes", [("AdamW", "fused", "no", "true or false or null"),
                                                    ("AdamW", "foreach", "off", "true or false or null"),
                                                    ("Adam", "amsgrad", "yes", "true or false"),
                                                    ("SGD", "nesterov", "n", "true or false"),
                                                    ("AdamW", "capturable", "on", "true or false"),
                                                    ("RMSprop", "maximize", "Off", "true or false"),
                                                    ("AdamW", "differentiable", 0, "true or false")])
def test_the_optimizers_boolean_keywords_are_true_or_false_as_every_boolean_key_is(name, key, word, takes):
    """YAML 1.2 reads ``fused: no`` as the string "no", which the optimizer read as True: the fused step was on, and
    the start line said so as if asked. Refused before anything runs, in the config's one line naming the key."""
    shown = f'"{word}"' if isinstance(word, str) else repr(word)
    with pytest.raises(ConfigError, match=f"^optimizer.kwargs.{key}: expected {takes}, got {shown}$"):
        load_config({"optimizer": {"name": name, "kwargs": {key: word}}})
    with pytest.raises(ConfigError, match=f"^optimizer.kwargs.{key}: expected"):  # --set too
        load_config({"optimizer": {"name": name}}, [f"optimizer.kwargs.{key}={word}"])


def test_true_false_null_and_the_other_keywords_pass_as_before():
    cfg = load_config({"optimizer": {"name": "AdamW", "kwargs": {"fused": None, "foreach": False, "amsgrad": True,
                                                                 "weight_decay": 0.1, "betas": [0.9, 0.95]}}})
    assert cfg.optimizer.kwargs["fused"] is None and cfg.optimizer.kwargs["amsgrad"] is True
    assert load_config({"optimizer": {"name": "NoSuchOptimizer", "kwargs": {"fused": "no"}}})  # its builder says it
    with pytest.raises(ConfigError, match='^scheduler.kwargs.three_phase: expected true or false, got "no"$'):
        load_config({"scheduler": {"name": "onecycle", "kwargs": {"three_phase": "no"}}})


def test_build_optimizer_builds_what_the_rule_chose():
    model = nn.Linear(4, 2)
    opt = OptimizerConfig(name="AdamW", lr=1e-3, kwargs={"weight_decay": 0.05})
    assert build_optimizer(opt, model, CUDA).param_groups[0]["fused"] is True  # checked by torch at its first step
    assert not build_optimizer(opt, model, CPU).param_groups[0]["fused"]
    assert not build_optimizer(opt, model).param_groups[0]["fused"]  # no device: as before (plan, search, compare)
    assert not build_optimizer(opt.replace(kwargs={"foreach": True}), model, CUDA).param_groups[0]["fused"]
    assert "fused" not in build_optimizer(opt.replace(name="RMSprop", kwargs={}), model, CUDA).param_groups[0]


def _trained(name: str, use_fused: bool, kwargs: dict) -> tuple:
    """Eight float16 steps of a small CNN under a GradScaler whose first scale overflows (a skipped step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.01, fused=use_fused, **kwargs)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", dtype="float16",
                                 scaler_kwargs={"init_scale": 2.0 ** 40, "growth_interval": 2})
    skipped = []
    trainer.add_event_handler(AmpEvents.STEP_SKIPPED, lambda e: skipped.append(e.state.iteration))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(8)]
    trainer.run(data, max_epochs=1)
    return [p.detach().clone() for p in model.parameters()], skipped, trainer.amp_step.scaler.get_scale()


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs", [("AdamW", {"weight_decay": 0.05}), ("Adam", {}),
                                          ("SGD", {"momentum": 0.9, "nesterov": True})])
def test_a_fused_step_gives_the_unfused_result_under_a_float16_scaler(name, kwargs):
    """The step unscales the gradients itself and skips an overflowed step before optimizer.step(): a fused
    optimizer then updates as the foreach one does, to assert_close's float32 tolerance (torch's own test of
    fused against for-loop optimizers compares with it too)."""
    fused_params, fused_skipped, fused_scale = _trained(name, True, kwargs)
    plain_params, plain_skipped, plain_scale = _trained(name, False, kwargs)
    assert fused_skipped == plain_skipped and fused_skipped  # the overflow was seen, and skipped, by both
    assert fused_scale == plain_scale
    for a, b in zip(fused_params, plain_params, strict=True):
        torch.testing.assert_close(a, b)


def test_a_config_run_on_cpu_keeps_the_steps_it_had_and_says_why(tmp_path):
    """The quickstart's CPU run is unchanged: NCHW, torch's default optimizer step, no loader workers."""
    cfg = load_config("configs/quickstart.yaml")
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 2))
    optimizer = build_optimizer(cfg.optimizer, model, CPU)
    facts = speed_facts(cfg, model, optimizer, CPU)
    assert facts == {"data_on_device": False, "channels_last": False, "channels_last_why": "auto: CUDA only",
                     "fused_optimizer": False, "fused_optimizer_why": "auto: CUDA only", "num_workers": 0,
                     "num_workers_why": "auto: 0 off a GPU", "prefetch": False}
    assert speed_words(facts, "AdamW") == ("channels_last off (auto: CUDA only), AdamW step unfused (auto: CUDA "
                                           "only), 0 loader workers (auto: 0 off a GPU)")


def test_on_cuda_the_config_chooses_the_fast_path(monkeypatch):
    import ignite_amp.data.datasets as datasets

    monkeypatch.setattr(datasets, "usable_cores", lambda: 16)
    cfg = load_config({"data": {"name": "shapes"}})
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 2))
    optimizer = build_optimizer(cfg.optimizer, model, CUDA)
    loader = DevicePrefetcher([], CUDA, streams=object())  # what a config run's loader is on CUDA (device_loader)
    facts = speed_facts(cfg, model, optimizer, CUDA, loader)
    assert (facts["channels_last"], facts["fused_optimizer"], facts["num_workers"], facts["prefetch"]) == \
        (True, True, 4, True)
    assert speed_words(facts, "AdamW") == (
        "channels_last on (auto: 2-d convolutions hold 93% of the weights), AdamW step fused (auto: on CUDA), "
        "4 loader workers (auto: 16 cores less one per process, at most 4 per process for data in memory), "
        "prefetch to GPU on a side stream")
    given = load_config({"amp": {"channels_last": False}, "data": {"num_workers": 2},
                         "optimizer": {"kwargs": {"fused": False}}})
    facts = speed_facts(given, model, build_optimizer(given.optimizer, model, CUDA), CUDA)
    assert (facts["channels_last"], facts["fused_optimizer"], facts["num_workers"]) == (False, False, 2)
    assert speed_words(facts, "AdamW") == ("channels_last off, AdamW step unfused (optimizer.kwargs.fused), "
                                           "2 loader workers")


def test_with_the_data_on_the_gpu_the_start_line_says_no_workers_and_why():
    """data.on_device (ignite_amp.data.device_batches): batches are cut on the GPU, no worker process."""
    from ignite_amp.data.datasets import TensorImageDataset
    from ignite_amp.data.device_batches import DeviceBatches

    cfg = load_config({"data": {"name": "shapes"}})
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 2))
    dataset = TensorImageDataset(torch.zeros(4, 3, 2, 2, dtype=torch.uint8), torch.arange(4), (0.5,) * 3, (0.25,) * 3)
    facts = speed_facts(cfg, model, build_optimizer(cfg.optimizer, model, CUDA), CUDA, DeviceBatches(dataset, 2))
    assert (facts["data_on_device"], facts["num_workers"], facts["num_workers_why"]) == (True, 0, "data on the GPU")
    assert speed_words(facts, "AdamW").endswith("AdamW step fused (auto: on CUDA), 0 loader workers (data on the GPU)")


def test_auto_channels_last_is_off_under_fsdp_where_true_is_refused():
    cfg = load_config({"distributed": {"strategy": "fsdp"}})
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 2))
    assert config_channels_last(cfg, model, CUDA) == (False, "auto: off under distributed.strategy fsdp "
                                                             "(contiguous shards only)")


@pytest.mark.slow
def test_the_start_line_of_a_cpu_run_says_the_batch_and_fits_two_rows_of_80_columns(tmp_path):
    """The batch size and the choices that matter on a CPU; the GPU-only ones and every reason in full go to
    train.log and the run facts."""
    from ignite_amp.run.compose import build_run

    printed = []
    cfg = tiny_config(tmp_path, data={"num_workers": "auto"})
    run = build_run(cfg, print_fn=printed.append)
    run.train()
    (start,) = [line for line in printed if line.startswith("training u on cpu")]
    assert ", batch 32; output in " in start and start.endswith(f"output in {cfg['output_dir']}")
    shown = start.replace(cfg["output_dir"], "runs/quickstart")  # as the quickstart's would be
    assert "channels_last" not in start and "unfused" not in start and len(shown) <= 160, start
    assert all(len(line) <= 80 for line in printed if line.startswith("  ")), printed  # the health summary
    log = open(os.path.join(cfg["output_dir"], "train.log")).read()
    assert "channels_last off (auto: CUDA only), AdamW step unfused (auto: CUDA only), " \
           "0 loader workers (auto: 0 off a GPU)" in log
    assert run.facts["channels_last"] is False and run.facts["num_workers"] == 0
    assert run.train_loader.num_workers == 0


def test_a_resume_keeps_the_kernels_this_run_chose_not_the_checkpoints():
    """torch's load_state_dict takes the saved groups' flags; a CPU run's checkpoint resumed on CUDA stays fused."""
    model = nn.Linear(4, 2)
    opt = OptimizerConfig(name="AdamW", lr=1e-3, kwargs={})
    on_cpu, on_cuda = build_optimizer(opt, model, CPU), build_optimizer(opt, model, CUDA)
    model(torch.randn(3, 4)).sum().backward()
    on_cpu.step()
    on_cuda.load_state_dict(on_cpu.state_dict())
    assert on_cuda.param_groups[0]["fused"] is True and on_cuda.param_groups[0]["foreach"] is None
    on_cpu.load_state_dict(on_cuda.state_dict())
    assert not on_cpu.param_groups[0]["fused"]
    assert on_cuda.state[model.weight]["step"] == 1  # the rest of the state is the checkpoint's
