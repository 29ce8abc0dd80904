"""The batch-size search and the out-of-memory backoff on a capped device, without a GPU: a CPU stand-in of
CUDA's caching allocator (tests/helpers/caching_allocator.py) whose reserve reaches the cap whatever the
batch, as an H100's did under ``set_per_process_memory_fraction`` (issue 48)."""
import gc

import pytest
import torch
from ignite.engine import Events
from torch.nn.functional import cross_entropy

from helpers.caching_allocator import AllocatingNet, CachingAllocatorStandIn, MiB
from ignite_amp import create_amp_trainer
from ignite_amp.batch_search import CudaMemoryMeter, MemoryMeter, Trial, TrialRunner, find_batch_size, search_batch_size
from ignite_amp.handlers import OOMBackoff

CAP = 1024 * MiB


def make_batch(n):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def capped(cap=CAP, **net):
    torch.manual_seed(0)
    allocator = CachingAllocatorStandIn(cap)
    model = AllocatingNet(allocator, fixed=net.pop("fixed", 100 * MiB), per_sample=net.pop("per_sample", 4 * MiB),
                          **net)
    return allocator, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def largest_that_trains(model, optimizer, start):
    """The largest batch whose trial (the search's own steps, from an empty cache) raises no out-of-memory
    error, to 1%."""
    def trial(n, stage):
        gc.collect()
        model.allocator.empty_cache()
        with TrialRunner(model, optimizer, cross_entropy, make_batch, device="cpu", dtype="float32") as runner:
            t = runner(n, "verify")  # no meter on a CPU: fits == ran
        return Trial(n, t.fits, None, 0.0, stage)

    return search_batch_size(trial, strategy="bisect", start=start, margin=0.0, tolerance=0.01).largest_fit


@pytest.fixture(scope="module")
def true_fit():
    """The largest batch that trains under CAP (the same for every fresh ``capped()``)."""
    _, model, optimizer = capped()
    return largest_that_trains(model, optimizer, start=128)


# -- the stand-in itself ---------------------------------------------------------------------------
def test_the_stand_in_rounds_caches_caps_and_gives_workspaces_what_is_free():
    a = CachingAllocatorStandIn(16 * MiB)
    small = a.malloc(1)
    assert a.memory_allocated() == 512 and a.memory_reserved() == 2 * MiB  # 512 B from a 2 MiB segment
    big = a.malloc(5 * MiB + 1)
    assert a.memory_reserved() == 2 * MiB + 6 * MiB  # its own segment, rounded up to 2 MiB
    del big
    assert a.memory_allocated() == 512 and a.memory_reserved() == 8 * MiB  # freed, still cached
    again = a.malloc(3 * MiB)
    assert a.memory_reserved() == 8 * MiB  # served by the cache
    space = a.workspace(float("inf"))
    assert a.memory_reserved() == 16 * MiB and space.size >= 8 * MiB  # elastic: all that is left under the cap
    del space, again
    assert a.max_memory_reserved() == 16 * MiB
    a.reset_peak_memory_stats()
    assert a.max_memory_reserved() == 16 * MiB and a.max_memory_allocated() == 512
    big = a.malloc(13 * MiB)  # a new segment past the cap: the cached ones go back, then it fits
    assert a.memory_reserved() == 2 * MiB + 14 * MiB and a.ooms == 0
    with pytest.raises(torch.OutOfMemoryError, match="stand-in"):
        a.malloc(2 * MiB)  # nothing cached is left to give back
    assert a.ooms == 1
    del big, small
    a.empty_cache()
    assert a.memory_allocated() == 0 and a.memory_reserved() == 0


def test_the_stand_in_net_fills_the_cap_whatever_the_batch():
    """The H100's symptom: under a cap the reserve reads ~100% of it for a batch that trains easily."""
    allocator, model, optimizer = capped()
    for n in (8, 64):
        allocator.reset_peak_memory_stats()
        x, y = make_batch(n)
        cross_entropy(model(x), y).backward()
        assert allocator.max_memory_reserved() >= 0.98 * CAP
        assert allocator.memory_allocated() < 0.5 * CAP  # while a fraction is held
        optimizer.zero_grad(set_to_none=True)


# -- the search -------------------------------------------------------------------------------------
class ReservedMeter(MemoryMeter):
    """The meter before issue 48: the peak reserve from before the warm-up (what failed on the H100)."""

    def __init__(self, allocator):
        self.allocator = allocator

    def reset(self):
        self.allocator.reset_peak_memory_stats()

    def peak_bytes(self):
        return float(self.allocator.max_memory_reserved())

    def capacity_bytes(self):
        return float(self.allocator.cap)


@pytest.mark.slow
def test_a_search_that_reads_the_reserve_falls_short_on_a_capped_device(true_fit):
    """The stand-in reproduces the H100's failure: reading the reserve, the search keeps far less than fits
    (or nothing at all)."""
    allocator, model, optimizer = capped()
    try:
        result = find_batch_size(model, optimizer, cross_entropy, make_batch, device="cpu", dtype="float32",
                                 meter=ReservedMeter(allocator), margin=0.05, strategy="model")
        kept = result.batch_size
    except torch.OutOfMemoryError:
        kept = 0
    assert kept < 0.9 * true_fit, (kept, true_fit)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["model", "bisect"])
def test_the_search_on_a_capped_device_is_within_10_percent_of_the_largest_fit(strategy, true_fit):
    """Issue 48's CPU target: the reserve reaches the cap at every size, and the search still keeps a batch
    within 10% of the largest that trains; that batch then trains an epoch under the cap."""
    allocator, model, optimizer = capped()
    meter = CudaMemoryMeter("stand-in", allocator=allocator)
    result = find_batch_size(model, optimizer, cross_entropy, make_batch, device="cpu", dtype="float32",
                             meter=meter, margin=0.05, strategy=strategy)
    assert 0.9 * true_fit <= result.batch_size <= true_fit, (result.batch_size, true_fit, result.trials)
    assert result.capacity_bytes == CAP
    kept = [t for t in result.trials if t.size == result.batch_size and t.fits]
    assert kept and all(t.peak_bytes <= 0.95 * CAP for t in kept)  # its need, under the budget
    assert allocator.max_memory_reserved() >= 0.98 * CAP  # while the reserve pressed the cap
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", dtype="float32")
    trainer.run([make_batch(result.batch_size) for _ in range(3)], max_epochs=2)
    assert trainer.state.iteration == 6


@pytest.mark.slow
def test_the_slack_is_measured_where_the_reserve_is_clear_of_the_cap():
    """The allocator's rounding shows as slack when the reserve had room, and only then."""
    allocator, model, optimizer = capped(cap=8192 * MiB, benchmark=False, per_sample=3 * MiB + 100)
    meter = CudaMemoryMeter("stand-in", allocator=allocator)
    with TrialRunner(model, optimizer, cross_entropy, make_batch, device="cpu", dtype="float32",
                     meter=meter) as runner:
        t = runner(64, "verify")
    assert 0 < meter.slack < 0.2
    assert t.peak_bytes == pytest.approx(meter.window.highest * (1 + meter.slack), rel=0.05)


@pytest.mark.slow
def test_the_search_leaves_the_peak_counter_as_it_would_read_untouched():
    """A user who reads max_memory_allocated after a search gets the process's peak, the trials' included
    (CUDA's counter has one value per process; the search resets it per trial and restores it)."""
    allocator, model, optimizer = capped()
    before = allocator.malloc(300 * MiB)  # the user's own peak, 100 + 300 MiB, before the search
    del before
    assert allocator.max_memory_allocated() == 400 * MiB
    find_batch_size(model, optimizer, cross_entropy, make_batch, device="cpu", dtype="float32",
                    meter=CudaMemoryMeter("stand-in", allocator=allocator), max_size=32, strategy="bisect")
    gc.collect()
    assert allocator.max_memory_allocated() >= 400 * MiB  # not reset to the last trial's window
    assert allocator.memory_allocated() == 100 * MiB  # nothing left held


# -- the backoff --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_backoff_recovers_from_the_stand_ins_out_of_memory_error_losing_no_sample(true_fit):
    """A batch of 2n where n trains and 2n cannot (the reserve at the cap, the cache full of the last
    step's blocks): the allocator raises, the step retries the same batch in micro-batches, every sample is
    trained once."""
    allocator, model, optimizer = capped()
    n = true_fit * 2 // 3
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]) if m.training else None)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", dtype="float32", check_split=False)
    backoff = OOMBackoff()
    backoff.attach(trainer)
    attempts = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: attempts.append(len(seen)))
    data = [make_batch(2 * n) for _ in range(3)]
    trainer.run(data, max_epochs=1)
    assert allocator.ooms >= 1 and backoff.events >= 1 and trainer.state.iteration == 3
    assert trainer.amp_step.micro_batches >= 2
    # after the backoff every iteration's forwards add up to the batch exactly once
    assert sum(seen[attempts[2]:]) == 2 * n
