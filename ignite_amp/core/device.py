"""Where a step runs and in what precision: device and dtype resolution, out-of-memory helpers.

Every layer that names a device or a dtype, or recognises an out-of-memory error, asks here.
"""
import functools
import gc
import logging
from typing import Optional, Tuple, Union

import ignite.distributed as idist
import torch

from ignite_amp.core.collectives import is_distributed
from ignite_amp.errors import RUN_STOPPED, ConfigError

__all__ = ["DTYPES", "resolve_device", "run_device", "resolve_dtype", "indexed", "describe_device", "dtype_name",
           "cpu_has_native_bf16", "cpu_has_amx", "auto_dtype_reason", "is_oom_error", "free_memory", "peak_tflops",
           "PEAK_TFLOPS"]

logger = logging.getLogger("ignite_amp")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(device: Union[str, torch.device, None] = "auto") -> torch.device:
    """``"auto"`` (or None) is CUDA when available, else CPU; anything else goes to ``torch.device``.

    A CUDA device always gets its index (``cuda`` -> ``cuda:<current>``): some CUDA calls (the
    per-process memory fraction) refuse a device without one. A device that is not there (no CUDA,
    ``cuda:1`` on a one-GPU machine, no MPS/XPU) is a ValueError naming it.
    """
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {str(device)!r} was asked for but this machine has {count} CUDA "
                             f"device{'s' if count != 1 else ''} "
                             f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
        return indexed(device)
    backend = getattr(torch.backends, device.type, None) if device.type == "mps" else getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but {device.type} is not available here")
    return device


def run_device(name: str) -> torch.device:
    """A config's ``device`` (``auto``, ``cpu``, ``cuda:1``...) as this process's torch device; a device that isn't
    there is a ConfigError.

    Inside a process group of several ranks it is this rank's device (``cuda:LOCAL_RANK`` on GPUs), whose type must
    match the config's.
    """
    try:
        device = resolve_device(name)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"device: {exc}") from None
    if not is_distributed():
        return device
    rank_device = idist.device()
    if rank_device.type != device.type:
        raise ConfigError(f"device: {name} resolves to {device.type}, but ignite.distributed places this rank on "
                          f"{rank_device}; use device: auto")
    return rank_device


def indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index (``cuda`` -> ``cuda:<current>``); other devices as they are."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu``: the device with its index and, for a GPU, its model."""
    device = indexed(torch.device(device))
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device.index)})"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name configs, logs and facts use."""
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), or ``"unknown CPU"``."""
    for line in _cpu_flags().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown CPU"


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bfloat16 instructions (AVX512-BF16 or AMX); False when unknown."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx() -> bool:
    """True when the CPU has AMX bfloat16 matrix tiles (Intel Sapphire Rapids and newer); False when unknown."""
    return "amx_bf16" in _cpu_flags()


@functools.lru_cache(maxsize=None)
def _warn_slow_cpu_bf16() -> None:
    logger.warning("this CPU has no native bfloat16 instructions: bfloat16 autocast will work, but slowly")


def auto_dtype_reason(device: Union[str, torch.device]) -> str:
    """Why :func:`resolve_dtype`'s ``auto`` chose what it did on ``device``, for a start line
    (`` (dtype auto: ...)``); "" off a CPU. A config run words its own
    (:func:`ignite_amp.run.dtype_probe.config_dtype`)."""
    if torch.device(device).type != "cpu":
        return ""
    if cpu_has_amx():
        return " (dtype auto: AMX bfloat16 tiles)"
    if cpu_has_native_bf16():
        return " (dtype auto: float32 without AMX tiles, where bfloat16's speed depends on the torch build)"
    return " (dtype auto: no bfloat16 instructions on this CPU)"


def resolve_dtype(dtype: Union[str, torch.dtype] = "auto", device: Union[str, torch.device] = "cpu") -> torch.dtype:
    """Turn ``auto | float16 | bfloat16 | float32`` (or a torch dtype) into a torch dtype.

    ``auto`` is the fastest safe choice known without measuring: bfloat16 on Ampere and newer GPUs,
    float16 on older ones (they only emulate bfloat16, slowly). On a CPU it is float32, except where
    AMX bfloat16 matrix tiles run bfloat16 matmuls in hardware. With AVX512-BF16 alone bfloat16's
    speed depends on the torch build (the quickstart on a 2-core AMD EPYC: 0.78-0.81x float32's speed
    on torch 2.15.0, 1.24x on 2.14.1; benchmarks/RESULTS.md), so float32 is the safe rule here and a
    config run measures instead (:func:`ignite_amp.probe_cpu_dtype`); emulated bfloat16 (no bfloat16
    instructions) ran 8x slower. Asked for by name, bfloat16 runs on any CPU, with one log line where
    it is emulated. :func:`auto_dtype_reason` says why, in words.
    """
    device = torch.device(device)
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype should be one of auto, {', '.join(DTYPES)}; got {dtype}")
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_amx() else torch.float32
        return torch.float16
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"dtype should be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    if resolved == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        _warn_slow_cpu_bf16()
    return resolved


def is_oom_error(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and a RuntimeError whose text says memory ran out.

    Illegal memory accesses and every other error are not out-of-memory errors.
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, RUN_STOPPED):  # ours say "out of memory" too
        return False
    text = str(exc).lower()
    return "out of memory" in text or "alloc_failed" in text


def free_memory(device: torch.device) -> None:
    """Collect garbage and give cached blocks of the device's allocator back."""
    gc.collect()
    backend = getattr(torch, torch.device(device).type, None)
    if torch.device(device).type != "cpu" and backend is not None and hasattr(backend, "empty_cache"):
        backend.empty_cache()


# Dense peak TFLOP/s per GPU from the vendors' data sheets: (bf16/fp16 tensor cores, TF32, fp32, float8
# tensor cores; None: no float8). The first name found in torch.cuda.get_device_name() wins, so the more
# specific names come first.
PEAK_TFLOPS = {
    "H200": (989.4, 494.7, 66.9, 1978.9),
    "H100 PCIe": (756.5, 378.0, 51.2, 1513.0),
    "H100 NVL": (835.5, 417.5, 60.0, 1670.5),
    "H100": (989.4, 494.7, 66.9, 1978.9),  # SXM
    "A100": (312.0, 156.0, 19.5, None),
    "L4": (121.0, 60.0, 30.3, 242.5),
}


def peak_tflops(device: torch.device, dtype: torch.dtype, float8: bool = False) -> Optional[Tuple[float, str]]:
    """``(dense peak TFLOP/s, what it is)`` of ``device`` for matmuls in ``dtype``, or None where unknown
    (a CPU, a GPU not in :data:`PEAK_TFLOPS`). float32 counts TF32's peak when torch allows TF32 matmuls.
    ``float8``: the float8 tensor cores' peak instead (a float8 run reports MFU against both: its
    converted matmuls run at the float8 peak, the rest at the bfloat16 one)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for model, (half, tf32, fp32, fp8) in PEAK_TFLOPS.items():
        if model in name:
            if float8:
                return (fp8, f"{model} float8 dense peak") if fp8 else None
            if dtype in (torch.bfloat16, torch.float16):
                return half, f"{model} {dtype_name(dtype)} dense peak"
            if torch.backends.cuda.matmul.allow_tf32:
                return tf32, f"{model} TF32 dense peak"
            return fp32, f"{model} float32 peak"
    return None
