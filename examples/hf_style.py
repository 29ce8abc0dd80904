"""A Hugging Face-style model: dict batches in, its own loss out, no wrapper module.

The model follows the ``transformers`` convention (keyword inputs ``input_ids``,
``attention_mask``, ``labels``; an output with ``.loss`` and ``.logits``), so the same glue
serves a real ``AutoModelForSequenceClassification``: the default ``prepare_batch`` moves a dict
batch to the device as ``x`` (``y`` is None), ``model_fn`` calls ``model(**x)``, and ``loss_fn``
takes the model's own loss. The task (synthetic, no download): does a padded sequence hold
token 1?

    python examples/hf_style.py              # about 20 seconds on a 2-core CPU
    python examples/hf_style.py --tiny       # a few seconds (what the tests run)
"""
import argparse

import torch
from ignite.engine import Events
from ignite.metrics import Accuracy
from torch import nn
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_evaluator, create_amp_trainer


class Output(dict):
    """What ``transformers`` models return: a dict whose keys are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class TinySequenceClassifier(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 32, num_labels: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask, labels=None) -> Output:
        h = self.mix(self.embed(input_ids))
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1)  # mean over real tokens
        logits = self.classifier(torch.relu(pooled * 4))
        out = Output(logits=logits)
        if labels is not None:
            out["loss"] = cross_entropy(logits, labels)
        return out


def dataset(count: int, seed: int, vocab: int = 32, length: int = 24) -> list:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        n = int(torch.randint(4, length + 1, (1,), generator=g))
        ids = torch.randint(2, vocab, (length,), generator=g)
        label = int(torch.rand((), generator=g) < 0.5)
        if label:
            ids[int(torch.randint(0, n, (1,), generator=g))] = 1
        ids[n:] = 0  # padding
        samples.append({"input_ids": ids, "attention_mask": (torch.arange(length) < n).long(),
                        "labels": torch.tensor(label)})
    return samples


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few seconds: the size the tests run")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    train = torch.utils.data.DataLoader(dataset(512 if args.tiny else 4096, seed=0), batch_size=32, shuffle=True)
    val = torch.utils.data.DataLoader(dataset(256, seed=1), batch_size=128)
    model = TinySequenceClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # The glue: two lines, as with a real transformers model.
    trainer = create_amp_trainer(model, optimizer, loss_fn=lambda out, y: out.loss, device="auto", dtype="auto",
                                 model_fn=lambda model, x: model(**x), micro_batches=2)
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy()}, device="auto", dtype="auto",
                                     model_fn=lambda model, x: model(**x),
                                     output_transform=lambda x, y, out: (out.logits, x["labels"]))
    history = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        accuracy = evaluator.run(val).metrics["accuracy"]
        history.append(accuracy)
        print(f"epoch {engine.state.epoch}: train loss {trainer.amp_step.loss.item():.3f}  val accuracy {accuracy:.3f}")

    trainer.run(train, max_epochs=3)
    return {"val_accuracy": history}


if __name__ == "__main__":
    main()
