"""The evaluation step: autocast, no grad, no scaler; outputs in float32, joined across chunks."""
from collections.abc import Mapping
from typing import Any, Iterator, Sequence, Tuple

import torch
from ignite.engine import Engine

from ignite_amp.core.nested import join_chunks, to_float32
from ignite_amp.errors import SplitCheckError
from ignite_amp.step.base import StepBase

__all__ = ["EvalStep", "refuse_pair_blocks"]


class EvalStep(StepBase):
    """Ignite process function for evaluation: autocast, no grad, no scaler.

    Takes ``model`` and the keyword arguments of :class:`AmpStep` that concern the forward
    (``device``, ``dtype``, ``micro_batches``, ``non_blocking``, ``channels_last``, ``compile``,
    ``fp32_modules``, ``prepare_batch``, ``model_fn``, ``model_transform``), and
    ``output_transform(x, y, y_pred)`` (Ignite's signature; default ``(y_pred, y)``).

    ``y_pred`` holds its floating-point tensors in float32 at any nesting (what Ignite metrics
    expect), and is the full batch's whatever the micro-batches; ``y`` may be None. With a custom
    ``split_batch`` (which may reorder rows), ``x`` and ``y`` are the chunks' joined in the chunks' order, as
    ``y_pred`` is. Outputs that pair the rows of a chunk with each other (CLIP's ``logits_per_image``, an
    ``(s, s)`` block per chunk of ``s`` samples) cannot be joined into the batch's ``(n, n)``: a
    :class:`~ignite_amp.errors.SplitCheckError` says so.
    """

    _probed = False  # square outputs were probed once and are not in-batch pairs

    def _run(self, engine: Engine, batch: Any, defer: bool = False) -> Any:
        if self.module.training:
            self._model.eval()
        parts, sizes = self._chunks(batch)
        preds = []
        with torch.no_grad():
            for x, _ in parts:
                with self.autocast():
                    preds.append(to_float32(self._forward(x)))
        names = [] if self._probed else square_blocks(preds, sizes)
        if names:
            self._probed = True  # class logits or in-batch pairs? A smaller piece of the first chunk tells
            x0, y0 = parts[0]
            probe = self.split(x0, y0, sizes[0], 2)[0]
            with torch.no_grad(), self.autocast():
                refuse_pair_blocks(names, self._forward(probe[0]), self.count_samples(*probe))
        x, y = self._joined(batch, parts, sizes)  # each chunk's predictions meet that chunk's own targets
        y_pred = join_chunks(preds, sizes)
        if self.output_transform is None:
            return y_pred, y
        return self.output_transform(x, y, y_pred)


def _tensors(value: Any, path: str = "y_pred") -> Iterator[Tuple[str, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}[{i}]")
    elif torch.is_tensor(value):
        yield path, value


def square_blocks(preds: Sequence[Any], sizes: Sequence[int]) -> list:
    """Names of the 2-d outputs that are ``(s, s)`` in every chunk of ``s`` samples: similarities of a chunk's
    rows with each other, or (when the chunks are as many samples as there are classes) plain logits."""
    if len(preds) < 2 or min(sizes) < 2:
        return []
    found = [dict(_tensors(p)) for p in preds]
    return [name for name in found[0]
            if all(name in f and f[name].dim() == 2 and f[name].shape[0] == f[name].shape[1] == n
                   for f, n in zip(found, sizes, strict=True))]


def refuse_pair_blocks(names: Sequence[str], probe: Any, size: int) -> None:
    """Refuse the outputs of ``names`` that are ``(s, s)`` on a probe of ``size`` samples too: in-batch pairs,
    which joined would be ``(n, s)`` blocks, not the batch's ``(n, n)``."""
    found = dict(_tensors(probe))
    for name in names:
        if name in found and tuple(found[name].shape) == (size, size):
            raise SplitCheckError(
                f"micro-batches: the model's output {name} pairs the rows of each chunk with each other (a "
                f"{size}x{size} block for {size} samples: in-batch similarities, as CLIP's logits_per_image); the "
                f"chunks' blocks are not the batch's: evaluate this model with micro_batches=1")
