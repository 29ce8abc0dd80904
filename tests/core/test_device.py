"""ignite_amp.core.device: device and dtype resolution, their names, out-of-memory errors."""
import pytest
import torch

from ignite_amp.core.device import is_oom_error, resolve_dtype


def test_is_oom_error():
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom_error(RuntimeError("CUDA error: out of memory"))
    assert not is_oom_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom_error(ValueError("out of memory"))


def test_resolve_dtype(monkeypatch):
    import ignite_amp.core.device

    flags = {"": torch.float32,  # emulated bfloat16 ran 8x slower than float32 (benchmarks/RESULTS.md)
             "avx512f avx512_bf16": torch.float32,  # the torch build decides: a config run probes (test_dtype_probe)
             "avx512_bf16 amx_bf16 amx_tile": torch.bfloat16}  # AMX: bfloat16 matrix tiles
    for cpu, expected in flags.items():
        monkeypatch.setattr(ignite_amp.core.device, "_cpu_flags", lambda cpu=cpu: cpu)
        assert resolve_dtype("auto", "cpu") == expected, cpu
        assert ignite_amp.core.device.auto_dtype_reason("cpu").startswith(" (dtype auto: ")
        assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # by name it runs
    assert ignite_amp.core.device.auto_dtype_reason("cuda:0") == ""
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype should be one of"):
        resolve_dtype("half", "cpu")


def test_auto_dtype_is_float16_where_bfloat16_is_only_emulated(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_dtype("auto", "cuda") == torch.float16  # pre-Ampere: emulated bf16 is slow
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16


def test_devices_that_are_not_there_are_named(monkeypatch):
    from ignite_amp.core.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match=r"'cuda:1' was asked for but this machine has 1 CUDA device \(cuda:0\)"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'mps' was asked for but mps is not available"):
        resolve_device("mps")


def test_a_cuda_device_always_carries_its_index(monkeypatch):
    """torch.cuda.{get,set}_per_process_memory_fraction refuse torch.device("cuda"): the search's
    capacity read crashed on every single-GPU run with device auto."""
    from ignite_amp.batch_search import CudaMemoryMeter
    from ignite_amp.core.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda:1")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    assert CudaMemoryMeter("cuda").device == torch.device("cuda:1")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_gpu_is_described_by_its_index_and_model(monkeypatch):
    from ignite_amp.core.device import describe_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"Fake GPU {index}")
    assert describe_device(torch.device("cuda")) == "cuda:0 (Fake GPU 0)"  # torchrun x1 prints this
    assert describe_device("cuda:1") == "cuda:1 (Fake GPU 1)" and describe_device("cpu") == "cpu"
