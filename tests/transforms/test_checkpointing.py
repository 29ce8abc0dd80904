"""Activation checkpointing (issue 30): the same training with less saved activation memory, from Python,
from a config, under micro-batches, accumulation, every dtype, dropout, BatchNorm, DDP and FSDP2."""
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

import ignite_amp.transforms.activation_checkpointing
from helpers import FakeClock, assert_doctests_pass, free_port, in_group, recording_backend, tiny_config
from helpers.checkpointing import Net, batches, block_calls, net, relative_difference, train
from helpers.memory import FakeMeter
from ignite_amp import create_amp_trainer, find_batch_size
from ignite_amp.errors import ConfigError
from ignite_amp.handlers import OOMBackoff
from ignite_amp.run.compose import build_run, train_from_config
from ignite_amp.step.facts import step_facts
from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks, checkpointed_blocks, describe_blocks
from ignite_amp.transforms.blocks import block_names
from ignite_amp.transforms.sharding import shard_model

GiB = 2**30


def test_docstring_examples():
    assert_doctests_pass(ignite_amp.transforms.activation_checkpointing)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, options, dropout", [
    ("float32", {}, 0.0),
    ("float32", {"micro_batches": 2, "accumulation_steps": 2, "num_items": lambda x, y: (y != -100).sum()}, 0.0),
    ("float32", {"micro_batches": 2}, 0.3),  # dropout: the recompute draws the forward's masks
    ("float16", {}, 0.0),  # with the GradScaler
    ("bfloat16", {"micro_batches": 2}, 0.0),
])
def test_training_is_the_same_with_and_without_it(dtype, options, dropout):
    data = batches(padded="num_items" in options)
    plain, checkpointed = net(dropout=dropout), net(dropout=dropout)
    train(plain, False, data, dtype, **options)
    trainer = train(checkpointed, True, data, dtype, **options)
    assert checkpointed_blocks(checkpointed) == ["blocks.0", "blocks.1", "blocks.2"]
    calls, once, check = block_calls(checkpointed), block_calls(plain), trainer.amp_step.split_check
    # every block's forward ran again in the backward, but not the split check's (checkpointing is suspended in it)
    assert calls == 2 * once > 0 if not (check.batches or check.inconclusive) else once < calls < 2 * once
    assert trainer.amp_step.scaler.is_enabled() == (dtype == "float16")
    # 8 (float32) or 16 SGD steps: the weights agree to float32 rounding
    assert relative_difference(checkpointed, plain) < 1e-6


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
                           for _ in range(3)])


def test_batch_norm_running_statistics_are_updated_once():
    plain, checkpointed = cnn(), cnn()
    checkpoint_blocks(checkpointed)
    for _ in range(2):
        x = torch.randn(8, 4, 6, 6)
        plain(x).sum().backward()
        checkpointed(x).sum().backward()
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # num_batches_tracked is 2, not 4; the running means and variances agree


@pytest.mark.slow
def test_compile_captures_the_checkpointed_blocks_in_one_graph():
    """Issue 39: the wrapper's recompute flag (a list appended to) was a side effect dynamo refuses inside the
    checkpoint ("HOP: Unsafe side effect"): compile captured nothing and the model ran eager."""
    backend, graphs = recording_backend()

    def captured_ops():  # the operators in the graphs, those inside each checkpoint's subgraph included
        return sum(node.op == "call_function" and not str(node.target).startswith("<built-in function getitem")
                   for gm in graphs for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                   for node in module.graph.nodes)

    plain, checkpointed = cnn(), cnn()
    torch.compile(plain, backend=backend)(torch.zeros(2, 4, 6, 6))
    plain_ops, graphs[:] = captured_ops(), []
    plain = cnn()
    checkpoint_blocks(checkpointed)
    compiled = torch.compile(checkpointed, backend=backend, fullgraph=True)  # a graph break is an error
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(8, 4, 6, 6, generator=g)
        plain(x).sum().backward()
        compiled(x).sum().backward()
    assert len(graphs) == 1 and captured_ops() >= plain_ops > 0
    assert checkpointed_blocks(checkpointed) == ["0", "1", "2"]  # still reported
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name  # BatchNorm statistics updated once under compile too
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


def saved_bytes(model, x):
    """The bytes autograd holds for the backward after a forward: tensors saved by the forward (those
    that are not parameters), each storage once."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return sum(held.values())


def test_a_6_block_model_saves_at_least_2x_fewer_activation_bytes():
    x = torch.randn(64, 8)
    plain, checkpointed = net(depth=6, width=32), net(depth=6, width=32)
    checkpoint_blocks(checkpointed)
    without, with_it = saved_bytes(plain, x), saved_bytes(checkpointed, x)
    assert without >= 2 * with_it > 0, (without, with_it)  # 8.5x on this model
    assert relative_difference(plain, checkpointed) == 0.0 and all(
        torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True))


@pytest.mark.slow
def test_the_run_facts_name_the_blocks_and_a_model_without_blocks_is_one_warning():
    trainer = train(net(depth=12), True, batches(1))
    facts = step_facts(trainer.amp_step)
    assert facts["activation_checkpointing"] is True and facts["checkpointed_blocks"] == "blocks.0-11"
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.warns(UserWarning, match="activation checkpointing: Sequential has no repeated blocks") as caught:
        trainer = train(model, True, batches(1))
    assert len(caught) == 1
    assert step_facts(trainer.amp_step)["checkpointed_blocks"] == "none"
    assert step_facts(train(net(), False, batches(1)).amp_step)["activation_checkpointing"] is False


def test_blocks_checkpointed_already_stay_as_they_are_and_bad_arguments():
    model = net()
    assert checkpoint_blocks(model, ["Linear"]) == ["inp", "head", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1",
                                                    "blocks.1.fc2", "blocks.2.fc1", "blocks.2.fc2"]
    train(model, True, batches(1))  # the factory keeps the user's choice
    kept = checkpointed_blocks(model)
    assert kept[:3] == ["inp", "head", "blocks.0.fc1"] and "blocks.0" not in kept
    with pytest.raises(ValueError, match="Argument activation_checkpointing should be true or false or auto or "
                                         "selective, got 'yes'"):
        train(net(), "yes", batches(1))
    with pytest.raises(ValueError, match="blocks: the model has no submodule of class 'Layer'"):
        checkpoint_blocks(net(), ["Layer"])
    assert block_names(net()) == ["blocks.0", "blocks.1", "blocks.2"]  # the rule FSDP2 shards by


@pytest.mark.slow
def test_compile_traces_the_checkpointed_blocks():
    data = batches(2)
    plain, checkpointed = net(), net()
    train(plain, False, data)
    # Checkpointed first, then compiled (the factory's order); aot_eager: dynamo and AOTAutograd trace the
    # checkpoints as compile=True does, without inductor's minute of code generation on a CPU.
    compiled = torch.compile(checkpointed, backend="aot_eager")
    train(checkpointed, True, data, model_fn=lambda model, x: compiled(x))
    assert relative_difference(checkpointed, plain) < 1e-6


def test_describe_blocks():
    assert describe_blocks(["layers.0", "layers.1", "layers.2", "head", "0", "1", "x.3", "x.5"]) == \
        "layers.0-2, head, 0-1, x.3, x.5"
    assert describe_blocks([]) == ""


@pytest.mark.slow
def test_out_of_memory_backoff_with_it_on_loses_nothing():
    data = batches(3, size=8)
    reference = net()
    train(reference, False, data)
    model = net(limit=4)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32", activation_checkpointing=True)
    OOMBackoff(min_batch_size=1).attach(trainer)
    trainer.run(data, max_epochs=2)
    assert trainer.amp_step.micro_batches == 2 and trainer.amp_step.oom_count == 1
    assert relative_difference(model, reference) < 1e-6


class SavedBytesDevice(nn.Module):
    """Stand-in for a GPU: a training forward of the 6-block model holds ``fixed`` bytes plus ``scale`` times
    the bytes autograd saves for the backward (counted, not assumed), and raises torch.OutOfMemoryError above
    the meter's capacity: memory per sample shrinks when the blocks keep only their inputs."""

    def __init__(self, meter, clock, fixed=2 * GiB, scale=40000):
        super().__init__()
        self.meter, self.clock, self.fixed, self.scale = meter, clock, fixed, scale
        torch.manual_seed(0)
        self.net = Net(depth=6, width=32)

    def forward(self, x):
        held = {}

        def pack(t):
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.net(x)
        parameters = {p.untyped_storage().data_ptr() for p in self.parameters()}
        nbytes = self.fixed + self.scale * sum(v for k, v in held.items() if k not in parameters)
        if nbytes > self.meter.capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in: {nbytes / GiB:.1f} GiB)")
        self.meter.hold(nbytes)
        self.clock.ms += 0.01 * (x.shape[0] + 64)
        return out


@pytest.mark.slow
def test_the_batch_size_search_finds_a_larger_batch_with_it_on():
    found = {}
    for checkpointing in (False, True):
        meter, clock = FakeMeter(16 * GiB), FakeClock()
        model = SavedBytesDevice(meter, clock)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        found[checkpointing] = find_batch_size(model, optimizer, cross_entropy, lambda n: batches(1, n)[0],
                                               device="cpu", dtype="float32", meter=meter, clock=clock,
                                               warmup=1, steps=1, verify_steps=1,
                                               activation_checkpointing=checkpointing).batch_size
        assert bool(checkpointed_blocks(model)) == checkpointing
    assert found[True] >= 2 * found[False] > 0, found


# -- from a config -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_config_run_checkpoints_the_named_blocks_and_a_resume_may_turn_it_off(tmp_path):
    cfg = tiny_config(tmp_path, amp={"activation_checkpointing": True}, distributed={"blocks": ["Sequential"]})
    run = build_run(cfg, print_fn=lambda line: None)
    try:
        assert checkpointed_blocks(run.model) == ["0", "1", "2", "3"]  # small_cnn's four conv blocks
        assert step_facts(run.trainer.amp_step)["checkpointed_blocks"] == "0-3"
    finally:
        run.close()
    train_from_config(cfg, print_fn=lambda line: None)
    lines = []
    cfg = tiny_config(tmp_path, train={"epochs": 2}, distributed={"blocks": ["Sequential"]})
    train_from_config(cfg, print_fn=lines.append)
    resumed = next(line for line in lines if line.startswith("resumed from"))
    assert "now in effect: amp.activation_checkpointing True -> False" in resumed, resumed


def flat_cnn(num_classes: int) -> nn.Module:
    """A config model without repeated blocks."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))


@pytest.mark.slow
def test_a_config_model_without_blocks_warns_once_and_unknown_blocks_are_one_line(tmp_path):
    cfg = tiny_config(tmp_path, amp={"activation_checkpointing": True},
                      model={"name": "test_checkpointing:flat_cnn", "kwargs": {}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_run(cfg, print_fn=lambda line: None).close()
    assert [str(w.message)[:50] for w in caught if "activation checkpointing" in str(w.message)] == [
        "activation checkpointing: Sequential has no repeat"]
    cfg = tiny_config(tmp_path, amp={"activation_checkpointing": True}, distributed={"blocks": ["Layer"]})
    with pytest.raises(ConfigError, match=r"^distributed\.blocks: the model has no submodule of class 'Layer'$"):
        build_run(cfg, print_fn=lambda line: None)


# -- DDP and FSDP2 on 2 gloo processes ---------------------------------------------------------------------
def _ranks(rank, out):
    options = {"micro_batches": 2, "accumulation_steps": 2}
    data = batches(seed=rank)
    ddp = {}
    for checkpointing in (False, True):
        model = net()
        train(torch.nn.parallel.DistributedDataParallel(model), checkpointing, data, **options)
        ddp[checkpointing] = model
    sharded = {}
    for checkpointing in (False, True, "selective"):  # selective (issue 52): FSDP2 gathers for its recompute too
        model = shard_model(net(), "float32", device="cpu", activation_checkpointing=checkpointing)
        train(model, checkpointing, data, **options)  # the factory keeps shard_model's blocks
        sharded[checkpointing] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    fsdp = max(float((sharded[on][k] - v).abs().max() / v.abs().max()) for k, v in sharded[False].items()
               for on in (True, "selective"))
    try:
        train(shard_model(net(), "float32", device="cpu"), True, data)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    torch.save({"ddp": relative_difference(ddp[True], ddp[False]), "fsdp": fsdp, "refused": refused,
                "calls": (block_calls(ddp[False]), block_calls(ddp[True]))}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_and_fsdp2_train_the_same_with_it_and_a_sharded_model_is_refused(tmp_path):
    torch.multiprocessing.spawn(in_group, args=(2, free_port(), _ranks, str(tmp_path)), nprocs=2)
    assert not dist.is_initialized()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["ddp"] < 1e-6 and result["fsdp"] < 1e-6, result
        once, calls = result["calls"]  # the blocks ran again in the backward, but not in the split check's forwards
        assert once < calls < 2 * once, result
        assert result["refused"] == ("Argument activation_checkpointing: the model is sharded already, and "
                                     "checkpointing must come before sharding; pass activation_checkpointing=True "
                                     "to shard_model instead")
