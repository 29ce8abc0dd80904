"""``ignite-amp`` command line: a thin layer over the functions a script would call.

This module builds the parser and runs a command: :mod:`ignite_amp.cli.commands` holds the commands' bodies
(``configs``, ``init`` and ``plan`` theirs in :mod:`ignite_amp.cli.configs` and :mod:`ignite_amp.cli.plan`), and
:mod:`ignite_amp.cli.failures` how a failure ends: one line on stderr, exit 2 for a user error, 1 for a run
stopped or an unexpected error (``--debug`` also prints the traceback).
A bare ``ignite-amp`` prints the help (its commands) on stderr and exits 2. Only the command
functions import torch: ``--help`` and ``--version`` answer without it.
"""
import argparse
import logging
import signal
import sys
import threading
from typing import Any, List, NoReturn, Optional

import ignite_amp.cli.configs as cli_configs
from ignite_amp.cli import commands
from ignite_amp.cli.failures import failed, interrupted, state, terminated, thread_failed
from ignite_amp.cli.plan import add_plan_parser, plan_command
from ignite_amp.version import __version__

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as for every user error
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Commands(argparse._SubParsersAction):
    """The subcommands' action: each command's ``--help`` opens with its one line from the commands' list."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("description", kwargs.get("help"))
        return super().add_parser(name, **kwargs)


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a YAML config file, or a built-in config's name (ignite-amp configs)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a config value (repeatable), e.g. --set train.epochs=2")
    parser.add_argument("--debug", action="store_true", help="print the traceback of a failure too")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ignite-amp", description="Mixed-precision training with PyTorch Ignite.")
    parser.add_argument("--version", action="version", version=f"ignite-amp {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND", action=_Commands)
    train = sub.add_parser("train", help="train what a config describes")
    _add_config(train)
    train.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show a progress bar (default: when stderr is a terminal)")
    cmp = sub.add_parser("compare", help="float32 against the precisions the device runs fast: float16 (with and "
                                         "without GradScaler) and bfloat16 on a GPU, bfloat16 on a CPU")
    _add_config(cmp)
    cmp.add_argument("--steps", type=int, default=50, help="training steps per mode (default 50)")
    cmp.add_argument("--tolerance", type=float, default=0.1,
                     help="largest relative loss difference from float32 before a mode is flagged (default 0.1)")
    # named once in the help: a usage line that fits
    modes = ["float32", "float16", "float16+scaler", "bfloat16", "float8"]
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


COMMANDS = dict(commands.COMMANDS)  # train, compare, find-batch-size, schema
COMMANDS.update(cli_configs.COMMANDS)  # configs, init
COMMANDS["plan"] = plan_command


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    from ignite_amp.files.run_directory import terminal_log_handler

    handler = terminal_log_handler()
    logging.getLogger().addHandler(handler)
    state.clear()
    state["command"] = args.command  # how a failure ends depends on it (a run's checkpoints, or none)
    # A full disk in a writer thread (TensorBoard's) or in train.log's handler: the command's one line
    # reports it (the main thread's next write raises it), not a thread traceback or "--- Logging error ---".
    quiet = (threading.excepthook, logging.raiseExceptions)
    state["excepthook"] = quiet[0]
    threading.excepthook = thread_failed
    logging.raiseExceptions = False
    signals = threading.current_thread() is threading.main_thread()
    if signals:  # a scheduler's SIGTERM stops the run like Ctrl-C does: one line, the checkpoints kept
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, terminated),
                    signal.SIGINT: signal.getsignal(signal.SIGINT)}
    try:
        cli_configs.resolve_config(args)  # CONFIG: a file, or a built-in config's name
        return COMMANDS[args.command](args)
    except KeyboardInterrupt as exc:
        return interrupted(args, exc, signals)
    except Exception as exc:
        return failed(args, exc, signals)
    finally:
        threading.excepthook, logging.raiseExceptions = quiet
        logging.getLogger().removeHandler(handler)
        if signals:  # the command's handlers go with it, before the interpreter's teardown
            _flush()
            for number, before in previous.items():
                # The console command's work is done and said: a signal now ends the process as the signal, with
                # no traceback (Python's Ctrl-C handler, or ours, raised into torch's exit callbacks).
                signal.signal(number, signal.SIG_DFL if _exiting and before is not signal.SIG_IGN else before)


def _flush() -> None:
    """What the command printed, out now (a signal in the teardown ends the process before Python flushes)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed terminal or pipe: nothing more to say
            pass


_exiting = False


def entry() -> int:
    """The ``ignite-amp`` console command: :func:`main`, then exit. A SIGTERM or Ctrl-C after the command returned
    (torch's teardown can take seconds) ends the process as that signal, with nothing more said."""
    global _exiting
    _exiting = True
    return main()


if __name__ == "__main__":
    sys.exit(entry())
