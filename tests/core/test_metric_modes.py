"""One rule for which way a metric is better: BestCheckpoint and TensorBoard's val/best_* agree."""
import doctest
import os

import pytest
import torch
from ignite.engine import Engine, Events

import ignite_amp.core.metric_modes
from ignite_amp.core.metric_modes import metric_mode
from ignite_amp.handlers import BestCheckpoint, TensorBoardMetrics


def test_docstring_examples_run():
    result = doctest.testmod(ignite_amp.core.metric_modes)
    assert result.attempted > 0 and result.failed == 0


def test_metric_mode():
    assert [metric_mode(m) for m in ("loss", "val_perplexity", "top1_error", "accuracy", "miou")] == \
        ["min", "min", "min", "max", "max"]
    assert metric_mode("miou", "min") == "min"
    with pytest.raises(ValueError, match="mode should be 'max' or 'min'"):
        metric_mode("loss", "lowest")


def run_with_scores(tmp_path, scores, metric, mode=None, modes=None):
    from ignite_amp import create_amp_trainer

    model = torch.nn.Linear(2, 2)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), torch.nn.functional.cross_entropy,
                                 device="cpu", dtype="float32")
    evaluator = Engine(lambda e, b: None)
    values = iter(scores)

    @evaluator.on(Events.COMPLETED)
    def score(engine):
        engine.state.metrics.update(next(values))

    ckpt = BestCheckpoint(str(tmp_path / "ckpt"), {"model": model}, metric=metric, n_saved=1, mode=mode)
    tb = TensorBoardMetrics(str(tmp_path / "tb"), log_every=1, hparam_metrics=(), modes=modes)
    tb.attach(trainer, evaluator=evaluator)
    ckpt.attach(trainer, evaluator)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run([0]))
    trainer.run([(torch.randn(2, 2), torch.tensor([0, 1]))], max_epochs=len(scores))
    tb.close()
    return sorted(f for f in os.listdir(tmp_path / "ckpt") if f.startswith("best")), tb.best


def test_perplexity_keeps_the_lowest_epoch_in_the_checkpoint_and_in_tensorboard(tmp_path):
    best, tb_best = run_with_scores(tmp_path, [{"perplexity": 9.0}, {"perplexity": 3.0}, {"perplexity": 5.0}],
                                    "perplexity")
    assert best == ["best_checkpoint_2_neg_perplexity=-3.0000.pt"] and tb_best["perplexity"] == 3.0


def test_a_mode_given_to_both_is_followed_by_both(tmp_path):
    best, tb_best = run_with_scores(tmp_path, [{"distance": 9.0}, {"distance": 3.0}, {"distance": 5.0}], "distance",
                                    mode="min", modes={"distance": "min"})
    assert best == ["best_checkpoint_2_neg_distance=-3.0000.pt"] and tb_best["distance"] == 3.0


def test_a_metric_the_evaluator_never_produces_is_named_at_the_first_evaluation(tmp_path):
    with pytest.raises(ValueError, match=r"BestCheckpoint: the evaluator produced no metric 'perplexity' "
                                         r"\(it produced: accuracy, loss\)"):
        run_with_scores(tmp_path, [{"accuracy": 0.5, "loss": 1.0}], "perplexity")
    assert not os.listdir(tmp_path / "ckpt")  # nothing saved
