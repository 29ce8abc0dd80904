"""Image folders (``data.name: imagefolder``): reading files with errors that name them, checking every
image before training, and a directory walk that symlink loops cannot fool."""
import logging
import os
from typing import Optional, Sequence

from ignite_amp.errors import ConfigError

__all__ = ["ImageReadError", "read_image", "check_images", "image_folder"]

logger = logging.getLogger("ignite_amp")


class ImageReadError(ConfigError):
    """An image file that cannot be decoded: a user error whose message names the file."""


def read_image(path: str):
    """torchvision's default image loader, with an error that names the file."""
    from torchvision.datasets.folder import default_loader

    try:
        return default_loader(path)
    except Exception as exc:
        raise ImageReadError(f"data.root: cannot read image {path} ({exc.__class__.__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no detail'}); "
                             f"remove or replace the file") from None


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + os.sep)


def _loop_safe_make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
    """torchvision's ``make_dataset`` walk, following symlinks, but never to a directory already walked, to one
    holding the class folder (a link to ``..`` would otherwise repeat the images once per level until the
    path is too long), or to anything in another class's folder (an image would get two labels); each
    image file counts once per class. What was left out is named in a warning."""
    from torchvision.datasets.folder import has_file_allowed_extension

    def valid(path: str) -> bool:
        return is_valid_file(path) if is_valid_file is not None else has_file_allowed_extension(path, extensions)

    split = os.path.realpath(directory)
    instances, empty, skipped = [], [], []
    for name in sorted(class_to_idx):
        top = os.path.join(directory, name)
        if not os.path.isdir(top):
            continue
        top_real = os.path.realpath(top)

        def foreign(real: str, top_real: str = top_real) -> bool:  # in this split, not in this class's folder
            return _inside(real, split) and not _inside(real, top_real)

        seen, found, files_seen = {top_real}, [], set()
        for folder, dirs, files in os.walk(top, followlinks=True):
            keep = []
            for d in sorted(dirs):
                path = os.path.join(folder, d)
                real = os.path.realpath(path)
                if _inside(top_real, real) or foreign(real):  # a loop, or another class
                    skipped.append(path)
                elif real not in seen:
                    seen.add(real)
                    keep.append(d)
            dirs[:] = keep
            for f in files:
                path = os.path.join(folder, f)
                real = os.path.realpath(path)
                if not valid(path) or real in files_seen:
                    continue
                if foreign(real):
                    skipped.append(path)
                    continue
                files_seen.add(real)
                found.append(path)
        instances += [(path, class_to_idx[name]) for path in sorted(found)]
        if not found:
            empty.append(name)
    if skipped:
        logger.warning(
            "data.root: left out %d link(s) to another class's folder or to a folder holding the class (%s%s): an "
            "image gets one label", len(skipped), skipped[0], " ..." if len(skipped) > 1 else "")
    if empty and not allow_empty:
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(sorted(empty))}")
    return instances


def check_images(paths: Sequence[str], workers: int = 0) -> None:
    """Open and decode every image (JPEG at 1/8 scale: its whole stream is read, a truncated file is caught),
    in threads: an unreadable file is an :class:`ImageReadError` naming it now, before the first
    iteration, not an epoch later."""
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    def check(path: str) -> Optional[str]:
        try:
            with Image.open(path) as image:  # a JPEG decodes at 1/8 scale: every byte read, little work done
                image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
                image.load()
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
            return (f"data.root: cannot read image {path} ({exc.__class__.__name__}: {first}); remove or replace "
                    f"the file")
        return None

    with ThreadPoolExecutor(max_workers=max(2, min(workers, 16))) as pool:
        for problem in pool.map(check, paths, chunksize=64):
            if problem:
                raise ImageReadError(problem)


def image_folder(root: str, split: str, image_size: int, augment: bool, mean: tuple, std: tuple):
    """``root/split`` as a loop-safe ``ImageFolder`` with the resize (and, for training, augmentation) of
    ``image_size``."""
    from torchvision import datasets, transforms

    path = os.path.join(root, split)
    if not os.path.isdir(path):
        raise ConfigError(f"data.root: {path} is not a directory (imagefolder expects root/train and root/val)")
    if augment and split == "train":
        resize = [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()]
    else:
        resize = [transforms.Resize(int(image_size * 8 / 7)), transforms.CenterCrop(image_size)]
    tf = transforms.Compose([*resize, transforms.ToTensor(), transforms.Normalize(mean, std)])


    class LoopSafeImageFolder(datasets.ImageFolder):
        make_dataset = staticmethod(_loop_safe_make_dataset)

    try:
        return LoopSafeImageFolder(path, transform=tf, loader=read_image)
    except (FileNotFoundError, RuntimeError) as exc:
        raise ConfigError(f"data.root: {path}: {str(exc).splitlines()[0]}") from None
