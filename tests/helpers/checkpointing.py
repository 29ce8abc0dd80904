"""Activation checkpointing's test models: repeated blocks that count their forwards, their batches and training."""
import torch
from torch import nn
from torch.nn.functional import cross_entropy, gelu

from ignite_amp import create_amp_trainer


class Block(nn.Module):
    """A pre-norm MLP block (a transformer layer without attention) that counts its forwards."""

    def __init__(self, width=16, dropout=0.0):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.drop(self.fc2(gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    """``depth`` repeated blocks between an input layer and a head: the blocks are ``blocks.0`` ... ."""

    def __init__(self, depth=3, width=16, dropout=0.0, limit=None):
        super().__init__()
        self.inp, self.head = nn.Linear(8, width), nn.Linear(width, 4)
        self.blocks = nn.Sequential(*[Block(width, dropout) for _ in range(depth)])
        self.limit = limit  # an out-of-memory stand-in above this many samples

    def forward(self, x):
        if self.limit is not None and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in: {x.shape[0]} samples)")
        return self.head(self.blocks(self.inp(x)))


def net(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Net(**kwargs)


def batches(n=4, size=8, seed=0, padded=False):
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        y = torch.randint(0, 4, (size,), generator=g)
        if padded:  # a padded token mean: num_items counts the targets that are not -100
            y[torch.rand(size, generator=g) < 0.3] = -100
        out.append((torch.randn(size, 8, generator=g), y))
    return out


def train(model, checkpointing, data, dtype="float32", **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", dtype=dtype,
                                 activation_checkpointing=checkpointing, **kwargs)
    torch.manual_seed(1)  # the dropout masks
    trainer.run(data, max_epochs=2)
    return trainer


def relative_difference(a, b):
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a.state_dict().values(),
                                                                          b.state_dict().values(), strict=True))


def block_calls(model):
    return sum(m.calls for m in model.modules() if isinstance(m, Block))
