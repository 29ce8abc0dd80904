"""The scripts in examples/ run, at tiny size, and do what their docstrings say."""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT

pytestmark = [pytest.mark.docs]


EXAMPLES = os.path.join(ROOT, "examples")


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_char_lm_learns_with_token_weighted_micro_batches_and_keeps_the_best(tmp_path):
    lm = example("char_lm")
    result = lm.main(["--tiny", "--output-dir", str(tmp_path)])
    losses = result["val_loss"]
    assert losses[-1] < losses[0] < math.log(len(lm.VOCAB))  # better than a uniform guess, and improving
    best = [f for f in os.listdir(tmp_path / "checkpoints") if f.startswith("best")]
    assert len(best) == 2 and any(f"{min(losses):.4f}" in f for f in best)


@pytest.mark.slow
def test_hf_style_dict_model_trains_without_a_wrapper():
    result = example("hf_style").main(["--tiny"])
    assert result["val_accuracy"][-1] > 0.9


@pytest.mark.slow
def test_segmentation_evaluates_in_float16_with_float32_outputs():
    result = example("segmentation").main(["--tiny"])
    assert result["output_dtype"] == torch.float32
    assert all(math.isfinite(m["loss"]) and 0.0 <= m["miou"] <= 1.0 for m in result["history"])


@pytest.mark.slow
def test_two_inputs_reports_training_accuracy_from_the_trainer():
    result = example("two_inputs").main(["--tiny"])
    (train_first, _), (train_last, val_last) = result["accuracy"][0], result["accuracy"][-1]
    assert train_last > train_first and val_last > 0.8


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.subprocess
def test_an_example_runs_as_the_readme_says():
    proc = subprocess.run([sys.executable, os.path.join("examples", "hf_style.py"), "--tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("val accuracy") == 3
