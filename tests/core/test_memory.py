"""ignite_amp.core.memory: the peak window over an allocator's counters (on the CPU stand-in of CUDA's caching
allocator, tests/helpers/caching_allocator.py), and the module's examples."""
import ignite_amp.core.memory
from helpers import assert_doctests_pass
from helpers.caching_allocator import CachingAllocatorStandIn, MiB
from ignite_amp.core.memory import PeakWindow

CAP = 1024 * MiB


def test_the_memory_module_examples_run():
    assert_doctests_pass(ignite_amp.core.memory)


def test_a_peak_window_restores_the_larger_of_before_and_its_windows():
    allocator = CachingAllocatorStandIn(CAP)
    held = allocator.malloc(10 * MiB)
    with PeakWindow("stand-in", allocator) as window:
        window.start()
        big = allocator.malloc(50 * MiB)
        del big
        assert window.allocated_peak() == 60 * MiB
        window.start()
        assert window.allocated_peak() == 10 * MiB
    assert allocator.max_memory_allocated() == 60 * MiB and allocator.memory_allocated() == 10 * MiB
    del held
