"""A character-level transformer language model, trained with ignite-amp.

The text is the Zen of Python (it ships with every Python: ``import this``). Each batch holds
windows of random length, padded: labels of padding are -100, so the loss is a mean over real
tokens. ``num_items`` counts them, which keeps the gradient the exact token mean of the whole
batch however it is cut into micro-batches and accumulation steps. bfloat16 autocast, a cosine
schedule stepped per optimizer step, and the best checkpoint kept by validation loss.

    python examples/char_lm.py                 # about a minute on a 2-core CPU
    python examples/char_lm.py --tiny          # a few seconds (what the tests run)
"""
import argparse
import codecs
import contextlib
import io
import math

import torch
from ignite.engine import Events
from ignite.metrics import Loss
from torch import nn
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_evaluator, create_amp_trainer
from ignite_amp.handlers import BestCheckpoint, GradientClipping, StepSchedule

with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
    import this
TEXT = codecs.decode(this.s, "rot13")
VOCAB = sorted(set(TEXT))
CODES = torch.tensor([VOCAB.index(c) for c in TEXT])


def windows(count: int, length: int, seed: int) -> list:
    """``count`` padded samples: input ids and next-character labels, -100 past each window's random length."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        start = int(torch.randint(0, len(CODES) - length - 1, (1,), generator=g))
        keep = int(torch.randint(length // 4, length + 1, (1,), generator=g))
        ids = CODES[start:start + length].clone()
        labels = CODES[start + 1:start + length + 1].clone()
        labels[keep:] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return samples


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4, length: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(length, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=input_ids.device)
        h = self.blocks(self.embed(input_ids) + self.position[:n], mask=causal, is_causal=True)
        return self.head(h)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens (padding is -100)."""
    return cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few seconds: the size the tests run")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--output-dir", default="runs/char_lm")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    length, batch = (32, 16) if args.tiny else (64, 32)
    epochs = args.epochs or (2 if args.tiny else 8)
    train = torch.utils.data.DataLoader(windows(128 if args.tiny else 1024, length, seed=0), batch_size=batch,
                                        shuffle=True)
    val = torch.utils.data.DataLoader(windows(32 if args.tiny else 128, length, seed=1), batch_size=64)

    model = CharTransformer(len(VOCAB), dim=32 if args.tiny else 64, length=length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    steps = epochs * math.ceil(len(train) / 2)  # one optimizer step per 2 iterations (accumulation)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    trainer = create_amp_trainer(
        model, optimizer, lambda logits, labels: token_loss(logits, labels), device="auto", dtype="bfloat16",
        micro_batches=2, accumulation_steps=2,
        prepare_batch=lambda b, device, nb: (b["input_ids"].to(device), b["labels"].to(device)),
        num_items=lambda x, y: (y != -100).sum(),  # the loss is a mean over these: weigh chunks by them
    )
    evaluator = create_amp_evaluator(
        model, {"loss": Loss(cross_entropy)}, device="auto", dtype="bfloat16",
        prepare_batch=lambda b, device, nb: (b["input_ids"].to(device), b["labels"].to(device)),
        # Ignite's Loss weighs each batch by len(y): give it the real tokens only, so it is the token mean.
        output_transform=lambda x, y, y_pred: (y_pred[y != -100], y[y != -100]),
    )
    GradientClipping(max_norm=1.0).attach(trainer)
    StepSchedule(schedule).attach(trainer)  # optimizer step k uses the schedule's value k
    best = BestCheckpoint(f"{args.output_dir}/checkpoints", {"model": model, "optimizer": optimizer}, metric="loss")
    history = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        val_loss = evaluator.run(val).metrics["loss"]
        history.append(val_loss)
        print(f"epoch {engine.state.epoch}: train loss {trainer.amp_step.loss.item():.3f}  val loss {val_loss:.3f}  "
              f"perplexity {math.exp(val_loss):.1f}  lr {schedule.get_last_lr()[0]:.2e}")

    best.attach(trainer, evaluator)  # after validate: it ranks the evaluation validate just ran
    trainer.run(train, max_epochs=epochs)
    print(f"best val loss {min(history):.3f} (first epoch {history[0]:.3f}; a uniform guess is "
          f"{math.log(len(VOCAB)):.3f})")
    return {"val_loss": history}


if __name__ == "__main__":
    main()
