"""The step as its split check and its CUDA-graph guard see it (issue 62): public members only, one import direction,
and the members made for the check doing what the step itself does."""
import ast
import os

import torch
from ignite.engine import Events
from torch import nn
from torch.nn.functional import cross_entropy

from helpers import ROOT
from ignite_amp.batching import split_batch
from ignite_amp.engine import create_amp_trainer
from ignite_amp.step.train import AmpStep

PACKAGE = os.path.join(ROOT, "ignite_amp")
# Modules that take a step from elsewhere: the split check's folder, the chunks' weights, the CUDA-graph guard.
FOLDER = os.path.join(PACKAGE, "split_check")
READERS = [os.path.join(FOLDER, name) for name in sorted(os.listdir(FOLDER)) if name.endswith(".py")] + [
    os.path.join(PACKAGE, "step", "chunks.py"), os.path.join(PACKAGE, "transforms", "cuda_graphs.py")]


def step_members(path: str) -> list:
    """``(line, "step.<name>", stored)`` of every attribute of a name ``step`` the module reads or sets."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "step":
            found.append((node.lineno, f"step.{node.attr}", isinstance(node.ctx, ast.Store)))
    return found


def test_no_module_reads_a_private_member_of_the_step_or_sets_one():
    private = {os.path.relpath(p, ROOT): [(n, name) for n, name, _ in step_members(p) if name.startswith("step._")]
               for p in READERS}
    stored = {os.path.relpath(p, ROOT): [(n, name) for n, name, store in step_members(p) if store] for p in READERS}
    assert not any(private.values()), private
    assert not any(stored.values()), stored
    assert any(step_members(p) for p in READERS)  # the scan sees the reads that are there


def test_the_split_check_and_the_transforms_import_nothing_of_the_step():
    for folder in ("split_check", "transforms"):
        for name in os.listdir(os.path.join(PACKAGE, folder)):
            if not name.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(PACKAGE, folder, name), encoding="utf-8").read())
            imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
                [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            assert not [m for m in imported if m.startswith("ignite_amp.step")], (folder, name, imported)


def step_with(**hooks) -> AmpStep:
    model = nn.Linear(4, 3)
    return AmpStep(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu", dtype="float32",
                   **hooks)


def test_count_samples_and_split_follow_the_steps_hooks():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    plain = step_with()
    assert plain.count_samples(x, y) == 6 and plain.module is plain.model
    pieces = plain.split(x, y, 6, 2)
    assert [tuple(p[0].shape) for p in pieces] == [(3, 4), (3, 4)] and torch.equal(pieces[1][1], y[3:])
    cut = []

    def reversed_halves(x, y, chunks):  # a custom hook: the rows reversed, then cut
        cut.append(chunks)
        return [[a, b] for a, b in split_batch(x.flip(0), y.flip(0), chunks)]

    custom = step_with(batch_size=lambda x, y: len(x) * 10, split_batch=reversed_halves)
    assert custom.count_samples(x, y) == 60
    pieces = custom.split(x, y, 6, 3)
    assert cut == [3] and all(isinstance(p, tuple) for p in pieces) and torch.equal(pieces[0][0], x.flip(0)[:2])


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def test_a_flop_count_waits_for_an_iteration_without_the_split_checks_passes():
    """The check's forward and backward (note_extra_pass) are not the step's FLOPs: the count moves to the next
    iteration without a check, and then counts what a step without the check counts."""
    def trainer(check_split):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        return create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                  dtype="float32", micro_batches=2, check_split=check_split)

    unchecked = trainer(False)
    unchecked.amp_step.count_flops()
    unchecked.run(batches(1), max_epochs=1)
    assert unchecked.amp_step.flops_per_sample

    checked = trainer(1e-3)  # the first 3 batches checked, then spot checks far apart (a tiny budget)
    step, seen = checked.amp_step, []
    checked.add_event_handler(Events.ITERATION_COMPLETED,
                              lambda e: seen.append((step.split_check.batches, step.flops_per_sample)))
    step.count_flops()
    checked.run(batches(4), max_epochs=1)
    assert seen == [(1, None), (2, None), (3, None), (3, unchecked.amp_step.flops_per_sample)]
