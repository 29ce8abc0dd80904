"""Fixtures and hooks of the whole suite. The shared helpers (models, data, stand-ins) are in tests/helpers."""
import os

import pytest
import torch

# Compatibility: tests written before tests/helpers imported its names from here (``from conftest import mlp``,
# configs naming ``conftest:oom_cnn``). New tests import ``helpers``.
from helpers import *  # noqa: F401,F403
from helpers import tiny_config


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


@pytest.fixture(scope="session")
def forks(tmp_path_factory, dtype_auto_without_timing):
    """The suite's fork server (``helpers.forks``): one interpreter that imported torch and the package, from which a
    test that runs the CLI or a script forks it (a fresh process less its start). Its ``sys.path`` has tests/ (the
    test models a config names, ``helpers:oom_cnn``) and the checkout, as a CLI subprocess of a test had."""
    from helpers import ROOT
    from helpers.forks import Forks

    path = os.pathsep.join([os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH", "")])
    with Forks(tmp_path_factory.mktemp("forks"), env=dict(os.environ, PYTHONPATH=path)) as server:
        yield server


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


@pytest.fixture
def quick_cfg(tmp_path):
    """:func:`tiny_config` with more data, two epochs and the default handlers (TensorBoard on)."""
    cfg = tiny_config(tmp_path, name="test", data={"train_size": 256, "val_size": 64}, train={"epochs": 2})
    del cfg["handlers"]
    return cfg


@pytest.fixture
def browser():
    """Headless Chromium through chromedriver (tests/helpers/webdriver.py); the test is skipped without them."""
    from helpers.webdriver import Browser, find_browser

    found = find_browser()
    if found is None:
        pytest.skip("no chromium and chromedriver: install them from the OS packages to run this check")
    b = Browser(*found)
    yield b
    b.close()
