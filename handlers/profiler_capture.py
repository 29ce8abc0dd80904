"""torch.profiler capture of a few training steps: a Chrome trace, an operator table and a step breakdown."""
import dataclasses
import logging
import os
from typing import Any, Dict, Iterable, List, Optional

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from torch.autograd import DeviceType

from ignite_amp.core.config_keys import Boolean, Integer, argument, setting
from ignite_amp.core.config_values import Section
from ignite_amp.core.phases import PHASES as STEP_PHASES

logger = logging.getLogger("ignite_amp")

__all__ = ["ProfilerConfig", "ProfilerCapture", "step_breakdown", "format_breakdown"]


@dataclasses.dataclass(frozen=True, eq=False)
class ProfilerConfig(Section):
    """handlers.profiler: capture torch.profiler windows of training iterations (ProfilerCapture)."""

    enabled: bool = setting(False, Boolean(), "attach the profiler")
    wait: int = setting(5, Integer(0), "iterations skipped before each window")
    warmup: int = setting(2, Integer(0), "iterations profiled but discarded before each window")
    active: int = setting(5, Integer(1), "iterations recorded per window")
    repeat: int = setting(1, Integer(0), "windows to record (0: until the run ends)")
    row_limit: int = setting(25, Integer(1), "rows of the operator table written beside each trace")

# Ranges a profiled iteration is split into: torch labels the DataLoader's __next__, the AMP
# step labels its phases (ignite_amp.core.phases) while a profiler records.
PHASES = (("data wait", "enumerate(DataLoader)"), *STEP_PHASES.items())


def step_breakdown(events: Iterable) -> Dict[str, float]:
    """Mean milliseconds per iteration of each phase, from profiler events (``profiler.events()``).

    An iteration is a ``ProfilerStep`` range that ran a forward; ``other`` is the rest of it
    (handlers, zero_grad, an evaluation at an epoch's end). Host wall time: on a GPU a phase that
    does not wait for the device shows the time to launch its kernels. ``iterations`` holds the count.
    """
    # Host events only: with CUDA activity the profiler also lists a device-side mirror of each
    # record_function range (ProfilerStep#N, the phases), which would count every iteration twice.
    events = [e for e in events if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU]
    steps = [e.time_range for e in events if e.name.startswith("ProfilerStep")]
    spans: Dict[str, List] = {name: [e.time_range for e in events if e.name.startswith(prefix)]
                              for name, prefix in PHASES}
    counted = [s for s in steps if any(s.start <= f.start < s.end for f in spans["forward"])]
    totals = {name: 0.0 for name, _ in PHASES}
    for step in counted:
        for name, ranges in spans.items():
            totals[name] += sum(r.elapsed_us() for r in ranges if step.start <= r.start < step.end)
    n = max(len(counted), 1)
    result = {name: total / n / 1e3 for name, total in totals.items()}
    result["total"] = sum(s.elapsed_us() for s in counted) / n / 1e3
    result["other"] = max(result["total"] - sum(result[name] for name, _ in PHASES), 0.0)
    result["iterations"] = len(counted)
    return result


def format_breakdown(breakdown: Dict[str, float]) -> str:
    """A markdown table: phase, ms per iteration, share of the iteration."""
    total = breakdown["total"] or 1.0
    rows = [f"| {name} | {breakdown[name]:.2f} | {breakdown[name] / total:.0%} |"
            for name in [p for p, _ in PHASES] + ["other", "total"]]
    return (f"Mean host wall time per iteration over {breakdown['iterations']} profiled iterations\n\n"
            "| phase | ms | share |\n|---|---|---|\n" + "\n".join(rows) + "\n")


class ProfilerCapture:
    """Profile a window of iterations with ``torch.profiler`` (``schedule(wait, warmup, active, repeat)``).

    CPU activity always, CUDA activity when the trainer runs on a GPU. For each window it writes,
    in ``logdir`` (``N-M``: the window's iterations):

    - ``trace_iterations_N-M.json``: a Chrome trace whose ``ProfilerStep#N`` markers are the training
      iterations; open it in https://ui.perfetto.dev (the file stays local; current Chromium has
      turned ``chrome://tracing`` off);
    - ``profile_iterations_N-M.txt``: the per-iteration time breakdown (data wait, forward,
      backward, optimizer, other) and the top operators (by device time on GPU, CPU time on CPU);
    - the same two tables as TensorBoard text (``profiler/step_breakdown``, ``profiler/top_ops``):
      ``logdir`` is its own TensorBoard run.

    Rank 0 only. A run that ends inside the window still stops the profiler and writes what it
    has. On a CPU run the profiler library's log lines (Kineto's "gpuGetDeviceCount failed"
    on a machine without a GPU driver) are silenced with ``KINETO_LOG_LEVEL=6`` unless that
    variable is set; Kineto reads it once, when the first profiler of the process starts.

    The profiler is started and stopped with its explicit ``start()``/``stop()`` API when the
    run starts and completes (or is terminated), and stepped after each iteration.

    Args:
        logdir: directory for the traces, tables and TensorBoard text (``output_dir/profiler``).
        wait, warmup, active, repeat: ``torch.profiler.schedule`` arguments.
        record_shapes, profile_memory, with_stack: ``torch.profiler.profile`` options (off: they cost).
        row_limit: rows in the operator table.
        from_config: advice names config keys (``handlers.profiler.wait``), not this class's arguments
            (``train_from_config`` sets it).

    Example:
        >>> import os, tempfile, torch
        >>> from ignite_amp import create_amp_trainer
        >>> from ignite_amp.handlers import ProfilerCapture
        >>> model = torch.nn.Linear(4, 2)
        >>> trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                              torch.nn.functional.cross_entropy, device="cpu")
        >>> capture = ProfilerCapture(tempfile.mkdtemp(), wait=1, warmup=1, active=2)
        >>> capture.attach(trainer)
        >>> _ = trainer.run([(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 6)
        >>> sorted(os.path.basename(f) for f in capture.files)
        ['profile_iterations_3-4.txt', 'trace_iterations_3-4.json']
    """

    def __init__(self, logdir: str, wait: int = 5, warmup: int = 2, active: int = 5, repeat: int = 1,
                 record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
                 row_limit: int = 25, from_config: bool = False):
        for name, value in dict(wait=wait, warmup=warmup, active=active, repeat=repeat, row_limit=row_limit).items():
            argument(ProfilerConfig, name, value)
        self.logdir = str(logdir)
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.options: Dict[str, Any] = dict(record_shapes=record_shapes, profile_memory=profile_memory,
                                            with_stack=with_stack)
        self.row_limit = row_limit
        self.from_config = from_config
        self.profiler: Optional[torch.profiler.profile] = None
        self.last: Optional[int] = None
        self.traces = 0
        self.files: List[str] = []
        self.breakdown: Optional[Dict[str, float]] = None

    def attach(self, engine: Engine) -> None:
        """Profile ``engine`` on rank 0: start with the run, step each iteration, stop at its end. After an
        exception, call :meth:`stop` yourself (``train_from_config`` does)."""
        if idist.get_rank() != 0:
            return
        engine.add_event_handler(Events.STARTED, self.start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.step)
        # Not on EXCEPTION_RAISED: Ignite stops re-raising once a handler listens there. After
        # an exception, call stop() yourself (train_from_config does, in a finally block).
        for event in (Events.COMPLETED, Events.TERMINATE):
            engine.add_event_handler(event, self.stop)

    def start(self, engine: Engine) -> None:
        """Start the profiler, its schedule counted from the engine's next iteration (a resumed run too)."""
        from torch.profiler import ProfilerActivity, profile, schedule

        device = getattr(getattr(engine, "amp_step", None), "device", torch.device("cpu"))
        self.on_cuda = device.type == "cuda"
        if not self.on_cuda:
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        os.makedirs(self.logdir, exist_ok=True)
        self.iteration = engine.state.iteration  # the profiler's step 0: a resumed run does not start at 0
        self._warn_if_unreachable(engine)
        # The trace's ProfilerStep#N markers are the training iterations (the file names' numbers): the
        # profiler's step count starts at the next iteration, and the schedule counts from there.
        offset = self.iteration + 1
        base = schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat)
        self.profiler = profile(activities=activities, on_trace_ready=self._ready, **self.options,
                                schedule=lambda step: base(max(step - offset, 0)))
        self.profiler.step_num = offset
        self._done = 0  # training iterations since start: the profiler's count lags one at the run's last
        self.profiler.start()

    def _warn_if_unreachable(self, engine: Engine) -> None:
        length, epochs = engine.state.epoch_length, engine.state.max_epochs
        self.last = length * epochs if length and epochs else None  # the run's last iteration
        if self.last is None:
            return
        first = self.iteration + self.wait + self.warmup + 1
        end = first + self.active - 1
        if self.last < first:
            logger.warning("profiler: its window (iterations %d-%d) starts after this run's last iteration (%d): no "
                           "trace will be written; lower %s", first, end, self.last,
                           "handlers.profiler.wait/warmup" if self.from_config else "ProfilerCapture's wait or warmup")
        elif self.last < end:
            logger.warning("profiler: its window (iterations %d-%d) is cut short by the run's end: the trace will "
                           "hold iterations %d-%d", first, end, first, self.last)

    def step(self, engine: Engine) -> None:
        """Advance the profiler's schedule by one training iteration (stop after the run's last one)."""
        if self.profiler is not None:
            self._done += 1
            if self.last is not None and engine.state.iteration >= self.last:
                self.stop()  # the run's last iteration: what follows (the validation) is no training step
            else:
                self.profiler.step()

    def stop(self, engine: Optional[Engine] = None) -> None:
        """Stop the profiler and write what it holds; does nothing when it is not running."""
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _window(self) -> str:
        """``N-M``: the training iterations of the window that just ended."""
        done = self._done
        cycle = self.wait + self.warmup + self.active
        first = (done - 1) // cycle * cycle + self.wait + self.warmup + 1
        return f"{self.iteration + first}-{self.iteration + done}"

    def _ready(self, profiler: torch.profiler.profile) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb
        from torch.utils.tensorboard import SummaryWriter

        window = self._window()
        trace = os.path.join(self.logdir, f"trace_iterations_{window}.json")
        profiler.export_chrome_trace(trace)
        self.breakdown = step_breakdown(profiler.events())
        breakdown = format_breakdown(self.breakdown)
        sort_by = "self_cuda_time_total" if self.on_cuda else "self_cpu_time_total"
        ops = profiler.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        table = os.path.join(self.logdir, f"profile_iterations_{window}.txt")
        with open(table, "w", encoding="utf-8") as f:
            f.write(f"{breakdown}\nTop operators\n{ops}\n")
        with SummaryWriter(self.logdir) as writer:
            step = self.iteration + self._done
            where = (f"Iterations {window}: the trace is `{os.path.abspath(trace)}`; open it in "
                     f"https://ui.perfetto.dev (Open trace file; read in the browser, not uploaded).")
            writer.file_writer.add_summary(text_pb("profiler/step_breakdown", f"{where} {breakdown}"), step)
            # Markdown code block: keep the table's columns aligned in TensorBoard's text tab.
            writer.file_writer.add_summary(text_pb("profiler/top_ops", "```\n" + ops + "\n```"), step)
        self.files += [trace, table]
        self.traces += 1
