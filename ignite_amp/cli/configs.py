"""The ``ignite-amp`` commands about the built-in configs, and how a command's CONFIG finds its file.

``ignite-amp configs`` lists the built-in configs; ``ignite-amp init [NAME] [-o FILE]`` writes one to a
file to edit, with the JSON Schema beside it for editors. Every command that takes a CONFIG takes a
built-in's name too (``ignite-amp train quickstart``, from any directory); a local file of that name wins,
and the command says which it took (:func:`ignite_amp.config.builtin.find_config`). Imports no torch.
"""
import argparse
import os
import shlex
import sys

from ignite_amp.config.builtin import builtin_names, builtin_path, builtin_summary, find_config, init_config
from ignite_amp.errors import ConfigError
from ignite_amp.run.console import fitted, safe_print

__all__ = ["add_commands", "COMMANDS", "resolve_config"]


def add_commands(sub: "argparse._SubParsersAction") -> None:
    """Add ``configs`` and ``init`` to the ``ignite-amp`` parser's commands."""
    sub.add_parser("configs", help="list the built-in configs (train one by name: ignite-amp train quickstart)")
    init = sub.add_parser("init", help="write a built-in config to a file to edit, with the JSON Schema beside it "
                                       "for editors")
    init.add_argument("name", metavar="NAME", nargs="?", default="quickstart",
                      help="the built-in config to copy (default quickstart; ignite-amp configs lists them)")
    init.add_argument("-o", "--output", metavar="FILE",
                      help="the file to write (default NAME.yaml in this directory; - prints it)")
    init.add_argument("--force", action="store_true", help="replace FILE if it exists")


def _configs(args: argparse.Namespace) -> int:
    names = builtin_names()
    width = max(len(name) for name in names)
    for name in names:
        safe_print(f"{name:<{width}}  {builtin_summary(name)}")
    safe_print("train one: ignite-amp train NAME; a copy to edit: ignite-amp init NAME -o FILE")
    return 0


def _init(args: argparse.Namespace) -> int:
    if args.output == "-":  # the config alone (its schema line names a file that is not written)
        with open(builtin_path(args.name), encoding="utf-8") as f:
            safe_print(f.read(), end="")
        return 0
    output = args.output or f"{args.name}.yaml"
    if args.output is None and os.path.exists(output) and not args.force:  # the default name: no -o to blame
        raise ConfigError(f"{output}: exists (init writes NAME.yaml when no -o is given); name another file with "
                          f"-o FILE, or add --force to replace it")
    written = init_config(args.name, output, force=args.force)
    beside = " and the JSON Schema beside it (for editors)" if len(written) > 1 else ""
    safe_print(fitted(f"wrote {output} (the built-in {args.name}){beside}"))
    safe_print(f"train it: ignite-amp train {shlex.quote(output)}")
    return 0


#: The commands of this module, by name (merged into the CLI's table).
COMMANDS = {"configs": _configs, "init": _init}


def resolve_config(args: argparse.Namespace) -> None:
    """Point ``args.config`` (as typed: a file or a built-in's name) at the file to read, keeping the typed
    word in ``args.config_as_typed`` (for the commands the run suggests); print which config was taken
    where the word could name a built-in."""
    typed = getattr(args, "config", None)
    if typed is None:
        return
    source = find_config(typed)
    if source.builtin and getattr(args, "write", False):
        raise ConfigError(f"--write: {typed} is a built-in config, not a file of yours; write a copy first "
                          f"(ignite-amp init {source.builtin} -o FILE) and search with it")
    args.config_as_typed, args.config = typed, source.path
    if source.note and int(os.environ.get("RANK", 0)) == 0:  # under torchrun, rank 0 says it
        from ignite_amp.cli.plan import json_to_stdout

        # on stderr where stdout carries the plan's JSON alone (plan --json -)
        safe_print(fitted(source.note), **({"file": sys.stderr} if json_to_stdout(args) else {}))
