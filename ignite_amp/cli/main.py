"""``ignite-amp`` command line: a thin layer over the functions a script would call.

Every failure ends in one line on stderr: a user error (bad config, missing data, unwritable
output, a run directory in use) exits 2; a run stopped for a stated reason (non-finite loss,
out of memory at the floor, disk full) exits 1; an unexpected error exits 1 and points at the
traceback in the run's ``train.log``. ``--debug`` also prints the traceback.
A bare ``ignite-amp`` prints the help (its commands) on stderr and exits 2. Only the command
functions import torch: ``--help`` and ``--version`` answer without it.
"""
import argparse
import errno
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import List, Optional, Tuple

import ignite_amp.cli.configs as cli_configs
from ignite_amp.cli.plan import add_plan_parser, plan_command
from ignite_amp.version import __version__

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every user error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a YAML config file, or a built-in config's name (ignite-amp configs)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a config value (repeatable), e.g. --set train.epochs=2")
    parser.add_argument("--debug", action="store_true", help="print the traceback of a failure too")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ignite-amp", description="Mixed-precision training with PyTorch Ignite.")
    parser.add_argument("--version", action="version", version=f"ignite-amp {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    train = sub.add_parser("train", help="train what a config describes")
    _add_config(train)
    train.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show a progress bar (default: when stderr is a terminal)")
    cmp = sub.add_parser("compare", help="float32 against float16 (with and without GradScaler) and bfloat16")
    _add_config(cmp)
    cmp.add_argument("--steps", type=int, default=50, help="training steps per mode (default 50)")
    cmp.add_argument("--tolerance", type=float, default=0.1,
                     help="largest relative loss difference from float32 before a mode is flagged (default 0.1)")
    modes = ["float32", "float16", "float16+scaler", "bfloat16", "float8"]  # named once in the help: a usage line that fits
    cmp.add_argument("--modes", nargs="+", choices=modes, metavar="MODE",
                     help=f"modes to run besides float32: {', '.join(modes)} (default: those the device runs fast)")
    search = sub.add_parser("find-batch-size", help="find the batch size to train with on the GPU (needs CUDA)")
    _add_config(search)
    search.add_argument("--write", action="store_true", help="store the chosen size as data.batch_size in CONFIG")
    search.add_argument("--objective", choices=["largest", "fastest"], default="largest",
                        help="largest: the largest batch under 95%% of the GPU memory (default); fastest: the "
                             "smallest batch within 3%% of the best samples/s")
    schema = sub.add_parser("schema", help="print the config's JSON Schema (for editors: see the config reference)")
    schema.add_argument("-o", "--output", metavar="FILE", help="write it to FILE instead of stdout")
    cli_configs.add_commands(sub)  # configs, init
    add_plan_parser(sub, _add_config)  # ignite-amp plan: its arguments and command in ignite_amp.cli.plan
    return parser


def _schema(args: argparse.Namespace) -> int:
    import json

    from ignite_amp.config.tree import config_schema
    from ignite_amp.run.console import safe_print

    from ignite_amp.errors import ConfigError

    text = json.dumps(config_schema(), indent=2) + "\n"
    if args.output in (None, "", "-"):
        safe_print(text, end="")
        return 0
    try:  # in place: a symlink is followed, a device is written to, nothing is left behind
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise ConfigError(f"-o {args.output}: cannot write ({exc.strerror or exc})") from None
    return 0


def _find_batch_size(args: argparse.Namespace) -> int:
    from ignite_amp.config.tree import load_config, write_batch_size
    from ignite_amp.errors import ConfigError
    from ignite_amp.launcher import launch
    from ignite_amp.run.search import search_config

    cfg = load_config(args.config, args.overrides)
    if cfg["distributed"]["strategy"] == "fsdp":
        raise ConfigError("find-batch-size: not with distributed.strategy fsdp (a trial that runs out of memory "
                          "inside a sharded forward cannot be retried safely); give data.batch_size a number")
    # Progress: one line per trial on stderr as it finishes; then the table on stdout.
    result, device_name, world = launch(cfg, search_config, cfg, args.objective, True)
    if int(os.environ.get("RANK", 0)) != 0:
        return 0  # under torchrun, rank 0 reports
    print(f"{cfg['model']['name']} on {device_name}, dtype {cfg['amp']['dtype']}")
    print(result.table)
    size = result.batch_size * world
    if world > 1:
        print(f"the smallest of {world} processes: {result.batch_size} per process, global batch {size}")
    if args.write:
        write_batch_size(args.config, size)
        print(f"wrote data.batch_size: {size} to {args.config}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from ignite_amp.cli.compare import compare, format_table
    from ignite_amp.config.tree import load_config
    from ignite_amp.core.config_keys import POSITIVE_INT, Number
    from shlex import quote

    POSITIVE_INT(args.steps, "--steps")
    Number()(args.tolerance, "--tolerance")
    from ignite_amp.run.console import safe_print
    from ignite_amp.files.run_directory import RunLayout

    cfg = load_config(args.config, args.overrides)
    results = compare(cfg, steps=args.steps, tolerance=args.tolerance, modes=args.modes, print_fn=safe_print)
    safe_print(format_table(results))  # `ignite-amp compare ... | head` is not an error
    where = RunLayout(cfg["output_dir"]).compare_dir  # beside the run: its own dashboard stays one run
    safe_print(f"per-mode TensorBoard runs: {where}  (open with: tensorboard --logdir {quote(where)})")
    return 0


def _train_command(args: argparse.Namespace) -> str:
    """This command, quoted for a shell, without the settings the hints set themselves."""
    import shlex

    words = ["ignite-amp", "train", getattr(args, "config_as_typed", args.config)]
    for override in args.overrides:
        if override.partition("=")[0].strip() not in ("train.epochs", "handlers.checkpoint.resume"):
            words += ["--set", override]
    return " ".join(shlex.quote(word) for word in words)


def _train(args: argparse.Namespace) -> int:
    from ignite_amp.config.tree import load_config
    from ignite_amp.run.console import safe_print
    from ignite_amp.run.compose import train_from_config
    from ignite_amp.files.run_directory import RunLayout

    cfg = load_config(args.config, args.overrides)
    _refuse_to_replace_the_source(args.config, RunLayout(cfg["output_dir"]).config_path, cfg["output_dir"])
    _state["log"] = RunLayout(cfg["output_dir"]).log_path
    _state["checkpoints"] = RunLayout(cfg["output_dir"]).checkpoint_dir
    if cfg["handlers"]["checkpoint"]["resume"] != "auto":  # the same command would resume another checkpoint
        _state["resume"] = f"{_train_command(args)} --set handlers.checkpoint.resume=auto"
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    result = train_from_config(cfg, progress=progress, command=_train_command(args))
    if int(os.environ.get("RANK", 0)) != 0:
        return 0  # under torchrun, rank 0 reports
    final = result["final"]
    if final:
        epochs = final["epoch"]
        safe_print(f"done: val accuracy {final.get('val_accuracy', float('nan')):.4f} after {epochs} "
                   f"epoch{'' if epochs == 1 else 's'}")
    if result["best_checkpoint"]:
        safe_print(f"best checkpoint: {result['best_checkpoint']}")
    if result["tensorboard_dir"]:
        safe_print(_dashboard_hint(result["tensorboard_dir"]))
    return 0


def _dashboard_hint(tensorboard_dir: str) -> str:
    """The last lines of a training run: the command that shows its dashboard (quoted for a shell), then the
    page to open on a line of its own, so that a terminal of 100 columns does not wrap the URL."""
    from ignite_amp.files.run_directory import dashboard_command

    return (f"dashboard: {dashboard_command(tensorboard_dir)}\n"
            f"  then open http://localhost:6006/#custom_scalars&_smoothingWeight=0")


COMMANDS = {"train": _train, "compare": _compare, "find-batch-size": _find_batch_size, "schema": _schema}
COMMANDS.update(cli_configs.COMMANDS)  # configs, init
COMMANDS["plan"] = plan_command


_state: dict = {}  # what the command knew before it failed (the run's log file)


def one_line(exc: BaseException) -> str:
    """The user-facing line of an error: its first line; for an error raised in a DataLoader worker
    (which arrives as "Caught X in DataLoader worker ... Original Traceback ..."), the original's."""
    text = str(exc).strip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        name, sep, message = last.partition(": ")
        text = message if sep and re.fullmatch(r"[\w.]+", name) else last
    return text.splitlines()[0] if text else exc.__class__.__name__


def _refuse_to_replace_the_source(source: str, resolved: str, output_dir: str) -> None:
    """The run writes its resolved config to ``output_dir/config.yaml``: when that is the file trained from,
    it must be a resolved config already (rerunning a run's own config.yaml resumes it), not the user's."""
    import ignite_amp.config.yaml12 as yaml12
    from ignite_amp.config.tree import ConfigError, load_config
    from ignite_amp.config.limits import same

    if not (os.path.exists(resolved) and os.path.samefile(source, resolved)):
        return
    with open(source, encoding="utf-8") as f:
        raw = yaml12.load(f)
    if not same(raw, load_config(raw)):  # partial, or commented into a different shape: hand-written
        raise ConfigError(f"output_dir: {output_dir} holds the config you train from ({source}), where the run "
                          f"writes its resolved config; keep yours elsewhere, or choose another output_dir")


def _checkpoint_kept() -> bool:
    """Whether the run being trained has a checkpoint on disk (what "resume" would load)."""
    folder = _state.get("checkpoints")
    return bool(folder) and os.path.isdir(folder) and any(
        n.endswith((".pt", ".dcp")) and not n.startswith(".") for n in os.listdir(folder))


def _rerun() -> str:
    """How to resume the run being trained from its last checkpoint: the same command, unless that names
    another checkpoint (``resume:`` a path) or starts over (``never``)."""
    command = _state.get("resume")
    return f"run {command}" if command else "run the same command"


def describe(exc: BaseException) -> Tuple[int, str]:
    """(exit code, the one line) for a failure of a command."""
    from ignite_amp.files.checkpoints import disk_full
    from ignite_amp.core.device import is_oom_error
    from ignite_amp.errors import RUN_STOPPED, USER_ERRORS, RankDiedError

    if isinstance(exc, USER_ERRORS):
        return 2, f"ignite-amp: error: {one_line(exc)}"
    if isinstance(exc, RankDiedError):
        then = (f"the last checkpoint is intact: {_rerun()} to resume" if _checkpoint_kept() else
                "no checkpoint was written yet: run the same command to start again")
        return 1, f"ignite-amp: stopped: {one_line(exc)}; {then}"
    if isinstance(exc, RUN_STOPPED):
        return 1, f"ignite-amp: stopped: {one_line(exc)}"
    if is_oom_error(exc):  # one process, or one rank of several (FSDP2 cannot retry a batch: no OOMBackoff)
        # amp.micro_batches may change on a resume; data.batch_size not under a schedule
        then = (f"the last checkpoint is intact: {_rerun()} with --set amp.micro_batches=N (the same batch in N "
                f"smaller chunks) to resume" if _checkpoint_kept() else "lower data.batch_size, or raise "
                f"amp.micro_batches (the same batch in smaller chunks), and run it again")
        return 1, f"ignite-amp: stopped: out of memory ({one_line(exc)}); {then}"
    if disk_full(exc):
        where = getattr(exc, "filename", None) or "writing the run"
        then = (f"the last checkpoint is kept: free space and {_rerun()} to resume" if _checkpoint_kept() else
                "no checkpoint was written yet: free space and run the same command again")
        return 1, f"ignite-amp: stopped: no space left on device ({where}); {then}"
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM, errno.EISDIR,
                                                   errno.ENOTDIR):
        # EISDIR/ENOTDIR: a directory where the run keeps a file (.lock, config.yaml), or the reverse
        return 2, f"ignite-amp: error: cannot write {exc.filename or ''}: {exc.strerror}"
    log = _state.get("log")
    where = f"the traceback is in {log}" if log and os.path.exists(log) else "run it again with --debug"
    return 1, f"ignite-amp: internal error: {exc.__class__.__name__}: {one_line(exc)} ({where})"


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    from ignite_amp.files.run_directory import terminal_log_handler

    handler = terminal_log_handler()
    logging.getLogger().addHandler(handler)
    _state.clear()
    # A full disk in a writer thread (TensorBoard's) or in train.log's handler: the command's one line
    # reports it (the main thread's next write raises it), not a thread traceback or "--- Logging error ---".
    quiet = (threading.excepthook, logging.raiseExceptions)
    _state["excepthook"] = quiet[0]
    threading.excepthook = _thread_failed
    logging.raiseExceptions = False
    signals = threading.current_thread() is threading.main_thread()
    if signals:  # a scheduler's SIGTERM stops the run like Ctrl-C does: one line, the checkpoints kept
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminated),
                    signal.SIGINT: signal.getsignal(signal.SIGINT)}
    try:
        cli_configs.resolve_config(args)  # CONFIG: a file, or a built-in config's name
        return COMMANDS[args.command](args)
    except KeyboardInterrupt as exc:
        if signals:  # a second Ctrl-C while this one is handled: no traceback
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if getattr(args, "debug", False):
            traceback.print_exc()
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        log = _state.get("log")
        if log and os.path.exists(log):
            with open(log, "a") as f:
                f.write(f"ignite-amp: {what}\n")
        if args.command != "train":
            then = "nothing was kept: run the command again"
        elif _checkpoint_kept():
            then = f"{_rerun()} to resume from the last checkpoint"
        else:
            then = "no checkpoint was written yet: run the same command to start again"
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun every rank gets the signal: rank 0 says it
            print(f"ignite-amp: {what}: {then}", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except Exception as exc:
        stopped = _stopped_with_rank_0() if signals else None
        if stopped is not None:  # under torchrun: rank 0 says it, in its one line
            return stopped
        if getattr(args, "debug", False):
            traceback.print_exc()
        code, line = describe(exc)
        print(line, file=sys.stderr)
        _log_rank_death(exc, line)
        return code
    finally:
        threading.excepthook, logging.raiseExceptions = quiet
        logging.getLogger().removeHandler(handler)
        if signals and not _exiting:  # the console command keeps ignoring a late Ctrl-C until it exits
            for number, before in previous.items():
                signal.signal(number, before)


def _stopped_with_rank_0(wait: float = 3.0) -> Optional[int]:
    """Under torchrun, on a rank other than 0: whether the error came from a stop of every worker (torchrun
    sends each one the signal; rank 0 stopped first and this rank's collective lost its peer, "Connection
    closed by peer"). Waits up to ``wait`` seconds for this rank's own signal; returns its exit code, or None."""
    if int(os.environ.get("RANK", 0)) == 0 or "LOCAL_RANK" not in os.environ:
        return None
    deadline = time.monotonic() + wait
    try:
        while "signalled" not in _state and time.monotonic() < deadline:
            time.sleep(0.02)
    except KeyboardInterrupt as exc:
        _state["signalled"] = 143 if isinstance(exc, Terminated) else 130
    return _state.get("signalled")


def _log_rank_death(exc: BaseException, line: str) -> None:
    """A killed rank wrote nothing about it: the command's line goes to train.log too."""
    from ignite_amp.errors import RankDiedError

    log = _state.get("log")
    if isinstance(exc, RankDiedError) and log and os.path.exists(log):
        with open(log, "a") as f:
            f.write(line + "\n")


def _thread_failed(args: "threading.ExceptHookArgs") -> None:
    """A thread's error: a full disk goes to train.log only (the run stops on it in one line); others as usual."""
    from ignite_amp.files.checkpoints import disk_full

    if not disk_full(args.exc_value):
        _state.get("excepthook", threading.__excepthook__)(args)
        return
    log = _state.get("log")
    try:
        with open(log, "a") as f:
            f.write("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
    except (OSError, TypeError):
        pass


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so it unwinds like Ctrl-C."""


def _terminated(signum, frame) -> None:
    _state["signalled"] = 143
    raise Terminated()


_exiting = False


def entry() -> int:
    """The ``ignite-amp`` console command: :func:`main`, then exit."""
    global _exiting
    _exiting = True
    return main()


if __name__ == "__main__":
    sys.exit(entry())
