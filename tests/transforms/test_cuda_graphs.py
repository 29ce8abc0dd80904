"""compile="reduce-overhead" (issue 51): the parity check against the eager forward and the fallbacks (shapes, out
of memory), on CPU. The compiler is stood in for where the test needs it to disagree with eager; one test compiles
for real (Inductor without graphs on a CPU)."""
import logging

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

import ignite_amp.transforms.cuda_graphs as graphs
from helpers import OOMAbove, assert_doctests_pass
from ignite_amp.config.tree import load_config
from ignite_amp.engine import create_amp_evaluator, create_amp_trainer
from ignite_amp.errors import ConfigError
from ignite_amp.step.events import AmpEvents
from ignite_amp.transforms.cuda_graphs import MAX_SHAPES, loss_mismatch


class Shifted(nn.Module):
    """A stand-in for a compiled forward that disagrees with eager: the model's output plus ``shift``."""

    def __init__(self, model: nn.Module, shift: float):
        super().__init__()
        self.model, self.shift, self.calls = model, shift, 0

    def forward(self, x):
        self.calls += 1
        return self.model(x) + self.shift


@pytest.fixture
def compiled(monkeypatch):
    """torch.compile stood in for by Shifted(model, shift); the modes it was asked for."""
    made = {"modes": [], "shift": 0.0, "forwards": []}

    def fake(model, mode=None, **kwargs):
        made["modes"].append(mode)
        forward = Shifted(model, made["shift"])
        made["forwards"].append(forward)
        return forward

    monkeypatch.setattr(torch, "compile", fake)
    return made


def batches(sizes, features=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def trainer_for(model, **kwargs):
    return create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                              dtype="float32", compile="reduce-overhead", **kwargs)


def test_the_docstring_examples_run():
    assert_doctests_pass(graphs)


def test_the_tolerance_follows_the_dtype_and_nan_fails():
    assert loss_mismatch(1.0, 1.0009, torch.float32) is None and loss_mismatch(1.0, 1.002, torch.float32)
    assert loss_mismatch(1.0, 1.004, torch.float16) is None and loss_mismatch(1.0, 1.006, torch.float16)
    assert loss_mismatch(1.0, 1.019, torch.bfloat16) is None and loss_mismatch(1.0, 1.021, torch.bfloat16)
    assert loss_mismatch(1.0, float("nan"), torch.float32)


def test_a_compiled_forward_that_agrees_with_eager_takes_over(compiled):
    model = nn.Linear(4, 3)
    trainer = trainer_for(model)
    trainer.run(batches([8, 8, 8]), max_epochs=1)
    step, forward = trainer.amp_step, compiled["forwards"][0]
    assert compiled["modes"] == ["reduce-overhead"]
    assert step.graphs.parity == "passed" and step.graphs.off is None and step.forward is forward
    assert forward.calls == 1 + 3  # the parity check's compiled forward, then each step's


def test_a_compiled_forward_that_disagrees_falls_back_to_eager_before_it_trains(compiled, caplog):
    compiled["shift"] = torch.tensor([0.0, 0.0, 3.0])  # one class's logit moved: another loss
    torch.manual_seed(0)
    model, reference = nn.Linear(4, 3), nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    data = batches([8, 8])
    with caplog.at_level(logging.WARNING, logger="ignite_amp"):
        trainer_for(model).run(data, max_epochs=1)
    assert "compile reduce-overhead: back to the eager forward: parity check failed on the first step" in caplog.text
    eager = create_amp_trainer(reference, torch.optim.SGD(reference.parameters(), lr=0.1), cross_entropy,
                               device="cpu", dtype="float32")
    eager.run(data, max_epochs=1)
    # every step eager, the first one included
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_the_parity_check_leaves_the_buffers_and_random_state_as_they_were(compiled):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    reference = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    reference.load_state_dict(model.state_dict())
    data = batches([8, 8])
    torch.manual_seed(5)
    trainer_for(model).run(data, max_epochs=1)
    after_compiled = torch.rand(1)
    torch.manual_seed(5)
    create_amp_trainer(reference, torch.optim.SGD(reference.parameters(), lr=0.1), cross_entropy, device="cpu",
                       dtype="float32").run(data, max_epochs=1)
    assert torch.equal(after_compiled, torch.rand(1))  # the check drew nothing from the generator
    assert model[1].num_batches_tracked.item() == reference[1].num_batches_tracked.item() == 2
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)


def test_dropout_is_said_and_not_checked(compiled):
    trainer = trainer_for(nn.Sequential(nn.Dropout(0.1), nn.Linear(4, 3)))
    trainer.run(batches([8]), max_epochs=1)
    assert trainer.amp_step.graphs.parity.startswith("not checked: dropout")
    assert trainer.amp_step.graphs.off is None


def test_too_many_input_shapes_fall_back_to_eager(compiled, caplog):
    model = nn.Linear(4, 3)
    trainer = trainer_for(model)
    with caplog.at_level(logging.WARNING, logger="ignite_amp"):
        trainer.run(batches(range(2, 3 + MAX_SHAPES)), max_epochs=1)  # MAX_SHAPES + 1 sizes
    graphs_ = trainer.amp_step.graphs
    assert graphs_.off.startswith(f"{MAX_SHAPES + 1} input shapes") and trainer.amp_step.forward is model
    assert compiled["forwards"][0].calls == 1 + MAX_SHAPES  # the check, then MAX_SHAPES steps compiled


def test_a_short_last_batch_and_micro_batches_are_shapes_like_any_other(compiled):
    trainer = trainer_for(nn.Linear(4, 3), micro_batches=2)
    trainer.run(batches([8, 8, 5]), max_epochs=1)  # chunks of 4, 4, then 3 and 2: three shapes
    assert trainer.amp_step.graphs.off is None and len(trainer.amp_step.graphs._shapes) == 3


def test_an_out_of_memory_error_falls_back_to_eager_for_the_retry(compiled):
    model = OOMAbove(in_features=4, limit=4)
    trainer = trainer_for(model)
    trainer.add_event_handler(AmpEvents.OUT_OF_MEMORY, lambda e: setattr(e.amp_step, "micro_batches", 2))
    data = [(torch.cat([torch.arange(8.).unsqueeze(1), torch.randn(8, 3)], 1), torch.randint(0, 3, (8,)))]
    trainer.run(data, max_epochs=1)
    step = trainer.amp_step
    assert step.oom_count == 1 and step.graphs.off.startswith("out of memory") and step.forward is model


def test_the_config_takes_reduce_overhead():
    assert load_config({"amp": {"compile": "reduce-overhead"}}).amp.compile == "reduce-overhead"
    with pytest.raises(ConfigError, match='amp.compile: expected true or false or reduce-overhead or null, got "max"'):
        load_config({"amp": {"compile": "max"}})


@pytest.mark.slow
def test_reduce_overhead_compiles_for_real_on_cpu_and_passes_its_parity_check():
    torch.manual_seed(0)
    model, reference = nn.Linear(4, 3), nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    data = batches([8, 8])
    trainer = trainer_for(model)
    trainer.run(data, max_epochs=1)
    assert trainer.amp_step.graphs.parity == "passed" and trainer.amp_step.graphs.off is None
    create_amp_trainer(reference, torch.optim.SGD(reference.parameters(), lr=0.1), cross_entropy, device="cpu",
                       dtype="float32").run(data, max_epochs=1)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("value", ["max-autotune", "reduce_overhead", "false", "default", 1, "True"])
def test_the_python_api_refuses_what_the_config_refuses(compiled, value):
    """compile="max-autotune" (torch's own mode name), a typo, the string "false": each compiled in torch's default
    mode, silently; now the config's check, named as an argument, before anything is built."""
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"^Argument compile should be true or false or reduce-overhead or None, got "
                                         + repr(value).replace("(", r"\(")):
        create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                           compile=value)
    with pytest.raises(ValueError, match="^Argument compile"):
        create_amp_evaluator(model, device="cpu", compile=value)
    assert compiled["modes"] == []  # nothing compiled
    with pytest.raises(ConfigError, match="^amp.compile: expected true or false or reduce-overhead or null"):
        load_config({"amp": {"compile": value}})


def test_torch_mode_names_say_which_value_is_which_mode():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"compile=True is its default mode; \"reduce-overhead\" records CUDA graphs"):
        create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                           compile="max-autotune")


def test_off_cuda_the_trainer_says_in_one_line_that_graphs_do_not_apply(compiled, caplog):
    with caplog.at_level(logging.WARNING, logger="ignite_amp"):
        trainer_for(nn.Linear(4, 3))
        create_amp_evaluator(nn.Linear(4, 3), device="cpu", compile="reduce-overhead")  # the trainer's says it
    said = [r.getMessage() for r in caplog.records]
    assert said == ["compile reduce-overhead: CUDA graphs apply on CUDA only; on cpu the forward is compiled without "
                    "them (torch.compile's code, the first steps compiling), with the same parity check"]


def test_a_first_loss_that_is_not_finite_is_said_so_not_compared(compiled, caplog):
    """A NaN first loss said "the compiled loss nan differs from the eager nan" and fell back to eager."""
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    trainer = trainer_for(model)
    with caplog.at_level(logging.WARNING, logger="ignite_amp"):
        trainer.run(batches([8]), max_epochs=1)
    graphs_ = trainer.amp_step.graphs
    assert graphs_.parity == "not checked: the first loss is not finite (nan eager, nan compiled)"
    assert graphs_.off is None and "differs" not in caplog.text
    assert "compile reduce-overhead: parity not checked: the first loss is not finite" in caplog.text


def test_a_compiled_loss_that_is_not_finite_where_eager_is_falls_back_saying_so():
    assert loss_mismatch(2.302, float("inf"), torch.bfloat16) == ("the compiled loss is not finite (inf) where the "
                                                                  "eager one is 2.302")


def test_the_guard_holds_both_forwards_and_knows_no_step():
    """The guard says which module runs (the step's forward reads it); its parity check takes a loss function of a
    forward, not a step."""
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    x, y = batches([8])[0]

    def loss_of(forward):
        return cross_entropy(forward(x), y)

    agreeing = graphs.GraphGuard(eager, Shifted(eager, 0.0))
    agreeing.check_parity(loss_of, torch.device("cpu"), torch.float32)
    assert agreeing.parity == "passed" and agreeing.forward is agreeing.compiled
    disagreeing = graphs.GraphGuard(eager, Shifted(eager, torch.tensor([0.0, 0.0, 3.0])))
    disagreeing.check_parity(loss_of, torch.device("cpu"), torch.float32)
    assert disagreeing.off.startswith("parity check failed") and disagreeing.forward is eager
    sharded = graphs.GraphGuard(eager, Shifted(eager, 3.0))
    sharded.check_parity(loss_of, torch.device("cpu"), torch.float32, sharded=True)
    assert sharded.parity == "not checked under DDP or FSDP2" and sharded.forward is sharded.compiled
