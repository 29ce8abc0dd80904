import math
import os

import pytest
import torch
import yaml
from torch import nn

from ignite_amp.cli.compare import compare, format_table
from ignite_amp.cli.main import main


@pytest.mark.slow
def test_compare_modes_from_the_same_weights(quick_cfg, tmp_path):
    results = compare(quick_cfg, steps=6, modes=["float16", "float16+scaler", "bfloat16"], print_fn=lambda *a: None)
    assert [r.mode for r in results] == ["float32", "float16", "float16+scaler", "bfloat16"]
    fp32 = results[0]
    assert fp32.max_abs_diff == 0 and fp32.flag == ""
    for r in results:
        assert len(r.losses) == 6 and r.step_ms > 0
    # Same weights and batches: the first step's loss agrees across modes up to the dtype's precision.
    for r in results[1:]:
        assert abs(r.losses[0] - fp32.losses[0]) < 0.05 * abs(fp32.losses[0])
    for mode in ("float32", "float16", "float16+scaler", "bfloat16"):
        assert os.listdir(os.path.join(quick_cfg["output_dir"] + "-compare", mode))  # beside the run, not in it
    table = format_table(results)
    assert table.splitlines()[0].startswith("mode") and len(table.splitlines()) == 5
    # Each mode logs what a training run of its dtype logs: the scaler's figures only with the scaler.
    tags = {mode: set(scalar_tags(os.path.join(quick_cfg["output_dir"] + "-compare", mode, "train")))
            for mode in ("float16", "float16+scaler", "bfloat16")}
    assert {"precision/loss_scale", "precision/skipped_steps", "loss"} <= tags["float16+scaler"]
    assert "loss" in tags["bfloat16"] and not {t for t in tags["bfloat16"] | tags["float16"]
                                               if t.startswith("precision/")}


def scalar_tags(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path)
    acc.Reload()
    return acc.Tags()["scalars"]


@pytest.mark.slow
def test_a_second_comparison_starts_fresh_curves(quick_cfg):
    compare(quick_cfg, steps=2, modes=[], print_fn=lambda *a: None)
    said = []
    compare(quick_cfg, steps=3, modes=[], print_fn=said.append)
    out = quick_cfg["output_dir"] + "-compare"
    (moved,) = [d for d in os.listdir(os.path.dirname(out)) if d.startswith(os.path.basename(out) + ".replaced-")]
    assert said[0] == f"moved the previous comparison's TensorBoard runs to {os.path.join(os.path.dirname(out), moved)}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "float32"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("compare/loss")] == [1, 2, 3]  # this comparison's steps only


@pytest.mark.slow
def test_compare_names_the_layer_that_overflows_float16(quick_cfg):
    cfg = dict(quick_cfg, model={"name": "helpers:overflow_cnn", "num_classes": 10},
               optimizer={"name": "SGD", "lr": 0.01})
    modes = ["float16", "float16+scaler", "bfloat16"]
    results = {r.mode: r for r in compare(cfg, steps=3, modes=modes, print_fn=lambda *a: None)}
    assert results["float32"].flag == "" and results["bfloat16"].flag == ""
    assert results["float32"].max_abs_diff == 0 == results["float32"].max_rel_diff
    assert results["float16"].flag.startswith("NON-FINITE")
    assert results["float16"].first_non_finite == "layer blowup at step 1"
    # With the scaler, the same overflow in the forward is skipped step after step.
    assert results["float16+scaler"].skipped == 3


class NanInOwnForward(nn.Module):
    """float32 only: the model's own forward (no layer) turns the output NaN from its ``nan_from``-th training
    call on; under bfloat16 autocast it stays finite. Only the layer search's root hooks can see where."""

    def __init__(self, num_classes: int = 10, nan_from: int = 1):
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, num_classes)
        self.nan_from, self.calls = nan_from, 0

    def forward(self, x):
        out = self.head(self.stem(x).mean((2, 3)))
        if self.training:
            self.calls += 1
            if out.dtype == torch.float32 and self.calls >= self.nan_from:
                out = out * float("nan")
        return out


def _nan_cfg(quick_cfg, nan_from):
    return dict(quick_cfg, model={"name": "test_compare:NanInOwnForward", "num_classes": 10,
                                  "kwargs": {"nan_from": nan_from}}, optimizer={"name": "SGD", "lr": 0.01})


def test_a_non_finite_reference_is_named_and_blames_no_finite_mode(quick_cfg):
    results = {r.mode: r for r in compare(_nan_cfg(quick_cfg, 1), steps=3, modes=["bfloat16"],
                                          print_fn=lambda *a: None)}
    # The first non-finite value came out of the model's own forward at step 1 (not "layer stem at step 2",
    # where the NaN weights of step 1's update showed up next).
    assert results["float32"].first_non_finite == "the model's own forward (outside its layers) at step 1"
    assert results["float32"].flag == ("NON-FINITE (the reference; first: the model's own forward (outside its "
                                       "layers) at step 1)")
    bf16 = results["bfloat16"]
    assert all(map(math.isfinite, bf16.losses)) and "DIVERGES" not in bf16.flag
    assert bf16.flag == "not compared: float32 went non-finite at step 1"
    assert "not compared" in format_table(list(results.values()))


def test_a_finite_mode_is_compared_up_to_where_the_reference_went_non_finite(quick_cfg):
    results = compare(_nan_cfg(quick_cfg, 3), steps=4, modes=["bfloat16"], print_fn=lambda *a: None)
    assert results[0].first_non_finite == "the model's own forward (outside its layers) at step 3"
    assert results[1].flag == "compared on steps 1-2 only: float32 went non-finite at step 3"
    assert 0 <= results[1].max_rel_diff < 0.1


@pytest.mark.slow
def test_compare_cli(quick_cfg, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(quick_cfg))
    assert main(["compare", str(path), "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "comparing on CPU" in out and "bfloat16" in out and "speedup" in out
    assert "float16 modes left out" in out and "float16+scaler " not in out
    assert f"per-mode TensorBoard runs: {quick_cfg['output_dir']}-compare\n" in out
    shown = out.replace(quick_cfg["output_dir"], "runs/quickstart")  # as the quickstart's would be
    assert all(len(line) <= 80 for line in shown.splitlines()), shown  # a terminal of 80 columns
    assert main(["compare", str(path), "--steps", "2", "--modes", "float16+scaler"]) == 0
    assert "float16+scaler " in capsys.readouterr().out
    assert main(["compare", str(path), "--steps", "0"]) == 2
    assert "--steps: expected a positive integer" in capsys.readouterr().err


def test_compare_with_a_missing_device_is_one_line(quick_cfg, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message shown without CUDA")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(quick_cfg, device="cuda")))
    assert main(["compare", str(path), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "device: device 'cuda' was asked for but CUDA is not available" in err


def test_a_file_where_the_comparison_goes_is_named_in_one_line(quick_cfg, tmp_path, capsys):
    """Issue 59, unclear: compare's folder naming an existing file said "cannot write ... (File exists)"."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(quick_cfg))
    folder = quick_cfg["output_dir"] + "-compare"
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(folder, "w") as f:
        f.write("mine")
    assert main(["compare", str(path), "--steps", "2"]) == 2
    assert capsys.readouterr().err == (f"ignite-amp: error: output_dir: cannot write to {folder} ({folder} is a file, "
                                       f"not a folder)\n")
    assert open(folder).read() == "mine"
