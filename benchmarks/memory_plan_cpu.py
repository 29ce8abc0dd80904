"""The memory plan on CPU (issue 40): its peak against the real step's, and its time against one real step.

For each case the plan (``ignite_amp.estimate_memory``: the step on fake tensors under ``MemTracker``) and the
real step of the same model, optimizer state and batch, tracked with the same ``MemTracker``
(``ignite_amp.memory_plan.fake_step.step_tracker``), from a fresh ``create_amp_trainer`` with the optimizer's state as
after a first step. Then the plan's wall time against one real step (the step alone, not the tracker's cost) for the
quickstart config's model and batch and for a ~110M-parameter GPT-style decoder.

    python benchmarks/memory_plan_cpu.py
"""
import argparse
import copy
import sys
import time

import torch
from float8_gpt import GPT, next_token_loss
from torch import nn
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer, estimate_memory
from ignite_amp.memory_plan.fake_step import step_tracker, warm_optimizer
from ignite_amp.models import build_model, small_cnn


class Transformer(nn.Module):
    def __init__(self, vocab=1000, width=256, layers=4, classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def images(n, size=64):
    return torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))


def tokens(n):
    return torch.randint(0, 1000, (n, 128)), torch.randint(0, 10, (n,))


CASES = [  # name, model, batch(n), n, step arguments
    ("CNN: torchvision resnet18 64x64, bfloat16", lambda: build_model("resnet18", 10, {}), images, 32,
     {"dtype": "bfloat16"}),
    ("transformer 4x256, 128 tokens, bfloat16", Transformer, tokens, 16, {"dtype": "bfloat16"}),
    ("transformer, activation checkpointing", Transformer, tokens, 16,
     {"dtype": "bfloat16", "activation_checkpointing": True}),
    ("transformer, 4 micro-batches, float16", Transformer, tokens, 16, {"dtype": "float16", "micro_batches": 4}),
    ("MLP 1024, float8 tensorwise (emulated)", mlp, lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,))),
     256, {"dtype": "float8"}),
]


def real_peak(model, optimizer, loss_fn, batch, **kwargs) -> int:
    trainer = create_amp_trainer(model, optimizer, loss_fn, device="cpu", **kwargs)
    warm_optimizer(optimizer)
    trainer.state.iteration, trainer.state.epoch_length = 1, 1
    tracker = step_tracker()
    tracker.track_external(model, optimizer, *batch)
    with tracker:
        trainer.amp_step(trainer, batch)
    return sum(v for d in tracker.get_tracker_snapshot("peak").values() for k, v in d.items() if k != "Total")


def accuracy() -> float:
    print("| case | batch | planned MiB | real MiB (MemTracker) | relative error |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for name, make, batch, n, kwargs in CASES:
        torch.manual_seed(0)
        model = make()
        optimizer = torch.optim.AdamW(model.parameters())
        plan = estimate_memory(model, optimizer, cross_entropy, batch, [n], device="cpu", fit=False, **kwargs)
        real = real_peak(model, optimizer, cross_entropy, batch(n), **kwargs)
        error = abs(plan.peaks[0].peak - real) / real
        worst = max(worst, error)
        print(f"| {name} | {n} | {plan.peaks[0].peak / 2**20:.2f} | {real / 2**20:.2f} | {error:.1e} |", flush=True)
    print(f"worst relative error: {worst:.1e}")
    return worst


def timing(name, make, loss_fn, batch, n, **kwargs) -> None:
    torch.manual_seed(0)
    model = make()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    begin = time.perf_counter()
    estimate_memory(model, optimizer, loss_fn, batch, [n], device="cpu", fit=False, **kwargs)
    planned = time.perf_counter() - begin
    trainer = create_amp_trainer(model, optimizer, loss_fn, device="cpu", **kwargs)
    data = [batch(n)]
    trainer.run(copy.copy(data), max_epochs=1)  # the first step: optimizer state, one-time checks
    begin = time.perf_counter()
    trainer.run(data, max_epochs=1)
    step = time.perf_counter() - begin
    print(f"| {name} | {params / 1e6:.1f} M | {n} | {planned:.2f} | {step:.2f} | {planned / step:.2f} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true", help="leave out the 110M-parameter decoder")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads")
    accuracy()
    print()
    print("| model | parameters | batch | plan s | one real step s | plan / step |")
    print("|---|---|---|---|---|---|")
    timing("quickstart: small_cnn 32x32, bfloat16, AdamW", lambda: small_cnn(10), cross_entropy,
           lambda n: images(n, 32), 64, dtype="bfloat16")
    if not args.skip_large:
        timing("GPT 12x768, 16k vocab, 256 tokens, bfloat16, AdamW",
               lambda: GPT(16384, 768, 12, 12, 256), next_token_loss,
               lambda n: (torch.randint(0, 16384, (n, 256)), torch.randint(0, 16384, (n, 256))), 8,
               dtype="bfloat16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
