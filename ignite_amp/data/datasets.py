"""Data sets and loaders: the built-in ``shapes`` set, CIFAR-10/100, ImageFolder and ``fake`` (the samplers:
``samplers``).

``shapes`` is generated from a seed (no download): ten classes of simple figures (disk,
ring, square, frame, triangle, diamond, plus, cross, bars) at random places, sizes and
colours, with noise. It is learnable in a few CPU epochs, so the quickstart runs anywhere.
"""
import dataclasses
import logging
import os
import pickle
from typing import Any, Literal, Optional, Sequence, Tuple, Union, cast

import ignite.distributed as idist
import torch
from torch.utils.data import DataLoader, Dataset

from ignite_amp.core.collectives import adopt_ignite_loggers, global_batch, per_process
from ignite_amp.core.config_keys import FIXED, FIXED_UNDER_SCHEDULE, Boolean, Choice, Integer, Text, setting
from ignite_amp.core.config_values import Section, section_of
from ignite_amp.data.device_batches import DeviceBatches, OnDeviceChoice, choose_on_device, device_memory
from ignite_amp.data.image_folder import ImageReadError, check_images, image_folder, read_image  # noqa: F401
from ignite_amp.data.samplers import EpochShuffleSampler, EvenShardSampler, LockstepBatches, ShuffleShardSampler
from ignite_amp.data.workers import WorkersChoice, choose_num_workers, usable_cores
from ignite_amp.errors import ConfigError

__all__ = ["DataConfig", "EpochShuffleSampler", "ShuffleShardSampler", "EvenShardSampler", "ImageReadError",
           "read_image", "TensorImageDataset", "make_shapes", "read_cifar", "build_datasets", "build_loaders",
           "data_workers", "data_on_device", "SHAPE_CLASSES", "train_samples"]

logger = logging.getLogger("ignite_amp")

SHAPE_CLASSES = ("disk", "ring", "square", "frame", "triangle", "diamond", "plus", "cross", "hbar", "vbar")
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True, eq=False)
class DataConfig(Section):
    """data: the training and validation sets and their loaders."""

    name: str = setting("shapes", Choice("shapes", "cifar10", "cifar100", "imagefolder", "fake"),
                        "shapes (built in, no download), cifar10, cifar100, imagefolder or fake", FIXED)
    root: str = setting("./data", Text(), "cifar: torchvision's layout; imagefolder: root/train and root/val")
    batch_size: Union[int, Literal["auto"]] = setting(
        64, Integer(1, 2**20, also=("auto",)),
        "the global batch (split over the processes of a distributed run); auto: search for "
        "the largest that fits", FIXED_UNDER_SCHEDULE)
    eval_batch_size: Optional[int] = setting(None, Integer(1, 2**20, nullable=True), "default: batch_size")
    num_workers: Union[int, Literal["auto"]] = setting(
        "auto", Integer(0, 256, also=("auto",)), "loader worker processes (per machine); "
        "auto: 0 off a GPU, on one the cores less one per process, at most 4 per process for "
        "an in-memory set and 8 for imagefolder")
    download: bool = setting(False, Boolean(), "cifar only: download when missing")
    on_device: Union[bool, Literal["auto"]] = setting(
        "auto", Boolean(also=("auto",)),
        "keep the images on the device and cut batches there (no workers); auto: on CUDA for "
        "an in-memory set taking at most 5% of the device's memory and 2 GiB; true on a CPU: "
        "batches indexed in memory")
    augment: bool = setting(False, Boolean(),
                            "cifar: padded random crop + flip; imagefolder: random resized crop + flip")
    image_size: Optional[int] = setting(
        None, Integer(8, 4096, nullable=True), "default: shapes/fake 32, imagefolder 224",
        FIXED)
    train_size: Optional[int] = setting(
        None, Integer(1, 10**8, nullable=True),
        "default: shapes 8000, fake 1024; cifar: a prefix of the set", FIXED_UNDER_SCHEDULE)
    val_size: Optional[int] = setting(None, Integer(1, 10**8, nullable=True), "default: shapes 2000, fake 256")

    @staticmethod
    def check_values(values: dict, path: str) -> None:
        if values["name"] == "imagefolder" and values["on_device"] is True:
            raise ConfigError(f"{path}.on_device: true needs a data set held in memory (shapes, cifar10, cifar100, "
                              f"fake); imagefolder reads its images from files")
        if values["name"] == "imagefolder":
            for key in ("train_size", "val_size"):
                if values[key] is not None:
                    raise ConfigError(f"{path}.{key}: imagefolder takes every image under root/train; leave it null "
                                      f"(and {path}.val_size too)")


class TensorImageDataset(Dataset):
    """In-memory uint8 images (N, C, H, W) and labels; normalised floats out.

    ``augment`` applies the CIFAR recipe per sample: 4-pixel padded random crop and a random
    horizontal flip.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float],
                 std: Sequence[float], augment: bool = False, classes: Optional[Sequence[str]] = None):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError("images should be a uint8 tensor of shape (N, C, H, W)")
        self.images, self.labels = images, labels.long()
        self.mean = torch.tensor(mean).view(-1, 1, 1) * 255
        self.std = torch.tensor(std).view(-1, 1, 1) * 255
        self.augment = augment
        self.classes = list(classes) if classes is not None else sorted(set(self.labels.tolist()))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            h, w = image.shape[-2:]
            padded = torch.nn.functional.pad(image, (4, 4, 4, 4), mode="constant", value=0)
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = padded[:, top:top + h, left:left + w]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return (image.float() - self.mean) / self.std, self.labels[index]


def make_shapes(n: int, image_size: int = 32, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generate ``n`` shape images (uint8, N x 3 x S x S) and their labels from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SHAPE_CLASSES), (n,), generator=g)
    grid = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    centre = 0.35 + 0.3 * torch.rand(n, 2, 1, 1, generator=g)
    radius = 0.09 + 0.17 * torch.rand(n, 1, 1, generator=g)
    dx = (xx - centre[:, 0]) / radius
    dy = (yy - centre[:, 1]) / radius
    ax, ay = dx.abs(), dy.abs()
    box, dist = torch.maximum(ax, ay), (dx**2 + dy**2).sqrt()
    masks = torch.stack([
        dist <= 1,                                                          # disk
        (dist >= 0.6) & (dist <= 1),                                        # ring
        box <= 0.85,                                                        # square
        (box >= 0.5) & (box <= 0.85),                                       # frame
        (dy.abs() <= 0.8) & (ax <= 0.9 * (dy + 0.8) / 1.6),                 # triangle
        ax + ay <= 1,                                                       # diamond
        ((ax <= 0.25) & (ay <= 0.9)) | ((ay <= 0.25) & (ax <= 0.9)),        # plus
        (((dx - dy).abs() <= 0.3) | ((dx + dy).abs() <= 0.3)) & (box <= 0.8),  # cross
        (ay <= 0.3) & (ax <= 0.95),                                         # hbar
        (ax <= 0.3) & (ay <= 0.95),                                         # vbar
    ])
    mask = masks[labels, torch.arange(n)].unsqueeze(1).float()
    fg = torch.rand(n, 3, 1, 1, generator=g)
    bg = (fg + 0.35 + 0.3 * torch.rand(n, 3, 1, 1, generator=g)) % 1.0
    image = mask * fg + (1 - mask) * bg + 0.2 * torch.randn(n, 3, image_size, image_size, generator=g)
    return (image.clamp(0, 1) * 255).round().to(torch.uint8), labels


def read_cifar(root: str, train: bool, fine: bool = False) -> Tuple[torch.Tensor, torch.Tensor, list]:
    """Read CIFAR-10 (``fine=False``) or CIFAR-100 from torchvision's on-disk pickle layout."""
    folder = os.path.join(root, "cifar-100-python" if fine else "cifar-10-batches-py")
    if fine:
        files, meta, key, names = (["train"] if train else ["test"]), "meta", "fine_labels", "fine_label_names"
    else:
        files = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        meta, key, names = "batches.meta", "labels", "label_names"
    images, labels = [], []
    for name in files:
        entry = _unpickle(os.path.join(folder, name))
        images.append(torch.as_tensor(entry["data"], dtype=torch.uint8).reshape(-1, 3, 32, 32))
        labels.append(torch.as_tensor(entry[key], dtype=torch.long))
    classes = [c.decode() if isinstance(c, bytes) else c for c in _unpickle(os.path.join(folder, meta))[names]]
    return torch.cat(images), torch.cat(labels), classes


def _unpickle(path: str) -> dict:
    if not os.path.exists(path):
        raise ConfigError(f"data.root: {path} is missing (set data.download: true to fetch the data set)")
    try:
        with open(path, "rb") as f:  # Python 2 pickles: latin1, as torchvision reads them
            entry = pickle.load(f, encoding="latin1")
    except Exception as exc:  # a corrupt file: one line, whatever pickle raised
        raise ConfigError(f"data.root: {path} is not a CIFAR batch file ({exc.__class__.__name__})") from None
    if not isinstance(entry, dict):
        raise ConfigError(f"data.root: {path} is not a CIFAR batch file")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}


def _download_cifar(root: str, fine: bool) -> None:
    from torchvision import datasets

    name = "CIFAR-100" if fine else "CIFAR-10"
    try:
        (datasets.CIFAR100 if fine else datasets.CIFAR10)(root, train=True, download=True)
    except Exception as exc:  # no network, a proxy, a full disk, a bad archive: one line with the way out
        reason = str(getattr(exc, "reason", "") or exc).strip().splitlines()
        raise ConfigError(f"data.download: cannot download {name} into {root} ({exc.__class__.__name__}: "
                          f"{reason[0] if reason else 'no detail'}); put the extracted "
                          f"{'cifar-100-python' if fine else 'cifar-10-batches-py'} folder there yourself") from None


def _subset(images: torch.Tensor, labels: torch.Tensor, size: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    return (images, labels) if size is None else (images[:size], labels[:size])


def train_samples(data: Union[DataConfig, dict]) -> Optional[int]:
    """The training set's size for ``cfg.data`` without building it, where the config alone tells (the built-in
    sets, CIFAR); None for an image folder."""
    data = section_of(DataConfig, data)
    full = {"shapes": 8000, "fake": 1024, "cifar10": 50000, "cifar100": 50000}.get(data.name)
    if full is None:
        return None
    return min(data.train_size, full) if data.train_size and data.name.startswith("cifar") else \
        data.train_size or full


def build_datasets(data: Union[DataConfig, dict], num_classes: int, seed: int = 0) -> Tuple[Dataset, Dataset, int]:
    """The train and validation sets for ``cfg.data`` and the number of classes they hold."""
    data = section_of(DataConfig, data)
    name, root, augment = data.name, data.root, data.augment
    classes: Sequence[str]
    if name == "shapes":
        size = data.image_size or 32
        train = make_shapes(data.train_size or 8000, size, seed=seed)
        val = make_shapes(data.val_size or 2000, size, seed=seed + 1_000_003)
        mean, std, classes = (0.5,) * 3, (0.25,) * 3, SHAPE_CLASSES
    elif name in ("cifar10", "cifar100"):
        fine = name == "cifar100"
        if data.download:
            _download_cifar(root, fine)
        train_images, train_labels, classes = read_cifar(root, train=True, fine=fine)
        val_images, val_labels, _ = read_cifar(root, train=False, fine=fine)
        train = _subset(train_images, train_labels, data.train_size)
        val = _subset(val_images, val_labels, data.val_size)
        mean, std = CIFAR_MEAN, CIFAR_STD
    elif name == "fake":
        size = data.image_size or 32
        g = torch.Generator().manual_seed(seed)
        n_train, n_val = data.train_size or 1024, data.val_size or 256
        train = (torch.randint(0, 256, (n_train, 3, size, size), dtype=torch.uint8, generator=g),
                 torch.randint(0, num_classes, (n_train,), generator=g))
        val = (torch.randint(0, 256, (n_val, 3, size, size), dtype=torch.uint8, generator=g),
               torch.randint(0, num_classes, (n_val,), generator=g))
        mean, std, classes = (0.5,) * 3, (0.29,) * 3, [str(i) for i in range(num_classes)]
    elif name == "imagefolder":
        size = data.image_size or 224
        train_set = image_folder(root, "train", size, augment, IMAGENET_MEAN, IMAGENET_STD)
        if len(train_set.classes) < 2:
            raise ConfigError(f"data.root: {root}/train has one class folder ({train_set.classes[0]}); a "
                              f"classifier needs at least two")
        val_set = image_folder(root, "val", size, False, IMAGENET_MEAN, IMAGENET_STD)
        if val_set.classes != train_set.classes:  # labels are indices into the sorted class list
            missing = sorted(set(train_set.classes) - set(val_set.classes))
            extra = sorted(set(val_set.classes) - set(train_set.classes))
            raise ConfigError(f"data.root: {root}/val has other classes than {root}/train (missing in val: "
                              f"{', '.join(missing) or 'none'}; only in val: {', '.join(extra) or 'none'}); "
                              f"the labels would not match")
        threads = usable_cores() if data.num_workers == "auto" else data.num_workers
        check_images([p for p, _ in train_set.samples + val_set.samples], threads)
        return train_set, val_set, len(train_set.classes)
    else:  # the config schema already refused other names
        raise ConfigError(f"data.name: unknown data set {name!r}")
    train_set = TensorImageDataset(*train, mean, std, augment=augment, classes=classes)
    val_set = TensorImageDataset(*val, mean, std, classes=classes)
    return train_set, val_set, len(classes)


def make_loader(dataset: Any, batch_size: int, train: bool, num_workers: int, device: torch.device,
                seed: int = 0, no_single_last: bool = False, lockstep: bool = False,
                micro_batches: int = 1, on_device: bool = False) -> Union[DataLoader, DeviceBatches]:
    """A loader through ``idist.auto_dataloader``, pinned on CUDA, persistent workers when there are workers.

    ``batch_size`` is the global batch: under data-parallel training each of the N ranks loads
    ``batch_size / N`` (validation: rounded down; and ``num_workers`` is shared out over the processes of a
    machine). The training order is drawn from ``seed + epoch`` (``set_epoch``), the same permutation in one
    process (:class:`EpochShuffleSampler`) as over N (:class:`ShuffleShardSampler`), so the global
    batches are the same sets of samples. Validation is sharded without padding.
    ``no_single_last``: a training epoch whose last batch would hold one sample (which BatchNorm
    cannot train on), or cut in ``micro_batches`` a micro-batch of one, leaves it out, with a warning;
    the order is shuffled, so not the same samples.
    ``lockstep``: validation batches as many on every rank (:class:`LockstepBatches`), for a sharded model.
    ``on_device``: a :class:`~ignite_amp.data.device_batches.DeviceBatches` over ``dataset`` (a
    :class:`TensorImageDataset`) copied to ``device``, with the same samplers and last batch; no workers.
    """
    adopt_ignite_loggers()
    world = idist.get_world_size()
    if lockstep and not train and world > 1:
        if len(dataset) < world:
            raise ConfigError(f"data: {len(dataset)} validation samples for {world} processes; a sharded model needs "
                              f"one per process at least")
        if on_device:
            return DeviceBatches(dataset, batch_sampler=LockstepBatches(dataset, per_process(batch_size, world)),
                                 device=device)
        workers = -(-num_workers // idist.get_nproc_per_node())
        return DataLoader(dataset, batch_sampler=LockstepBatches(dataset, per_process(batch_size, world)),
                          num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0)
    sampler: Any  # one of the samplers module's (each has a len), or None: in order
    if world > 1:
        if train and batch_size % world:
            raise ConfigError(f"data.batch_size: {batch_size} is the global batch and should divide evenly over "
                              f"{world} processes")
        sampler = ShuffleShardSampler(dataset, shuffle=True, seed=seed) if train else EvenShardSampler(dataset)
    else:
        sampler = EpochShuffleSampler(len(dataset), seed) if train else None
    drop_last = False
    last = len(sampler) % per_process(batch_size, world) if train else 0
    if no_single_last and 0 < last < 2 * micro_batches:
        drop_last = True
        held = "1 sample" if last == 1 else f"{last} samples, a micro-batch of 1 in {micro_batches} micro-batches,"
        logger.warning(f"data: the last batch of each epoch would hold {held} which BatchNorm layers cannot train "
                       f"on: it is left out (different samples each epoch: the order is shuffled); change "
                       f"data.batch_size or data.train_size to keep it")
    if on_device:
        return DeviceBatches(dataset, per_process(batch_size, world), sampler, drop_last=drop_last, device=device,
                             seed=seed)
    return cast(DataLoader, idist.auto_dataloader(  # (another kind of loader on XLA devices only)
        dataset,
        batch_size=global_batch(per_process(batch_size, world), world),  # auto_dataloader divides it by world
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
    ))


def data_workers(data: Union[DataConfig, dict], device: torch.device) -> WorkersChoice:
    """``data.num_workers`` for this machine (``auto``: :func:`ignite_amp.data.workers.choose_num_workers`)."""
    data = section_of(DataConfig, data)
    return choose_num_workers(data.num_workers, device.type, in_memory=data.name != "imagefolder",
                              cores=usable_cores(), processes=idist.get_nproc_per_node())


def data_on_device(data: Union[DataConfig, dict], device: torch.device, datasets: Sequence[Dataset]) -> OnDeviceChoice:
    """``data.on_device`` for these data sets on ``device`` (``auto``:
    :func:`ignite_amp.data.device_batches.choose_on_device`, from their uint8 images' bytes)."""
    data = section_of(DataConfig, data)
    images = [d.images for d in datasets if isinstance(d, TensorImageDataset)]
    in_memory = len(images) == len(datasets)
    size = sum(i.numel() for i in images) if in_memory else 0
    return choose_on_device(data.on_device, device.type, in_memory, size, device_memory(device))


def build_loaders(data: Union[DataConfig, dict], num_classes: int, device: torch.device, seed: int = 0,
                  batch_norm: bool = False, lockstep: bool = False, micro_batches: int = 1,
                  batch_size: Optional[int] = None):
    """``(train_loader, val_loader, classes)`` for ``cfg.data``.

    ``batch_size``: the global batch (default ``data.batch_size``, which must then be a number: a run passes its
    plan's, which has settled ``auto``).

    ``batch_norm``: the model has BatchNorm layers (training batches, or micro-batches of ``micro_batches``
    (``amp.micro_batches``), of one sample are refused or left out).
    ``lockstep``: the model is sharded (validation batches as many on every rank)."""
    data = section_of(DataConfig, data)
    batch = data.batch_size if batch_size is None else batch_size
    if batch == "auto":
        raise ValueError("build_loaders: data.batch_size is auto; pass the batch_size the search found")
    per_process_batch = per_process(batch, idist.get_world_size())
    if batch_norm and per_process_batch == 1:
        raise ConfigError("data.batch_size: 1 sample per batch (per process), but the model has BatchNorm layers, "
                          "whose training statistics need at least 2")
    if batch_norm and per_process_batch < 2 * micro_batches:
        raise ConfigError(f"amp.micro_batches: {micro_batches} micro-batches of a batch of {per_process_batch} (per "
                          f"process) hold 1 sample, but the model has BatchNorm layers, whose training statistics "
                          f"need at least 2: use at most {per_process_batch // 2}, or a larger data.batch_size")
    workers = data_workers(data, device).workers
    data = data.replace(num_workers=workers)
    train_set, val_set, n_classes = build_datasets(data, num_classes, seed)
    on_device = data_on_device(data, device, (train_set, val_set)).on
    train = make_loader(train_set, batch, True, workers, device, seed, no_single_last=batch_norm,
                        micro_batches=micro_batches, on_device=on_device)
    val = make_loader(val_set, data.eval_batch_size or batch, False, workers, device, lockstep=lockstep,
                      on_device=on_device)
    return train, val, n_classes
