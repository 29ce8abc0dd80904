"""``ignite-amp plan CONFIG``: the peak memory of one training step of a config's run, before it runs.

The parser part imports no torch (``ignite-amp --help`` stays fast); :func:`plan_command` does.
"""
import argparse
import functools
import re
import sys
import time

__all__ = ["add_plan_parser", "plan_command", "json_to_stdout"]


def add_plan_parser(sub, add_config) -> None:
    """The ``plan`` sub-command's arguments (``add_config``: CONFIG, ``--set``, ``--debug``)."""
    plan = sub.add_parser("plan", help="the peak memory of a training step by kind, and the largest batch that fits "
                                       "(fake tensors: nothing runs)")
    add_config(plan)
    plan.add_argument("--memory", metavar="SIZE",
                      help="the memory to fit, e.g. 80GiB or 24GB (default: the GPU's free memory on a GPU)")
    plan.add_argument("--batch-sizes", type=int, nargs="+", metavar="N",
                      help="batch sizes to plan (default: the config's data.batch_size)")
    plan.add_argument("--margin", type=float, default=None,
                      help="share of the memory kept free for what the plan does not count (default 0.15)")
    plan.add_argument("--json", metavar="FILE", help="also write the plan as JSON to FILE (- or /dev/stdout: to "
                                                     "stdout, and the table to stderr)")
    plan.add_argument("--checkpointing", action="store_true",
                      help="also the table of activation checkpointing choices (none, selective, full per number of "
                           "blocks) with their peak and recompute (shown for activation_checkpointing: auto too)")


def plan_command(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from ignite_amp.config.tree import load_config
    from ignite_amp.errors import ConfigError
    from ignite_amp.files.atomic import write_text
    from ignite_amp.memory_plan.plan import DEFAULT_MARGIN, format_bytes, parse_bytes
    from ignite_amp.run.console import fitted, safe_print
    from ignite_amp.run.plan import plan_config, plan_dtype, planned_world, resolve

    print_to_stdout = safe_print

    bare = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*", args.memory or "")
    if bare:  # 80: bytes, or 80 GB meant? (parse_bytes reads a number as bytes; a command line says its unit)
        raise ConfigError(f"--memory: {bare[1]} has no unit; write {bare[1]}GiB or {bare[1]}GB (units: B, KB, MB, GB, "
                          f"TB, KiB, MiB, GiB, TiB)")
    try:
        memory = None if args.memory is None else parse_bytes(args.memory)
    except ValueError as exc:
        raise ConfigError(f"--memory: {exc}") from None
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    if not 0 <= margin < 1:
        raise ConfigError(f"--margin: expected a share in [0, 1), got {margin}")
    if args.batch_sizes and min(args.batch_sizes) < 1:
        raise ConfigError(f"--batch-sizes: expected positive integers, got {args.batch_sizes}")
    cfg = load_config(args.config, args.overrides)
    to_stdout = json_to_stdout(args)
    if args.json and not to_stdout:
        _check_json_output(args.json, args.config)
    if to_stdout:  # the JSON alone on stdout, to parse; the table for a person on stderr
        safe_print = functools.partial(_print_to, sys.stderr)
    decided, dtype_why = plan_dtype(cfg)  # dtype auto on a CPU: train's kept choice, with no probe (nothing real)
    started = time.perf_counter()

    def progress(peak) -> None:  # one line per traced size: a large model takes seconds each
        print(f"planned batch {peak.batch_size}: peak {format_bytes(peak.peak)} "
              f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)

    plan = plan_config(decided, args.batch_sizes, memory, margin, progress)
    dtype = cfg.amp.dtype
    if dtype == "auto":
        from ignite_amp.core.device import dtype_name, resolve_dtype

        dtype = f"auto ({decided.amp.dtype if dtype_why else dtype_name(resolve_dtype('auto', plan.device))})"
    safe_print(fitted(f"{cfg.name}: {cfg.model.name}, dtype {dtype}, batch sizes per process"))
    if dtype_why:
        safe_print(fitted(f"dtype auto: {dtype_why}"))
    for line in plan.lines():
        safe_print(fitted(line))
    if plan.memory is None:
        safe_print("for the largest batch that fits: --memory SIZE (e.g. --memory 80GiB)")
    options = None
    if args.checkpointing or cfg.amp.activation_checkpointing == "auto":
        from ignite_amp.run.plan import checkpoint_options_lines, config_batch_sizes, config_checkpoint_options

        size = max(args.batch_sizes or config_batch_sizes(cfg))  # as auto chooses: at the largest size asked
        options = config_checkpoint_options(decided, size)
        for line in checkpoint_options_lines(options, size, plan.budget):
            safe_print(line)
    if args.json:
        extra = {} if options is None else {"checkpoint_options": [dataclasses.asdict(o) for o in options]}
        import torch

        run = resolve(decided, planned_world(decided), torch.device(plan.device))  # its device, processes, batches
        text = json.dumps({"config": cfg.name, "run": run.to_dict(), **plan.to_dict(), **extra}, indent=2) + "\n"
        if to_stdout:
            print_to_stdout(text, end="")
            return 0
        try:
            write_text(args.json, text)  # whole or not at all: a failed write leaves nothing to refuse a retry
        except OSError as exc:
            raise ConfigError(f"--json {args.json}: cannot write ({exc.strerror or exc})") from None
    return 0


def _print_to(stream, *args, **kwargs) -> None:
    print(*args, **kwargs, file=stream, flush=True)


def json_to_stdout(args: argparse.Namespace) -> bool:
    """Whether ``--json`` is ``-`` or a name of this process's stdout (``/dev/stdout``, ``/dev/fd/1``,
    ``/proc/self/fd/1``): the JSON is printed there, alone, not written over it (a redirected stdout's file would
    be truncated)."""
    import os

    path = getattr(args, "json", None)
    if not path or path == "-":
        return path == "-"
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):  # no such file, or no stdout with a descriptor
        return False


def _check_json_output(path: str, config: str) -> None:
    """``--json FILE``, before the plan: a file in a folder that exists, not the config it read, nor another file that
    is not an earlier plan."""
    import json
    import os

    from ignite_amp.errors import ConfigError

    if os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path))):  # found before the plan
        why = "is a directory" if os.path.isdir(path) else "its folder does not exist"
        raise ConfigError(f"--json {path}: cannot write ({why})")
    if os.path.exists(path) and os.path.exists(config) and os.path.samefile(path, config):
        raise ConfigError(f"--json {path}: is the config the plan reads; name another file for the plan")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                earlier = json.load(f)
        except (OSError, ValueError):
            earlier = None
        if not (isinstance(earlier, dict) and "peaks" in earlier):
            raise ConfigError(f"--json {path}: exists and is not an earlier plan; name another file (a plan's JSON "
                              f"is replaced, another file is not)")
