"""``dtype: auto`` on a CPU decided by evidence: a short timed probe of the model's own training step.

Whether bfloat16 autocast is faster than float32 on a CPU with AVX512-BF16 but no AMX depends on the
torch build (the quickstart ran at 0.78-0.81x float32's speed on torch 2.15.0 and 1.24x on 2.14.1 on the
same 2-core AMD EPYC, benchmarks/RESULTS.md), so no fixed rule is right there.
:func:`~ignite_amp.probe_cpu_dtype` times both on the model; :func:`~ignite_amp.run.dtype_probe.config_dtype`
is what a config run (the CLI, ``train_from_config``) and ``ignite-amp plan`` ask. The probe's choice is kept per
machine and model (``ignite_amp.files.dtype_choice``), so a later run, a plan and a resume make the same one;
an inconclusive probe (over its budget, or a close call) chooses float32, the safe choice, and says so.
Elsewhere the choice is fixed without a probe: ``ignite_amp.core.device.resolve_dtype``'s rule.
"""
import dataclasses
import hashlib
import json
import os
import re
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

import ignite.distributed as idist
import torch
import torch.nn.functional as F
from torch import nn

from ignite_amp.config.tree import Config
from ignite_amp.core.device import cpu_has_amx, cpu_has_native_bf16, cpu_model, dtype_name
from ignite_amp.errors import ConfigError
from ignite_amp.files.dtype_choice import choices_path, keep_choice, kept_choice, shown_path
from ignite_amp.run.builders import input_shape
from ignite_amp.split_check.randomness import still

__all__ = ["probe_cpu_dtype", "DtypeProbe", "config_dtype", "brief_why", "choice_key", "PROBE_ENV", "FASTER"]

#: An environment variable that fixes the probe's outcome of a config run (``float32`` or ``bfloat16``),
#: where the choice is open: runs whose dtype must not depend on timing (the test suite sets it).
PROBE_ENV = "IGNITE_AMP_DTYPE_PROBE"
#: bfloat16 wins when its fastest step time is at most this fraction of float32's. Between this and its inverse
#: (0.8x-1.25x) the probe calls it a close call and chooses float32: a few percent either way is within what the
#: machine's load moves, and float32's numerics are the safer ones.
FASTER = 0.8


@dataclasses.dataclass(frozen=True)
class DtypeProbe:
    """What :func:`~ignite_amp.probe_cpu_dtype` measured and chose."""

    #: the faster dtype: ``torch.bfloat16`` (autocast) or ``torch.float32``
    dtype: torch.dtype
    #: bfloat16's fastest step time over float32's
    ratio: float
    #: the probe's wall time, warm-up included, in seconds
    seconds: float
    #: timed (float32, bfloat16) pairs
    pairs: int
    #: why the probe could not tell (``""`` where it could): over its budget, or a close call; float32 then
    inconclusive: str = ""

    def words(self) -> str:
        """The evidence in words, for a start line: ``a bfloat16 step took 0.70x float32's time in a 0.3 s probe
        on this CPU``, and ``: a close call (...), so float32, the safe choice`` where it could not tell."""
        seconds = f"{self.seconds:.1f}" if self.seconds >= 0.1 else f"{self.seconds:.2f}"
        words = f"a bfloat16 step took {self.ratio:.2f}x float32's time in a {seconds} s probe on this CPU"
        return f"{words}: {self.inconclusive}, so float32, the safe choice" if self.inconclusive else words


def brief_why(why: str) -> str:
    """:func:`config_dtype`'s reason, short enough for the start line: without where the choice is kept (the run
    facts and train.log have the whole of it), and a kept choice without the evidence it was made on."""
    why = why.split("; kept in ")[0].split("; not kept: ")[0]
    kept = re.match(r"this machine's choice for this model since (\S+)", why)
    if kept:
        return f"chosen on this machine on {kept.group(1)}"
    probe = re.fullmatch(r"a bfloat16 step took (\S+)x float32's time in a (\S+) s probe on this CPU(: .*)?", why)
    if probe and probe.group(3):
        return f"a {probe.group(2)} s probe could not tell, so float32"
    if probe:
        return f"bfloat16 took {probe.group(1)}x float32's time in a {probe.group(2)} s probe"
    return why.split(" (emulated")[0].split("; ")[0]


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, dtype: torch.dtype) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = loss_fn(model(x), y)
    if params and loss.requires_grad:
        torch.autograd.grad(loss.float(), params, allow_unused=True)  # never touches .grad


def probe_cpu_dtype(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor], loss_fn: Callable = F.cross_entropy,
                    *, budget_s: float = 2.0, max_pairs: int = 3,
                    clock: Callable[[], float] = time.perf_counter) -> DtypeProbe:
    """Time ``model``'s training step (forward, ``loss_fn(model(x), y)``, backward by ``torch.autograd.grad``) on
    ``batch = (x, y)`` in float32 and under bfloat16 autocast on the CPU, and return the faster
    (:class:`~ignite_amp.run.dtype_probe.DtypeProbe`).

    The two run interleaved: one warm-up step each, then timed (float32, bfloat16) pairs, the order
    alternating, until ``max_pairs`` pairs or ``budget_s`` seconds since the start (at least one pair).
    bfloat16 is chosen when its fastest step is at most :data:`~ignite_amp.run.dtype_probe.FASTER` (0.8)
    times float32's fastest: each dtype's fastest step, since other work on the machine only ever adds time.
    The probe is inconclusive, and chooses float32 (``inconclusive`` says why), when the budget ran out before
    ``max_pairs`` pairs (a busy machine: too few steps to tell) or on a close call (0.8x-1.25x).
    The step runs under ``ignite_amp.split_check.randomness.still``: no random generator is drawn from and no
    BatchNorm statistic changes; the parameters, their ``.grad``, the buffers and the training flag are
    as they were. ``clock`` is the timer (a fake one makes the decision deterministic in tests).

    The timing is the machine's at that moment; a config run keeps the first choice per machine and model
    (``ignite_amp.files.dtype_choice``) so that its runs repeat.
    """
    if max_pairs < 1 or budget_s < 0:
        raise ValueError(f"max_pairs must be >= 1 and budget_s >= 0; got max_pairs={max_pairs}, budget_s={budget_s}")
    x, y = batch
    times: Dict[torch.dtype, List[float]] = {torch.float32: [], torch.bfloat16: []}
    start = clock()
    with still(model):
        for dtype in times:  # warm-up: first-call costs (allocations, kernel choice) out of the figures
            _step(model, x, y, loss_fn, dtype)
        while not times[torch.float32] or (len(times[torch.float32]) < max_pairs and clock() - start < budget_s):
            order = list(times) if len(times[torch.float32]) % 2 == 0 else list(times)[::-1]
            for dtype in order:
                began = clock()
                _step(model, x, y, loss_fn, dtype)
                times[dtype].append(clock() - began)
    f32, bf16 = min(times[torch.float32]), min(times[torch.bfloat16])  # load only adds time
    ratio, pairs = (bf16 / f32 if f32 > 0 else 1.0), len(times[torch.float32])
    inconclusive = ""
    if pairs < max_pairs:
        inconclusive = f"over its {budget_s:g} s budget after {pairs} of {max_pairs} timed pairs"
    elif FASTER < ratio < 1 / FASTER:
        inconclusive = f"a close call (bfloat16 must take at most {FASTER:g}x float32's time)"
    chosen = torch.bfloat16 if ratio <= FASTER and not inconclusive else torch.float32
    return DtypeProbe(chosen, ratio, clock() - start, pairs, inconclusive)


def _per_forward(cfg: Config) -> int:
    size = cfg.data.batch_size
    return max(1, (size if isinstance(size, int) else 1) // cfg.amp.micro_batches)


def _batch(cfg: Config, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Seeded synthetic images and labels of the config's per-process, per-micro-batch size and shape."""
    per_forward = _per_forward(cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn((per_forward, *input_shape(cfg.data)), generator=generator).to(device)
    y = torch.randint(0, cfg.model.num_classes, (per_forward,), generator=generator).to(device)
    return x, y


def choice_key(cfg: Config) -> Tuple[str, str]:
    """``(key, words)`` of a config's model on this machine, under which its probed choice is kept: the CPU's model,
    its cores and torch's threads, the torch version, the model and its image shape (not the batch size: a plan of
    other sizes and a searched batch size read the same choice). A change to any of these probes again."""
    x_shape = input_shape(cfg.data)
    machine = f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}"
    model = json.dumps(cfg.model.to_dict(), sort_keys=True, default=str)
    words = f"{machine}; model {model}; input {'x'.join(map(str, x_shape))}"
    return hashlib.sha256(words.encode()).hexdigest()[:16], words


def config_dtype(cfg: Config, model: Union[None, nn.Module, Callable[[], nn.Module]], device: torch.device,
                 resumed: Optional[str] = None) -> Tuple[str, str]:
    """``(the dtype for the engines, why)`` of a config run: ``amp.dtype`` as it is, with ``""`` for why, unless
    it is ``auto`` on a CPU; then the dtype chosen, and why in words.

    The probe (:func:`~ignite_amp.probe_cpu_dtype`, on ``model`` as built, before the trainer; ``model`` may be a
    function that builds it, called only when a probe runs) runs only where the choice is open: a CPU with native
    bfloat16 (AVX512-BF16) and no AMX, in one process, and only once per machine and model: its choice is kept
    (``ignite_amp.files.dtype_choice``) and read back by every later run and plan of that model. With AMX it is
    bfloat16, without bfloat16 instructions float32 (emulated bfloat16 is slower), across several processes
    float32 (every rank must run the same). :data:`~ignite_amp.run.dtype_probe.PROBE_ENV` fixes the outcome without
    a probe. ``resumed``: the dtype the resumed checkpoint trained in (float32 or bfloat16): kept, so that a resume
    does not change precision. ``model`` None (``ignite-amp plan``: fake tensors only, no real step): no probe; where
    one would run and no choice is kept, float32, saying that train's probe decides.
    """
    asked = cfg.amp.dtype
    if asked != "auto" or device.type != "cpu":
        return asked, ""
    if resumed in ("float32", "bfloat16"):
        return resumed, "the resumed checkpoint's precision, kept"
    if cpu_has_amx():
        return "bfloat16", "AMX bfloat16 tiles, no probe"
    if not cpu_has_native_bf16():
        return "float32", "no bfloat16 instructions on this CPU (emulated, bfloat16 is slower), no probe"
    world = idist.get_world_size()
    if world > 1:
        return "float32", f"{world} processes, no probe, so that every rank runs the same; name bfloat16 to try it"
    fixed: Optional[str] = os.environ.get(PROBE_ENV)
    if fixed:
        if fixed not in ("float32", "bfloat16"):
            raise ConfigError(f"{PROBE_ENV} should be float32 or bfloat16; got {fixed!r} (unset it to let the probe "
                              f"decide)")
        return fixed, f"fixed by {PROBE_ENV}, no probe"
    key, what = choice_key(cfg)
    kept = kept_choice(key)
    if kept is not None:
        return kept.dtype, (f"this machine's choice for this model since {kept.decided} ({kept.why}); kept in "
                            f"{shown_path(choices_path())}: delete it to probe again")
    if model is None:
        return "float32", ("no choice kept for this model on this machine yet: train's probe decides at its start "
                           "(float32 or bfloat16, timed on the model's own step); planned in float32")
    try:
        probe = probe_cpu_dtype(model if isinstance(model, nn.Module) else model(), _batch(cfg, device))
    except Exception as exc:  # the model cannot run this batch: float32, and check_model_runs says why
        return "float32", f"the probe could not run the model ({exc.__class__.__name__})"
    chosen, why = dtype_name(probe.dtype), probe.words()
    try:
        kept_in = f"kept in {shown_path(keep_choice(key, chosen, why, what))}"
    except OSError as exc:
        kept_in = f"not kept: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    return chosen, f"{why}; {kept_in}"
