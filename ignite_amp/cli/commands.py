"""The bodies of ``ignite-amp train``, ``compare``, ``find-batch-size`` and ``schema``: each reads its parsed
arguments, calls the functions a script would (and imports torch only then), prints what it found and returns the
exit code. A failure raises; :mod:`ignite_amp.cli.failures` turns it into one line and an exit code, from what
:data:`ignite_amp.cli.failures.state` was told here.
"""
import argparse
import os
import sys

from ignite_amp.cli.failures import state

__all__ = ["COMMANDS"]


def _schema(args: argparse.Namespace) -> int:
    import json

    from ignite_amp.config.tree import config_schema
    from ignite_amp.errors import ConfigError
    from ignite_amp.run.console import safe_print

    text = json.dumps(config_schema(), indent=2) + "\n"
    if args.output in (None, "", "-"):
        safe_print(text, end="")
        return 0
    from ignite_amp.files.atomic import write_text

    try:  # whole or not at all: a symlink is followed, a device is written to, nothing is left behind
        write_text(args.output, text)
    except OSError as exc:
        raise ConfigError(f"-o {args.output}: cannot write ({exc.strerror or exc})") from None
    return 0


def _find_batch_size(args: argparse.Namespace) -> int:
    from ignite_amp.config.tree import load_config, write_batch_size
    from ignite_amp.errors import ConfigError
    from ignite_amp.launcher import launch
    from ignite_amp.run.search import search_config

    cfg = load_config(args.config, args.overrides)
    if cfg.distributed.sharded:
        raise ConfigError("find-batch-size: not with distributed.strategy fsdp (a trial that runs out of memory "
                          "inside a sharded forward cannot be retried safely); give data.batch_size a number")
    # Progress: one line per trial on stderr as it finishes; then the table on stdout.
    result, device_name, world = launch(cfg, search_config, cfg, args.objective, True)
    if int(os.environ.get("RANK", 0)) != 0:
        return 0  # under torchrun, rank 0 reports
    print(f"{cfg.model.name} on {device_name}, dtype {cfg.amp.dtype}")
    print(result.table)
    size = result.batch_size * world
    if world > 1:
        print(f"the smallest of {world} processes: {result.batch_size} per process, global batch {size}")
    if args.write:
        write_batch_size(args.config, size)
        print(f"wrote data.batch_size: {size} to {args.config}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from shlex import quote

    from ignite_amp.cli.compare import compare, format_table
    from ignite_amp.config.tree import load_config
    from ignite_amp.core.config_keys import POSITIVE_INT, Number

    POSITIVE_INT(args.steps, "--steps")
    Number()(args.tolerance, "--tolerance")
    from ignite_amp.files.run_directory import RunLayout
    from ignite_amp.run.console import safe_print

    cfg = load_config(args.config, args.overrides)
    results = compare(cfg, steps=args.steps, tolerance=args.tolerance, modes=args.modes, print_fn=safe_print)
    safe_print(format_table(results))  # `ignite-amp compare ... | head` is not an error
    where = RunLayout(cfg.output_dir).compare_dir  # beside the run: its own dashboard stays one run
    safe_print(f"per-mode TensorBoard runs: {where}")
    safe_print(f"  open with: tensorboard --logdir {quote(where)}")
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
    from ignite_amp.files.run_directory import RunLayout
    from ignite_amp.run.compose import train_from_config
    from ignite_amp.run.console import safe_print

    cfg = load_config(args.config, args.overrides)
    _refuse_to_replace_the_source(args.config, RunLayout(cfg.output_dir).config_path, cfg.output_dir)
    state["log"] = RunLayout(cfg.output_dir).log_path
    state["checkpoints"] = RunLayout(cfg.output_dir).checkpoint_dir
    if cfg.handlers.checkpoint.resume != "auto":  # the same command would resume another checkpoint
        state["resume"] = f"{_train_command(args)} --set handlers.checkpoint.resume=auto"
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    result = train_from_config(cfg, progress=progress, command=_train_command(args))
    state["finished"] = True  # a signal from here on stops the last lines, not the run
    if int(os.environ.get("RANK", 0)) != 0:
        return 0  # under torchrun, rank 0 reports
    final = result["final"]
    if final:
        epochs = final["epoch"]
        safe_print(f"done: val accuracy {final.get('val_accuracy', float('nan')):.4f} after {epochs} "
                   f"epoch{'' if epochs == 1 else 's'}")
    if result["best_checkpoint"]:  # its path on a line of its own where both would not fit 80 columns
        line = f"best checkpoint: {result['best_checkpoint']}"
        safe_print(line if len(line) <= 80 else f"best checkpoint:\n  {result['best_checkpoint']}")
    if result["tensorboard_dir"]:
        safe_print(_dashboard_hint(result["tensorboard_dir"]))
    return 0


def _dashboard_hint(tensorboard_dir: str) -> str:
    """The last lines of a training run: the command that shows its dashboard (quoted for a shell), then the
    page to open on a line of its own, so that a terminal of 80 columns does not wrap the URL, then the one
    setting no URL can make: TensorBoard's default outlier scaling cuts the first epochs and the last value off
    the charts. Custom Scalars and Time Series each keep their own tick (in the browser's storage; Time Series'
    links take smoothing, tag and run filters, not this)."""
    from ignite_amp.files.run_directory import dashboard_command

    return (f"dashboard: {dashboard_command(tensorboard_dir)}\n"
            f"  then open http://localhost:6006/#custom_scalars&_smoothingWeight=0\n"
            f"  and untick \"Ignore outliers in chart scaling\" (left pane) to see every point\n"
            f"  (Time Series has its own: untick it in its Settings pane, right, too)")


def _refuse_to_replace_the_source(source: str, resolved: str, output_dir: str) -> None:
    """The run writes its resolved config to ``output_dir/config.yaml``: when that is the file trained from,
    it must be a resolved config already (rerunning a run's own config.yaml resumes it), not the user's."""
    import ignite_amp.config.yaml12 as yaml12
    from ignite_amp.config.limits import same
    from ignite_amp.config.tree import ConfigError, load_config

    if not (os.path.exists(resolved) and os.path.samefile(source, resolved)):
        return
    with open(source, encoding="utf-8") as f:
        raw = yaml12.load(f)
    if not same(raw, load_config(raw)):  # partial, or commented into a different shape: hand-written
        raise ConfigError(f"output_dir: {output_dir} holds the config you train from ({source}), where the run "
                          f"writes its resolved config; keep yours elsewhere, or choose another output_dir")


COMMANDS = {"train": _train, "compare": _compare, "find-batch-size": _find_batch_size, "schema": _schema}
