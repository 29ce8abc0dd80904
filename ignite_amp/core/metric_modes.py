"""Which way is better for a validation metric: the one rule the best checkpoint and TensorBoard share."""
from typing import Callable, Mapping, Optional

__all__ = ["LOWER_IS_BETTER", "metric_mode", "better", "require_metric"]

# A metric whose name contains one of these is lower-is-better unless a mode says otherwise.
LOWER_IS_BETTER = ("loss", "perplexity", "error", "nll", "mse", "mae", "rmse", "wer", "cer")


def metric_mode(metric: str, mode: Optional[str] = None) -> str:
    """``mode`` when given (``"min"`` or ``"max"``), else ``"min"`` for names like a loss or an error, else ``"max"``.

    >>> metric_mode("val_loss"), metric_mode("perplexity"), metric_mode("accuracy"), metric_mode("bleu", "max")
    ('min', 'min', 'max', 'max')
    """
    if mode is None:
        return "min" if any(word in metric.lower() for word in LOWER_IS_BETTER) else "max"
    if mode not in ("max", "min"):
        raise ValueError(f"Argument mode should be 'max' or 'min', got {mode!r}.")
    return mode


def better(mode: str) -> Callable[[float, float], float]:
    """``min`` or ``max``: the better of two values under ``mode``."""
    return min if mode == "min" else max


def require_metric(metrics: Mapping, metric: str, who: str) -> None:
    """A ValueError naming the metrics the evaluator did produce when ``metric`` is not among them."""
    if metric not in metrics:
        produced = ", ".join(sorted(metrics)) or "none"
        raise ValueError(f"{who}: the evaluator produced no metric {metric!r} (it produced: {produced}); attach a "
                         f"metric of that name to the evaluator or choose one of these")
