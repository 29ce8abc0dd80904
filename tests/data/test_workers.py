"""data.num_workers "auto" (issue 51): 0 off a GPU; on one, the cores less one per process, capped by what the data
costs to load; never more than the cores; a number wins."""
import pytest

import ignite_amp.data.workers as workers
from helpers import assert_doctests_pass
from ignite_amp.data.workers import MAX_FROM_FILES, MAX_IN_MEMORY, choose_num_workers, usable_cores


def test_the_docstring_examples_run():
    assert_doctests_pass(workers)


@pytest.mark.parametrize("device", ["cpu", "mps", "xpu"])
def test_auto_is_no_worker_off_a_gpu(device):
    assert choose_num_workers("auto", device, in_memory=False, cores=64) == (0, "auto: 0 off a GPU")


@pytest.mark.parametrize("cores, in_memory, processes, expected", [
    (16, True, 1, MAX_IN_MEMORY), (16, False, 1, MAX_FROM_FILES), (2, True, 1, 1), (1, False, 1, 0),
    (3, False, 1, 2), (16, False, 2, 14), (16, True, 8, 8), (64, False, 8, 56), (4, False, 8, 0)])
def test_auto_on_cuda_uses_the_cores_less_one_per_process_capped_by_the_data(cores, in_memory, processes, expected):
    choice = choose_num_workers("auto", "cuda", in_memory=in_memory, cores=cores, processes=processes)
    assert choice.workers == expected
    assert 0 <= choice.workers <= max(0, cores - processes)  # never more than the cores left to the loaders
    assert choice.why.startswith(f"auto: {cores} cores")


def test_a_number_wins_zero_included():
    assert choose_num_workers(0, "cuda", in_memory=False, cores=64) == (0, "")
    assert choose_num_workers(12, "cpu", in_memory=True, cores=2) == (12, "")


def test_usable_cores_is_this_process_affinity():
    import os

    assert 1 <= usable_cores() <= (os.cpu_count() or 1)
