import os
import pickle

import numpy as np
import pytest
import torch

from ignite_amp.config.tree import ConfigError, load_config
from ignite_amp.data.datasets import SHAPE_CLASSES, build_datasets, build_loaders, make_shapes, read_cifar


def write_cifar10(root, per_batch=6, seed=0, key=str):
    """Write CIFAR-10 in its on-disk layout: one pickled dict per batch file, plus batches.meta.

    The real files are Python 2 pickles whose keys load as str under latin1 (as torchvision
    reads them) and as bytes under encoding="bytes"; ``key`` picks which form to write.
    """
    k = (lambda s: s.encode()) if key is bytes else (lambda s: s)
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {k("batch_label"): name, k("labels"): rng.integers(0, 10, per_batch).tolist(),
                 k("data"): rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 k("filenames"): [f"{name}_{i}.png" for i in range(per_batch)]}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(entry, f, protocol=2)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({k("label_names"): names, k("num_cases_per_batch"): per_batch, k("num_vis"): 3072}, f,
                    protocol=2)


def write_cifar100(root, n=10, seed=0):
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-100-python")
    os.makedirs(folder)
    for name in ("train", "test"):
        entry = {b"filenames": [b"x.png"] * n, b"batch_label": name.encode(),
                 b"fine_labels": rng.integers(0, 100, n).tolist(), b"coarse_labels": rng.integers(0, 20, n).tolist(),
                 b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(entry, f, protocol=2)
    with open(os.path.join(folder, "meta"), "wb") as f:
        pickle.dump({b"fine_label_names": [f"c{i}".encode() for i in range(100)],
                     b"coarse_label_names": [f"s{i}".encode() for i in range(20)]}, f, protocol=2)


def test_shapes_is_deterministic_balanced_and_varied():
    x1, y1 = make_shapes(500, 32, seed=3)
    x2, y2 = make_shapes(500, 32, seed=3)
    x3, _ = make_shapes(500, 32, seed=4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert x1.dtype == torch.uint8 and x1.shape == (500, 3, 32, 32)
    counts = torch.bincount(y1, minlength=len(SHAPE_CLASSES))
    assert counts.min() > 25  # every class present in roughly equal numbers
    assert x1.float().std() > 20


def test_cifar10_reader_accepts_bytes_keys(tmp_path):
    write_cifar10(str(tmp_path), key=bytes)
    images, labels, classes = read_cifar(str(tmp_path), train=False)
    assert images.shape == (6, 3, 32, 32) and len(labels) == 6 and classes[-1] == "truck"


def test_cifar10_reader_matches_torchvision(tmp_path, monkeypatch):
    write_cifar10(str(tmp_path))
    images, labels, classes = read_cifar(str(tmp_path), train=True)
    assert images.shape == (30, 3, 32, 32) and classes[0] == "airplane"
    # torchvision reads the same files the same way (its md5 check switched off: the files are ours).
    from torchvision.datasets import CIFAR10, cifar

    monkeypatch.setattr(CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(cifar, "check_integrity", lambda *a, **k: True)
    tv = CIFAR10(str(tmp_path), train=True, download=False)
    assert torch.equal(images, torch.as_tensor(tv.data).permute(0, 3, 1, 2))
    assert labels.tolist() == tv.targets and classes == tv.classes


def test_cifar_loaders(tmp_path):
    write_cifar10(str(tmp_path))
    cfg = load_config({"data": {"name": "cifar10", "root": str(tmp_path), "batch_size": 4, "num_workers": 0,
                                "augment": True}})
    train, val, n = build_loaders(cfg.data, 10, torch.device("cpu"))
    x, y = next(iter(train))
    assert n == 10 and x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(train.dataset) == 30 and len(val.dataset) == 6


def test_cifar100(tmp_path):
    write_cifar100(str(tmp_path))
    data = load_config({"data": {"name": "cifar100", "root": str(tmp_path)}}).data
    train, val, n = build_datasets(data, 100)
    assert n == 100 and len(train) == 10 and train[0][0].shape == (3, 32, 32)


def test_missing_or_corrupt_cifar_is_one_line(tmp_path):
    data = load_config({"data": {"name": "cifar10", "root": str(tmp_path)}}).data
    with pytest.raises(ConfigError, match="data.root: .*data_batch_1 is missing .*download"):
        build_datasets(data, 10)
    write_cifar10(str(tmp_path))
    with open(os.path.join(tmp_path, "cifar-10-batches-py", "data_batch_2"), "wb") as f:
        f.write(b"\x80\x02garbage")
    with pytest.raises(ConfigError, match="data_batch_2 is not a CIFAR batch file"):
        build_datasets(data, 10)


def test_imagefolder(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for label, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
            os.makedirs(tmp_path / split / label)
            for i in range(3):
                Image.new("RGB", (40, 30), colour).save(tmp_path / split / label / f"{i}.png")
    data = load_config({"data": {"name": "imagefolder", "root": str(tmp_path), "image_size": 16,
                                 "augment": True}}).data
    train, val, n = build_datasets(data, 2)
    assert n == 2 and len(train) == 6 and train[0][0].shape == (3, 16, 16)
    assert val.classes == ["blue", "red"]
    with pytest.raises(ConfigError, match="expects root/train and root/val"):
        build_datasets(data.replace(root=str(tmp_path / "train")), 2)


def test_fake_data_follows_num_classes():
    data = load_config({"data": {"name": "fake", "train_size": 20, "val_size": 10, "image_size": 8}}).data
    train, val, n = build_datasets(data, 7)
    assert n == 7 and len(train) == 20 and train[0][0].shape == (3, 8, 8)
