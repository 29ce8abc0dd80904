"""What CUDA's libraries add to a step's memory, which a trace under fake tensors does not see.

cuBLAS keeps a workspace per handle and stream, allocated through torch's caching allocator at the first matmul
and held from then on (32 MiB on Hopper in the torch builds of 2026; ``CUBLAS_WORKSPACE_CONFIG`` and
``TORCH_CUBLASLT_WORKSPACE_SIZE`` change it). On an H100 (2026-11-27) the plan came out a near-constant 65-90 MB
under ``max_memory_allocated`` for ResNet-50, a GPT and the quickstart's small CNN: those workspaces. They are
measured here on the device, not looked up: cleared, then one small matmul forward and backward per autocast
dtype, and what stays allocated is theirs.

torch's handle to clear them is private (``torch._C._cuda_clearCublasWorkspaces``): it is used in this one
function, and tests/memory_plan/test_memory_plan.py fails loudly if torch removes it.
"""
import functools
from typing import Union

import torch

__all__ = ["LIBRARIES", "library_workspace_bytes"]

#: The plan's kind for the cuBLAS workspaces (CUDA only).
LIBRARIES = "cuBLAS workspaces"


def library_workspace_bytes(device: Union[str, torch.device]) -> int:
    """Bytes cuBLAS holds as workspaces on ``device`` once a step has run its matmuls (0 off CUDA).

    Measured once per device and process (the workspaces are cleared and made again: nothing else changes).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _measured(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _measured(index: int) -> int:
    device = torch.device("cuda", index)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:  # no way to see them apart: the plan names them as not counted
        return 0
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)
        clear()
        before = torch.cuda.memory_allocated(device)
        for dtype in dtypes:
            a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
            (a @ a).sum().backward()
            del a
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.memory_allocated(device) - before)
