"""The handlers' host cost (issue 42): the norm once per step at its kernels' cost, no per-iteration work that
matters only at a log, and every logged number the same as torch's own norm and clipping give."""
import math

import pytest
import torch
from ignite.engine import Events
from torch.nn.functional import cross_entropy
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from helpers import id_batches, mlp
from helpers.tensorboard import read, values
from ignite_amp import AmpEvents, create_amp_trainer
from ignite_amp.handlers import GradientClipping, NonFiniteGuard, TensorBoardMetrics
from ignite_amp.handlers.non_finite_guard import loss_code
from ignite_amp.step.grad_norm import clip_to_norm_, total_norm

MAX_NORM = 20.0
LOG_EVERY = 3
COMPARED = ("loss", "optimizer/grad_norm", "optimizer/clip_share", "optimizer/lr/group_0", "precision/loss_scale",
            "precision/skipped_steps")


def grads_of(dtypes, g):
    scale = torch.rand((), generator=g).item() * 10
    return [(torch.randn(7, 5, generator=g) * scale * 3 ** i).to(dtype) for i, dtype in enumerate(dtypes)]


@pytest.mark.parametrize("dtypes", [[torch.float32] * 4, [torch.bfloat16] * 3, [torch.float16] * 2,
                                    [torch.float32, torch.bfloat16, torch.float32]])  # the last: torch's own path
@pytest.mark.parametrize("max_norm", [0.7, 1e4])  # clipping, and a bound above the norm (coefficient clamped to 1)
def test_norm_and_clipping_are_torchs_to_the_bit(dtypes, max_norm):
    g = torch.Generator().manual_seed(0)
    for _ in range(30):  # a rounding that differs shows in some draws only
        grads = grads_of(dtypes, g)
        norm = total_norm(grads)
        expected = get_total_norm(grads, 2.0, foreach=True)
        assert norm.dtype == expected.dtype and torch.equal(norm, expected)
        ours, theirs = ([torch.nn.Parameter(torch.zeros_like(t)) for t in grads] for _ in range(2))
        for a, b, t in zip(ours, theirs, grads, strict=True):
            a.grad, b.grad = t.clone(), t.clone()
        ours[1].grad = theirs[1].grad = None  # a parameter without a gradient is left out by both
        clip_to_norm_(ours, max_norm, norm)
        clip_grads_with_norm_(theirs, max_norm, norm, foreach=True)
        assert all(a.grad is None and b.grad is None or torch.equal(a.grad, b.grad)
                   for a, b in zip(ours, theirs, strict=True))
    assert total_norm([]) is None


def reference(dtype, batches, lr):
    """The same run by hand with torch's own norm and clipping: per iteration the loss, the pre-clip norm
    (None when the scaler skipped) and the scale after the step."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16, init_scale=256.0)
    params, out = list(model.parameters()), []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        finite = bool(torch.isfinite(norm))
        if finite:
            clip_grads_with_norm_(params, MAX_NORM, norm, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        out.append((loss.detach().float(), norm if finite else None, scaler.get_scale()))
    return out


def expected_logs(steps, dtype, lr) -> dict:
    logs = {tag: {} for tag in COMPARED}
    skipped = 0
    for end in range(LOG_EVERY, len(steps) + 1, LOG_EVERY):
        window = steps[end - LOG_EVERY:end]
        norms = [n for _, n, _ in window if n is not None]
        skipped += len(window) - len(norms)
        logs["loss"][end] = torch.stack([loss for loss, _, _ in window]).mean().item()
        logs["optimizer/grad_norm"][end] = torch.stack(norms).mean().item()
        logs["optimizer/clip_share"][end] = (torch.stack(norms) > MAX_NORM).float().mean().item()
        logs["optimizer/lr/group_0"][end] = torch.tensor(lr).item()  # TensorBoard stores float32
        if dtype == torch.float16:
            logs["precision/loss_scale"][end] = window[-1][2]
            logs["precision/skipped_steps"][end] = float(skipped)
    return {tag: v for tag, v in logs.items() if v}


def same(a, b) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_logged_number_is_the_one_torchs_norm_and_clipping_give(tmp_path, dtype):
    """The default handlers together, seeded: each logged scalar equals, to the bit, what a hand loop with
    ``get_total_norm`` and ``clip_grads_with_norm_`` gives (float16: an inf batch, one skipped step)."""
    batches, lr = id_batches(96, 8), 0.01
    if dtype == "float16":
        x, y = batches[4]
        batches[4] = (x.clone().index_fill_(0, torch.tensor([0]), float("inf")), y)
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=lr), cross_entropy, device="cpu",
                                 dtype=dtype, scaler_kwargs={"init_scale": 256.0})
    NonFiniteGuard().attach(trainer)
    clip = GradientClipping(max_norm=MAX_NORM)
    clip.attach(trainer)
    tb = TensorBoardMetrics(str(tmp_path), log_every=LOG_EVERY, clipping=clip)
    tb.attach(trainer)
    trainer.run(batches, max_epochs=1)
    tb.close()
    acc = read(tmp_path, "train")
    expected = expected_logs(reference(getattr(torch, dtype), batches, lr), getattr(torch, dtype), lr)
    logged = {tag: values(acc, tag) for tag in expected}
    assert logged.keys() == expected.keys() and all(
        logged[t].keys() == expected[t].keys() and all(same(logged[t][i], v) for i, v in expected[t].items())
        for t in expected), (logged, expected)
    shares = expected["optimizer/clip_share"].values()
    assert 0 < sum(shares) < len(shares)  # windows that clipped and windows that did not


def test_tensorboard_adds_one_handler_per_iteration_and_logs_every_log_every(tmp_path):
    """Not one filtered handler per log handler: each of those ran at every iteration to test its filter."""
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy, device="cpu",
                                 dtype="float32")
    before = len(trainer._event_handlers[Events.ITERATION_COMPLETED])  # Ignite's registry of handlers
    tb = TensorBoardMetrics(str(tmp_path), log_every=LOG_EVERY)
    tb.attach(trainer)
    assert len(trainer._event_handlers[Events.ITERATION_COMPLETED]) == before + 1
    trainer.run(id_batches(64, 8), max_epochs=1)  # 8 iterations: logs at 3 and 6, and the rest at the end
    tb.close()
    assert sorted(values(read(tmp_path, "train"), "loss")) == [3, 6, 8]


def test_non_finite_guard_listens_to_steps_only_where_a_scaler_skips_them():
    for dtype, per_step in (("float32", False), ("bfloat16", False), ("float16", True)):
        model = mlp()
        trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy,
                                     device="cpu", dtype=dtype)
        guard = NonFiniteGuard()
        guard.attach(trainer)
        assert trainer.has_event_handler(guard._stepped, AmpEvents.GRADS_READY) is per_step, dtype
        assert trainer.has_event_handler(guard._check_loss, Events.ITERATION_COMPLETED) is not per_step, dtype


def test_loss_code_reads_a_count_on_the_host_and_a_counted_tensor_on_the_device():
    finite, nan = torch.tensor(1.5), torch.tensor(float("nan"))
    assert [int(loss_code(loss, items)) for loss in (finite, nan) for items in (8, 0)] == [0, 0, 1, 2]
    assert [int(loss_code(nan, torch.tensor(n))) for n in (8, 0)] == [1, 2]
    assert loss_code(finite, torch.tensor(0)).device == finite.device


def test_rss_mb_reads_the_current_resident_memory_from_one_open_file():
    import statistics

    from ignite_amp.handlers.tensorboard import memory
    from ignite_amp.handlers.tensorboard.memory import rss_mb
    from ignite_amp.handlers.tensorboard.scalars import _median

    before = rss_mb()
    fd = memory._statm[1]
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written: resident
    assert rss_mb() - before > 48 and memory._statm[1] == fd  # read again, not opened again
    del block
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 6):
        speeds = sorted(torch.rand(n, generator=g).tolist())
        assert _median(speeds) == statistics.median(speeds)


def test_a_log_writes_its_scalars_as_one_event(tmp_path):
    """Not one event per scalar (SummaryWriter.add_scalar's): the log's values in one summary, at the log's step."""
    import glob

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy, device="cpu",
                                 dtype="float32")
    tb = TensorBoardMetrics(str(tmp_path), log_every=LOG_EVERY)
    tb.attach(trainer)
    trainer.run(id_batches(48, 8), max_epochs=1)  # 6 iterations: logs at 3 and 6
    tb.close()
    events = [e for f in glob.glob(str(tmp_path / "train" / "*tfevents*")) for e in EventFileLoader(f).Load()
              if e.summary.value]
    assert [e.step for e in events] == [3, 6]
    tags = {v.tag for v in events[0].summary.value}
    assert {"loss", "optimizer/grad_norm", "optimizer/lr/group_0", "memory/rss_mb",
            "throughput/samples_per_sec"} <= tags
    from tensorboard.util.tensor_util import make_ndarray  # the loader gives simple values as tensors

    assert [float(make_ndarray(v.tensor)) for v in events[0].summary.value if v.tag == "optimizer/lr/group_0"] == [
        torch.tensor(0.01).item()]  # float32, as add_scalar stores it


@pytest.mark.parametrize("dtypes", [[torch.float32] * 3, [torch.bfloat16] * 2, [torch.float32, torch.bfloat16]])
def test_the_steps_grad_norm_and_its_clipping_are_torchs_to_the_bit(dtypes):
    """GradNorm (the step's): the norm once, clipping with its grouping; torch's own path where the gradients are not
    one group, or where a handler took a gradient away between the norm and the clipping."""
    from ignite_amp.step.grad_norm import GradNorm

    g = torch.Generator().manual_seed(1)
    for drop in (False, True):
        grads = grads_of(dtypes, g)
        ours, theirs = ([torch.nn.Parameter(torch.zeros_like(t)) for t in grads] for _ in range(2))
        for a, b, t in zip(ours, theirs, grads, strict=True):
            a.grad, b.grad = t.clone(), t.clone()
        norm = GradNorm(ours)
        norm.compute()
        assert norm.value is None  # not tracked
        norm.tracked = True
        norm.compute()
        expected = get_total_norm([p.grad for p in theirs], 2.0, foreach=True)
        assert norm.value.dtype == expected.dtype and torch.equal(norm.value, expected)
        if drop:
            ours[0].grad = theirs[0].grad = None
        norm.clip_(0.5)
        clip_grads_with_norm_(theirs, 0.5, expected, foreach=True)
        assert all(a.grad is None and b.grad is None or torch.equal(a.grad, b.grad)
                   for a, b in zip(ours, theirs, strict=True))
        norm.clear()
        assert norm.value is None
