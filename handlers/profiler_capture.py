"""torch.profiler capture of a few training steps, for TensorBoard and as a text table."""
import os
from typing import Optional

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

__all__ = ["ProfilerCapture"]


class ProfilerCapture:
    """Profile a window of iterations with ``torch.profiler`` (``schedule(wait, warmup, active, repeat)``).

    CPU activity always, CUDA activity when the trainer runs on a GPU. Traces are written with
    ``tensorboard_trace_handler`` under ``logdir`` (TensorBoard's profiler plugin reads them);
    a table of the top operators (by device time on GPU, CPU time on CPU) is saved beside them
    as ``profiler_top_ops.txt`` and logged as TensorBoard text. Rank 0 only. A run that ends
    inside the window still stops the profiler and writes what it has.

    The profiler is started and stopped with its explicit ``start()``/``stop()`` API when the
    run starts and completes (or is terminated), and stepped after each iteration.

    Args:
        logdir: TensorBoard directory of the run.
        wait, warmup, active, repeat: ``torch.profiler.schedule`` arguments.
        record_shapes, profile_memory, with_stack: ``torch.profiler.profile`` options (off: they cost).
        row_limit: rows in the operator table.
    """

    TABLE = "profiler_top_ops.txt"

    def __init__(self, logdir: str, wait: int = 5, warmup: int = 2, active: int = 5, repeat: int = 1,
                 record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
                 row_limit: int = 25):
        for name, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                 ("repeat", repeat, 0), ("row_limit", row_limit, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Argument {name} should be an integer >= {low}, got {value!r}.")
        self.logdir = str(logdir)
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.options = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self.row_limit = row_limit
        self.profiler: Optional[torch.profiler.profile] = None
        self.traces = 0

    def attach(self, engine: Engine) -> None:
        if idist.get_rank() != 0:
            return
        engine.add_event_handler(Events.STARTED, self.start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.step)
        # Not on EXCEPTION_RAISED: Ignite stops re-raising once a handler listens there. After
        # an exception, call stop() yourself (train_from_config does, in a finally block).
        for event in (Events.COMPLETED, Events.TERMINATE):
            engine.add_event_handler(event, self.stop)

    def start(self, engine: Engine) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        device = getattr(getattr(engine, "amp_step", None), "device", torch.device("cpu"))
        self.on_cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        os.makedirs(self.logdir, exist_ok=True)
        self.profiler = profile(activities=activities, on_trace_ready=self._ready, **self.options,
                                schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active,
                                                  repeat=self.repeat))
        self.profiler.start()

    def step(self, engine: Engine) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self, engine: Optional[Engine] = None) -> None:
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _ready(self, profiler: torch.profiler.profile) -> None:
        from torch.profiler import tensorboard_trace_handler
        from torch.utils.tensorboard import SummaryWriter

        tensorboard_trace_handler(self.logdir)(profiler)
        sort_by = "self_cuda_time_total" if self.on_cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        with open(os.path.join(self.logdir, self.TABLE), "w", encoding="utf-8") as f:
            f.write(table)
        with SummaryWriter(self.logdir) as writer:
            # Markdown code block: keep the table's columns aligned in TensorBoard's text tab.
            writer.add_text("profiler/top_ops", "```\n" + table + "\n```", global_step=profiler.step_num)
        self.traces += 1
