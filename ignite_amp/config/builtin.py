"""The built-in configs: the ready YAML files and the JSON Schema that ship inside the package.

The repository's ``configs/`` folder is installed as the subpackage ``ignite_amp.configs`` (setup.cfg
``package_dir``, as ``handlers/`` is installed as ``ignite_amp.handlers``), so a wheel trains without a
checkout: ``ignite-amp train quickstart`` finds the built-in by its name from any directory, and
``ignite-amp init quickstart`` copies it out to edit, with the JSON Schema beside it for editors.

A local file wins over a built-in of the same name (``quickstart`` or ``quickstart.yaml`` in the working
directory); :func:`find_config` says which one it took.
"""
import importlib.resources
import json
import os
import re
from typing import Any, List, NamedTuple, Optional

from ignite_amp.errors import ConfigError
from ignite_amp.files.atomic import write_text

__all__ = ["SCHEMA_FILE", "SCHEMA_LINE", "ConfigSource", "builtin_names", "builtin_path", "builtin_summary",
           "find_config", "init_config"]

PACKAGE = "ignite_amp.configs"
#: The file name of the JSON Schema, beside the configs that name it.
SCHEMA_FILE = "ignite-amp.schema.json"
#: The first line of a config: editors (the YAML language server) check the file against the schema beside it.
SCHEMA_LINE = f"# yaml-language-server: $schema={SCHEMA_FILE}"
_SUFFIXES = (".yaml", ".yml")


def _folder() -> str:
    """The installed ``configs/`` folder (a real folder: pip unpacks wheels)."""
    try:
        folder: Any = importlib.resources.files(PACKAGE)  # a Traversable: a path when installed as files
        return os.fspath(folder)
    except (ModuleNotFoundError, TypeError):  # TypeError: a zipped or namespace install, no plain folder
        raise ConfigError("the built-in configs are not installed with this ignite_amp (an editable install made "
                          "before 0.2.0 does not map ignite_amp.configs: run pip install -e . again)") from None


def builtin_names() -> List[str]:
    """The names of the built-in configs, sorted (``quickstart``, ...).

    Example:
        >>> "quickstart" in builtin_names()
        True
    """
    return sorted(name[:-5] for name in os.listdir(_folder()) if name.endswith(".yaml"))


def builtin_path(name: str) -> str:
    """The file of the built-in config ``name``; a :class:`ConfigError` listing the names if there is none."""
    if name not in builtin_names():
        raise ConfigError(f"{name}: no built-in config of that name (built-in: {', '.join(builtin_names())})")
    return os.path.join(_folder(), name + ".yaml")


def builtin_summary(name: str) -> str:
    """The first comment line of a built-in config after its schema line: what it is, in one line."""
    with open(builtin_path(name), encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") and not line.startswith(SCHEMA_LINE):
                return line.lstrip("#").strip()
            if not line.startswith("#"):
                break
    return ""


class ConfigSource(NamedTuple):
    """Where a config argument led: the file to read and, for a built-in, its name."""

    #: the file to load
    path: str
    #: the built-in's name when the built-in was taken, else None
    builtin: Optional[str]
    #: one line saying which was taken, where the argument could name a built-in; else ""
    note: str


def _stem(arg: str) -> str:
    return next((arg[: -len(s)] for s in _SUFFIXES if arg.endswith(s)), arg)


def find_config(arg: str) -> ConfigSource:
    """The config a command-line argument names: a file, else a built-in config's name.

    A local file wins over the built-in of the same name: ``quickstart`` takes ``./quickstart`` or
    ``./quickstart.yaml`` when one exists, else the built-in ``quickstart``. ``note`` says which.
    An argument that is neither an existing file nor a built-in name is a :class:`ConfigError`
    naming both.

    Example:
        >>> source = find_config("quickstart")  # (with no quickstart.yaml in the working directory)
        >>> source.builtin, source.path.endswith(os.path.join("configs", "quickstart.yaml"))
        ('quickstart', True)
    """
    stem = _stem(arg)
    is_name = os.sep not in arg and "/" not in arg and (stem == arg or arg.endswith(_SUFFIXES))
    try:
        names = builtin_names()
    except ConfigError:
        if os.path.exists(arg):  # a file still trains where the built-ins are missing
            return ConfigSource(arg, None, "")
        raise
    if not (is_name and stem in names):
        if not os.path.exists(arg):
            also = f", and no built-in config of that name (built-in: {', '.join(names)})" if is_name else ""
            raise ConfigError(f"{arg}: no such file{also}")
        return ConfigSource(arg, None, "")
    candidates = [arg, arg + ".yaml", arg + ".yml"] if stem == arg else [arg]
    local = next((p for p in candidates if os.path.isfile(p)), None)  # a folder of that name is not a config
    if local is not None:
        return ConfigSource(local, None, f"config: {local} from this directory (not the built-in {stem})")
    path = builtin_path(stem)
    return ConfigSource(path, stem, f"config: the built-in {stem} ({path}); a copy to edit: ignite-amp init {stem}")


def _written_as(text: str, name: str, output: str) -> str:
    """The built-in ``name``'s text for a file named ``stem``: the run named after the file, so two copies
    do not share (and resume) one output_dir. ``output_dir`` is ``runs/<stem>`` as typed (quoted where YAML
    needs it); ``name`` is the stem with each run of characters a name cannot hold made ``_`` ("my run" ->
    "my_run")."""
    stem = _stem(os.path.basename(output))
    if stem == name:
        return text
    if not stem.strip("."):  # "-o .yaml": runs/ or runs/.. would be another run's folder, or all of them
        raise ConfigError(f"-o {output}: name the file, e.g. -o mine.yaml (the run is named after it)")
    run = re.sub(r"[^A-Za-z0-9_.\-]+", "_", stem)
    folder = f"runs/{stem}"
    try:
        folder.encode("utf-8")
    except UnicodeEncodeError:  # a file name's undecodable bytes: the name's characters only
        folder = f"runs/{run}"
    folder = folder if re.fullmatch(r"[A-Za-z0-9_./\-]+", folder) else json.dumps(folder, ensure_ascii=False)
    text = re.sub(rf"^name: {re.escape(name)}$", lambda _: f"name: {run}", text, count=1, flags=re.M)
    return re.sub(rf"^output_dir: runs/{re.escape(name)}$", lambda _: f"output_dir: {folder}", text, count=1,
                  flags=re.M)


def init_config(name: str, output: str, force: bool = False) -> List[str]:
    """Write the built-in config ``name`` to ``output`` to edit, and the JSON Schema beside it (the file its
    first line names, for editors). Returns the files written; an existing ``output`` is kept unless
    ``force``. The schema beside it is replaced when it differs (it is generated: this version's is the one
    that matches). Errors are :class:`ConfigError` lines naming the file.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     [os.path.basename(p) for p in init_config("quickstart", os.path.join(folder, "mine.yaml"))]
        ['mine.yaml', 'ignite-amp.schema.json']
    """
    if os.path.isdir(output):
        raise ConfigError(f"-o {output}: is a directory; name the file to write, e.g. -o "
                          f"{os.path.join(output, name + '.yaml')}")
    with open(builtin_path(name), encoding="utf-8") as f:
        text = _written_as(f.read(), name, output)
    if os.path.exists(output) and not force:
        raise ConfigError(f"-o {output}: exists; choose another file, or add --force to replace it")
    with open(os.path.join(_folder(), SCHEMA_FILE), encoding="utf-8") as f:
        schema = f.read()
    schema_path = os.path.join(os.path.dirname(output), SCHEMA_FILE)
    if os.path.isdir(schema_path):  # found before the config is written: a rerun would find that one in the way
        raise ConfigError(f"{schema_path}: is a directory, where the config's JSON Schema goes (its first line names "
                          f"it); move it, or write the config elsewhere")
    try:
        with open(schema_path, encoding="utf-8") as f:
            current = f.read()
    except (OSError, UnicodeDecodeError):
        current = None
    if not os.path.isdir(os.path.dirname(output) or "."):
        raise ConfigError(f"-o {output}: cannot write (No such file or directory)")
    # The schema first, each file whole or not at all (a full disk, a quota, ulimit -f): a write that fails leaves
    # no config behind to refuse the retry, nor a config beside a schema cut short
    written = [output] + ([schema_path] if current != schema else [])
    if current != schema:
        _write(schema_path, schema, "", f"; {output} not written")
    _write(output, text, "-o ")
    return written


def _write(path: str, text: str, label: str, then: str = "") -> None:
    try:
        write_text(path, text)
    except OSError as exc:
        raise ConfigError(f"{label}{path}: cannot write ({exc.strerror or exc}){then}") from None
