"""What a failed split check says: the cause the gradients point at, decided from the measured gradients.

:class:`Measured` holds the dot products of the part's gradient ``g`` and its two pieces' ``g1``, ``g2`` (float64,
computed only when the check failed) and tells, by the residual ``|w1 g1 + w2 g2 - g| / |g|`` of each weighting:

- ``(1, 1)`` fits: the loss is a sum;
- the samples' shares fit while the step weighs by ``num_items``: a per-sample mean;
- one of the usual counts fits (labels that are not the loss's ignore_index, with or without a causal LM's shift;
  a class-weighted loss's ``weight[y].sum()``): it is named, as the loss behaved on this batch;
- some other weighting fits: the loss averages over something else (the share it found);
- none fits, and the loss's terms (a dict of losses, as torchvision detection returns) each fit a weighting of
  their own: two means of different counts in one loss;
- none fits: rows interact.

A forward that is not the same function on every call (randomness or state the check could not hold still) is
detected by the check itself (:mod:`ignite_amp.split_check.check`) and named before any of these.
"""
import math
from collections.abc import Mapping
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from ignite_amp.batching import ignore_index_of
from ignite_amp.split_check.protocol import CheckedStep

#: A piece's gradient smaller than this fraction of the part's is taken for none (the check's own TINY).
TINY = 1e-2

__all__ = ["Measured", "candidates", "shares", "dots", "coincides", "unkeyed", "unsteady", "loss_terms", "SWITCH"]

#: Labels with at most this many distinct values have each tried as the ignored one when naming a num_items.
MAX_CLASSES = 32
SWITCH = "or pass check_split=False (config: amp.check_split: false) to accept it knowingly"


def shares(counts: Sequence[float]) -> Tuple[float, float]:
    """The weights the step gives two chunks of ``counts`` items (or samples): a chunk that counts none weighs as
    one item (a loss divided by ``count.clamp(min=1)``), any other as its count (a fraction too: a sum of per-sample
    weights); the cycle divides by the items it counted (or by one, where it counted none)."""
    least = [float(c) if c > 0 else 1.0 for c in counts]
    total = float(sum(counts)) if sum(counts) > 0 else 1.0
    return least[0] / total, least[1] / total


def dots(g: Sequence[torch.Tensor], g1: Sequence[torch.Tensor], g2: Sequence[torch.Tensor], dtype: torch.dtype
         ) -> List[float]:
    """``[g1.g1, g1.g2, g2.g2, g1.g, g2.g, g.g]`` over all parameters, in ``dtype`` (one host sync)."""
    def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Union[torch.Tensor, int]:  # 0: no tensors
        return sum(torch.dot(u.reshape(-1).to(dtype), v.reshape(-1).to(dtype)) for u, v in zip(a, b, strict=True))
    found = [dot(g1, g1), dot(g1, g2), dot(g2, g2), dot(g1, g), dot(g2, g), dot(g, g)]
    device = found[-1].device if isinstance(found[-1], torch.Tensor) else None
    return torch.stack([torch.as_tensor(d, dtype=dtype, device=device) for d in found]).tolist()


class Measured:
    """The three gradients' dot products, and what fits them."""

    def __init__(self, products: List[float], sizes: Sequence[int], counts: Optional[List[float]], tol: float,
                 named: List[Tuple[str, List[float]]], terms: Optional[List[Tuple[str, List[float]]]] = None):
        (self.a11, self.a12, self.a22, self.b1, self.b2, self.c), self.sizes, self.counts = products, sizes, counts
        self.tol, self.named, self.terms = tol, named, terms or []
        self.weights = shares(counts if counts is not None else sizes)
        self.rel = self.residual(self.weights)

    def residual(self, w: Sequence[float]) -> float:
        """``|w1 g1 + w2 g2 - g| / |g|`` from the dot products (float64: no cancellation at these sizes)."""
        return _residual(w, (self.a11, self.a12, self.a22, self.b1, self.b2, self.c))

    def fitted(self) -> Optional[Tuple[float, float]]:
        """The weights that fit best (least squares), or None when the pieces' gradients are parallel."""
        return _fitted((self.a11, self.a12, self.a22, self.b1, self.b2, self.c))

    def message(self, items: bool) -> str:
        n, (s1, s2) = sum(self.sizes), self.sizes
        rule = "num_items" if items else "samples"
        head = (f"split check: {n} samples of the batch cut into {s1} + {s2} and weighted by {rule} "
                f"({self.weights[0]:.0%} / {self.weights[1]:.0%}) give a gradient {self.rel:.1%} off the {n} "
                f"samples' at once (tolerance {self.tol:g})")
        return f"{head}: {self.cause(items)}; {SWITCH}"

    def fits(self, w: Sequence[float]) -> bool:
        return self.residual(w) <= self.tol

    def cause(self, items: bool) -> str:
        """The cause, from the weightings that make the part exact (each tried on the measured gradients): a mean
        of other counts first, a sum only where both pieces have a gradient, else what was measured."""
        if items and self.fits(shares(self.sizes)):
            return ("the loss is a mean over the samples (each sample's loss weighs the same, as CTC's "
                    "reduction='mean' does), not over what num_items counts: drop num_items (checked on this batch)")
        empty = [i for i, a in enumerate((self.a11, self.a22)) if a <= (TINY ** 2) * self.c]
        if not empty and self.fits((1.0, 1.0)):  # both pieces have a gradient, and they add up to the part's
            return ("the chunks' gradients add up to the batch's, so the loss is a sum over the samples, not a mean: "
                    "divide it by the samples it adds up (reduction='none', then .mean(); KLDivLoss: 'batchmean'), "
                    "which makes the chunks exact (checked on this batch); reduction='mean' is the same only where "
                    "it averages over the samples (CTCLoss's, and a transformers CTC head's ctc_loss_reduction='mean', "
                    "also divide each sample by its target length: exact too, but another objective)")
        fits = [text for text, counts in self.named if self.fits(shares(counts))]
        if fits:
            return (f"the loss averages over other items than the step weighs by: num_items={fits[0]} fits (checked "
                    f"on this batch)")
        if len(empty) == 1 and self.fits((1.0, 0.0) if empty[0] == 1 else (0.0, 1.0)):
            # one piece without a gradient: only the other's weight is measured, and it is the whole part's
            return (f"the piece of {self.sizes[empty[0]]} samples has no gradient at all (nothing in it that the "
                    f"loss averages over: its labels all ignored, say) and the other piece's gradient is the whole "
                    f"part's, yet the step gave the empty one a share: pass num_items=fn(x, y) counting what the "
                    f"loss averages over (0 in such a chunk)")
        w = self.fitted()
        if w is not None and self.fits(w) and w[0] + w[1] > 0:
            share = w[0] / (w[0] + w[1])
            what = ("pass num_items=fn(x, y) counting what the loss averages over (the labels it does not ignore, "
                    "after any shift the model makes inside; class weights: their sum over the labels)" if not items
                    else "make num_items count exactly what the loss averages over (after any shift the model "
                    "makes inside; the loss's own ignore_index; a per-sample mean needs none)")
            return (f"the loss averages over something other than what the step weighs by: the first chunk holds "
                    f"{share:.0%} of it (the weighting that makes the part exact, measured), the step gave it "
                    f"{self.weights[0]:.0%}; {what}; where the model draws what it averages over itself (a mask "
                    f"drawn inside forward), no num_items can count it: use micro_batches=1 and accumulation_steps=1")
        means = self.two_means()
        if means:
            return means
        closest = f" (the closest, {w[0]:.2f} and {w[1]:.2f}, leaves {self.residual(w):.1%})" if w is not None else ""
        return (f"no weighting of the two pieces gives the part's gradient{closest}, so the check cannot tell why; "
                f"the usual causes: rows interact (a sample's loss depends on the other samples of its chunk: "
                f"in-batch negatives or pairs, a contrastive or batch-hard loss, inputs padded to the chunk's largest "
                f"one as torchvision detection pads images of different sizes), the loss adds means over different "
                f"counts (a per-sample and a per-token mean in one loss: weigh each term inside it), or rows that "
                f"belong together were cut apart (views of one image stacked, as AugMix's JsdCrossEntropy takes "
                f"them: pass split_batch=fn(x, y, chunks) that keeps them together); for the first two, "
                f"micro-batches and accumulation change the objective: use micro_batches=1 and accumulation_steps=1")

    def two_means(self) -> str:
        """The loss's terms each fit a weighting but not the same one: two means of different counts."""
        found = []
        for name, products in self.terms:
            if products[5] <= 0:
                continue
            w = _fitted(products)
            if w is None or _residual(w, products) > self.tol or w[0] + w[1] <= 0:
                return ""  # a term whose rows interact: that is the cause
            found.append((name, w[0] / (w[0] + w[1])))
        if len(found) < 2 or max(s for _, s in found) - min(s for _, s in found) < 0.02:
            return ""
        listed = ", ".join(f"{name} {share:.0%}" for name, share in found)
        return (f"the loss adds means over different counts: each of its terms is a mean, but the first chunk holds "
                f"a different share of what each averages over ({listed}; the step gave it {self.weights[0]:.0%}), "
                f"so no one num_items weighs them all (torchvision's RoI and mask losses average over the batch's "
                f"sampled RoIs): use micro_batches=1 and accumulation_steps=1, or weigh each term inside the loss")


def _residual(w: Sequence[float], p: Sequence[float]) -> float:
    a11, a12, a22, b1, b2, c = p
    w1, w2 = w
    r2 = w1 * w1 * a11 + 2 * w1 * w2 * a12 + w2 * w2 * a22 - 2 * (w1 * b1 + w2 * b2) + c
    return math.sqrt(max(r2, 0.0) / c) if c > 0 else math.inf


def _fitted(p: Sequence[float]) -> Optional[Tuple[float, float]]:
    a11, a12, a22, b1, b2, _ = p
    det = a11 * a22 - a12 ** 2
    if det <= 1e-9 * a11 * a22:
        return None
    return (b1 * a22 - b2 * a12) / det, (b2 * a11 - b1 * a12) / det


def _labels(x: Any, y: Any) -> Tuple[str, Any]:
    if isinstance(x, Mapping) and torch.is_tensor(x.get("labels")):
        return 'x["labels"]', x["labels"]
    return "y", y


def _class_weight(loss_fn: Any) -> Optional[torch.Tensor]:
    """The loss's class weights: its ``weight`` (a loss module), a ``functools.partial``'s ``weight=``, or the one
    1-d floating tensor a function reads from its closure or globals (``lambda out, y: cross_entropy(out, y,
    weight=w)``); a guess the
    residual of the measured gradients confirms or not before anything is said."""
    weight = getattr(loss_fn, "weight", None)
    if weight is None and hasattr(loss_fn, "keywords"):  # functools.partial(cross_entropy, weight=...)
        weight = loss_fn.keywords.get("weight")
    code = getattr(loss_fn, "__code__", None)
    if weight is None and code is not None:  # what the function's body reads: its closure and its globals
        values = []
        for cell in getattr(loss_fn, "__closure__", None) or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                continue
        names = getattr(loss_fn, "__globals__", {})
        values += [names[name] for name in code.co_names if name in names]
        held = [v for v in values if torch.is_tensor(v) and v.dim() == 1 and v.is_floating_point()]
        weight = held[0] if len(held) == 1 else None
    return weight if torch.is_tensor(weight) and weight.dim() == 1 else None


def candidates(loss_fn: Any, parts: list) -> List[Tuple[str, List[float]]]:
    """The usual num_items counted in each piece: the labels that are not the loss's ignore_index (or -100, or,
    among a few classes, any one value), with and without a causal LM's shift; a class-weighted loss's
    ``weight[y].sum()``."""
    name, first = _labels(*parts[0])
    every = [_labels(x, y)[1] for x, y in parts]
    if not all(torch.is_tensor(t) and not t.is_floating_point() and t.dim() == first.dim() for t in every):
        return []
    found = []
    ignored = ignore_index_of(loss_fn)
    weight = _class_weight(loss_fn) if name == "y" else None
    if weight is not None:
        skip = -100 if ignored is None else ignored
        kept = [t[t != skip] for t in every]
        if all(bool(((k >= 0) & (k < len(weight))).all()) for k in kept):
            text = "weight[y].sum()" if all(len(k) == t.numel() for k, t in zip(kept, every, strict=True)) else \
                f"weight[y[y != {skip}]].sum()"
            found.append((f"lambda x, y: {text} (weight: the loss's class weights)",
                          [float(weight.detach().cpu()[k.cpu()].sum()) for k in kept]))
    values = [ignored, -100]
    distinct = torch.unique(torch.cat([t.reshape(-1) for t in every]))
    if len(distinct) <= MAX_CLASSES:  # a few classes (segmentation): any one of them may be the ignored one
        values += distinct.tolist()
    for ignore in dict.fromkeys(values):
        if ignore is None:
            continue
        for shift in ("", "[..., 1:]") if first.dim() > 1 else ("",):
            counts = [float(((labels[..., 1:] if shift else labels) != ignore).sum()) for labels in every]
            if any(counts):  # a piece that counts none weighs as one item (see shares)
                found.append((f"lambda x, y: ({name}{shift} != {ignore}).sum()", counts))
    return found


def coincides(step: CheckedStep, batch: Tuple[Any, Any], chunks: int, pieces: List[tuple], w: Tuple[float, float]
              ) -> bool:
    """Whether a pass proves nothing: another usual weighting (the samples, where the step weighs by num_items; a
    count :func:`~ignite_amp.split_check.diagnosis.candidates` names) gives the part's pieces the step's shares by
    coincidence (two labelled tokens in each), while it gives the step's own chunks other shares than the step
    does. The step's chunks would then be weighed wrong without the check seeing it."""
    firsts = step.split(*batch, step.batch_size, max(chunks, 2))[:2]
    sizes = [step.count_samples(*c) for c in firsts]
    counts = None if step.num_items is None else [float(step.num_items(*c)) for c in firsts]
    if counts is not None and not all(c >= 0 for c in counts):
        return False
    steps = shares(counts if counts is not None else sizes)  # what the step gives its chunks
    ignored = ignore_index_of(step.loss_fn)
    marks = ("!= -100)", "weight[") + ((f"!= {ignored})",) if ignored is not None else ())
    likely = lambda found: {t: c for t, c in found if any(m in t for m in marks)}  # noqa: E731  (not "any class")
    others = likely(candidates(step.loss_fn, firsts))
    if step.num_items is not None:
        others["the samples"] = [float(s) for s in sizes]
        piece_counts = {"the samples": [float(step.count_samples(*p)) for p in pieces]}
    else:
        piece_counts = {}
    piece_counts.update(likely(candidates(step.loss_fn, pieces)))
    for text, on_pieces in piece_counts.items():
        on_chunks = others.get(text)
        if on_chunks is None:
            continue
        same_here = abs(shares(on_pieces)[0] - w[0]) < 1e-3
        differs_there = abs(shares(on_chunks)[0] - steps[0]) > 1e-3
        if same_here and differs_there:
            return True
    return False


def unkeyed(m: int, rel: float, tol: float, names: List[str]) -> str:
    return (f"split check: {m} samples of the batch cut in two give a gradient {rel:.1%} off theirs at once "
            f"(tolerance {tol:g}), but the forward draws with torch.{', torch.'.join(names)} in a way no per-sample "
            f"key can serve (a draw over the batch's rows together, such as a permutation of its samples, or a call "
            f"made in some forwards only), so the check cannot tell whether the chunks are exact: such a draw mixes "
            f"a chunk's samples, not the batch's (use micro_batches=1 and accumulation_steps=1 for it), or pass "
            f"check_split=False (config: amp.check_split: false) if the loss is a mean over what the step weighs by")


def unsteady(m: int, rel: float, tol: float, unheld: List[str], drew: List[str], changed: List[str]) -> str:
    if unheld:
        what = f"draws randomness with torch operators the check cannot hold still ({', '.join(unheld)})"
    elif drew:
        what = (f"draws from {' and '.join(drew)} random generator in a way the check cannot hold still (neither "
                f"per sample nor once per forward)")
    else:
        kept = f"; it changes its buffers {', '.join(changed[:3])} too" if changed else ""
        what = f"gives another gradient on the same samples at each call (state kept outside its buffers{kept})"
    return (f"split check: {m} samples of the batch cut in two give a gradient {rel:.1%} off theirs at once "
            f"(tolerance {tol:g}), but the forward {what}, so the check cannot tell whether the chunks are exact: "
            f"hold that randomness or state still in training, or pass check_split=False (config: "
            f"amp.check_split: false) if the loss is a mean over what the step weighs by")


def loss_terms(step: CheckedStep, module: Any, params: list, part: tuple, pieces: list, held: Any, dtype: torch.dtype
               ) -> List[Tuple[str, List[float]]]:
    """The dot products of each loss term, where the model returns its losses as a dict of 0-d tensors
    (torchvision detection) that the loss adds: for the diagnosis of two means."""
    outputs = []
    for i, (x, y) in enumerate([part, *pieces]):
        held.reset(replay=i < 2)
        with held.forward(x, y, step.count_samples(x, y)):
            out = step.model_transform(step.model_fn(module, x))
        if not (isinstance(out, dict) and len(out) > 1 and
                all(torch.is_tensor(v) and v.ndim == 0 for v in out.values())):
            return []
        outputs.append(out)
    found = []
    for name in outputs[0]:
        g = [list(torch.autograd.grad(o[name], params, allow_unused=True, materialize_grads=True, retain_graph=True))
             if o[name].requires_grad else [torch.zeros_like(p) for p in params] for o in outputs]
        found.append((repr(name), dots(g[0], g[1], g[2], dtype)))
    return found
