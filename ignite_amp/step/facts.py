"""Run facts: what actually ran (precision, scaler, device, batch), resolved, as a flat dict.

``step_facts`` reads a training step; ``config_facts`` adds what only the run knows (the
loader's batch, the model and optimizer named in the config). ``TensorBoardMetrics`` writes
them at the start of a run as a text entry and as HParams. Values are ``bool``, ``int``,
``float``, ``str`` or ``None`` (unknown: not written to HParams).
"""
import functools
import platform
from typing import Any, Dict, Optional

import ignite
import ignite.distributed as idist
import torch

from ignite_amp.core.collectives import unwrap
from ignite_amp.core.device import auto_dtype_reason, describe_device, dtype_name
from ignite_amp.transforms.activation_checkpointing import checkpoint_policies, describe_blocks
from ignite_amp.version import __version__

__all__ = ["step_facts", "config_facts", "device_name", "format_facts", "summary_line"]


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def device_name(device: torch.device) -> str:
    """``"cuda:0 (NVIDIA H100 80GB HBM3)"``, ``"cpu (Intel(R) Xeon(R) ...)"``, or the device itself."""
    device = torch.device(device)
    if device.type == "cpu":
        model = _cpu_model()
        return f"cpu ({model})" if model else "cpu"
    return describe_device(device)


def step_facts(step: Any) -> Dict[str, Any]:
    """Facts a training step knows, read through its documented interface.

    ``init_scale`` is the GradScaler's scale at the time of the call (its ``init_scale`` on a
    fresh run, the checkpoint's on a resume); None without a scaler. ``checkpointed_blocks``: the
    blocks under activation checkpointing, in short (``blocks.0-5``; ``blocks.0-5 (selective)``), or ``none``.
    """
    scaler = step.scaler.is_enabled()
    world = idist.get_world_size()
    sharded = hasattr(step.model, "set_requires_gradient_sync")  # FSDP2 (fully_shard)
    policies = checkpoint_policies(unwrap(step.model))
    checkpointed = list(policies)
    selective = [name for name, policy in policies.items() if policy == "selective"]
    float8 = step.float8.facts() if getattr(step, "float8", None) is not None else {}
    return {
        "dtype": dtype_name(step.dtype),
        "grad_scaler": scaler,
        "init_scale": float(step.scaler.get_scale()) if scaler else None,
        "device": device_name(step.device),
        "world_size": world,
        "strategy": ("fsdp" if sharded else "ddp") if world > 1 else "none",
        "shards": world if sharded else 1,
        "micro_batches": step.micro_batches,
        "accumulation_steps": step.accumulation_steps,
        "activation_checkpointing": bool(checkpointed),
        "checkpointed_blocks": (describe_blocks(checkpointed) or "none") + (
            " (selective)" if selective == checkpointed and selective else
            f" (selective: {describe_blocks(selective)})" if selective else ""),
        **float8,
        "torch": str(torch.__version__),  # a str subclass: plain str for the HParams plugin
        "ignite": str(ignite.__version__),
        "ignite_amp": __version__,
    }


def config_facts(cfg: Any, train_loader: Any, batch_size_searched: bool = False) -> Dict[str, Any]:
    """Facts of a run built from a config that the step cannot know.

    ``batch_size`` is the global batch the loader yields (per process x processes);
    ``batch_size_search`` says whether ``data.batch_size: auto`` chose it.
    """
    per_process: Optional[int] = getattr(train_loader, "batch_size", None)
    return {
        "batch_size": per_process * idist.get_world_size() if per_process else cfg.data.batch_size,
        "batch_size_search": bool(batch_size_searched),
        "compile": cfg.amp.compile,
        "channels_last": cfg.amp.channels_last,
        "model": cfg.model.name,
        "optimizer": cfg.optimizer.name,
        "lr": cfg.optimizer.lr,
        "scheduler": cfg.scheduler.name,
        "epochs": cfg.train.epochs,
        "seed": cfg.seed,
    }


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("|", "\\|")


def summary_line(facts: Dict[str, Any]) -> str:
    """One sentence: ``bfloat16 autocast, no GradScaler, on cpu (...), 1 process, batch 64``."""
    dtype = facts.get("dtype")
    parts = ["float32, autocast off" if dtype == "float32" else f"{dtype} autocast" if dtype else None]
    if facts.get("float8_recipe"):
        parts[0] = (f"float8 {facts['float8_recipe']} Linear layers"
                    f"{' (emulated)' if facts.get('float8_emulated') else ''} in {parts[0]}")
    if "grad_scaler" in facts:
        parts.append(f"GradScaler from scale {facts['init_scale']:g}" if facts["grad_scaler"] and
                     facts.get("init_scale") else "GradScaler on" if facts["grad_scaler"] else "no GradScaler")
    if facts.get("device"):
        parts.append(f"on {facts['device']}")
    if facts.get("world_size"):
        sharded = f" ({facts['strategy']}, {facts['shards']} shards)" if facts.get("strategy") == "fsdp" else ""
        parts.append(f"{facts['world_size']} process{'es' if facts['world_size'] != 1 else ''}{sharded}")
    if facts.get("batch_size"):
        searched = " (chosen by the batch-size search)" if facts.get("batch_size_search") else ""
        parts.append(f"batch {facts['batch_size']}{searched}")
    return ", ".join(p for p in parts if p)


def format_facts(facts: Dict[str, Any]) -> str:
    """Markdown for TensorBoard's Text tab: the summary line, then a table of every fact."""
    rows = "\n".join(f"| {name} | {_show(value)} |" for name, value in facts.items())
    return f"**{summary_line(facts)}**\n\n| fact | value |\n|---|---|\n{rows}\n"


def start_words(step: Any, auto: bool, why: str = "") -> tuple:
    """``(where, precision)`` of a run's start line: the processes or device, and the precision that runs
    (``auto``: the dtype was chosen by ``dtype: auto``, and the line says why: ``why``, else the static rule's
    reason)."""
    world, sharded = idist.get_world_size(), step.fsdp is not None
    shards = f", FSDP2: the model in {world} shards" if sharded else ""
    where = (f"{world} processes ({idist.backend()}{shards}), {step.device.type}" if world > 1
             else describe_device(step.device))
    precision = "float32, autocast off" if step.dtype == torch.float32 else f"{dtype_name(step.dtype)} autocast"
    if sharded and step.dtype != torch.float32:
        precision += f" over {dtype_name(step.dtype)} parameters"
    if step.float8 is not None:
        precision = (f"float8 {step.float8.recipe} Linear layers in {precision}" if step.float8.converted
                     else f"{precision} (float8: no Linear layer converted)")
    reason = (f" (dtype auto: {why})" if why else auto_dtype_reason(step.device)) if auto else ""
    return where, precision + reason
