"""The GPU suite report's header: device, driver, CUDA, versions, date."""
import datetime
import os
import platform
import re
import subprocess

import ignite
import torch


def probe_environment(smoke: bool) -> dict:
    """The report's header. Runs in a child process: it may initialise CUDA."""
    cuda = not smoke and torch.cuda.is_available()
    smi = _nvidia_smi()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "ignite": ignite.__version__, "python": platform.python_version(),
            "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "cuda_available": cuda,
            "driver": smi.get("driver") or "none (no NVIDIA driver here)"}
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    built = torch.version.cuda or "none"
    info["cuda"] = f"{built} (torch's build); driver's CUDA {smi.get('cuda') or 'none'}"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB)",
                    compute_capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version(),
                    bf16=torch.cuda.is_bf16_supported())
    else:
        info["device"] = f"cpu: {info['cpu']} ({info['cpu_count']} cores)"
    return info


def _nvidia_smi() -> dict:
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        plain = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    found = re.search(r"CUDA Version:\s*([\d.]+)", plain.stdout)
    driver = query.stdout.strip().splitlines()[0] if query.returncode == 0 and query.stdout.strip() else None
    return {"driver": driver, "cuda": found.group(1) if found else None}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^model name\s*:\s*(.+)$", f.read(), flags=re.M)
        return found.group(1).strip() if found else platform.processor()
    except OSError:
        return platform.processor() or "unknown"
