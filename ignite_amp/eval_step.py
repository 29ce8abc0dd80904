"""The evaluation step: autocast, no grad, no scaler; outputs in float32, joined across chunks."""
from typing import Any

import torch
from ignite.engine import Engine

from ignite_amp.nested import join_chunks, to_float32
from ignite_amp.step_base import StepBase

__all__ = ["EvalStep"]


class EvalStep(StepBase):
    """Ignite process function for evaluation: autocast, no grad, no scaler.

    Takes ``model`` and the keyword arguments of :class:`AmpStep` that concern the forward
    (``device``, ``dtype``, ``micro_batches``, ``non_blocking``, ``channels_last``, ``compile``,
    ``fp32_modules``, ``prepare_batch``, ``model_fn``, ``model_transform``), and
    ``output_transform(x, y, y_pred)`` (Ignite's signature; default ``(y_pred, y)``).

    ``y_pred`` holds its floating-point tensors in float32 at any nesting (what Ignite metrics
    expect), and is the full batch's whatever the micro-batches; ``y`` may be None.
    """

    def _run(self, engine: Engine, batch: Any, defer: bool = False) -> Any:
        if self._module.training:
            self._model.eval()
        parts, sizes = self._chunks(batch)
        preds = []
        with torch.no_grad():
            for x, _ in parts:
                with self.autocast():
                    preds.append(to_float32(self._forward(x)))
        x, y = batch  # the full batch, as prepare_batch returned it
        y_pred = join_chunks(preds, sizes)
        if self.output_transform is None:
            return y_pred, y
        return self.output_transform(x, y, y_pred)
