"""The tests' shared helpers, imported as ``helpers`` (setup.cfg: pytest's ``pythonpath = tests``): tiny models
and data, honest out-of-memory stand-ins, the model factories configs name (``helpers:oom_cnn``), a fake clock,
process-group and checkout helpers. Fixtures and hooks are in tests/conftest.py; the subject helpers in this
package's modules (``helpers.memory``, ``helpers.tensorboard``, ...)."""
import gc
import os
import socket
import subprocess
from collections import OrderedDict

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")


def assert_doctests_pass(module) -> None:
    """The module's docstring examples run and pass, and there are some (a deleted example fails too)."""
    import doctest

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0, (module.__name__, result)


def error_lines(stderr: str) -> list:
    """The lines a run printed on stderr, less the one-time notice a CPU without native bfloat16 gets
    (by design, and on some CI machines only)."""
    return [line for line in stderr.strip().splitlines() if "has no native bfloat16 instructions" not in line]


def hand_loop(model, batches, loss_of, lr=0.1):
    """The loop every tutorial writes: the full batch's loss, backward, SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
    return model


def tiny_config(tmp_path, **over) -> dict:
    """A CPU run of a few seconds for end-to-end CLI tests; ``over`` updates sections key by key."""
    cfg = {"name": "u", "device": "cpu", "output_dir": str(tmp_path / "run"),
           "data": {"name": "shapes", "batch_size": 32, "num_workers": 0, "train_size": 64, "val_size": 32,
                    "image_size": 16},
           "model": {"name": "ignite_amp.models:small_cnn", "num_classes": 10, "kwargs": {"width": 8}},
           "optimizer": {"name": "AdamW", "lr": 3e-3}, "train": {"epochs": 1},
           "handlers": {"tensorboard": {"enabled": False}}}
    for key, value in over.items():
        cfg[key] = dict(cfg[key], **value) if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


class OOMAbove(nn.Module):
    """Stand-in for a GPU model: raises torch.OutOfMemoryError when a batch is larger than ``limit``.

    Records the ids (first input feature) of every sample it ran forward on successfully.
    """

    def __init__(self, in_features: int = 5, classes: int = 3, limit: int = 4):
        super().__init__()
        self.limit = limit
        self.linear = nn.Linear(in_features, classes)
        self.seen = []

    def forward(self, x):
        if x.shape[0] > self.limit:
            self.raised = torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} samples "
                                                 "(stand-in)")
            raise self.raised
        if self.training:
            self.seen.extend(x[:, 0].round().long().tolist())
        return self.linear(x)


def id_batches(n_samples: int = 24, batch: int = 8, in_features: int = 5, classes: int = 3, seed: int = 0):
    """Batches whose first feature is the sample id (for checking that each sample is seen once)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, in_features, generator=g)
    x[:, 0] = torch.arange(n_samples, dtype=torch.float32)
    y = torch.randint(0, classes, (n_samples,), generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n_samples, batch)]


def recording_backend():
    """A ``torch.compile`` backend that keeps each graph dynamo captured, then runs it by ``aot_eager``
    (AOTAutograd's partitioner and recompute, no inductor code generation): ``(backend, graphs)``."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list = []

    def backend(gm, inputs):
        graphs.append(gm)
        return aot_eager(gm, inputs)

    return backend, graphs


def three_blocks() -> nn.Module:
    """``Linear(16, 32)``, three ``(Linear(32, 32), GELU)`` blocks in a Sequential, ``Linear(32, 4)``."""
    return nn.Sequential(nn.Linear(16, 32), nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU())
                                                            for _ in range(3)]), nn.Linear(32, 4))


def mlp(in_features: int = 5, classes: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, classes))


class OOMCNN(nn.Module):
    """Image stand-in for config runs: a tiny CNN raising torch.OutOfMemoryError above ``limit`` samples."""

    def __init__(self, num_classes: int = 10, limit: int = 16, norm: bool = False):
        super().__init__()
        self.limit = limit
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8) if norm else nn.Identity(),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in, {x.shape[0]} > {self.limit})")
        return self.body(x)


def oom_cnn(num_classes: int = 10, limit: int = 16) -> nn.Module:
    return OOMCNN(num_classes, limit)


class Blowup(nn.Module):
    """Multiplies activations far beyond float16's range (65504): fine in float32 and bfloat16."""

    def forward(self, x):
        return x * 1e6


def overflow_cnn(num_classes: int = 10) -> nn.Module:
    """A small CNN whose middle layer, named ``blowup``, overflows float16."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict([
        ("conv", nn.Conv2d(3, 4, 3, padding=1)), ("blowup", Blowup()), ("pool", nn.AdaptiveAvgPool2d(1)),
        ("flat", nn.Flatten()), ("norm", nn.LayerNorm(4)), ("head", nn.Linear(4, num_classes)),
    ]))


class NaNAfter(nn.Module):
    """A small model whose output turns NaN from the ``after``-th training forward on.

    ``after`` comes from the NAN_AFTER environment variable when set, so a test can make a
    resumed run go bad without changing its config (which a resume would refuse)."""

    def __init__(self, num_classes: int = 10, after: int = 3):
        super().__init__()
        self.after, self.calls = int(os.environ.get("NAN_AFTER", after)), 0
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(4, num_classes))

    def forward(self, x):
        out = self.body(x)
        if self.training:
            self.calls += 1
            if self.calls >= self.after:
                out = out * float("nan")
        return out


def nan_after(num_classes: int = 10, after: int = 3) -> nn.Module:
    return NaNAfter(num_classes, after)


class OOMOnRank(OOMCNN):
    """OOMCNN that runs out of memory only in the process of rank ``rank`` (others have no limit)."""

    def __init__(self, num_classes: int = 10, limit: int = 8, rank: int = 1, norm: bool = False):
        super().__init__(num_classes, limit, norm)
        self.rank = rank

    def forward(self, x):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == self.rank:
            return super().forward(x)
        return self.body(x)


def oom_on_rank(num_classes: int = 10, limit: int = 8, rank: int = 1, norm: bool = False) -> nn.Module:
    return OOMOnRank(num_classes, limit, rank, norm)


def warns_when_built(num_classes: int = 10, heads: int = None) -> nn.Module:
    """A model whose construction warns; ``heads`` sets the head's width (default num_classes)."""
    import warnings

    warnings.warn("built with a made-up concern", UserWarning, stacklevel=2)
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, heads or num_classes))


def three_outputs(num_classes: int = 10) -> nn.Module:
    """A model whose head has 3 outputs whatever num_classes says."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3))


def raises_when_built(num_classes: int = 10, **kwargs) -> nn.Module:
    raise ValueError("the user's model code failed")


def image_mlp(num_classes: int = 10, width: int = 64) -> nn.Module:
    """An MLP on 3x16x16 images whose middle Linear layers float8 converts (multiples of 16, not first or last)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))


def flat_mlp(num_classes=10, batch_norm=False, reads_values=False):
    """An MLP of 3x16x16 images; ``batch_norm``: a BatchNorm1d (batch 1 cannot train); ``reads_values``: its
    constructor reads a value (as a check of its initialisation would), which fake tensors cannot."""
    torch.manual_seed(0)
    layers = [torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 64)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(64))
    model = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(64, num_classes))
    if reads_values and not torch.isfinite(model[1].weight).all():
        raise ValueError("non-finite initial weights")
    return model


class FakeClock:
    """A clock that moves only when told: what a timed probe or search reads in tests (no wall time). It reads
    ``now`` seconds; a stand-in may move it by ``now`` or by ``ms``, in milliseconds."""

    def __init__(self):
        self.now = 0.0

    @property
    def ms(self) -> float:
        return self.now * 1000

    @ms.setter
    def ms(self, value: float) -> None:
        self.now = value / 1000

    def __call__(self) -> float:
        return self.now


CLOCK = FakeClock()


class ClockedCNN(nn.Module):
    """A tiny image CNN whose forward advances :data:`CLOCK` by ``costs[dtype]``: under bfloat16 autocast or
    not. It records the shapes it ran on."""

    def __init__(self, num_classes: int = 10, float32: float = 1.0, bfloat16: float = 0.5):
        super().__init__()
        self.costs = {torch.float32: float32, torch.bfloat16: bfloat16}
        self.ran = []
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))

    def forward(self, x):
        dtype = torch.bfloat16 if torch.is_autocast_enabled("cpu") else torch.float32
        CLOCK.now += self.costs[dtype]
        self.ran.append((dtype, tuple(x.shape)))
        return self.body(x)


def clocked_cnn(num_classes: int = 10, float32: float = 1.0, bfloat16: float = 0.5) -> nn.Module:
    return ClockedCNN(num_classes, float32, bfloat16)


def tiny_detector():
    """A torchvision Faster R-CNN of a few thousand parameters, for 32x32 to 48x48 images and 3 classes."""
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4, padding=1), nn.ReLU())
    backbone.out_channels = 8
    return FasterRCNN(backbone, num_classes=3, min_size=32, max_size=48, image_mean=[0.5] * 3, image_std=[0.25] * 3,
                      rpn_anchor_generator=AnchorGenerator(sizes=((8, 16),), aspect_ratios=((1.0,),)),
                      box_roi_pool=MultiScaleRoIAlign(["0"], 3, 2), representation_size=32)


def detection_prepare(batch, device, non_blocking):
    """A detection batch ``(images, targets)`` as the model takes it in training: ``((images, targets), None)``."""
    images, targets = batch
    return (list(images), list(targets)), None  # the model takes (images, targets) in training


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a process group's or a server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_group(rank, world, port, work, out):
    """A spawned rank: ``work(rank, out)`` inside a gloo group of ``world``. Its objects are freed (gc: the
    engines hold the model in reference cycles) while the group exists; freed at exit instead, gloo's
    teardown aborted now and then ("terminate called without an active exception"), as the launcher's
    ``_call`` avoids for runs."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        work(rank, out)
    finally:
        gc.collect()
        dist.destroy_process_group()


def checkout_copy(dest) -> str:
    """The checkout's files (tracked, and new ones git does not ignore) copied to ``dest``: a build there leaves
    nothing in the checkout (setuptools writes ``build/`` and ``*.egg-info`` beside the sources)."""
    import shutil

    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True)
    if listing.returncode != 0 or not os.path.exists(os.path.join(ROOT, ".git")):
        # not a git checkout (.ci/versions runs the suite on an exported copy): the tree, less what builds leave
        shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache", ".pytest_cache", ".coverage*"))
        return str(dest)
    for name in filter(None, listing.stdout.split("\0")):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))
    return str(dest)
