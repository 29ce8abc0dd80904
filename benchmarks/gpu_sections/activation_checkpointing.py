"""Section h: activation checkpointing, peak activation memory and step time with and without it, on a GPT-style
transformer (12 layers, width 1024, 1024 tokens) and on ResNet-50 at 224x224 (bfloat16). Section s (opt-in, issue
52; the default sections' 9 minutes are spent): the same models under none, selective and full checkpointing, and
``auto`` in a memory limit between none's and full's peaks."""
import gc
import statistics
import time
from typing import Optional

import torch
from bench_amp import resnet50
from float8_gpt import Block as GPTBlock
from torch import nn
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer
from ignite_amp.core.device import free_memory
from ignite_amp.memory_plan.auto_checkpoint import checkpoint_to_fit
from ignite_amp.models import build_model
from ignite_amp.transforms.activation_checkpointing import checkpointed_blocks

from .common import Context, sync


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` GPTBlocks (``blocks.N``), a final norm and the vocabulary head;
    returns the logits of every position flattened to ``(batch * tokens, vocab)``."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, tokens: int):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(tokens, width))
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).flatten(0, 1)


_SIZES = dict(
    # Expected on one H100: ~25 s. GPT (12 x 1024, 16 heads, 1024 tokens, batch 8, ~150 M parameters with
    # the 32k head) takes ~0.1-0.15 s a step; ResNet-50 (batch 128, 224x224) ~0.1 s after cudnn autotuning
    # (a few seconds). Each: 3 warm-up and 5 timed steps, with and without, one after the other.
    gpu=dict(layers=12, width=1024, heads=16, vocab=32768, tokens=1024, batch=8,
             cnn=resnet50, cnn_name="torchvision resnet50", cnn_batch=128, image=224, warmup=3, steps=5),
    smoke=dict(layers=2, width=32, heads=4, vocab=64, tokens=16, batch=4,
               cnn=lambda: build_model("resnet18", 10, {}), cnn_name="torchvision resnet18 (stand-in)",
               cnn_batch=8, image=16, warmup=1, steps=2))
_COLUMNS = ["model", "checkpointing", "blocks", "step_ms", "peak_activation_mb", "peak_mb", "status"]


def _specs(ctx: Context) -> tuple:
    """The sizes, and (name, spec) of the GPT and the CNN: a factory, a batch maker and the batch size."""
    size = ctx.sizes(**_SIZES)
    device = ctx.device
    torch.backends.cudnn.benchmark = True
    ctx.result["data"]["sizes"] = {k: v for k, v in size.items() if k != "cnn"}
    gpt = dict(factory=lambda: GPT(size["layers"], size["width"], size["heads"], size["vocab"], size["tokens"]),
               batch=lambda: (torch.randint(0, size["vocab"], (size["batch"], size["tokens"]), device=device),
                              torch.randint(0, size["vocab"], (size["batch"] * size["tokens"],), device=device)),
               batch_size=size["batch"])
    cnn = dict(factory=size["cnn"],
               batch=lambda: (torch.randn(size["cnn_batch"], 3, size["image"], size["image"], device=device),
                              torch.randint(0, 10, (size["cnn_batch"],), device=device)),
               batch_size=size["cnn_batch"])
    return size, ((f"GPT {size['layers']}x{size['width']}, {size['tokens']} tokens", gpt), (size["cnn_name"], cnn))


def activation_checkpointing(ctx: Context) -> None:
    size, specs = _specs(ctx)
    device = ctx.device
    ctx.table("bfloat16, create_amp_trainer, SGD; activation memory: peak allocated during the steps less what the "
              "weights, gradients and optimizer state hold", _COLUMNS)
    measured = {}
    for name, spec in specs:
        for on in (False, True):
            if ctx.left() < 5:
                ctx.row(model=name, checkpointing=on, status=f"not run: {ctx.left():.0f} s left of the budget")
                continue
            r = _checkpointing_step(spec, on, size, device)
            measured[(name, on)] = r
            ctx.row(model=name, checkpointing=on, blocks=r["blocks"], step_ms=r["step_ms"],
                    peak_activation_mb=r["activation_mb"], peak_mb=r["peak_mb"], status="measured")
        plain, checkpointed = measured.get((name, False)), measured.get((name, True))
        transformer = name.startswith("GPT")
        if plain is None or checkpointed is None or plain["activation_mb"] is None:
            saved, slower, value = None, None, ""
        else:
            saved = 1 - checkpointed["activation_mb"] / plain["activation_mb"]
            slower = checkpointed["step_ms"] / plain["step_ms"] - 1
            value = f"{saved * 100:.1f}% less activation memory, {slower * 100:+.1f}% step time"
        ctx.target(f"{name}: >= 40% less peak activation memory for <= 35% more step time" if transformer else
                   f"{name}: less peak activation memory (no target; measured)", value,
                   None if saved is None else (saved >= 0.40 and slower <= 0.35) if transformer else saved > 0)
    ctx.note("Checkpointed blocks: the GPT's blocks.N and ResNet-50's Bottleneck blocks (layerN.M), by the rule FSDP2 "
             "shards by. Peaks are torch.cuda.max_memory_allocated; without CUDA there is no memory figure.")


def checkpointing_policies(ctx: Context) -> None:
    """Section s (opt-in, issue 52): none, selective and full checkpointing on section h's GPT and ResNet-50, then
    (GPT) ``auto`` under a memory limit halfway between none's and full's measured peaks."""
    size, specs = _specs(ctx)
    device = ctx.device
    cuda = device.type == "cuda"
    ctx.table("bfloat16, create_amp_trainer, SGD; policies one after the other; activation memory as in section h; "
              "auto: checkpoint_to_fit(memory=limit, margin=0.05) before the trainer", _COLUMNS + ["chosen"])
    for name, spec in specs:
        measured = {}
        for on in (False, "selective", True) + (("auto",) if name.startswith("GPT") else ()):
            limit = None
            if on == "auto":
                if not cuda or measured.get(False, {}).get("peak_mb") is None or True not in measured:
                    ctx.row(model=name, checkpointing=on, status="skipped: needs CUDA (a limit from measured peaks)")
                    continue
                limit = (measured[False]["peak_mb"] + measured[True]["peak_mb"]) / 2
            if ctx.left() < 5:
                ctx.row(model=name, checkpointing=on, status=f"not run: {ctx.left():.0f} s left of the budget")
                continue
            r = measured[on] = _checkpointing_step(spec, on, size, device, limit)
            ctx.row(model=name, checkpointing=on, blocks=r["blocks"], step_ms=r["step_ms"],
                    peak_activation_mb=r["activation_mb"], peak_mb=r["peak_mb"], status="measured",
                    chosen=r.get("chosen", ""))
        plain, selective, full = (measured.get(k) for k in (False, "selective", True))
        value, ok = "", None
        if plain and selective and plain["activation_mb"]:
            saved = 1 - selective["activation_mb"] / plain["activation_mb"]
            slower = selective["step_ms"] / plain["step_ms"] - 1
            value = f"{saved * 100:.1f}% less activation memory, {slower * 100:+.1f}% step time"
            ok = (saved >= 0.40 and slower <= 0.15) if name.startswith("GPT") else saved > 0
        ctx.target(f"{name}: selective: >= 40% less peak activation memory for <= 15% more step time"
                   if name.startswith("GPT") else f"{name}: selective: less peak activation memory (no target)",
                   value, ok)
        if name.startswith("GPT"):
            auto = measured.get("auto")
            value, ok = "", None
            if auto and full and auto["peak_mb"] is not None:
                value = (f"peak {auto['peak_mb']:.0f} MB in a {auto['limit_mb']:.0f} MB limit, "
                         f"{auto['step_ms']:.0f} ms a step against full's {full['step_ms']:.0f} ms ({auto['chosen']})")
                ok = auto["peak_mb"] <= auto["limit_mb"] and auto["step_ms"] < full["step_ms"]
            ctx.target(f"{name}: auto in a limit halfway between none's and full's peaks fits and is faster than full",
                       value, ok)
    ctx.note("Selective keeps the outputs of ignite_amp.transforms.activation_checkpointing.SAVED_OPS (matmuls, "
             "convolutions, attention) and recomputes the rest. Without CUDA there is no memory figure and no auto "
             "row.")


def _checkpointing_step(spec: dict, on, size: dict, device: torch.device, limit_mb: Optional[float] = None) -> dict:
    """Median ms per step and peak memory of ``size['steps']`` bfloat16 steps, after the warm-up steps; ``on``:
    False, True, "selective", or "auto" (``checkpoint_to_fit`` in ``limit_mb``)."""
    gc.collect()
    free_memory(device)
    torch.manual_seed(0)
    model = spec["factory"]().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    chosen = {}
    if on == "auto":
        choice = checkpoint_to_fit(model, optimizer, cross_entropy, spec["batch"](), spec["batch_size"],
                                   memory=int(limit_mb * 2**20), margin=0.05, device=device, dtype="bfloat16")
        chosen = {"chosen": choice.line(), "limit_mb": limit_mb}
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype="bfloat16",
                                 activation_checkpointing=on if on != "auto" else False)
    batches = [spec["batch"]() for _ in range(size["warmup"] + size["steps"])]
    trainer.run(batches[:size["warmup"]], max_epochs=1)  # gradients and optimizer state exist from here on
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device) if cuda else None
    times = []
    for batch in batches[size["warmup"]:]:
        begin = time.perf_counter()
        trainer.run([batch], max_epochs=1)
        sync(device)
        times.append(time.perf_counter() - begin)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    blocks = checkpointed_blocks(model)
    del trainer, optimizer, model, batches
    return {**chosen, "step_ms": statistics.median(times) * 1e3, "blocks": len(blocks),
            "peak_mb": peak / 2**20 if cuda else None, "activation_mb": (peak - held) / 2**20 if cuda else None}
