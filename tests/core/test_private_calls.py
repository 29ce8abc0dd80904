"""Canaries: each private or version-dependent torch and Ignite call the package makes, present as it is used.

.ci/versions runs this file on every tested set (the newest, the GPU image's torch, the declared floor), so a
torch or Ignite that moves one of them fails here by name, not mid-epoch in a user's run. Calls with a canary
beside their subject: the GradScaler's private reads (tests/step/test_scaler.py), cuBLAS's workspace handle
(tests/memory_plan/test_memory_plan.py), the fused-kernel device list (tests/run/test_fast_path.py), the copy
of Ignite's ``Engine._fire_event`` (tests/step/test_engine.py).
"""
import importlib
import inspect

import pytest
import torch


def _attr(path: str):
    module, _, name = path.rpartition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# (what the package reaches, where it does): importable and callable (a class counts)
CALLABLE = [
    ("torch:_C._group_tensors_by_device_and_dtype", "step/grad_norm.py"),
    ("torch:_foreach_norm", "step/grad_norm.py, split_check/check.py"),
    ("torch:_foreach_mul_", "step/grad_norm.py"),
    ("torch:_foreach_add_", "split_check/check.py"),
    ("torch:_foreach_sub_", "split_check/check.py"),
    ("torch.distributed._tools.mem_tracker:MemTracker._pre_fw_hook", "memory_plan/fake_step.py (overridden)"),
    ("torch.distributed._tools.mem_tracker:MemTracker.reset_mod_stats", "memory_plan/fake_step.py"),
    ("torch.utils._python_dispatch:TorchDispatchMode", "memory_plan, split_check/randomness.py"),
    ("torch.utils._pytree:tree_leaves", "memory_plan/flops.py"),
    ("torch._subclasses.fake_tensor:FakeTensorMode", "memory_plan/fake_step.py, run/plan.py"),
    ("torch._subclasses.fake_tensor:FakeTensor", "run/plan.py"),
    ("torch._subclasses.fake_tensor:DataDependentOutputException", "memory_plan/fake_step.py"),
    ("torch.nn.modules.batchnorm:_BatchNorm", "run/compose.py"),
    ("ignite.engine:Engine._fire_event", "engine.py (overridden: tests/step/test_engine.py)"),
    ("ignite.engine:Engine._handle_exception", "engine.py (overridden)"),
]


@pytest.mark.parametrize("path, used_in", CALLABLE, ids=[p for p, _ in CALLABLE])
def test_the_private_call_is_there(path, used_in):
    assert callable(_attr(path)), f"{path} (used in ignite_amp/{used_in}) moved in this torch or Ignite"


def test_aten_local_scalar_dense_is_the_op_item_dispatches_to():
    """memory_plan/fake_step.py answers ``.item()`` on a fake tensor by catching this op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(()).item()
    assert torch.ops.aten._local_scalar_dense.default in seen, seen


@pytest.mark.parametrize("name", ["save", "load"])
def test_distributed_checkpoint_takes_no_dist(name):
    """files/checkpoints.py and transforms/sharding.py save and load DCP checkpoints without a process group by
    ``no_dist=`` (added to ``save`` and ``load`` in torch 2.7)."""
    import torch.distributed.checkpoint as dcp

    assert "no_dist" in inspect.signature(getattr(dcp, name)).parameters


def test_ignites_engine_keeps_its_handlers_as_the_copied_fire_event_reads_them():
    """engine.py's ``_fire_event`` reads ``Engine._event_handlers[event]`` as (handler, args, kwargs) triples,
    the engine first in ``args`` where the handler takes it: itself (Ignite 0.5.0 to 0.5.2) or a weak reference."""
    import weakref

    from ignite.engine import Engine, Events

    engine = Engine(lambda e, b: None)
    engine.add_event_handler(Events.STARTED, lambda e, a: None, 1)
    engine.add_event_handler(Events.STARTED, lambda: None)
    (func, args, kwargs), (_, bare, _) = engine._event_handlers[Events.STARTED]
    first = args[0]() if isinstance(args[0], weakref.ref) else args[0]
    assert callable(func) and first is engine and args[1:] == (1,)
    assert isinstance(kwargs, dict) and bare == ()
