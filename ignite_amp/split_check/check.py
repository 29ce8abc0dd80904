"""The split check: do the weighted chunks of a batch give the full batch's gradient, on the user's own loss?

Micro-batches, accumulation, out-of-memory retries and DDP weigh each chunk's mean loss by its share: of the
samples, or of the items ``num_items`` counts. That is one assumption about the loss (a mean over what is
counted). :class:`SplitCheck` checks it once on the real batch, the first time a batch is cut or combined, and
again whenever the number of micro-batches changes:

1. a part of the prepared batch (its first :data:`SAMPLES` samples, or as many as one of the step's chunks holds
   when that is fewer, but at least 2, by the step's own ``split_batch``) and that part cut in two by the same hook;
2. the gradient with respect to the parameters (``torch.autograd.grad``: ``.grad`` and an accumulation in
   progress are untouched) of the part's loss, and of each half's, through the step's own hooks
   (``model_fn``, ``model_transform``, ``loss_fn``), in float32 (no autocast, no TF32), with randomness and
   BatchNorm held still (:func:`ignite_amp.split_check.randomness.still`: dropout off, random operators constant, BatchNorm
   on its running statistics; every state restored after);
3. the halves' gradients weighted as the step weighs them, compared with the part's: the relative
   difference ``|sum_i w_i g_i - g| / |g|`` must be at most :data:`TOLERANCE` (:data:`LOW_PRECISION_TOLERANCE`
   for a model whose parameters are not float32, :data:`FLOAT8_TOLERANCE` with float8 layers).

Where it is not, :class:`~ignite_amp.errors.SplitCheckError` stops the run in one line, with the measured
difference and the cause the gradients point at: the halves add up to the part (a sum); they fit by samples
while the step weighs by ``num_items`` (a per-sample mean); they fit with other weights (the loss averages over
something other than what is counted; a ``num_items`` that fits is named when one of the usual ones does); or no
weighting fits (rows interact: in-batch negatives, a contrastive loss). ``check_split=False`` accepts it knowingly.

Not checked: a batch of one sample (nothing to cut; the next batch is), FSDP2-sharded models, a chunk that counts
no items. An out-of-memory error inside the check skips it with a warning. Under DDP the ranks agree on the
verdict (one all-reduce).
"""
import contextlib
import logging
import math
from collections.abc import Mapping
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from ignite_amp.core.collectives import is_distributed, max_across_ranks
from ignite_amp.step.contracts import ignore_index_of
from ignite_amp.core.device import free_memory, is_oom_error
from ignite_amp.errors import SplitCheckError
from ignite_amp.core.config_keys import Boolean
from ignite_amp.split_check.randomness import still

__all__ = ["SplitCheck", "SAMPLES", "TOLERANCE", "LOW_PRECISION_TOLERANCE", "FLOAT8_TOLERANCE"]

logger = logging.getLogger("ignite_amp")

#: Samples of the real batch the check runs on (cut into two chunks).
SAMPLES = 4
#: Largest relative gradient difference accepted, float32 parameters (rounding is ~1e-6).
TOLERANCE = 1e-3
#: Largest relative gradient difference accepted for parameters in a lower precision (bfloat16, float16).
LOW_PRECISION_TOLERANCE = 5e-2
#: Largest relative gradient difference accepted with float8 layers: their tensorwise scales are the whole
#: batch's, so a chunk rounds differently (~10%); a sum (50% off in two halves) or a contrastive loss still shows.
FLOAT8_TOLERANCE = 0.25
#: Labels with at most this many distinct values have each tried as the ignored one when naming a num_items.
MAX_CLASSES = 32
SWITCH = "or pass check_split=False (config: amp.check_split: false) to accept it knowingly"


class SplitCheck:
    """The step's split check: called with the prepared batch before the chunks run (see the module)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = Boolean().argument(enabled, "check_split")
        self.checked: Optional[int] = None  # the micro-batch count the last check ran for
        self.last: Optional[float] = None  # the relative difference it measured

    def __call__(self, step: Any, batch: tuple, chunks: int, cycle_length: int) -> None:
        # Keyed by the micro-batch setting, which every rank shares (a rank's short last batch may be cut in fewer).
        if not self.enabled or step.micro_batches == self.checked or not (chunks > 1 or cycle_length > 1 or
                                                                          is_distributed()):
            return
        if getattr(step, "fsdp", None) is not None:
            self.checked = step.micro_batches
            logger.info("split check: not run on a model sharded with FSDP2")
            return
        found = None
        if step.batch_size >= 2:
            try:
                found = _measure(step, batch, chunks)
            except RuntimeError as exc:
                if not is_oom_error(exc):
                    raise
                found = _SKIP
                logger.warning("split check: skipped, out of memory on a part of the batch")
        if found is _SKIP:
            free_memory(step.device)
        rel = found.rel if isinstance(found, _Measured) else (-1.0 if found is None else 0.0)
        worst = max_across_ranks(rel)  # every rank calls it (DDP): the verdict is the same everywhere
        if worst < 0:  # nobody could compare (one sample, or a chunk without items): the next batch is
            return
        self.checked, self.last = step.micro_batches, worst
        tol = found.tol if isinstance(found, _Measured) else TOLERANCE
        if worst <= tol:
            return
        if isinstance(found, _Measured) and found.rel > found.tol:
            raise SplitCheckError(found.message(step.num_items is not None))
        raise SplitCheckError(f"split check: on another process the weighted chunks' gradient is {worst:.1%} off "
                              f"the full batch's (tolerance {tol:g}); {SWITCH}")


_SKIP = object()  # checked and passed: no gradient to compare (zero or not finite), or out of memory


class _Measured:
    """The three gradients' dot products, and what fits them."""

    def __init__(self, dots: List[float], sizes: Sequence[int], counts: Optional[List[float]], tol: float,
                 candidates: List[Tuple[str, List[float]]]):
        (self.a11, self.a12, self.a22, self.b1, self.b2, self.c), self.sizes, self.counts = dots, sizes, counts
        self.tol, self.candidates = tol, candidates
        self.weights = _shares(counts if counts is not None else sizes)
        self.rel = self.residual(self.weights)

    def residual(self, w: Sequence[float]) -> float:
        """``|w1 g1 + w2 g2 - g| / |g|`` from the dot products (float64: no cancellation at these sizes)."""
        w1, w2 = w
        r2 = (w1 * w1 * self.a11 + 2 * w1 * w2 * self.a12 + w2 * w2 * self.a22 - 2 * (w1 * self.b1 + w2 * self.b2)
              + self.c)
        return math.sqrt(max(r2, 0.0) / self.c)

    def fitted(self) -> Optional[Tuple[float, float]]:
        """The weights that fit best (least squares), or None when the halves' gradients are parallel."""
        det = self.a11 * self.a22 - self.a12 ** 2
        if det <= 1e-9 * self.a11 * self.a22:
            return None
        return ((self.b1 * self.a22 - self.b2 * self.a12) / det, (self.b2 * self.a11 - self.b1 * self.a12) / det)

    def message(self, items: bool) -> str:
        n, (s1, s2) = sum(self.sizes), self.sizes
        rule = "num_items" if items else "samples"
        head = (f"split check: {n} samples of the batch cut into {s1} + {s2} and weighted by {rule} "
                f"({self.weights[0]:.0%} / {self.weights[1]:.0%}) give a gradient {self.rel:.1%} off the {n} "
                f"samples' at once (tolerance {self.tol:g})")
        return f"{head}: {self.cause(items)}; {SWITCH}"

    def cause(self, items: bool) -> str:
        tol = self.tol
        if self.residual((1.0, 1.0)) <= tol:
            return ("the chunks' gradients add up to the batch's, so the loss is a sum, not a mean: make it a mean "
                    "(reduction='mean'; a transformers CTC head: ctc_loss_reduction='mean'), or divide it by the "
                    "samples or items it adds up")
        samples = _shares(self.sizes)
        if items and self.residual(samples) <= tol:
            return ("the loss is a mean over the samples (each sample's loss weighs the same, as CTC's "
                    "reduction='mean' does), not over what num_items counts: drop num_items")
        fits = [text for text, counts in self.candidates if self.residual(_shares(counts)) <= tol]
        if fits:
            return (f"the loss averages over other items than the step weighs by: num_items={fits[0]} fits (checked "
                    f"on this batch)")
        w = self.fitted()
        if w is not None and self.residual(w) <= tol and w[0] + w[1] > 0:
            share = w[0] / (w[0] + w[1])
            what = ("pass num_items=fn(x, y) counting what the loss averages over (its labels that are not its "
                    "ignore_index, after any shift the model makes: a causal LM counts labels[..., 1:])" if not items
                    else "make num_items count exactly what the loss averages over (a causal LM shifts its labels "
                    "inside: count labels[..., 1:]; the loss's own ignore_index; a per-sample mean needs none)")
            return (f"the loss averages over something other than what the step weighs by: the first chunk holds "
                    f"{share:.0%} of it, the step gave it {self.weights[0]:.0%}; {what}")
        return ("no weighting of the chunks gives the batch's gradient, so its rows interact: a sample's loss depends "
                "on the other samples of its chunk (in-batch negatives, a contrastive loss such as CLIP's; or inputs "
                "padded to the chunk's largest one, as torchvision detection pads images of different sizes), and "
                "micro-batches and accumulation change the objective: use micro_batches=1 and accumulation_steps=1 "
                "for this loss, or inputs of one size")


def _shares(values: Sequence[float]) -> Tuple[float, float]:
    total = float(sum(values))
    return (values[0] / total, values[1] / total) if total else (0.5, 0.5)


def _labels(x: Any, y: Any) -> Tuple[str, Any]:
    if isinstance(x, Mapping) and torch.is_tensor(x.get("labels")):
        return 'x["labels"]', x["labels"]
    return "y", y


def _candidates(step: Any, parts: list) -> List[Tuple[str, List[float]]]:
    """The usual num_items counted in each half: the labels that are not the loss's ignore_index (or -100, or,
    among a few classes, any one value), with and without a causal LM's shift."""
    name, first = _labels(*parts[0])
    every = [_labels(x, y)[1] for x, y in parts]
    if not all(torch.is_tensor(t) and not t.is_floating_point() and t.dim() == first.dim() for t in every):
        return []
    found = []
    values = [ignore_index_of(step.loss_fn), -100]
    distinct = torch.unique(torch.cat([t.reshape(-1) for t in every]))
    if len(distinct) <= MAX_CLASSES:  # a few classes (segmentation): any one of them may be the ignored one
        values += distinct.tolist()
    for ignore in dict.fromkeys(values):
        if ignore is None:
            continue
        for shift in ("", "[..., 1:]") if first.dim() > 1 else ("",):
            counts = []
            for labels in every:
                labels = labels[..., 1:] if shift else labels
                counts.append(float((labels != ignore).sum()))
            if all(counts):
                found.append((f"lambda x, y: ({name}{shift} != {ignore}).sum()", counts))
    return found


def _dot(a: Sequence[Optional[torch.Tensor]], b: Sequence[Optional[torch.Tensor]], dtype: torch.dtype) -> Any:
    total = None
    for u, v in zip(a, b):
        if u is not None and v is not None:
            d = torch.dot(u.reshape(-1).to(dtype), v.reshape(-1).to(dtype))
            total = d if total is None else total + d
    return total if total is not None else torch.zeros((), dtype=dtype)


@contextlib.contextmanager
def _full_float32() -> Iterator[None]:
    """Float32 matmuls and convolutions without TF32, restored after."""
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = conv


def _measure(step: Any, batch: tuple, chunks: int) -> Any:
    """The part's and its halves' gradients, compared as the step would combine them; None: nothing to compare."""
    n = step.batch_size
    size = max(2, min(SAMPLES, -(-n // chunks)))  # no larger than the step's chunks: it fits where they fit
    part = batch if n <= size else step._split_pieces(*batch, n, -(-n // size))[0]
    m = step._count_samples(*part)
    if m < 2:
        return None
    halves = step._split_pieces(*part, m, 2)
    sizes = [step._count_samples(*h) for h in halves]
    counts = None
    if step.num_items is not None:
        counts = [float(step.num_items(*h)) for h in halves]
        if not all(c > 0 for c in counts):
            return None  # a half without items has no mean: another batch will be checked
    module = step._module
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return None

    def grads(x: Any, y: Any) -> Optional[list]:
        loss = step.loss_fn(step.model_transform(step.model_fn(module, x)), y)
        if not (torch.is_tensor(loss) and loss.ndim == 0 and loss.requires_grad):
            return None  # the step itself says what is wrong with this loss
        return list(torch.autograd.grad(loss, params, allow_unused=True))

    dtype = torch.float32 if step.device.type == "mps" else torch.float64
    step._extra_passes += 1  # a FLOP count of this iteration would include the check's: the step counts the next
    with _full_float32(), still(module) as held:
        held.replay()
        whole = grads(*part)
        if whole is None:
            return None
        held.replay()  # the first half draws what the part's first rows drew (NumPy, Python)
        first = grads(*halves[0])
        a11, b1 = _dot(first, first, dtype), _dot(first, whole, dtype)
        second = grads(*halves[1])  # continues where the first half stopped
        dots = [a11, _dot(first, second, dtype), _dot(second, second, dtype), b1, _dot(second, whole, dtype),
                _dot(whole, whole, dtype)]
        del whole, first, second
    dots = torch.stack([d.to(dots[0].device) for d in dots]).tolist()  # the check's one host sync
    if not all(map(math.isfinite, dots)) or dots[5] == 0:
        return _SKIP  # a non-finite loss is the guard's to report; a zero gradient has no direction to compare
    low = any(p.dtype not in (torch.float32, torch.float64) for p in params)
    tol = FLOAT8_TOLERANCE if step.float8 is not None else LOW_PRECISION_TOLERANCE if low else TOLERANCE
    return _Measured(dots, sizes, counts, tol, _candidates(step, halves))
