"""The split check: do the weighted chunks of a batch give the full batch's gradient, on the user's own loss?

Micro-batches, accumulation, out-of-memory retries and DDP weigh each chunk's mean loss by its share: of the
samples, or of the items ``num_items`` counts (a chunk that counts none weighs as one item, as a loss divided by
``count.clamp(min=1)`` does). That is one assumption about the loss. :class:`SplitCheck` checks it on the real
batches where a batch is cut or combined, until :data:`REPEATS` batches gave a conclusive pass (again whenever the
number of micro-batches changes), so that a loss whose weights depend on the batch's content is seen on several:

1. a part of the prepared batch and its two pieces, cut where the step cuts it: with the default ``split_batch``,
   half of each of the step's first two chunks (the batch's halves where the step only combines batches:
   accumulation, DDP), their last halves on the first try and every other one, their first halves in between,
   joined. So the part holds at most a chunk's samples (it fits where the chunks fit, in float32, and costs
   about one step at ``micro_batches=2``), crosses the step's cut (a sample and the one at its place in the next
   chunk meet in it) and keeps uneven chunks uneven. With the user's ``split_batch`` (which joining may not
   undo), or after an out-of-memory error, the part is the step's first chunk (or half the batch), cut in two
   by that hook;
2. the gradient with respect to the parameters (``torch.autograd.grad``: ``.grad`` and an accumulation in
   progress are untouched) of the part's loss, and of each piece's, through the step's own hooks
   (``model_fn``, ``model_transform``, ``loss_fn``), in float32 (no autocast, no TF32), with randomness, BatchNorm
   and the model's buffers held still (:func:`ignite_amp.split_check.randomness.still`; every state restored after);
3. the pieces' gradients weighted as the step weighs them, compared with the part's: the relative difference
   ``|w1 g1 + w2 g2 - g| / |g|`` (foreach kernels in the gradients' dtype; float64 dot products only when it
   fails, for the diagnosis) must be at most :data:`TOLERANCE` (:data:`LOW_PRECISION_TOLERANCE` for parameters
   that are not float32, :data:`FLOAT8_TOLERANCE` with float8 layers).

A part whose gradient is zero, not finite or too small to compare (``|g| < TINY * (w1 |g1| + w2 |g2|)``) is
inconclusive: the next cut batch is tried, up to :data:`TRIES` times, then a warning says the loss was not
checked. A part the loss fails on (a batch of stacked views that the default cut breaks) is one line naming
``split_batch``: a :class:`~ignite_amp.errors.SplitCheckError` where the step cuts batches, a warning where it only
combines them. Where the difference is too large, :class:`~ignite_amp.errors.SplitCheckError` stops the run in one
line with the cause (:mod:`ignite_amp.split_check.diagnosis`); a forward that is not the same function on every
call (randomness the check could not hold still, state outside its buffers) is detected and named first.
``check_split=False`` accepts it knowingly. Not checked: a batch of one sample, FSDP2-sharded models. Under DDP
the ranks agree on each verdict (one all-reduce).
"""
import contextlib
import logging
import math
import time
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch

from ignite_amp.batching import split_batch
from ignite_amp.core.collectives import is_distributed, max_across_ranks
from ignite_amp.core.config_keys import BooleanOrFraction
from ignite_amp.core.device import free_memory, is_oom_error
from ignite_amp.core.nested import join_chunks
from ignite_amp.errors import SplitCheckError
from ignite_amp.split_check.diagnosis import (
    SWITCH,
    Measured,
    candidates,
    coincides,
    dots,
    loss_terms,
    shares,
    unkeyed,
    unsteady,
)
from ignite_amp.split_check.protocol import CheckedStep
from ignite_amp.split_check.randomness import still
from ignite_amp.transforms.activation_checkpointing import suspended

__all__ = ["SplitCheck", "REPEATS", "TRIES", "TINY", "TOLERANCE", "LOW_PRECISION_TOLERANCE", "FLOAT8_TOLERANCE",
           "SPOT_BUDGET"]

logger = logging.getLogger("ignite_amp")

#: Batches whose check must pass conclusively (per micro-batch count).
REPEATS = 3
#: Inconclusive tries (zero gradient, out of memory) before the check gives up with a warning.
TRIES = 20
#: The share of the run's step time the spot checks may take (``check_split=True``): after the first checks, one
#: batch in every ``ceil(check's time / (SPOT_BUDGET * step time))`` is checked again, timed as the run goes.
SPOT_BUDGET = 0.02
#: A part's gradient smaller than this fraction of its weighted pieces' is inconclusive (it would compare rounding).
TINY = 1e-2
#: Largest relative gradient difference accepted, float32 parameters (rounding is ~1e-6).
TOLERANCE = 1e-3
#: Largest relative gradient difference accepted for parameters in a lower precision (bfloat16, float16).
LOW_PRECISION_TOLERANCE = 5e-2
#: Largest relative gradient difference accepted with float8 layers: their tensorwise scales are the whole
#: batch's, so a chunk rounds differently (~10%); a sum (50% off in two halves) or a contrastive loss still shows.
FLOAT8_TOLERANCE = 0.25
_VAGUE = ("a zero, tiny or non-finite gradient, a part whose pieces the usual weightings weigh alike, a batch of one "
          "sample, or out of memory")
_INCONCLUSIVE, _UNCUT = -1.0, -0.5  # verdicts the ranks agree on (max): a measured difference is >= 0
_ALIKE = -0.75  # a pass on a part whose pieces another usual weighting weighs as the step does: the other halves next


class _Said(NamedTuple):
    """A verdict without a diagnosis: a pass (``message`` None), or a stop or warning said in ``message``."""

    rel: float  # the measured difference; inf: stop; _UNCUT: warn
    tol: float = TOLERANCE
    message: Optional[str] = None

SPLIT_HOOK = ("pass split_batch=fn(x, y, chunks) that cuts it where its samples are (timm's JsdCrossEntropy: each "
              "chunk holding the same rows of every view), or micro_batches=1")


class SplitCheck:
    """The step's split check: called with the prepared batch before the chunks run (see the module).

    Args:
        enabled: True (spot checks within :data:`SPOT_BUDGET` of the step time), a fraction in (0, 1] (spot checks
            within that share), or False (no check).
        clock: the timer the spot checks' schedule reads (a fake one in tests).
    """

    def __init__(self, enabled: Union[bool, float] = True, clock: Callable[[], float] = time.perf_counter) -> None:
        value = BooleanOrFraction().argument(enabled, "check_split")
        self.enabled = value is not False
        self.budget = SPOT_BUDGET if value is True else float(value or 0.0)
        self.checked: Optional[int] = None  # the micro-batch count the checks run for
        self.passes = 0  # conclusive passes at that count
        self.tries = 0  # inconclusive tries at that count
        self.last: Optional[float] = None  # the relative difference the last conclusive check measured
        self.batches = 0  # batches checked conclusively in the run (spot checks among them)
        self.spots = 0  # spot checks made (conclusive or not)
        self.inconclusive = 0  # checks of the run that stayed inconclusive
        self.interval: Optional[int] = None  # cut batches from one spot check to the next (set after each check)
        self.not_run: Optional[str] = None  # why the check stopped without a verdict (a batch it cannot cut)
        self._limit: Optional[int] = None  # after an out-of-memory error: the most samples a part may hold
        self._clock = clock
        self._ended: Optional[float] = None  # the clock when the last check ended
        self._since = 0  # cut batches since the last check

    @property
    def done(self) -> bool:
        """Whether the first checks at the current micro-batch count are over (spot checks follow)."""
        return self.passes >= REPEATS or self.tries >= TRIES

    def summary(self) -> Optional[str]:
        """What the check did in the run, in one line; None where no batch was cut or combined."""
        if self.not_run and not self.batches:
            return self.not_run
        if not self.batches and not self.inconclusive:
            return None
        if not self.batches:
            tried = "the 1 batch" if self.inconclusive == 1 else f"all {self.inconclusive} batches"
            return (f"split check: inconclusive on {tried} it tried ({_VAGUE}): the weighting of the chunks was "
                    f"never checked")
        spots = f", {self.spots} of them spot checks" if self.spots else ""
        vague = f"; {self.inconclusive} inconclusive" if self.inconclusive else ""
        batches = "1 batch" if self.batches == 1 else f"{self.batches} batches"
        return f"split check: {batches} checked, exact within tolerance{spots}{vague}"

    def __call__(self, step: CheckedStep, batch: tuple, chunks: int, cycle_length: int) -> None:
        if not self.enabled or not (chunks > 1 or cycle_length > 1 or is_distributed()):
            return
        if step.micro_batches != self.checked:  # keyed by the setting every rank shares
            self.checked, self.passes, self.tries = step.micro_batches, 0, 0
        self._since += 1
        spot = self.done
        if spot and (self.interval is None or self._since < self.interval):
            return
        if step.fsdp is not None:
            self.passes, self.interval = REPEATS, None
            logger.info("split check: not run on a model sharded with FSDP2")
            self.enabled = False
            return
        started = self._clock()
        found: Any = _INCONCLUSIVE
        oom = False
        if step.batch_size >= 2:
            try:
                small = self._limit is not None or step.oom_count > 0
                last = self.passes % 2 == 0
                found = _measure(step, batch, chunks, small, last, self._limit, seed=self.batches + self.inconclusive)
                if isinstance(found, float) and found == _ALIKE:  # the batch's other halves may tell them apart
                    found = _measure(step, batch, chunks, small, not last, self._limit,
                                     seed=self.batches + self.inconclusive)
                if isinstance(found, float) and found == _ALIKE:
                    found = _INCONCLUSIVE
            except RuntimeError as exc:
                if not is_oom_error(exc):
                    raise
                oom = True
        if oom:
            free_memory(step.device)
            self._limit = max(2, (self._limit or step.batch_size) // 2)
            found = _INCONCLUSIVE
            logger.warning("split check: out of memory on a part of the batch: the next try takes at most %d "
                           "samples", self._limit)
        rel = found if isinstance(found, float) else found.rel
        worst = max_across_ranks(rel)  # every rank calls it (DDP): the verdict is the same everywhere
        self.spots += spot
        self._conclude(step, found, worst, chunks)
        self._schedule(started)

    def _schedule(self, started: float) -> None:
        """The next spot check: the last check's time over the budget's share of the steps' time since the one
        before (the first checks run on consecutive batches, so the steps' time is known after two)."""
        ended = self._clock()
        cost = ended - started
        step = (started - self._ended) / self._since if self._ended is not None and self._since else cost
        self._ended, self._since = ended, 0
        interval = max(1, math.ceil(cost / (self.budget * step))) if step > 0 and cost > 0 else 1
        # every rank checks the same batches (the verdict is a collective): the longest interval of any rank
        self.interval = int(max_across_ranks(float(interval)))

    def _conclude(self, step: CheckedStep, found: Any, worst: float, chunks: int) -> None:
        if worst == _INCONCLUSIVE:
            self.tries += 1
            self.inconclusive += 1
            if self.tries == TRIES and not self.passes:
                logger.warning("split check: inconclusive on %d batches (%s, each time): the weighting of the chunks "
                               "is not checked yet; spot checks go on through the run", TRIES, _VAGUE)
            return
        if worst == _UNCUT:  # the batch cannot be cut, and the step does not cut it: nothing to check
            self.tries, self.enabled = TRIES, False
            if isinstance(found, _Said) and found.message:  # said once, and in the run's summary
                self.not_run = f"{found.message} (the step only combines whole batches: not checked)"
                logger.info(self.not_run)
            return
        if isinstance(found, _Said) and found.message:
            raise SplitCheckError(found.message)
        tol = _tolerance(step)  # the same on every rank: a pass on another rank is judged as there
        if worst <= tol:
            self.passes, self.last, self.batches = self.passes + 1, worst, self.batches + 1
            return
        self.last = worst
        if isinstance(found, Measured) and found.rel > found.tol:
            raise SplitCheckError(found.message(step.num_items is not None))
        raise SplitCheckError(f"split check: on another process the weighted chunks' gradient is {worst:.1%} off "
                              f"the full batch's (tolerance {tol:g}); {SWITCH}")


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


def _cut(step: CheckedStep, batch: Tuple[Any, Any], chunks: int, small: bool, last: bool, limit: Optional[int] = None
         ) -> Optional[Tuple[tuple, List[tuple]]]:
    """The part and its two pieces, cut where the step cuts (see the module); None when there is nothing to cut.
    ``last``: the pieces are the last halves of the two chunks, else their first halves. ``small`` (after an
    out-of-memory error): the part is the first chunk, or its first ``limit`` samples."""
    n = step.batch_size
    firsts = step.split(*batch, n, max(chunks, 2))[:2]  # the step's first two chunks, or the batch's halves
    if step.split_batch is split_batch and not small:
        pieces = [_half(step, chunk, i, last) for i, chunk in enumerate(firsts)]
        sizes = [step.count_samples(*c) for c in pieces]
        part = (join_chunks([c[0] for c in pieces], sizes), join_chunks([c[1] for c in pieces], sizes))
        if step.count_samples(*part) == sum(sizes):
            return part, pieces
    part = firsts[0]  # one chunk (it fits), cut in two by the step's split_batch
    m = step.count_samples(*part)
    if limit is not None and m > limit:
        part = step.split(*part, m, -(-m // limit))[0]
        m = step.count_samples(*part)
    return (part, step.split(*part, m, 2)) if m >= 2 else None


def _half(step: CheckedStep, chunk: Tuple[Any, Any], index: int, last: bool) -> tuple:
    """Half of a chunk: its last floor(s / 2) rows, or its first ceil(s / 2) (the first chunk) or at most
    floor(s / 2) (the second): the two halves hold at most a chunk's samples."""
    size = step.count_samples(*chunk)
    if size < 2:
        return chunk
    if last or index == 0:
        return step.split(*chunk, size, 2)[1 if last else 0]
    return step.split(*chunk, size, -(-size // (size // 2)))[0]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _measure(step: CheckedStep, batch: tuple, chunks: int, small: bool, last: bool, limit: Optional[int] = None,
             seed: int = 0) -> Any:
    """A :class:`Measured` (failed), :data:`_INCONCLUSIVE`, or a :class:`_Said`: passed, or a forward the check
    could not hold still, or a batch the loss fails on once cut (``inf``: stop; :data:`_UNCUT`: warn). Activation
    checkpointing is suspended throughout (it does not change the math); ``seed`` varies the keyed draws."""
    try:
        cut = _cut(step, batch, chunks, small, last, limit)
    except Exception as exc:  # noqa: BLE001 (a hook's error, said in one line)
        return _uncut(chunks, f"split check: split_batch cannot cut the batch in two ({_first_line(exc)}): "
                              f"{SPLIT_HOOK}")
    if cut is None:
        return _INCONCLUSIVE
    part, pieces = cut
    module = step.module
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return _INCONCLUSIVE
    sizes = [step.count_samples(*p) for p in pieces]
    counts = None if step.num_items is None else [float(step.num_items(*p)) for p in pieces]
    if counts is not None and not all(c >= 0 for c in counts):
        return _INCONCLUSIVE  # a negative or NaN count: the step's own check says so
    w1, w2 = shares(counts if counts is not None else sizes)
    m = sum(sizes)

    def grads(x: Any, y: Any, n: int) -> Optional[List[torch.Tensor]]:
        with held.forward(x, y, n):  # the backward runs without the dispatch modes (nothing random in it)
            loss = step.loss_fn(step.model_transform(step.model_fn(module, x)), y)
        if not (torch.is_tensor(loss) and loss.ndim == 0 and loss.requires_grad):
            return None  # the step itself says what is wrong with this loss
        return list(torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True))

    step.note_extra_pass()  # a FLOP count of this iteration would include the check's: the step counts the next
    with _full_float32(), suspended(), still(module, forwards_only=True, seed=seed) as held:
        try:
            for _ in range(3):  # again only where random operators were keyed wrong (see Still.learn)
                held.reset()
                whole = grads(part[0], part[1], m)
                if whole is None:
                    return _INCONCLUSIVE
                changed = held.changed()
                held.reset()  # the first piece draws what the part's first rows drew (NumPy, Python)
                first = grads(pieces[0][0], pieces[0][1], sizes[0])
                held.reset(replay=False)  # the second piece continues where the first stopped
                second = grads(pieces[1][0], pieces[1][1], sizes[1])
                again, unkeyable = held.learn([m, *sizes])
                if not again:
                    break
        except RuntimeError as exc:
            if is_oom_error(exc):
                raise
            return _uncut(chunks, _cannot(m, exc))
        except Exception as exc:  # noqa: BLE001 (the loss on a cut it cannot take, said in one line)
            return _uncut(chunks, _cannot(m, exc))
        if whole is None or first is None or second is None:  # a piece's loss has no gradient (no item in it)
            return _INCONCLUSIVE
        rel, conclusive = _difference(whole, first, second, (w1, w2))
        if not conclusive:
            return _INCONCLUSIVE
        tol = _tolerance(step)
        if rel <= tol:
            if coincides(step, batch, chunks, pieces, (w1, w2)):
                return _ALIKE  # this part cannot tell the step's weighting from another: another part
            return _Said(rel, tol)
        if unkeyable:
            return _Said(math.inf, tol, unkeyed(m, rel, tol, unkeyable))
        drew = held.drew()
        if drew:  # a draw per forward rather than per row: the second piece from the entry state too
            held.reset()
            second_again = grads(pieces[1][0], pieces[1][1], sizes[1])
            again_rel = math.inf if second_again is None else _difference(whole, first, second_again, (w1, w2))[0]
            if again_rel <= tol:
                return _Said(again_rel, tol)
        held.reset()
        whole_again = grads(part[0], part[1], m)
        if whole_again is None:  # the part's loss had a gradient the first time: not this time
            return _INCONCLUSIVE
        drift = _difference(whole, whole_again, [torch.zeros_like(g) for g in whole], (1.0, 0.0))[0]
        if drift > tol:
            return _Said(math.inf, tol, unsteady(m, rel, tol, sorted(held.unheld), drew, changed))
        dtype = torch.float32 if step.device.type == "mps" else torch.float64
        products = dots(whole, first, second, dtype)
        del whole, first, second
        terms = loss_terms(step, module, params, part, pieces, held, dtype)
    return Measured(products, sizes, counts, tol, candidates(step.loss_fn, pieces), terms)


def _tolerance(step: CheckedStep) -> float:
    """The largest difference accepted for the step's model (its parameters' precision, float8 layers)."""
    if step.float8 is not None:
        return FLOAT8_TOLERANCE
    low = any(p.dtype not in (torch.float32, torch.float64) for p in step.module.parameters() if p.requires_grad)
    return LOW_PRECISION_TOLERANCE if low else TOLERANCE


def _uncut(chunks: int, message: str) -> _Said:
    return _Said(math.inf if chunks > 1 else _UNCUT, TOLERANCE, message)


def _cannot(m: int, exc: BaseException) -> str:
    return (f"split check: the loss fails on {m} samples of the batch cut by split_batch ({_first_line(exc)}): the "
            f"batch cannot be cut there; {SPLIT_HOOK}")


def _difference(whole: List[torch.Tensor], first: List[torch.Tensor], second: List[torch.Tensor],
                w: Tuple[float, float]) -> Tuple[float, bool]:
    """``|w1 g1 + w2 g2 - g| / |g|`` and whether it is conclusive (``g`` finite, and not small beside the weighted
    pieces'), with foreach kernels and one host read."""
    diff = torch._foreach_mul(first, w[0])
    torch._foreach_add_(diff, second, alpha=w[1])
    torch._foreach_sub_(diff, whole)
    norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32)))
             for ts in (diff, whole, first, second)]
    d, g, n1, n2 = torch.stack([t.to(norms[0].device) for t in norms]).tolist()
    if not all(map(math.isfinite, (d, g, n1, n2))) or g == 0 or g < TINY * (w[0] * n1 + w[1] * n2):
        return math.inf, False
    return d / g, True
