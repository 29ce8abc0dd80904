"""What a run prints fits a terminal of 80 columns: the epoch lines, the health summary's lines, the best checkpoint
(issue 53: the epoch line was 84 characters and wrapped)."""
from types import SimpleNamespace

from ignite_amp.handlers.tensorboard.health import Health, health_lines
from ignite_amp.run.epochs import EpochSummary


def epoch_line(epoch, epochs, loss, accuracy, val_loss, seconds, samples_per_sec=12_345.0) -> str:
    printed = []
    summary = EpochSummary(SimpleNamespace(state=SimpleNamespace(metrics={"accuracy": accuracy, "loss": val_loss})),
                           [], printed.append)
    summary.measured = {"train_loss": loss, "samples_per_sec": samples_per_sec, "seconds": seconds}
    summary.report(SimpleNamespace(state=SimpleNamespace(epoch=epoch, max_epochs=epochs)))
    (line,) = printed
    assert summary.history[-1]["samples_per_sec"] == samples_per_sec  # the record keeps the speed
    return line


def test_an_epoch_line_fits_80_columns_even_long_runs_with_large_figures():
    assert epoch_line(3, 5, 0.526, 0.8045, 0.5625, 4.8) == (
        "epoch 3/5  train loss 0.5260  val accuracy 0.8045  val loss 0.5625  4.8s")
    for line in (epoch_line(100, 100, 12.3456, 1.0, 12.3456, 12_345.6), epoch_line(1, 1000, float("nan"), 0.0,
                                                                                   float("inf"), 0.0)):
        assert len(line) <= 80, line


def test_the_health_lines_fit_80_columns_as_printed():
    window = {"throughput/samples_per_sec": 123_456.0, "throughput/step_time_ms": 1234.5, "iterations": 50,
              "throughput/data_wait_share": 0.123, "optimizer/clip_share": 0.25, "clip_steps": 50,
              "optimizer/grad_norm": 12.34}
    lines = health_lines(Health("bfloat16", False, [window] * 120, 6000, 0, max_norm=5.0, peak_memory_mb=12_345.0))
    assert [line.split(":")[0] for line in lines] == ["verdict", "precision", "clipping", "speed", "data wait",
                                                      "memory"]
    assert all(len("  " + line) <= 80 for line in lines), lines
