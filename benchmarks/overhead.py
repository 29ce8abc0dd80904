"""What the trainer and each handler cost per iteration over the hand-written AMP loop of the tutorials.

One interleaved run (variant 1, variant 2, ..., variant 1, ...) so drift in clocks or load hits every variant
alike; each figure is the median over the repeats, each overhead the median of the per-repeat differences
against its reference (the hand loop, Ignite's bare trainer, or ours).

Variants: the hand loop (also with ``clip_grad_norm_``, and with ``get_total_norm``), Ignite's
``create_supervised_trainer`` bare and with its own handlers where an equivalent exists (``TerminateOnNan``; a
``TensorboardLogger`` writing the loss, the learning rate and the gradient norms every 50 iterations),
``create_amp_trainer`` bare, with each default handler alone, and with all of them (``attach_default_handlers``:
what a config attaches). Beside them, the tensor work a handler must do: ``clip_grad_norm_`` for the clipping,
one ``get_total_norm`` for TensorBoard, each timed alone (a tight loop on one backward's gradients) and in the
hand loop (its variant less the bare one). "Between logs": the median iteration without a log, from
per-iteration stamps, of TensorBoard's trainer less the bare trainer's (twins carrying the same stamps; the
hand loops' twins give the norm's in-loop cost the same way).

- ``--case host`` (the default): a tiny MLP 32-64-10, batch 32, float32, torch on one thread, timed in CPU
  time of this thread (``time.thread_time``): other processes on a shared machine do not count, and the
  kernels take microseconds, so the figure is the Python work around them (what a small model waits on,
  on a GPU too).
- ``--case model``: a real model (default the small CNN at 32x32, batch 64, dtype "auto"; float16 on CUDA
  compares Ignite's ``amp_mode="amp"`` too), timed in wall clock, device-synchronized after each epoch.

    python benchmarks/overhead.py                        # the host table (markdown)
    python benchmarks/overhead.py --case tax             # the hand loop's phases with and without a norm, clipping
    python benchmarks/overhead.py --case model --device cuda --dtype float16 --model resnet50 --batch-size 32 \
        --image-size 224
"""
import argparse
import copy
import itertools
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer
from ignite_amp.core.device import resolve_device, resolve_dtype
from ignite_amp.models import build_model

HAND, HAND_CLIP, HAND_NORM = ("hand-written loop", "hand-written loop + clip_grad_norm_",
                              "hand-written loop + get_total_norm")
IGNITE, OURS, ALL = "Ignite create_supervised_trainer", "create_amp_trainer", "+ all default handlers"
CLIP, TB = "+ GradientClipping(max_norm=1.0)", "+ TensorBoardMetrics(log_every=50)"
CLIP_WORK, NORM_WORK = "clip_grad_norm_(params, 1.0, foreach=True) alone", "get_total_norm(grads, foreach=True) alone"
STAMPED = " (stamped)"  # the twins timed per iteration for "between logs"
LOG_EVERY = 50


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_written_loop(model, optimizer, scaler, batches, device, dtype, max_norm=None, grad_norm=False,
                      stamps: Optional[Callable[[], None]] = None):
    """The loop every AMP tutorial ends with; with ``max_norm``, the clipping step on unscaled gradients; with
    ``grad_norm``, the gradients' norm of each step (what logging it takes); ``stamps()`` at each batch."""
    model.train()
    params = list(model.parameters())
    for x, y in batches:
        if stamps is not None:
            stamps()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if max_norm is not None or grad_norm:
            scaler.unscale_(optimizer)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        elif grad_norm:
            torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        scaler.step(optimizer)
        scaler.update()


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def attach_default_handlers(trainer, model, optimizer, logdir):
    """The handlers a config attaches by default, in the order build_run attaches them."""
    from ignite_amp.handlers import BestCheckpoint, GradientClipping, NonFiniteGuard, OOMBackoff, TensorBoardMetrics

    evaluator = _evaluator(trainer, model)
    NonFiniteGuard().attach(trainer)
    OOMBackoff().attach(trainer)
    clipping = GradientClipping(max_norm=1.0)
    clipping.attach(trainer)
    TensorBoardMetrics(logdir, log_every=LOG_EVERY, clipping=clipping).attach(trainer, evaluator=evaluator,
                                                                              optimizer=optimizer)
    BestCheckpoint(logdir, {"model": model, "optimizer": optimizer, "amp_step": trainer.amp_step}).attach(
        trainer, evaluator)
    return evaluator


def _evaluator(trainer, model):
    from ignite.metrics import Accuracy

    from ignite_amp import create_amp_evaluator

    step = trainer.amp_step
    return create_amp_evaluator(model, {"accuracy": Accuracy(device=step.device)}, device=step.device,
                                dtype=step.dtype, channels_last=step.channels_last)  # the trainer's layout


def _ours_alone() -> Dict[str, Callable]:
    """Each default handler alone: name -> attach(trainer, model, optimizer, logdir)."""
    from ignite_amp.handlers import BestCheckpoint, GradientClipping, NonFiniteGuard, OOMBackoff, TensorBoardMetrics

    return {
        CLIP: lambda t, m, o, d: GradientClipping(max_norm=1.0).attach(t),
        TB: lambda t, m, o, d: TensorBoardMetrics(d, log_every=LOG_EVERY).attach(t, optimizer=o),
        "+ NonFiniteGuard": lambda t, m, o, d: NonFiniteGuard().attach(t),
        "+ OOMBackoff": lambda t, m, o, d: OOMBackoff().attach(t),
        "+ BestCheckpoint (saves at evaluation)": lambda t, m, o, d: BestCheckpoint(
            d, {"model": m, "optimizer": o, "amp_step": t.amp_step}).attach(t, _evaluator(t, m)),
        ALL: attach_default_handlers,
    }


def _ignite_tensorboard(trainer, model, optimizer, logdir) -> None:
    from ignite.engine import Events
    from ignite.handlers.tensorboard_logger import GradsScalarHandler, TensorboardLogger

    logger, every = TensorboardLogger(log_dir=logdir), Events.ITERATION_COMPLETED(every=LOG_EVERY)
    logger.attach_output_handler(trainer, every, tag="training", output_transform=lambda loss: {"loss": loss})
    logger.attach_opt_params_handler(trainer, every, optimizer)
    logger.attach(trainer, GradsScalarHandler(model, reduction=torch.norm), every)


def _ignite_alone() -> Dict[str, Callable]:
    from ignite.engine import Events
    from ignite.handlers import TerminateOnNan

    return {"Ignite + TerminateOnNan (NonFiniteGuard's equivalent)":
            lambda t, m, o, d: t.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan()),
            "Ignite + TensorboardLogger every 50: loss, lr, grad norms": _ignite_tensorboard}


class Stamps:
    """The clock at each batch (an engine: at ``GET_BATCH_STARTED``, attached first; the hand loop: at its top)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock, self.times = clock, []

    def __call__(self, *_) -> None:
        self.times.append(self.clock())

    def attach(self, trainer) -> None:
        from ignite.engine import Events

        trainer.add_event_handler(Events.GET_BATCH_STARTED, self)

    def between_logs(self) -> float:
        """Median seconds of the iterations that do not log (iteration i runs from stamp i to stamp i + 1)."""
        spans = [b - a for i, (a, b) in enumerate(itertools.pairwise(self.times), 1) if i % LOG_EVERY]
        self.times.clear()
        return statistics.median(spans)


def variants(base, batches, device, dtype, optimizer_fn, logdir, clock=time.thread_time) -> Dict[str, Callable]:
    """name -> a function running one epoch over ``batches`` (each variant its own copy of the model), and
    the tensor work alone; the stamped twins return their median time per iteration between logs."""
    from ignite.engine import create_supervised_trainer

    def fresh():
        model = copy.deepcopy(base).to(device)
        return model, optimizer_fn(model)

    def scaler():
        return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    out, twins = {}, {}
    for name, kwargs in ((HAND, {}), (HAND_CLIP, {"max_norm": 1.0}), (HAND_NORM, {"grad_norm": True})):
        model, opt, sc = *fresh(), scaler()
        out[name] = lambda m=model, o=opt, s=sc, k=kwargs: hand_written_loop(m, o, s, batches, device, dtype, **k)
        if name != HAND_CLIP:
            model, opt, sc, stamps = *fresh(), scaler(), Stamps(clock)
            twins[name] = (lambda m=model, o=opt, s=sc, k=kwargs, st=stamps:
                           (hand_written_loop(m, o, s, batches, device, dtype, stamps=st, **k), st.between_logs())[1])
    if dtype == torch.float32 or (dtype == torch.float16 and device.type == "cuda"):
        amp = {} if dtype == torch.float32 else {"amp_mode": "amp", "scaler": True}  # Ignite's float16 autocast
        for name, attach in {IGNITE: None, **_ignite_alone()}.items():
            model, opt = fresh()
            trainer = create_supervised_trainer(model, opt, cross_entropy, device=device, **amp)
            if attach is not None:
                attach(trainer, model, opt, tempfile.mkdtemp(dir=logdir))
            out[name] = lambda t=trainer: t.run(batches, max_epochs=1)
    for name, attach in {OURS: None, **_ours_alone()}.items():
        for twin in ((False, True) if name in (OURS, TB) else (False,)):
            model, opt = fresh()
            trainer = create_amp_trainer(model, opt, cross_entropy, device=device, dtype=dtype, channels_last=False)
            stamps = Stamps(clock)
            if twin:
                stamps.attach(trainer)
            if attach is not None:
                attach(trainer, model, opt, tempfile.mkdtemp(dir=logdir))
            if twin:
                twins[name] = lambda t=trainer, st=stamps: (t.run(batches, max_epochs=1), st.between_logs())[1]
            else:
                out[name] = lambda t=trainer: t.run(batches, max_epochs=1)
    out.update({name + STAMPED: fn for name, fn in twins.items()})
    out.update(_work(fresh, batches[0], device, dtype, len(batches)))
    return out


def _work(fresh, batch, device, dtype, calls: int) -> Dict[str, Callable]:
    """The tensor work a handler must do, on one backward's gradients: ``calls`` calls of each."""
    model, _ = fresh()
    x, y = batch[0].to(device), batch[1].to(device)
    with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
        cross_entropy(model(x), y).backward()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]

    def clip():
        for _ in range(calls):
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)

    def norm():
        for _ in range(calls):
            torch.nn.utils.get_total_norm(grads, foreach=True)

    return {CLIP_WORK: clip, NORM_WORK: norm}


def measure(fns: Dict[str, Callable], repeats: int, clock, device: torch.device, warmup: int = 1) -> Dict[str, list]:
    """Seconds of each function per repeat, interleaved (a stamped twin: its own figure, seconds per iteration).
    A progress line per round on stderr: a run takes minutes."""
    started = time.perf_counter()
    print(f"measuring {len(fns)} variants: {warmup} warm-up round{'s' if warmup != 1 else ''}, then {repeats} timed",
          file=sys.stderr, flush=True)
    for _ in range(warmup):  # allocator, kernels, first-run work (the FLOP count of TensorBoard's first step)
        for fn in fns.values():
            fn()
            sync(device)
    times = {name: [] for name in fns}
    for done in range(repeats):
        print(f"  round {done + 1}/{repeats} ({time.perf_counter() - started:.0f} s so far)", file=sys.stderr,
              flush=True)
        for name, fn in fns.items():
            sync(device)
            start = clock()
            value = fn()
            sync(device)
            times[name].append(value if name.endswith(STAMPED) else clock() - start)
    return times


def overhead_table(times: Dict[str, list], iters: int, unit: str = "us") -> dict:
    """The table's rows and the issue's ratios from ``measure``'s times (per iteration, in ``unit``)."""
    scale = 1e6 if unit == "us" else 1e3
    per = {name: [t * scale if name.endswith(STAMPED) else t / iters * scale for t in values]
           for name, values in times.items()}

    def over(name: str, ref: str) -> float:  # the median of the per-repeat differences
        return statistics.median(a - b for a, b in zip(per[name], per[ref], strict=True))

    rows: List[dict] = []
    for name, values in per.items():
        if name.endswith(STAMPED) or name in (CLIP_WORK, NORM_WORK):
            continue
        ref = None if name == HAND else HAND if name in (HAND_CLIP, HAND_NORM, IGNITE, OURS) else (
            IGNITE if name.startswith("Ignite") else OURS)
        rows.append({"variant": name, "per_iter": statistics.median(values), "reference": ref,
                     "over": over(name, ref) if ref else None})
    by = {row["variant"]: row for row in rows}
    clip_alone, norm_alone = statistics.median(per[CLIP_WORK]), statistics.median(per[NORM_WORK])
    clip_in_loop, norm_in_loop = by[HAND_CLIP]["over"], over(HAND_NORM + STAMPED, HAND + STAMPED)
    digits = 1 if unit == "us" else 3
    by[CLIP].update(work=f"`clip_grad_norm_` alone {clip_alone:.{digits}f}; "
                         f"in the hand loop {clip_in_loop:+.{digits}f}")
    between = over(TB + STAMPED, OURS + STAMPED)
    by[TB].update(between_logs=between, work=f"`get_total_norm` alone {norm_alone:.{digits}f}; in the hand loop, "
                                             f"between logs {norm_in_loop:+.{digits}f}")
    ignite = by[IGNITE]["over"] if IGNITE in by else None
    ratios = [("all default handlers over ours bare / Ignite's bare over the hand loop", 1.0,
               by[ALL]["over"] / ignite if ignite and ignite > 0 else None),
              ("the same, less the clipping's own work (clip_grad_norm_ in the hand loop)", 1.0,
               (by[ALL]["over"] - clip_in_loop) / ignite if ignite and ignite > 0 else None),
              ("GradientClipping over ours bare / clip_grad_norm_ alone", 1.2, by[CLIP]["over"] / clip_alone),
              ("GradientClipping over ours bare / clip_grad_norm_ in the hand loop", 1.2,
               by[CLIP]["over"] / clip_in_loop),
              ("TensorBoardMetrics between logs / one get_total_norm alone", 1.2, between / norm_alone),
              ("TensorBoardMetrics between logs / get_total_norm in the hand loop", 1.2, between / norm_in_loop)]
    return {"rows": rows, "ratios": ratios, "unit": unit}


def markdown(table: dict) -> List[str]:
    u = table["unit"]
    d = 1 if u == "us" else 3
    lines = [f"| variant | {u}/iter | over its reference ({u}) | the work it must do ({u}) |", "|---|---|---|---|"]
    for row in table["rows"]:
        over = "" if row["over"] is None else f"{row['over']:+.{d}f} over {row['reference']}"
        if "between_logs" in row:
            over += f"; between logs {row['between_logs']:+.{d}f}"
        lines.append(f"| {row['variant']} | {row['per_iter']:.{d}f} | {over} | {row.get('work', '')} |")
    lines.append("")
    for text, limit, value in table["ratios"]:
        verdict = "not measured" if value is None else ("met" if value <= limit else "missed")
        lines.append(f"- {text}: " + ("-" if value is None else f"**{value:.2f}x**") + f" (target <= {limit}x: "
                     f"{verdict})")
    return lines


def host_case(args) -> None:
    torch.set_num_threads(1)  # the kernels stay in this thread: thread CPU time is all of it
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen))
               for _ in range(args.iters)]
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="ignite-amp-overhead-") as logdir:
        fns = variants(base, batches, device, torch.float32, lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
                       logdir)
        times = measure(fns, args.repeats, time.thread_time, device)
    import ignite

    print(f"Host cost per iteration: tiny MLP 32-64-10, batch 32, float32, CPU, torch on 1 thread, "
          f"{args.iters} iterations x {args.repeats} interleaved repeats, thread CPU time (medians); "
          f"torch {torch.__version__}, pytorch-ignite {ignite.__version__}\n")
    print("\n".join(markdown(overhead_table(times, args.iters))))


PHASES = ("zero_grad", "forward", "backward", "the call", "optimizer.step")


def phase_loop(model, optimizer, batches, call: Optional[Callable], out: Dict[str, list]) -> None:
    """The hand loop on CPU, each phase timed (thread CPU ns), ``call(params)`` between backward and step."""
    clock, params = time.thread_time_ns, list(model.parameters())
    for x, y in batches:
        t0 = clock()
        optimizer.zero_grad(set_to_none=True)
        t1 = clock()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        if call is not None:
            call(params)
        t4 = clock()
        optimizer.step()
        t5 = clock()
        for phase, span in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            out[phase].append(span / 1e3)


def tax_case(args) -> None:
    """Why a torch call costs more inside a step than alone: the hand loop's phases with and without it. The
    call's own span is near its cost alone; the phases around it slow down (their code and data evicted)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen))
               for _ in range(args.iters)]
    calls = {"nothing": None,
             "get_total_norm": lambda ps: torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None],
                                                                        foreach=True),
             "clip_grad_norm_": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)}
    runs = {}
    for name in calls:
        model = copy.deepcopy(base)
        runs[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01), {p: [] for p in PHASES})
    for _ in range(args.repeats):
        for name, call in calls.items():
            model, optimizer, out = runs[name]
            phase_loop(model, optimizer, batches, call, out)
    print(f"The hand loop's phases (tiny MLP 32-64-10, batch 32, float32, CPU, 1 thread), {args.iters} iterations x "
          f"{args.repeats} interleaved repeats, median us of thread CPU time per iteration:\n")
    print("| the call between backward and step | " + " | ".join(PHASES) + " | all | the others' increase |")
    print("|---" * (len(PHASES) + 3) + "|")
    ref = {p: statistics.median(v) for p, v in runs["nothing"][2].items()}
    for name, (_, _, out) in runs.items():
        med = {p: statistics.median(v) for p, v in out.items()}
        others = sum(med[p] - ref[p] for p in PHASES if p != "the call")
        print(f"| {name} | " + " | ".join(f"{med[p]:.1f}" for p in PHASES) + f" | {sum(med.values()):.1f} | "
              f"{others:+.1f} |")


def model_case(args) -> None:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(0)
    base = build_model(args.model, 10, {})
    batches = [(torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device),
                torch.randint(0, 10, (args.batch_size,), device=device)) for _ in range(args.iters)]
    with tempfile.TemporaryDirectory(prefix="ignite-amp-overhead-") as logdir:
        fns = variants(base, batches, device, dtype, lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                       logdir, clock=time.perf_counter)
        times = measure(fns, args.repeats, time.perf_counter, device)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, model {args.model}, batch {args.batch_size}, image {args.image_size}, "
          f"dtype {str(dtype)[6:]}, {args.iters} iters x {args.repeats} interleaved repeats, wall clock (medians)\n")
    print("\n".join(markdown(overhead_table(times, args.iters, unit="ms"))))


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["host", "model", "tax"], default="host")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="ignite_amp.models:small_cnn")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=None, help="iterations per repeat (host 256, model 60)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (host 15, model 7)")
    args = parser.parse_args(argv)
    if args.case in ("host", "tax"):
        args.iters, args.repeats = args.iters or 256, args.repeats or 15
        (host_case if args.case == "host" else tax_case)(args)
    else:
        args.iters, args.repeats = args.iters or 60, args.repeats or 7
        model_case(args)


if __name__ == "__main__":
    main()
