"""Memory stand-ins and measures: a fake device's peak counter, a small transformer and its tokens, and the real
step's peak as the memory plan tracks the fake one."""
import torch
from torch import nn
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer
from ignite_amp.batch_search import MemoryMeter
from ignite_amp.memory_plan.fake_step import step_tracker, warm_optimizer


class FakeMeter(MemoryMeter):
    """A simulated device's peak-memory counter: the stand-in model reports what it holds."""

    def __init__(self, capacity):
        self.capacity, self.peak, self.resets = capacity, 0.0, 0

    def reset(self):
        self.peak, self.resets = 0.0, self.resets + 1

    def hold(self, nbytes):
        self.peak = max(self.peak, nbytes)

    def peak_bytes(self):
        return self.peak

    def capacity_bytes(self):
        return self.capacity


class Transformer(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 32, layers: int = 3, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def tokens(n):
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 50, (n, 16), generator=g), torch.randint(0, 10, (n,), generator=g)


def measured_peak(model, optimizer, make_batch, n, **kwargs) -> int:
    """The real step's peak, tracked as the plan tracks the fake one (optimizer state as after a first step; the
    steady step's: the one-time split check is planned apart, tests/cli/test_adversarial_commands.py)."""
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", **{"check_split": False, **kwargs})
    warm_optimizer(optimizer)
    batch = make_batch(n)
    acc = kwargs.get("accumulation_steps", 1)
    trainer.state.epoch_length = acc
    tracker = step_tracker()
    tracker.track_external(model, optimizer, *batch)
    with tracker:
        for iteration in range(max(1, acc - 1), acc + 1):
            trainer.state.iteration = iteration
            trainer.amp_step(trainer, batch)
    return sum(v for per_device in tracker.get_tracker_snapshot("peak").values()
               for kind, v in per_device.items() if kind != "Total")
