"""The step's FLOPs on the plan's trace (issue 52): FlopCounterMode's formulas for matmuls, convolutions and attention,
one per output element for the rest; checkpointing's recompute priced by them."""
import pytest
import torch
from torch.nn.functional import gelu, scaled_dot_product_attention
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import ignite_amp.memory_plan.choices as choices
import ignite_amp.memory_plan.flops as flops
from helpers import assert_doctests_pass
from ignite_amp.memory_plan.flops import count_flops

pytestmark = pytest.mark.fake_trace  # runs after the tests that fork (see conftest)


def test_docstring_examples():
    assert_doctests_pass(flops)
    assert_doctests_pass(choices)


def test_matmuls_count_as_flop_counter_mode_counts_them_and_the_cheap_ops_by_their_outputs():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(16, 32, generator=g), torch.randn(32, 64, generator=g), torch.randn(64, 8, generator=g))
    with FlopCounterMode(display=False) as reference:
        (a @ b) @ c
    with count_flops() as counted:
        (a @ b) @ c
    assert counted() == reference.get_total_flops() == 2 * 16 * 32 * 64 + 2 * 16 * 64 * 8
    with count_flops() as counted:
        gelu(a @ b).view(-1)  # the GELU: one per output element; the view: none
    assert counted() == 2 * 16 * 32 * 64 + 16 * 64
    q = torch.randn(2, 4, 16, 8, generator=g)
    with count_flops() as counted:  # the CPU's attention kernel, which FlopCounterMode has no formula for
        scaled_dot_product_attention(q, q, q)
    assert counted() == sdpa_flop_count(q.shape, q.shape, q.shape) > 0
