"""data.on_device (issue 51): batches cut from tensors on the device, a drop-in for the DataLoader path.

On a CPU ``on_device: true`` runs the same code on host tensors: the batches are compared with the DataLoader
path's (same samples, order, normalisation and last batch), the augmentation against every crop and flip of
each sample's source; the GPU test compares the batches on CUDA with the host path's."""
import math
import os

import pytest
import torch
from ignite.engine import Events
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader

import ignite_amp.data.device_batches as device_batches
from helpers import OOMAbove, assert_doctests_pass, tiny_config
from ignite_amp import create_amp_trainer
from ignite_amp.config.tree import ConfigError, load_config
from ignite_amp.data.datasets import (
    DataConfig,
    EpochShuffleSampler,
    LockstepBatches,
    ShuffleShardSampler,
    TensorImageDataset,
    build_datasets,
    build_loaders,
    data_on_device,
    make_loader,
)
from ignite_amp.data.device_batches import AUGMENT_SEED_OFFSET, DeviceBatches, choose_on_device, crop_and_flip
from ignite_amp.data.passes import PassStream
from ignite_amp.handlers import OOMBackoff

CPU = torch.device("cpu")
GiB = 2**30


def shapes(train_size=50, augment=False, name="shapes"):
    cfg = load_config({"data": {"name": name, "train_size": train_size, "val_size": 21, "image_size": 12,
                                "augment": augment}})
    return build_datasets(cfg.data, 10, seed=0)


def batches(loader, epoch=None):
    if epoch is not None:
        loader.sampler.set_epoch(epoch)
    return [(x.clone(), y.clone()) for x, y in loader]


def assert_same(got, expected):
    assert len(got) == len(expected)
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(y, ey) and torch.equal(x, ex) and x.dtype == ex.dtype == torch.float32


def test_the_docstring_examples_run():
    assert_doctests_pass(device_batches)


@pytest.mark.parametrize("train_size, no_single_last", [(50, False), (49, True), (48, True)])
def test_training_batches_equal_the_dataloaders_over_two_epochs(train_size, no_single_last):
    """50 = 6 x 8 + 2 (a short last batch kept), 49 (a last batch of 1 left out), 48 (whole batches)."""
    train, _, _ = shapes(train_size)
    host = make_loader(train, 8, True, 0, CPU, seed=3, no_single_last=no_single_last)
    device = make_loader(train, 8, True, 0, CPU, seed=3, no_single_last=no_single_last, on_device=True)
    assert isinstance(device, DeviceBatches) and isinstance(host, DataLoader)
    assert (len(device), device.batch_size, device.drop_last, device.num_workers, device.pin_memory) == \
        (len(host), host.batch_size, host.drop_last, 0, False)
    assert device.dataset is train and type(device.sampler) is type(host.sampler)
    first = batches(device, 1)
    assert_same(first, batches(host, 1))
    assert_same(batches(device, 2), batches(host, 2))
    assert not torch.equal(first[0][1], batches(device, 2)[0][1])  # another order each epoch
    assert_same(batches(device, 1), first)  # restarts: the same epoch again is the same batches


def test_validation_batches_equal_the_dataloaders():
    _, val, _ = shapes()
    host = make_loader(val, 8, False, 0, CPU)
    device = make_loader(val, 8, False, 0, CPU, on_device=True)
    assert len(device) == len(host) == 3
    assert_same(batches(device), batches(host))


@pytest.mark.parametrize("world", [2, 3])
def test_each_ranks_share_equals_the_dataloaders(world):
    """The samplers of a distributed run, made for each rank here: shuffled shards, even and lockstep validation."""
    train, val, _ = shapes(50)
    for rank in range(world):
        sampler = ShuffleShardSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=5)
        host = DataLoader(train, batch_size=4, sampler=sampler, drop_last=True)
        device = DeviceBatches(train, 4, sampler, drop_last=True)
        assert len(device) == len(host)
        assert_same(batches(device, 2), batches(host, 2))
        lockstep = LockstepBatches(val, 4, num_replicas=world, rank=rank)
        assert_same(batches(DeviceBatches(val, batch_sampler=lockstep)),
                    batches(DataLoader(val, batch_sampler=lockstep)))


def test_a_pass_started_inside_equals_the_host_paths():
    """PassStream's resume: the sampler leaves out the first batches of the pass; train.epoch_length streams."""
    train, _, _ = shapes(50, augment=True)
    stream = PassStream(DeviceBatches(train, 8, EpochShuffleSampler(len(train), 1)), lambda: 9)  # pass 2, batch 3
    whole = DeviceBatches(train, 8, EpochShuffleSampler(len(train), 1))
    expected = batches(whole, 2)[2:] + batches(whole, 3)[:2]
    got = [b for _, b in zip(range(len(expected)), stream, strict=False)]  # (the stream goes on)
    assert_same(got, expected)  # the augmentation too: drawn per sample, whatever the start


def candidates(image: torch.Tensor) -> torch.Tensor:
    """Every 4-pixel padded crop (9 x 9 offsets) of a uint8 image, unflipped and flipped: (162, C, H, W)."""
    c, h, w = image.shape
    padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
    crops = torch.stack([padded[:, t:t + h, left:left + w] for t in range(9) for left in range(9)])
    return torch.cat([crops, crops.flip(-1)])


def test_augmented_batches_are_crops_and_flips_of_the_same_samples_in_the_same_order():
    train, _, _ = shapes(50, augment=True)
    host = make_loader(train, 8, True, 0, CPU, seed=3)
    device = make_loader(train, 8, True, 0, CPU, seed=3, on_device=True)
    got = batches(device, 1)
    labels = [y for _, y in batches(host, 1)]
    assert all(torch.equal(y, expected) for (_, y), expected in zip(got, labels, strict=True))
    order = list(device.sampler)
    xs = torch.cat([x for x, _ in got])
    flips = 0
    for position, index in enumerate(order):
        options = (candidates(train.images[index]).float() - train.mean) / train.std
        matches = [i for i in range(len(options)) if torch.equal(options[i], xs[position])]
        assert matches, f"sample {index} is not a crop or flip of its image"
        flips += all(i >= 81 for i in matches)
    assert 0 < flips < len(order)  # some flipped, some not
    assert_same(batches(make_loader(train, 8, True, 0, CPU, seed=3, on_device=True), 1), got)  # reproducible
    assert not torch.equal(torch.cat([x for x, _ in batches(device, 2)]).sort(0).values, xs.sort(0).values)


def test_the_augmentation_draws_follow_the_seed_and_the_epoch():
    offsets, flips = device_batches.augment_draws(100, seed=0, epoch=1)
    assert offsets.min() >= 0 and offsets.max() <= 8 and flips.dtype == torch.bool
    assert torch.equal(offsets, device_batches.augment_draws(100, 0, 1)[0])
    assert not torch.equal(offsets, device_batches.augment_draws(100, 0, 2)[0])
    assert not torch.equal(offsets, device_batches.augment_draws(100, 1, 1)[0])
    assert AUGMENT_SEED_OFFSET > 2**31  # apart from the shuffle's seed + epoch


def test_crop_and_flip_matches_the_host_recipe_per_sample():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 5, 7), dtype=torch.uint8, generator=g)
    offsets, flips = torch.randint(0, 9, (6, 2), generator=g), torch.tensor([True, False] * 3)
    got = crop_and_flip(images, offsets, flips)
    for i in range(6):
        padded = torch.nn.functional.pad(images[i], (4, 4, 4, 4))
        crop = padded[:, offsets[i, 0]:offsets[i, 0] + 5, offsets[i, 1]:offsets[i, 1] + 7]
        assert torch.equal(got[i], crop.flip(-1) if flips[i] else crop)


def test_the_auto_rule():
    small, big = 184 * 2**20, 5 * GiB
    assert choose_on_device("auto", "cpu", True, small, 0) == (False, "auto: CUDA only")
    assert choose_on_device("auto", "cuda", True, small, 80 * GiB) == (True, "auto: 184 MB of images")
    assert choose_on_device("auto", "cuda", True, small, 8 * GiB).on  # 5% of 8 GiB: 410 MB
    assert choose_on_device("auto", "cuda", True, small, 2 * GiB) == (False, "auto: 184 MB of images, over 102 MB")
    assert choose_on_device("auto", "cuda", True, big, 141 * GiB) == (False, "auto: 5120 MB of images, over 2048 MB")
    assert choose_on_device("auto", "cuda", False, 0, 80 * GiB) == (False, "auto: read from files")
    assert choose_on_device(True, "cpu", True, big, 0) == (True, "")
    assert choose_on_device(False, "cuda", True, small, 80 * GiB) == (False, "")


def test_the_rule_reads_the_images_bytes_and_the_device(monkeypatch):
    train, val, _ = shapes(50)
    data = DataConfig(on_device="auto")
    assert data_on_device(data, CPU, (train, val)) == (False, "auto: CUDA only")
    import ignite_amp.data.datasets as datasets

    monkeypatch.setattr(datasets, "device_memory", lambda device: 80 * GiB)
    assert data_on_device(data, torch.device("cuda"), (train, val)) == (True, "auto: 0 MB of images")
    monkeypatch.setattr(datasets, "device_memory", lambda device: 1000)
    assert not data_on_device(data, torch.device("cuda"), (train, val)).on
    files = torch.utils.data.TensorDataset(torch.zeros(2))  # not held as uint8 images (imagefolder reads files)
    assert data_on_device(data, torch.device("cuda"), (files,)) == (False, "auto: read from files")


def test_true_with_imagefolder_is_one_line():
    with pytest.raises(ConfigError, match=r"^data.on_device: true needs a data set held in memory .*imagefolder"):
        load_config({"data": {"name": "imagefolder", "on_device": True}})
    assert load_config({"data": {"name": "imagefolder", "on_device": "auto"}}).data.on_device == "auto"
    with pytest.raises(ConfigError, match="data.on_device"):
        load_config({"data": {"on_device": "yes"}})


def test_the_cpu_default_keeps_the_dataloader():
    cfg = load_config({"data": {"train_size": 16, "val_size": 8, "image_size": 8, "num_workers": 0}})
    train, val, _ = build_loaders(cfg.data, 10, CPU)
    assert isinstance(train, DataLoader) and isinstance(val, DataLoader)


@pytest.mark.slow
def test_a_config_run_with_data_on_the_device_trains(tmp_path):
    from ignite_amp.run.compose import build_run

    printed = []
    cfg = tiny_config(tmp_path, data={"on_device": True, "augment": True, "num_workers": "auto"}, train={"epochs": 2})
    run = build_run(cfg, print_fn=printed.append)
    assert isinstance(run.train_loader, DeviceBatches) and isinstance(run.val_loader, DeviceBatches)
    result = run.train()
    (start,) = [line for line in printed if line.startswith("training u on cpu")]
    assert "loader worker" not in start  # on a CPU the start line names workers only when there are some
    assert "0 loader workers (data on the cpu)" in open(os.path.join(cfg["output_dir"], "train.log")).read()
    assert run.facts["data_on_device"] is True and run.facts["num_workers"] == 0
    assert [h["epoch"] for h in result["history"]] == [1, 2]
    assert all(math.isfinite(h["train_loss"]) and math.isfinite(h["val_loss"]) and 0 <= h["val_accuracy"] <= 1
               for h in result["history"])


def test_oom_backoff_mode_batch_resizes_the_device_loader():
    """As tests/handlers/test_oom_backoff.py's DataLoader case: batches of 8 over a model that fits 4; each
    sample's first pixel is its id, so every sample is seen once an epoch."""
    images = torch.zeros(24, 5, 1, 1, dtype=torch.uint8)
    images[:, 0, 0, 0] = torch.arange(24, dtype=torch.uint8)
    dataset = TensorImageDataset(images, torch.randint(0, 3, (24,)), (0.0,) * 5, (1 / 255,) * 5)
    loader = DeviceBatches(dataset, 8, EpochShuffleSampler(24, 0))
    torch.manual_seed(0)
    stand_in = OOMAbove(limit=4)
    trainer = create_amp_trainer(nn.Sequential(nn.Flatten(), stand_in), torch.optim.SGD(stand_in.parameters(), lr=0.1),
                                 cross_entropy, device="cpu", dtype="float32", check_split=False)
    backoff = OOMBackoff(mode="batch")
    backoff.attach(trainer)
    seen, sizes = [], []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: e.state.dataloader.sampler.set_epoch(e.state.epoch))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: sizes.append(e.amp_step.batch_size))
    trainer.add_event_handler(Events.EPOCH_COMPLETED,
                              lambda e: seen.append(sorted(stand_in.seen)) or stand_in.seen.clear())
    trainer.run(loader, max_epochs=3)
    assert seen == [list(range(24))] * 3
    assert sizes == [8] * 3 + [4] * 6 + [4] * 6
    resized = trainer.state.dataloader
    assert isinstance(resized, DeviceBatches) and resized.batch_size == 4 and resized.sampler is loader.sampler
    assert resized._tensors is loader._tensors  # no second copy on the device


def test_bad_arguments():
    train, val, _ = shapes(50)
    with pytest.raises(ValueError, match="a batch_size or a batch_sampler"):
        DeviceBatches(train)
    with pytest.raises(ValueError, match="takes no sampler and no drop_last"):
        DeviceBatches(val, batch_sampler=LockstepBatches(val, 4, 2, 0), drop_last=True)
    with pytest.raises(ValueError, match="its batches come from a batch_sampler"):
        DeviceBatches(val, batch_sampler=LockstepBatches(val, 4, 2, 0)).with_batch_size(2)
    for size in (0, -1, 2.0, True):  # 0 was ZeroDivisionError in len(), at the first epoch
        with pytest.raises(ValueError, match=f"^Argument batch_size should be a positive integer, got {size!r}.$"):
            DeviceBatches(train, size)
    with pytest.raises(ValueError, match="^Argument batch_size should be a positive integer, got 0.$"):
        DeviceBatches(train, 4).with_batch_size(0)


@pytest.mark.gpu
@pytest.mark.parametrize("augment", [False, True])
def test_gpu_batches_are_on_the_gpu_and_equal_the_host_paths(augment):
    """On CUDA: the batches live on the GPU; without augmentation they equal the DataLoader's exactly, with it the
    device loader on a CPU (same draws: they are made on the CPU)."""
    cuda = torch.device("cuda")
    train, val, _ = shapes(50, augment=augment)
    device = make_loader(train, 8, True, 0, cuda, seed=3, on_device=True)
    reference = make_loader(train, 8, True, 0, CPU, seed=3, on_device=augment)
    for epoch in (1, 2):
        got, expected = batches(device, epoch), batches(reference, epoch)
        assert all(x.device.type == "cuda" and y.device.type == "cuda" for x, y in got)
        assert_same([(x.cpu(), y.cpu()) for x, y in got], expected)
    val_batches = batches(make_loader(val, 8, False, 0, cuda, on_device=True))
    assert_same([(x.cpu(), y.cpu()) for x, y in val_batches], batches(make_loader(val, 8, False, 0, CPU)))
