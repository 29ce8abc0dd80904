"""channels_last "auto" (issue 51): on CUDA for a model whose 2-d convolutions hold most of its weights, off
elsewhere; an explicit value wins. The rule is tested with the device it is given; the step on this CPU."""
import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

import ignite_amp.transforms.memory_format as memory_format
from helpers import assert_doctests_pass
from ignite_amp.engine import create_amp_evaluator, create_amp_trainer
from ignite_amp.transforms.memory_format import CONV_SHARE, choose_channels_last, conv_share

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def cnn(head: int = 2) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, head))


def test_the_docstring_examples_run():
    assert_doctests_pass(memory_format)


def test_conv_share_counts_the_weight_matrices_of_2d_convolutions():
    model = cnn()  # 3*8*9 + 8*8*9 = 792 conv weights, 16 linear: biases and norms are not matrices
    assert conv_share(model) == pytest.approx(792 / (792 + 16))
    assert conv_share(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))) is None
    assert conv_share(nn.Sequential(nn.Conv1d(3, 8, 3), nn.Linear(8, 2))) is None  # 3-d weights: not NCHW
    tied = nn.Sequential(nn.Embedding(10, 8), nn.Conv2d(8, 8, 1))
    assert conv_share(tied) == pytest.approx(64 / (64 + 80))  # an embedding table is a weight matrix too
    lazy = nn.Sequential(nn.LazyConv2d(4, 3), nn.Conv2d(4, 4, 1))
    assert conv_share(lazy) == 1.0  # the uninitialised one is not counted, and nothing raises


def test_auto_is_on_on_cuda_for_a_convolutional_model_and_says_why():
    choice = choose_channels_last("auto", cnn(), CUDA)
    assert choice.on and choice.why == "auto: 2-d convolutions hold 98% of the weights"


def test_auto_is_off_off_cuda_and_for_linear_or_head_heavy_models():
    assert choose_channels_last("auto", cnn(), CPU) == (False, "auto: CUDA only")
    assert choose_channels_last("auto", cnn(), torch.device("mps")).on is False
    assert choose_channels_last("auto", nn.Linear(4, 2), CUDA) == (False, "auto: no 2-d convolution")
    heavy = cnn(head=200)  # 792 conv weights against 1600 in the head: a VGG-like head
    choice = choose_channels_last("auto", heavy, CUDA)
    assert not choice.on and choice.why == f"auto: 2-d convolutions hold 33% of the weights, under {CONV_SHARE:.0%}"


def test_an_explicit_value_wins_and_a_wrong_one_is_refused():
    assert choose_channels_last(True, nn.Linear(4, 2), CPU) == (True, "")
    assert choose_channels_last(False, cnn(), CUDA) == (False, "")
    with pytest.raises(ValueError, match="Argument channels_last should be true or false or auto, got 'yes'"):
        choose_channels_last("yes", cnn(), CPU)


def test_the_factories_default_to_auto_which_leaves_a_cpu_run_as_it_was():
    model = cnn()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32")
    step = trainer.amp_step
    assert (step.channels_last, step.channels_last_why) == (False, "auto: CUDA only")
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    trainer.run([(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1]))], max_epochs=1)
    assert seen == [True] and model[0].weight.is_contiguous()  # NCHW images and weights, as before
    evaluator = create_amp_evaluator(model, device="cpu", dtype="float32")
    assert evaluator.amp_step.channels_last is False


def test_the_step_applies_what_the_rule_chose(monkeypatch):
    """Where the rule says on (CUDA, stood in for by the rule's answer), model and images go channels-last."""
    import ignite_amp.step.base as base

    monkeypatch.setattr(base, "choose_channels_last", lambda requested, model, device: (True, "auto: stand-in"))
    model = cnn()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32")
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(
        args[0].is_contiguous(memory_format=torch.channels_last)))
    trainer.run([(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1]))], max_epochs=1)
    assert seen == [True] and model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert trainer.amp_step.channels_last_why == "auto: stand-in"
