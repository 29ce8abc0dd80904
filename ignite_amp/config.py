"""YAML config: schema, defaults, validation with one-line errors, ``--set`` overrides.

A config is a plain nested dict. :func:`load_config` reads YAML (or takes a dict), applies
``key.path=value`` overrides, fills defaults and refuses unknown keys, wrong types and
impossible values with a :class:`ConfigError` whose message names the key path.
"""
import copy
import json
import os
import re
from typing import Any, Callable, Dict, Iterable, Optional, Union

import yaml

from ignite_amp.errors import ConfigError

__all__ = ["ConfigError", "load_config", "default_config", "save_config", "flatten_config", "write_batch_size",
           "SCHEMA"]

def _show(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return "null" if value is None else repr(value)


class Field:
    """A leaf of the schema: its default and a check that returns the (normalised) value."""

    def __init__(self, default: Any, check: Callable[[Any, str], Any], doc: str = ""):
        self.default = default
        self.check = check
        self.doc = doc


def _fail(path: str, expected: str, value: Any) -> None:
    raise ConfigError(f"{path}: expected {expected}, got {_show(value)}")


def _number(value: Any) -> Optional[float]:
    """A real number, accepting strings like "1e-3" that YAML 1.1 leaves as text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
        return number
    return None


def positive(allow_none: bool = False, allow_inf: bool = False) -> Callable:
    def check(value, path):
        if value is None and allow_none:
            return None
        number = _number(value)
        if number is None or number != number or number <= 0 or (number == float("inf") and not allow_inf):
            _fail(path, "a positive number" + (" or null" if allow_none else ""), value)
        return number
    return check


def integer(minimum: int = 0, allow_none: bool = False, also: Iterable[str] = (),
            maximum: Optional[int] = None) -> Callable:
    also = tuple(also)

    def check(value, path):
        if value is None and allow_none:
            return None
        if isinstance(value, str) and value in also:
            return value
        if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
                or (maximum is not None and value > maximum)):
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            if maximum is not None:
                what = f"an integer from {minimum} to {maximum}"
            extra = [*(f'"{a}"' for a in also), *(["null"] if allow_none else [])]
            _fail(path, what + "".join(f" or {e}" for e in extra), value)
        return value
    return check


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, "true or false", value)
    return value


def choice(*options: str) -> Callable:
    def check(value, path):
        if value not in options:
            _fail(path, "one of " + ", ".join(options), value)
        return value
    return check


def text(pattern: Optional[str] = None, what: str = "a string", allow_none: bool = False) -> Callable:
    def check(value, path):
        if value is None and allow_none:
            return None
        if not isinstance(value, str) or not value or (pattern and not re.fullmatch(pattern, value)):
            _fail(path, what + (" or null" if allow_none else ""), value)
        return value
    return check


def string_list(value: Any, path: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        _fail(path, "a list of names", value)
    return list(value)


def mapping(value: Any, path: str) -> dict:
    """A free-form mapping (keyword arguments passed through to a constructor)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        _fail(path, "a mapping", value)
    return copy.deepcopy(value)


def resume_value(value: Any, path: str) -> Union[str, bool]:
    if value is False or value == "never":
        return False
    if value == "auto" or (isinstance(value, str) and value):
        return value
    _fail(path, '"auto", "never" or a checkpoint path', value)


SCHEMA: Dict[str, Any] = {
    "name": Field("ignite-amp", text(r"[\w.\-]+", "a name of letters, digits, '.', '_' or '-'")),
    "seed": Field(0, integer(0, maximum=2**32 - 1)),
    "device": Field("auto", text(r"auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?", "auto, cpu, cuda or cuda:N")),
    "output_dir": Field(None, text(allow_none=True), "defaults to runs/<name>"),
    "amp": {
        "dtype": Field("auto", choice("auto", "float16", "bfloat16", "float32")),
        "accumulation_steps": Field(1, integer(1)),
        "micro_batches": Field(1, integer(1)),
        "fp32_modules": Field([], string_list),
        "channels_last": Field(False, boolean),
        "compile": Field(False, boolean),
        "cudnn_benchmark": Field(True, boolean, "CUDA: autotune convolutions for the run's fixed image shapes"),
    },
    "data": {
        "name": Field("shapes", choice("shapes", "cifar10", "cifar100", "imagefolder", "fake")),
        "root": Field("./data", text()),
        "batch_size": Field(64, integer(1, also=("auto",), maximum=2**20)),
        "eval_batch_size": Field(None, integer(1, allow_none=True, maximum=2**20)),
        "num_workers": Field(2, integer(0, maximum=256)),
        "download": Field(False, boolean),
        "augment": Field(False, boolean),
        "image_size": Field(None, integer(8, allow_none=True, maximum=4096)),
        "train_size": Field(None, integer(1, allow_none=True, maximum=10**8)),
        "val_size": Field(None, integer(1, allow_none=True, maximum=10**8)),
    },
    "model": {
        "name": Field("resnet18", text(r"[\w.]+(:[\w.]+)?", 'a torchvision model name or "pkg.module:callable"')),
        "num_classes": Field(10, integer(1)),
        "kwargs": Field({}, mapping),
    },
    "optimizer": {
        "name": Field("AdamW", text(r"[A-Za-z_]\w*", "a torch.optim class name")),
        "lr": Field(3.0e-4, positive()),
        "kwargs": Field({"weight_decay": 0.05}, mapping),
    },
    "scheduler": {
        "name": Field("none", choice("none", "cosine", "onecycle")),
        "kwargs": Field({}, mapping),
    },
    "train": {
        "epochs": Field(5, integer(1)),
        "epoch_length": Field(None, integer(1, allow_none=True), "iterations per epoch; null for the whole loader"),
    },
    "distributed": {
        "backend": Field("auto", choice("auto", "nccl", "gloo")),
        "nproc_per_node": Field(None, integer(1, allow_none=True, maximum=1024),
                                "processes to spawn on this machine; null: one, or what torchrun started"),
    },
    "handlers": {
        "clipping": {
            "max_norm": Field(1.0, positive(allow_none=True)),
            "norm_type": Field(2.0, positive(allow_inf=True)),
            "clip_value": Field(None, positive(allow_none=True)),
        },
        "checkpoint": {
            "metric": Field("accuracy", choice("accuracy", "loss")),
            "n_saved": Field(2, integer(1)),
            "resume": Field("auto", resume_value),
        },
        "oom_backoff": {
            "enabled": Field(True, boolean),
            "min_batch_size": Field(1, integer(1)),
            "mode": Field("micro_batch", choice("micro_batch", "batch")),
            "grow_after": Field(None, integer(1, allow_none=True)),
        },
        "non_finite": {
            "enabled": Field(True, boolean),
            "max_consecutive": Field(20, integer(1)),
        },
        "profiler": {
            "enabled": Field(False, boolean),
            "wait": Field(5, integer(0)),
            "warmup": Field(2, integer(0)),
            "active": Field(5, integer(1)),
            "repeat": Field(1, integer(0)),
        },
        "tensorboard": {
            "enabled": Field(True, boolean),
            "log_every": Field(50, integer(1)),
        },
    },
}


def _defaults(schema: dict) -> dict:
    return {k: _defaults(v) if isinstance(v, dict) else copy.deepcopy(v.default) for k, v in schema.items()}


def default_config() -> dict:
    """The full config with every default filled in."""
    return _defaults(SCHEMA)


def _validate(raw: Any, schema: dict, path: str) -> dict:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        _fail(path or "config", "a mapping", raw)
    for key in raw:
        if key not in schema:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown key (known: {', '.join(schema)})")
    out = {}
    for key, node in schema.items():
        where = f"{path}.{key}" if path else key
        if isinstance(node, dict):
            out[key] = _validate(raw.get(key), node, where)
        elif key in raw:
            out[key] = node.check(raw[key], where)
        else:
            out[key] = copy.deepcopy(node.default)
    return out


def _parse_override(item: str) -> tuple:
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected key.path=value")
    key, _, value = item.partition("=")
    key = key.strip()
    if not re.fullmatch(r"[\w\-]+(\.[\w\-]+)*", key):
        raise ConfigError(f"--set {item}: expected key.path=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def _apply_override(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node, schema = raw, SCHEMA
    for i, part in enumerate(parts[:-1]):
        sub = schema.get(part) if isinstance(schema, dict) else None
        where = ".".join(parts[: i + 1])
        if isinstance(schema, dict) and sub is None:
            raise ConfigError(f"{where}: unknown key (known: {', '.join(schema)})")
        if isinstance(sub, Field) and sub.check is not mapping:
            raise ConfigError(f"{where}: is a value, not a section")
        nxt = node.get(part)
        if nxt is None:  # a free mapping (kwargs) starts from its defaults
            nxt = node[part] = copy.deepcopy(sub.default) if isinstance(sub, Field) else {}
        elif not isinstance(nxt, dict):
            _fail(where, "a mapping", nxt)
        node, schema = nxt, (sub if isinstance(sub, dict) else None)
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (YAML would keep the last one)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: str) -> Any:
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory, expected a YAML file")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.__class__.__name__})") from None


def load_config(source: Union[str, os.PathLike, dict, None] = None, overrides: Iterable[str] = ()) -> dict:
    """Read, override, validate and fill a config.

    Args:
        source: a YAML file path, a (partial) config dict, or None for the defaults.
        overrides: ``"key.path=value"`` strings; values are parsed as YAML.

    Example:
        >>> cfg = load_config({"data": {"name": "shapes"}}, overrides=["train.epochs=2"])
        >>> cfg["train"]["epochs"], cfg["output_dir"]
        (2, 'runs/ignite-amp')
    """
    if source is None:
        raw = {}
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        raw = _read_yaml(os.fspath(source))
        if raw is None:
            raw = {}
    if not isinstance(raw, dict):
        _fail("config", "a mapping at the top level", raw)
    for item in overrides:
        _apply_override(raw, *_parse_override(item))
    cfg = _validate(raw, SCHEMA, "")
    if cfg["output_dir"] is None:
        cfg["output_dir"] = os.path.join("runs", cfg["name"])
    # Expanded once, here: every file of the run (checkpoints, TensorBoard, config.yaml) uses this path.
    cfg["output_dir"] = os.path.expanduser(cfg["output_dir"])
    cfg["data"]["root"] = os.path.expanduser(cfg["data"]["root"])
    return cfg


def save_config(cfg: dict, path: Union[str, os.PathLike]) -> None:
    """Write the resolved config as YAML (atomically: temp file, then rename)."""
    _write_atomic(os.fspath(path), yaml.safe_dump(cfg, sort_keys=False))


def flatten_config(cfg: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and mappings of kwargs become strings."""
    flat = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and not key.endswith("kwargs"):
            flat.update(flatten_config(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def write_batch_size(path: Union[str, os.PathLike], batch_size: int) -> None:
    """Set ``data.batch_size`` in a YAML file, keeping its comments and layout where it can.

    The value is replaced in place when the file names ``data.batch_size`` on one line (block or
    flow style); otherwise the file is rewritten from its parsed YAML (comments are then lost).
    """
    path = os.fspath(path)
    text = open(path, encoding="utf-8").read()
    raw = yaml.safe_load(text) or {}
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
                if (yaml.safe_load(candidate) or {}).get("data", {}).get("batch_size") == batch_size:
                    _write_atomic(path, candidate)
                    return
                lines[i] = line
    raw.setdefault("data", {})["batch_size"] = batch_size
    _write_atomic(path, yaml.safe_dump(raw, sort_keys=False))


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
