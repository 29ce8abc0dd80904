"""Shared test helpers: tiny models, data and an honest out-of-memory stand-in."""
import os
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")

# tests/ has a folder per subpackage; a test may use another folder's helpers by module name
# (``from test_fsdp import free_port``), whichever folders pytest collects: every folder is importable.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(_TESTS)):
    if os.path.isfile(os.path.join(_TESTS, _folder, "__init__.py")) or _folder.startswith(("_", ".")):
        continue
    if os.path.isdir(os.path.join(_TESTS, _folder)) and os.path.join(_TESTS, _folder) not in sys.path:
        sys.path.append(os.path.join(_TESTS, _folder))


@pytest.fixture(scope="session", autouse=True)
def dtype_auto_without_timing(tmp_path_factory):
    """``dtype: auto`` on a CPU with AVX512-BF16 and no AMX is a timed probe's choice: fixed to float32 for the
    whole session (in-process runs and CLI subprocesses, which inherit the environment), so no test's outcome
    depends on the machine's load. tests/run/test_dtype_probe.py drives the probe itself with a fake clock.
    The kept choices go to a temporary folder, never the user's cache folder."""
    from ignite_amp.files.dtype_choice import CACHE_ENV
    from ignite_amp.run.dtype_probe import PROBE_ENV

    before = {name: os.environ.get(name) for name in (PROBE_ENV, CACHE_ENV)}
    os.environ[PROBE_ENV] = "float32"
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("ignite-amp-cache"))
    yield
    for name, value in before.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that starts a process group must end it: Ignite caches the group it saw, and every later
    test would then call collectives on a destroyed group (CI failed that way)."""
    yield
    import ignite.distributed as idist
    import torch.distributed as dist

    leaked = idist.model_name() != "serial" or (dist.is_available() and dist.is_initialized())
    if leaked:
        idist.finalize()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not leaked, "the test left a process group (or Ignite's cached one) behind"


@pytest.fixture
def file_size_limit():
    """``file_size_limit(n)``: a context in which this process may write no file past ``n`` bytes (``ulimit -f``: a
    write past it fails with EFBIG, "File too large", as on a full disk or quota; Python ignores SIGXFSZ)."""
    import contextlib
    import resource

    @contextlib.contextmanager
    def limited(n: int):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    return limited


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


def pytest_collection_modifyitems(config, items):
    # A backward under FakeTensorMode (the memory plan) starts autograd's device threads, after which a forked
    # child cannot run autograd (torch's "Autograd and Fork" rule): the tests that trace fake run last, after
    # every test that forks a training child (test_resume, test_run_state).
    items.sort(key=lambda item: "fake_trace" in item.keywords)  # stable: the order is otherwise kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture
def quick_cfg(tmp_path):
    """:func:`tiny_config` with more data, two epochs and the default handlers (TensorBoard on)."""
    cfg = tiny_config(tmp_path, name="test", data={"train_size": 256, "val_size": 64}, train={"epochs": 2})
    del cfg["handlers"]
    return cfg


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


@pytest.fixture
def browser():
    """Headless Chromium through chromedriver (tests/webdriver.py); the test is skipped without them."""
    from webdriver import Browser, find_browser

    found = find_browser()
    if found is None:
        pytest.skip("no chromium and chromedriver: install them from the OS packages to run this check")
    b = Browser(*found)
    yield b
    b.close()


def image_mlp(num_classes: int = 10, width: int = 64) -> nn.Module:
    """An MLP on 3x16x16 images whose middle Linear layers float8 converts (multiples of 16, not first or last)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))


class FakeClock:
    """A clock that moves only when told: what a timed probe reads in tests (no wall time)."""

    now = 0.0

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
