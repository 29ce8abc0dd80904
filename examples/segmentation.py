"""Semantic segmentation with torchvision's LR-ASPP (dict outputs), mIoU, and float16 evaluation.

torchvision's segmentation models return ``{"out": N x C x H x W}``: the loss reads ``out["out"]``
and the evaluator hands every tensor of the dict back in float32 (a float16 forward's outputs
included), so metrics and the validation loss are computed in float32. The data is synthetic
(no download): squares (class 1) and disks (class 2) on a noisy background (class 0).

    python examples/segmentation.py           # a few minutes on a 2-core CPU, seconds on a GPU
    python examples/segmentation.py --tiny    # about 20 seconds (what the tests run)
"""
import argparse

import torch
from ignite.engine import Events
from ignite.metrics import ConfusionMatrix, Loss, mIoU
from torch.nn.functional import cross_entropy
from torchvision.models.segmentation import lraspp_mobilenet_v3_large

from ignite_amp import create_amp_evaluator, create_amp_trainer

CLASSES = 3


def shapes(count: int, size: int, seed: int) -> torch.utils.data.TensorDataset:
    """Images with one square and one disk each, and their per-pixel class masks."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 3, size, size, generator=g) * 0.3
    masks = torch.zeros(count, size, size, dtype=torch.long)
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i in range(count):
        r, c, half = (int(v) for v in torch.randint(size // 8, size // 2, (3,), generator=g))
        square = (rows - r).abs().le(half // 2) & (cols - c).abs().le(half // 2)
        r, c = (int(v) for v in torch.randint(size // 2, size - size // 8, (2,), generator=g))
        disk = ((rows - r) ** 2 + (cols - c) ** 2) <= (size // 6) ** 2
        for cls, region in ((1, square), (2, disk)):
            masks[i][region] = cls
            images[i][:, region] += torch.rand(3, 1, generator=g) * 0.5 + 0.3
    return torch.utils.data.TensorDataset(images, masks)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="about 20 seconds: the size the tests run")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    size = 64
    train = torch.utils.data.DataLoader(shapes(64 if args.tiny else 1024, size, seed=0), batch_size=16, shuffle=True)
    val = torch.utils.data.DataLoader(shapes(32 if args.tiny else 256, size, seed=1), batch_size=16)
    model = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    trainer = create_amp_trainer(model, optimizer, lambda out, y: cross_entropy(out["out"], y), device="auto",
                                 dtype="auto")
    confusion = ConfusionMatrix(CLASSES)
    evaluator = create_amp_evaluator(model, {"miou": mIoU(confusion), "loss": Loss(cross_entropy)}, device="auto",
                                     dtype="float16", model_transform=lambda out: out["out"])
    history = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        metrics = evaluator.run(val).metrics
        history.append(metrics)
        print(f"epoch {engine.state.epoch}: train loss {trainer.amp_step.loss.item():.3f}  "
              f"val loss {metrics['loss']:.3f}  val mIoU {metrics['miou']:.3f}  (float16 evaluation, "
              f"outputs {evaluator.state.output[0].dtype})")

    trainer.run(train, max_epochs=2 if args.tiny else 10)
    return {"history": history, "output_dtype": evaluator.state.output[0].dtype}


if __name__ == "__main__":
    main()
