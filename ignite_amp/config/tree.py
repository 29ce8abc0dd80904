"""The YAML config: the tree of the components' declarations, read with one-line errors and ``--set``.

Each component declares its own keys once, as a dataclass next to the code that uses them
(:mod:`ignite_amp.core.config_keys`): ``amp`` in :mod:`ignite_amp.engine`, ``data`` in :mod:`ignite_amp.data.datasets`,
``model`` in :mod:`ignite_amp.models`, the run's own (``optimizer``, ``scheduler``, ``train``, ``distributed``) in
:mod:`ignite_amp.config.run_keys` (the run and the launcher build from the config: they sit above it), and each
handler's in its handler's module. :class:`Config` gathers them; :func:`load_config` reads YAML
(with YAML 1.2's scalars, as editors do: :mod:`ignite_amp.config.yaml12`) or a dict against it, applies
``key.path=value`` overrides, fills defaults and refuses unknown keys, duplicate keys, wrong types,
impossible values and values that YAML aliases expand past a size (:mod:`ignite_amp.config.limits`) with a
:class:`ConfigError` naming the key path. A loaded config is typed, frozen values (:class:`Config`, one
instance of each declaration); ``cfg.to_dict()`` is the plain nested dict ``config.yaml`` and checkpoints hold.
:func:`config_schema` is the JSON Schema of the same tree (``ignite-amp schema``).
"""
import copy
import dataclasses
import os
import re
from typing import Any, Iterable, Optional, Union

import yaml

import ignite_amp.config.yaml12 as yaml12
from ignite_amp.config.limits import MAX_DEPTH, check_tree
from ignite_amp.config.run_keys import DistributedConfig, OptimizerConfig, SchedulerConfig, TrainConfig
from ignite_amp.core.config_keys import (
    FIXED,
    NOT_COMPARED,
    Integer,
    Mapping,
    Text,
    child,
    defaults,
    defaults_of,
    json_schema,
    section,
    setting,
    show,
    validate,
)
from ignite_amp.core.config_values import Section, build
from ignite_amp.data.datasets import DataConfig
from ignite_amp.engine import AmpConfig
from ignite_amp.errors import ConfigError
from ignite_amp.files.atomic import write_text
from ignite_amp.handlers.best_checkpoint import CheckpointConfig
from ignite_amp.handlers.gradient_clipping import ClippingConfig
from ignite_amp.handlers.non_finite_guard import NonFiniteConfig
from ignite_amp.handlers.oom_backoff import OOMBackoffConfig
from ignite_amp.handlers.profiler_capture import ProfilerConfig
from ignite_amp.handlers.tensorboard.metrics import TensorBoardConfig
from ignite_amp.models import ModelConfig

__all__ = ["Config", "ConfigError", "load_config", "default_config", "save_config", "flatten_config",
           "write_batch_size", "config_schema", "MAX_CONFIG_BYTES"]

MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML; a larger file is a mistake (and slow to parse)


@dataclasses.dataclass(frozen=True, eq=False)
class HandlersConfig(Section):
    """handlers: the run's handlers, each declared by its own module."""

    clipping: ClippingConfig = section(ClippingConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    oom_backoff: OOMBackoffConfig = section(OOMBackoffConfig)
    non_finite: NonFiniteConfig = section(NonFiniteConfig)
    profiler: ProfilerConfig = section(ProfilerConfig)
    tensorboard: TensorBoardConfig = section(TensorBoardConfig)


@dataclasses.dataclass(frozen=True, eq=False)
class Config(Section):
    """An ignite-amp run."""

    name: str = setting("ignite-amp", Text(r"[A-Za-z0-9_.\-]+", "a name of letters, digits, '.', '_' or '-'"),
                        "the run's name (default output_dir: runs/<name>)", NOT_COMPARED)
    seed: int = setting(0, Integer(0, 2**32 - 1), "orders the data and makes the synthetic data sets", FIXED)
    device: str = setting(
        "auto", Text(r"auto|cpu|cuda(:[0-9]+)?|mps|xpu(:[0-9]+)?", "auto, cpu, cuda, cuda:N, mps or xpu"),
        "auto, cpu, cuda, cuda:N, mps or xpu")
    output_dir: str = setting(None, Text(nullable=True), "checkpoints/, config.yaml, train.log and the "
                              "TensorBoard files go here; default runs/<name>; ~ is expanded", NOT_COMPARED)
    # (null in a file; a loaded config's is always a path: load_config fills runs/<name>)
    amp: AmpConfig = section(AmpConfig)
    data: DataConfig = section(DataConfig)
    model: ModelConfig = section(ModelConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    train: TrainConfig = section(TrainConfig)
    distributed: DistributedConfig = section(DistributedConfig)
    handlers: HandlersConfig = section(HandlersConfig)

    def replace(self, **changes: Any) -> "Config":
        """A copy with ``changes`` (sections, or top-level keys), checked and filled as :func:`load_config` does."""
        return load_config(dataclasses.replace(self, **changes).to_dict())

    @staticmethod
    def check_values(cfg: dict, path: str) -> None:
        """Rules between sections."""
        if cfg["distributed"]["strategy"] == "fsdp" and cfg["amp"]["channels_last"] is True:
            raise ConfigError("amp.channels_last: not with distributed.strategy fsdp (FSDP2 shards contiguous "
                              "parameters only)")
        if cfg["distributed"]["strategy"] == "fsdp" and cfg["data"]["batch_size"] == "auto":
            raise ConfigError("data.batch_size: auto is not available with distributed.strategy fsdp (a trial that "
                              "runs out of memory inside a sharded forward cannot be retried safely); give a number")
        backoff = cfg["handlers"]["oom_backoff"]
        if not (backoff["enabled"] and backoff["mode"] == "batch"):
            return
        if cfg["scheduler"]["name"] != "none":
            raise ConfigError(f"handlers.oom_backoff.mode: batch changes the steps per epoch, which a "
                              f"{cfg['scheduler']['name']} schedule cannot follow; use micro_batch")
        if cfg["train"]["epoch_length"] is not None:
            raise ConfigError("handlers.oom_backoff.mode: batch changes the epoch length; leave train.epoch_length "
                              "null")


def _name_sections(cls: type, path: str = "") -> None:
    """Each section class's key path (``Section.path``: a replaced section's errors name it)."""
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            f.metadata["section"].path = f"{path}{f.name}"
            _name_sections(f.metadata["section"], f"{path}{f.name}.")


_name_sections(Config)


def default_config() -> dict:
    """The full config with every default filled in."""
    return defaults(Config)


def config_schema() -> dict:
    """The JSON Schema (draft 07) of a config file, for editors (``# yaml-language-server: $schema=...``)."""
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "ignite-amp config",
            **json_schema(Config)}


def _fail(path: str, expected: str, value: Any) -> None:
    raise ConfigError(f"{path}: expected {expected}, got {show(value)}")


def _parse_override(item: str) -> tuple:
    shown = item if len(item) <= 80 else item[:60] + "..."
    if "=" not in item:
        raise ConfigError(f"--set {shown}: expected key.path=value")
    key, _, value = item.partition("=")
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*", key):
        raise ConfigError(f"--set {shown}: expected key.path=value")
    if key.count(".") >= MAX_DEPTH:
        raise ConfigError(f"--set {shown}: a key path of {key.count('.') + 1} levels (the limit is {MAX_DEPTH})")
    try:  # the value is read as in a config file (YAML 1.2 scalars)
        parsed = yaml12.load(value) if value.strip() else None
    except yaml.constructor.ConstructorError as exc:  # YAML, read as a config refuses it (a duplicate or a list key)
        raise ConfigError(f"--set {shown}: {exc.problem}") from None
    except yaml.YAMLError:
        parsed = value
    except RecursionError:
        raise ConfigError(f"--set {shown}: the value is nested too deeply") from None
    return key, parsed


def _apply_override(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    cls: Optional[type] = Config  # None: under a free mapping (kwargs)
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        f = child(cls, part) if cls is not None else None
        if cls is not None and f is None:
            raise ConfigError(f"{where}: unknown key (known: {', '.join(x.name for x in dataclasses.fields(cls))})")
        if f is not None and "section" not in f.metadata and not isinstance(f.metadata["check"], Mapping):
            raise ConfigError(f"{where}: is a value, not a section")
        nxt = node.get(part)
        if nxt is None:  # a free mapping (kwargs) starts from its defaults
            nxt = node[part] = {} if f is None or "section" in f.metadata else copy.deepcopy(defaults_of(f))
        elif not isinstance(nxt, dict):
            _fail(where, "a mapping", nxt)
        node, cls = nxt, (f.metadata["section"] if f is not None and "section" in f.metadata else None)
    node[parts[-1]] = value


def _read_yaml(path: str) -> Any:
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory, expected a YAML file")
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {os.path.getsize(path)} bytes is not a config (the limit is "
                          f"{MAX_CONFIG_BYTES // 2**20} MiB)")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml12.load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.__class__.__name__})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not a config (nested too deeply)") from None


def load_config(source: Union[str, os.PathLike, dict, Config, None] = None, overrides: Iterable[str] = ()) -> Config:
    """Read, override, validate and fill a config: typed, frozen values (:class:`~ignite_amp.config.tree.Config`).

    Args:
        source: a YAML file path, a (partial) config dict, a loaded config, or None for the defaults.
        overrides: ``"key.path=value"`` strings; values are parsed as YAML.

    Example:
        >>> cfg = load_config({"data": {"name": "shapes"}}, overrides=["train.epochs=2"])
        >>> cfg.train.epochs, cfg.output_dir
        (2, 'runs/ignite-amp')

    ``cfg.to_dict()`` is the plain nested dict (what ``config.yaml`` holds); a changed config is a new one:
    ``load_config(cfg, ["train.epochs=3"])``.
    """
    raw: Any
    if isinstance(source, Config):
        raw = source.to_dict()  # checked again: a Config built or replaced by hand is checked here
    elif source is None:
        raw = {}
    elif isinstance(source, dict):
        check_tree(source)  # before anything walks it: a bounded size and depth, no value inside itself
        raw = copy.deepcopy(_plain(source))  # loaded sections inside it as the dicts they hold
    else:
        raw = _read_yaml(os.fspath(source))
        if raw is None:
            raw = {}
    if not isinstance(raw, dict):
        _fail("config", "a mapping at the top level", raw)
    check_tree(raw)
    for item in overrides:
        _apply_override(raw, *_parse_override(item))
    check_tree(raw)
    values = validate(raw, Config)
    if values["output_dir"] is None:
        values["output_dir"] = os.path.join("runs", values["name"])
    # Expanded once, here: every file of the run (checkpoints, TensorBoard, config.yaml) uses this path.
    values["output_dir"] = os.path.expanduser(values["output_dir"])
    values["data"]["root"] = os.path.expanduser(values["data"]["root"])
    return build(Config, values)


def _plain(value: Any) -> Any:
    """``value`` with every loaded section in it (at any depth) as its plain dict."""
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def save_config(cfg: Union[Config, dict], path: Union[str, os.PathLike]) -> None:
    """Write the resolved config as YAML (atomically: temp file, then rename)."""
    write_text(os.fspath(path), yaml12.dump(cfg.to_dict() if isinstance(cfg, Config) else cfg))


def flatten_config(cfg: Union[Config, dict], prefix: str = "") -> dict:
    """Leaves by key path, as :func:`ignite_amp.core.config_keys.leaves` names them:
    ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; ``kwargs`` mappings and lists are leaves (values as they are)."""
    if isinstance(cfg, Config):
        cfg = cfg.to_dict()
    flat = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not key.endswith("kwargs"):
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = value
    return flat


def write_batch_size(path: Union[str, os.PathLike], batch_size: int) -> None:
    """Set ``data.batch_size`` in a YAML file, keeping its comments and layout where it can.

    The value is replaced in place when the file names ``data.batch_size`` on one line (block or
    flow style); otherwise the file is rewritten from its parsed YAML (comments are then lost).
    """
    path = os.fspath(path)
    text = open(path, encoding="utf-8").read()
    raw = yaml12.load(text) or {}
    lines = text.splitlines(keepends=True)
    in_data = False
    for i, line in enumerate(lines):
        flow = re.match(r"^data:\s*\{", line)
        if flow or re.match(r"^data:\s*(#.*)?$", line):
            in_data = True
        elif re.match(r"^\S", line):
            in_data = False
        if in_data or flow:
            new, count = re.subn(r"(?<![\w])(batch_size:\s*)([^,}\s#]+)", rf"\g<1>{batch_size}", line, count=1)
            if count:
                lines[i] = new
                candidate = "".join(lines)
                if (yaml12.load(candidate) or {}).get("data", {}).get("batch_size") == batch_size:
                    write_text(path, candidate)
                    return
                lines[i] = line
    raw.setdefault("data", {})["batch_size"] = batch_size
    write_text(path, yaml12.dump(raw))
