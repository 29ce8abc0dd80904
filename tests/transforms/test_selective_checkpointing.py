"""Selective activation checkpointing (issue 52): blocks keep their matmuls', convolutions' and attention's outputs
and recompute the rest; gradients bitwise equal to the uncheckpointed step's in float32 on the project's GPT, a
torchvision ResNet and a Hugging Face model, from Python and from a config, with micro-batches, float8, FSDP2 and
compile."""
import copy
import os

import pytest
import torch
from torch import nn

from helpers import ROOT, recording_backend, three_blocks, tiny_config
from helpers.checkpointing import batches, block_calls, net, relative_difference, train
from ignite_amp.errors import ConfigError
from ignite_amp.run.compose import build_run
from ignite_amp.step.facts import step_facts
from ignite_amp.transforms.activation_checkpointing import (
    SAVED_OPS,
    checkpoint_blocks,
    checkpoint_policies,
    checkpointed_blocks,
)
from ignite_amp.transforms.sharding import shard_model


@pytest.fixture
def gpt(monkeypatch):
    """The GPT of the benchmarks (float8_gpt.py, section h): pre-norm blocks with SDPA attention and a GELU MLP."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from float8_gpt import GPT

    return lambda: GPT(vocab=64, width=32, depth=3, heads=4, seq=16)


def tiny_gpt2():
    """A Hugging Face GPT-2 from a tiny config (nothing downloaded), with dropout; ``use_cache=False`` as HF's own
    gradient checkpointing sets it (a cache the blocks append to would make their recompute differ)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4, use_cache=False,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def resnet():
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10)


def gradients(model, x, loss):
    torch.manual_seed(3)  # the dropout masks
    loss(model, x).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "resnet", "hugging face gpt2 with dropout"])
def test_gradients_are_bitwise_those_without_checkpointing(name, gpt):
    make, x, loss = {
        "gpt": (gpt, torch.randint(0, 64, (2, 16)), lambda m, x: m(x).square().mean()),
        "resnet": (resnet, torch.randn(2, 3, 32, 32), lambda m, x: m(x).square().mean()),
        "hugging face gpt2 with dropout": (tiny_gpt2, torch.randint(0, 64, (2, 16)), lambda m, x: m(x, labels=x).loss),
    }[name]
    torch.manual_seed(0)
    plain = make().train()
    selective = copy.deepcopy(plain)
    names = checkpoint_blocks(selective, policy="selective")
    assert len(names) >= 3 and set(checkpoint_policies(selective).values()) == {"selective"}
    expected, got = gradients(plain, x, loss), gradients(selective, x, loss)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    for (key, a), b in zip(plain.state_dict().items(), selective.state_dict().values(), strict=True):
        assert torch.equal(a, b), key  # BatchNorm's running statistics updated once


def test_the_recompute_runs_no_matmul_again():
    """Full checkpointing runs each block's first Linear's matmul (addmm) again in the backward (the recompute
    stops once the saved tensors the backward needs exist: fc2's output is not one); selective reads it back (the
    backward's own matmuls are mm)."""

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    recomputed = {}
    for policy in ("full", "selective"):
        model, ops = net(depth=2), []
        checkpoint_blocks(model, policy=policy)
        y = model(torch.randn(4, 8)).sum()
        with Ops():
            y.backward()
        recomputed[policy] = ops.count("addmm")
        assert block_calls(model) == 4  # each block's forward ran again in the backward
    assert recomputed == {"full": 2, "selective": 0}
    assert "addmm" in SAVED_OPS and "native_layer_norm" not in SAVED_OPS


@pytest.mark.slow
@pytest.mark.parametrize("options, dropout", [
    ({}, 0.0), ({"micro_batches": 2}, 0.3), ({"dtype": "bfloat16"}, 0.0),
    ({"dtype": "float16", "micro_batches": 2, "accumulation_steps": 2}, 0.0),  # with the GradScaler
])
def test_training_is_the_same_from_the_factory(options, dropout):
    data = batches()
    plain, selective = net(dropout=dropout), net(dropout=dropout)
    train(plain, False, data, **options)
    trainer = train(selective, "selective", data, **options)
    assert checkpoint_policies(selective) == dict.fromkeys(["blocks.0", "blocks.1", "blocks.2"], "selective")
    calls, once, check = block_calls(selective), block_calls(plain), trainer.amp_step.split_check
    # every block's forward ran again in the backward, but not the split check's (checkpointing is suspended in it)
    assert calls == 2 * once > 0 if not (check.batches or check.inconclusive) else once < calls < 2 * once
    assert relative_difference(selective, plain) < 1e-6
    facts = step_facts(trainer.amp_step)
    assert facts["activation_checkpointing"] is True and facts["checkpointed_blocks"] == "blocks.0-2 (selective)"
    with pytest.raises(ValueError, match="Argument policy should be one of full, selective, got 'some'"):
        checkpoint_blocks(net(), policy="some")
    with pytest.raises(ValueError, match="Argument activation_checkpointing should be true or false or auto or "
                                         "selective, got 'some'"):
        train(net(), "some", data)
    with pytest.raises(ValueError, match="Argument activation_checkpointing should be True, False or 'selective', "
                                         "got 'auto'"):
        shard_model(net(), "float32", device="cpu", activation_checkpointing="auto")


@pytest.mark.slow
def test_compile_traces_the_selective_checkpoints():
    data = batches(2)
    plain, selective = net(), net()
    train(plain, False, data)
    compiled = torch.compile(selective, backend="aot_eager")
    train(selective, "selective", data, model_fn=lambda model, x: compiled(x))
    assert relative_difference(selective, plain) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("float8", [False, True])
def test_selective_checkpoints_compile_in_one_graph(float8):
    """As full checkpointing (issue 39): dynamo captures the selective checkpoints (torch's own contexts, read by
    the partitioner as save/recompute marks), float8 layers included; fullgraph=True: a graph break is an error."""
    backend, graphs = recording_backend()
    torch.manual_seed(0)
    model = three_blocks()
    if float8:
        pytest.importorskip("torchao")
        from ignite_amp.transforms.float8 import convert_to_float8

        convert_to_float8(model)
    checkpoint_blocks(model, policy="selective")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=float8):
        out = torch.compile(model, backend=backend, fullgraph=True)(torch.randn(8, 16))
    out.float().sum().backward()
    assert len(graphs) == 1 and checkpointed_blocks(model) == ["1.0", "1.1", "1.2"]
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_float8_and_selective_checkpointing_compose_exactly():
    """float8, then checkpointing (the transforms' order): the blocks' float8 matmuls (_scaled_mm) are kept."""
    pytest.importorskip("torchao")
    weights = {}
    for checkpointing in (False, "selective"):
        model = net(width=32)
        train(model, checkpointing, batches(2, size=16), dtype="float8", micro_batches=2)
        assert any("Float8" in type(m).__name__ for m in model.blocks.modules())
        weights[checkpointing] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(weights["selective"], weights[False])


@pytest.mark.slow
def test_a_config_says_selective(tmp_path):
    cfg = tiny_config(tmp_path, amp={"activation_checkpointing": "selective"}, distributed={"blocks": ["Sequential"]})
    run = build_run(cfg, print_fn=lambda line: None)
    try:
        assert checkpoint_policies(run.model) == dict.fromkeys(["0", "1", "2", "3"], "selective")
        run.trainer.run([(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))], max_epochs=1)
    finally:
        run.close()
    with pytest.raises(ConfigError, match='^amp.activation_checkpointing: expected true or false or auto or '
                                          'selective, got "partial"$'):
        build_run(tiny_config(tmp_path, amp={"activation_checkpointing": "partial"}), print_fn=lambda line: None)
    assert checkpointed_blocks(nn.Linear(2, 2)) == []
