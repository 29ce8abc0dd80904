"""The ``"plan"`` strategy when the memory plan traced one batch size only (issue 54's type check found it)."""
import pytest
import torch
from torch import nn

from ignite_amp.batch_search import MemoryMeter, find_batch_size


class SmallMeter(MemoryMeter):
    """A device of 1000 bytes on which every trial reads 10: the plan (weights alone exceed it) fits no batch."""

    def reset(self):
        pass

    def peak_bytes(self):
        return 10.0

    def capacity_bytes(self):
        return 1000.0


@pytest.mark.slow
def test_a_plan_with_one_traced_size_hands_over_to_the_memory_model():
    # Nothing fits the plan's budget, so it shows its first size only and has no line to read other sizes on:
    # its peak there was None, and the strategy compared None with the budget (a TypeError).
    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = find_batch_size(model, opt, nn.functional.cross_entropy,
                             lambda n: (torch.randn(n, 64), torch.randint(0, 8, (n,))), device="cpu",
                             dtype="float32", meter=SmallMeter(), clock=lambda: 0.0, plan=True, max_size=64)
    assert result.strategy == "plan, then model"
    assert "plan: the plan traced batch 16 only" in result.reason
    assert result.batch_size == 64
