"""A model with two inputs (an image and a row of tabular features), with training accuracy.

``model_fn`` unpacks the pair into the model's two arguments; ``output_transform`` hands
Ignite's metrics the full batch's predictions and targets (joined back when the batch is split
into micro-batches), so ``Accuracy`` attaches to the trainer itself. The data is synthetic: the
class is set by the brightest image channel and shifted by a tabular feature.

    python examples/two_inputs.py            # about 20 seconds on a 2-core CPU
    python examples/two_inputs.py --tiny     # a few seconds (what the tests run)
"""
import argparse

import torch
from ignite.engine import Events
from ignite.metrics import Accuracy
from torch import nn
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_evaluator, create_amp_trainer


class ImageAndTable(nn.Module):
    def __init__(self, features: int = 6, classes: int = 3):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.table = nn.Sequential(nn.Linear(features, 16), nn.ReLU())
        self.head = nn.Linear(32, classes)

    def forward(self, image: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.image(image), self.table(row)], dim=1))


def dataset(count: int, seed: int) -> list:
    """Samples ``((image, row), label)``: the model's two inputs as x, so the default prepare_batch takes them."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 3, 16, 16, generator=g)
    rows = torch.randn(count, 6, generator=g)
    labels = torch.randint(0, 3, (count,), generator=g)
    images[torch.arange(count), labels] += 0.4  # the class's channel is brighter
    rows[:, 0] += labels  # and the first feature hints at it
    return [((image, row), label) for image, row, label in zip(images, rows, labels, strict=True)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few seconds: the size the tests run")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    train = torch.utils.data.DataLoader(dataset(512 if args.tiny else 4096, seed=0), batch_size=64, shuffle=True)
    val = torch.utils.data.DataLoader(dataset(256, seed=1), batch_size=128)
    model = ImageAndTable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # The glue: the model takes x's two tensors; the metrics take the full batch's predictions.
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="auto", dtype="auto", micro_batches=2,
                                 model_fn=lambda model, x: model(*x),
                                 output_transform=lambda x, y, y_pred, loss: (y_pred, y))
    Accuracy().attach(trainer, "accuracy")  # training accuracy, over each epoch's full batches
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy()}, device="auto", dtype="auto",
                                     model_fn=lambda model, x: model(*x))
    history = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        val_accuracy = evaluator.run(val).metrics["accuracy"]
        history.append((engine.state.metrics["accuracy"], val_accuracy))
        print(f"epoch {engine.state.epoch}: train loss {trainer.amp_step.loss.item():.3f}  "
              f"train accuracy {engine.state.metrics['accuracy']:.3f}  val accuracy {val_accuracy:.3f}")

    trainer.run(train, max_epochs=3)
    return {"accuracy": history}


if __name__ == "__main__":
    main()
