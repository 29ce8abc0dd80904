"""An Ignite MNIST script ported to ignite-amp by one line: its import.

Written as Ignite's MNIST examples are (``create_supervised_trainer`` / ``create_supervised_evaluator``,
``RunningAverage`` and ``ProgressBar`` on the trainer, ``Accuracy`` and ``Loss`` on the evaluator,
``ModelCheckpoint`` of the best accuracy, ``EarlyStopping``, a ``Checkpoint`` of the trainer to resume
from), on built-in synthetic digits (nothing downloads). The line marked "the port" is the only one
that differs from the Ignite version: put ``ignite.engine`` back in it and the script runs on
Ignite's own factories (``tests/step/test_ignite_parity.py`` runs both).

    python examples/ignite_mnist.py                    # 4 epochs of 8192 images, val accuracy 1.00 by the 3rd
    python examples/ignite_mnist.py --tiny             # a few seconds (what the tests run)
    python examples/ignite_mnist.py --epochs 6 --resume_from runs/ignite_mnist/training_checkpoint_512.pt
"""
import os
from argparse import ArgumentParser

import ignite.distributed as idist
import torch
import torch.nn.functional as F
from ignite.handlers import Checkpoint, DiskSaver, EarlyStopping, ModelCheckpoint, ProgressBar
from ignite.metrics import Accuracy, Loss, RunningAverage
from torch import nn
from torch.optim import SGD
from torch.utils.data import DataLoader, TensorDataset

from ignite_amp.engine import Events, create_supervised_evaluator, create_supervised_trainer  # the port


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=-1)


def digits(count, seed):
    """MNIST-shaped synthetic digits: 28x28 grey images, class k a bright 7x7 block at its own place, plus noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=g)
    images = 0.5 * torch.randn(count, 1, 28, 28, generator=g)
    for i, k in enumerate(labels.tolist()):
        row, col = 7 * (k // 4), 7 * (k % 4)
        images[i, 0, row:row + 7, col:col + 7] += 1.0
    return TensorDataset(images, labels)


def get_data_loaders(train_size, train_batch_size, val_batch_size):
    train_loader = DataLoader(digits(train_size, seed=0), batch_size=train_batch_size, shuffle=True)
    val_loader = DataLoader(digits(max(train_size // 4, 128), seed=1), batch_size=val_batch_size, shuffle=False)
    return train_loader, val_loader


def run(train_size, train_batch_size, val_batch_size, epochs, lr, momentum, log_interval, output_dir, resume_from):
    train_loader, val_loader = get_data_loaders(train_size, train_batch_size, val_batch_size)
    model = Net()
    device = idist.device()
    model.to(device)  # move the model before creating the optimizer
    optimizer = SGD(model.parameters(), lr=lr, momentum=momentum)
    criterion = nn.NLLLoss()
    trainer = create_supervised_trainer(model, optimizer, criterion, device=device)
    val_metrics = {"accuracy": Accuracy(), "nll": Loss(criterion)}
    evaluator = create_supervised_evaluator(model, metrics=val_metrics, device=device)

    RunningAverage(output_transform=lambda x: x).attach(trainer, "loss")
    ProgressBar(persist=False).attach(trainer, metric_names=["loss"])
    history = []

    @trainer.on(Events.ITERATION_COMPLETED(every=log_interval))
    def log_training_loss(engine):
        print(f"Epoch[{engine.state.epoch}] Iteration[{engine.state.iteration}] Loss: {engine.state.output:.2f}")

    @trainer.on(Events.EPOCH_COMPLETED)
    def log_validation_results(engine):
        evaluator.run(val_loader)
        metrics = evaluator.state.metrics
        history.append(metrics["accuracy"])
        print(f"Validation Results - Epoch: {engine.state.epoch} "
              f"Avg accuracy: {metrics['accuracy']:.2f} Avg loss: {metrics['nll']:.2f}")

    def score_function(engine):
        return engine.state.metrics["accuracy"]

    best = ModelCheckpoint(output_dir, n_saved=1, filename_prefix="best", score_function=score_function,
                           score_name="accuracy", require_empty=False)
    evaluator.add_event_handler(Events.COMPLETED, best, {"model": model})
    evaluator.add_event_handler(Events.COMPLETED, EarlyStopping(patience=3, score_function=score_function,
                                                                trainer=trainer))

    to_save = {"trainer": trainer, "model": model, "optimizer": optimizer}
    saver = Checkpoint(to_save, DiskSaver(output_dir, require_empty=False), n_saved=1, filename_prefix="training")
    trainer.add_event_handler(Events.EPOCH_COMPLETED, saver)
    if resume_from:
        Checkpoint.load_objects(to_load=to_save, checkpoint=torch.load(resume_from, weights_only=False))

    trainer.run(train_loader, max_epochs=epochs)
    return {"accuracy": history, "epoch": trainer.state.epoch, "iteration": trainer.state.iteration,
            "checkpoints": sorted(os.listdir(output_dir))}


def main(argv=None):
    parser = ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="128 training images: a few seconds")
    parser.add_argument("--batch_size", type=int, default=64, help="input batch size for training (default: 64)")
    parser.add_argument("--val_batch_size", type=int, default=256, help="input batch size for validation")
    parser.add_argument("--epochs", type=int, default=4, help="number of epochs to train (default: 4)")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
    parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum (default: 0.5)")
    parser.add_argument("--log_interval", type=int, default=10, help="batches between two training loss lines")
    parser.add_argument("--output_dir", default="runs/ignite_mnist", help="checkpoints go here")
    parser.add_argument("--resume_from", default=None, help="a training checkpoint to resume from")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    return run(128 if args.tiny else 8192, args.batch_size, args.val_batch_size, args.epochs, args.lr, args.momentum,
               args.log_interval, args.output_dir, args.resume_from)


if __name__ == "__main__":
    main()
