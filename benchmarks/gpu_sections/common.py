"""What the GPU suite's sections share: the record a section writes (Context), a row of the section table
(Section), and small helpers."""
import json
import os
import time
from typing import Callable, NamedTuple

import torch
from torch import nn

from ignite_amp.config.tree import Config, load_config
from ignite_amp.models import small_cnn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
NEEDS_CUDA = "needs CUDA"


class Context:
    """A section's sizes, device and deadline, and the results it records (saved after every row,
    so a section stopped at its budget keeps what it measured)."""

    def __init__(self, key: str, title: str, smoke: bool, cuda: bool, budget_s: float, path: str, workdir: str):
        self.smoke, self.cuda = smoke, cuda
        self.device = torch.device("cuda:0" if cuda else "cpu")  # an index: the memory fraction calls need one
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.path, self.workdir = path, workdir
        self.result = {"key": key, "title": title, "status": "running", "reason": None, "tables": [],
                       "targets": [], "notes": [], "data": {}}

    def sizes(self, gpu: dict, smoke: dict) -> dict:
        return dict(smoke if self.smoke else gpu)

    def left(self) -> float:
        """Seconds left of this section's budget."""
        return self.deadline - time.monotonic()

    def table(self, name: str, columns: list) -> None:
        self.result["tables"].append({"name": name, "columns": columns, "rows": []})
        self.save()

    def row(self, **values) -> None:
        """A row of the table started last."""
        self.result["tables"][-1]["rows"].append(values)
        self.save()

    def target(self, name: str, value: str, ok) -> None:
        """A target of the issue beside its figure: PASS, MISS, INCONCLUSIVE (``ok == "inconclusive"``: measured,
        but the noise was larger than the difference asked about), or NOT MEASURED (``ok`` None, or no GPU)."""
        if ok is None or not self.cuda:
            verdict = "NOT MEASURED"
        elif ok == "inconclusive":
            verdict = "INCONCLUSIVE"
        else:
            verdict = "PASS" if ok else "MISS"
        if not self.cuda:
            value = f"{value} (on CPU: not a GPU figure)" if value else "no GPU"
        self.result["targets"].append({"target": name, "value": value, "verdict": verdict})
        self.save()

    def note(self, text: str) -> None:
        self.result["notes"].append(text)
        self.save()

    def skip(self, reason: str) -> None:
        self.result.update(status="skipped", reason=reason)
        self.save()

    def save(self) -> None:
        write_json(self.path, self.result)


class Section(NamedTuple):
    """A row of the section table (catalog.py); ``--only`` picks a section by its key's first letter."""

    key: str
    title: str
    run: Callable[[Context], None]
    budget_s: int      # on a GPU: the section is stopped here
    expected_s: int    # expected on one H100 (an estimate until a GPU run replaces it)


def write_json(path: str, value) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, default=str)
    os.replace(tmp, path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def recipe(path: str, **overrides) -> Config:
    """A seed config (``configs/...``) with ``key.path`` overrides, validated like ``--set``."""
    items = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    return load_config(os.path.join(ROOT, path), overrides=items)


def tiny_cnn(num_classes: int = 10) -> nn.Module:
    """The smoke runs' model: the quickstart's small CNN at width 8."""
    return small_cnn(num_classes, width=8)
