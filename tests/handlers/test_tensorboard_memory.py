"""The TensorBoard memory handler reads each window's CUDA peak and leaves the process's peak counter as a user
reads it (issue 48: every variant of a GPU benchmark read ~640 MB because the handler reset it at each log)."""
import torch
from ignite.engine import Engine, Events

from helpers.caching_allocator import CachingAllocatorStandIn, MiB
from ignite_amp.handlers.tensorboard.memory import DeviceMemory


def test_the_window_peaks_are_logged_and_the_process_peak_is_left_as_it_would_be():
    allocator = CachingAllocatorStandIn(4096 * MiB)
    held = allocator.malloc(100 * MiB)
    before = allocator.malloc(900 * MiB)  # the user's code peaked at 1000 MiB before the run
    del before
    sizes = [300, 50, 600, 20]  # what each iteration allocates on top of the 100 MiB held

    def step(engine, batch):
        block = allocator.malloc(sizes[(engine.state.iteration - 1) % 4] * MiB)
        del block

    trainer = Engine(step)
    memory = DeviceMemory(torch.device("cuda", 0), allocator=allocator)
    memory.attach(trainer)
    logged = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2), lambda e: logged.append(memory.read()))
    trainer.run([0] * 4, max_epochs=1)
    # windows of two iterations each, from the run's start: not the 1000 MiB from before it
    assert [v["memory/peak_mb"] for v in logged] == [400, 700]
    assert memory.peak_mb == 700 and all(v["memory/allocated_mb"] == 100 for v in logged)
    # after the run the counter reads what it would have, had nothing reset it
    assert allocator.max_memory_allocated() == 1000 * MiB and allocator.memory_allocated() == 100 * MiB
    after = memory.read()  # a read after the run's end (the health summary's) reports no window
    assert "memory/peak_mb" not in after and memory.peak_mb == 700
    # a second run of the same trainer reads its own windows again
    sizes[:] = [10, 1500, 10, 10]
    trainer.run([0] * 4, max_epochs=2)
    assert logged[-2]["memory/peak_mb"] == 1600 and allocator.max_memory_allocated() == 1600 * MiB
    del held
