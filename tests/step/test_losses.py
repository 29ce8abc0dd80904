"""What a loss says of itself: the label value it ignores, read by the step's padding warning and the split check."""
import functools

import torch
from torch import nn
from torch.nn.functional import cross_entropy

import ignite_amp.batching as losses
from helpers import assert_doctests_pass
from ignite_amp.batching import ignore_index_of


def test_the_docstring_examples_run():
    assert_doctests_pass(losses)


def test_the_ignored_label_comes_from_the_loss_module_or_a_partials_keyword():
    assert ignore_index_of(nn.CrossEntropyLoss()) == -100 and ignore_index_of(nn.NLLLoss(ignore_index=3)) == 3
    assert ignore_index_of(functools.partial(cross_entropy, ignore_index=255)) == 255
    assert ignore_index_of(cross_entropy) is None and ignore_index_of(None) is None
    assert ignore_index_of(functools.partial(cross_entropy, ignore_index=True)) is None  # not a label value


def test_the_step_reads_it_where_it_always_did():
    from ignite_amp.step.contracts import ignore_index_of as from_the_step

    assert from_the_step is ignore_index_of
    assert ignore_index_of(torch.nn.MSELoss()) is None
