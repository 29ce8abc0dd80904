"""How a component declares its config: a stdlib dataclass whose fields carry their own check.

Each component (data, model, optimizer, each handler...) owns a ``@dataclass`` whose fields are
made by :func:`setting` (a default, a :class:`Check`, a one-line doc and the key's resume rule)
or by :func:`section` (a nested component). :mod:`ignite_amp.config.tree` reads YAML against the
tree of these declarations, and generates the JSON Schema from the same tree: a key is declared
once, in the file of the component that uses it.

The checks also guard the Python API (``Check.argument``), so "a positive integer" is written
once for the config and for the handlers' arguments.
"""
import copy
import dataclasses
import json
import math
import re
import sys
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, cast

from ignite_amp.errors import ConfigError

__all__ = ["Check", "Integer", "Number", "Boolean", "BooleanOrFraction", "Choice", "Text", "Names", "Mapping",
           "ResumeValue", "setting", "section", "argument", "defaults", "validate", "leaves", "json_schema", "child",
           "FIXED", "FIXED_UNDER_SCHEDULE", "APPLIED", "NOT_COMPARED", "POSITIVE_INT"]

# Resume rules: what a resume may change (ignite_amp.run.resume applies them).
FIXED = "fixed"  # the run would not be the same run: a resume that changes it is refused
FIXED_UNDER_SCHEDULE = "fixed under a schedule"  # a cosine/one-cycle schedule was made for the old value
APPLIED = "applied"  # takes effect on resume, and the resume says so
NOT_COMPARED = "not compared"  # where or how the run is started, not what it is
RULES = (FIXED, FIXED_UNDER_SCHEDULE, APPLIED, NOT_COMPARED)


class _Invalid(Exception):
    pass


def show(value: Any) -> str:
    """A value as a config error names it: strings quoted, containers by kind."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return "null" if value is None else repr(value)


class Check:
    """What a value must be: ``check(value, path)`` returns it (normalised) or raises a one-line ConfigError."""

    what = "a value"

    def normalize(self, value: Any) -> Any:  # raises _Invalid
        return value

    def __call__(self, value: Any, path: str) -> Any:
        try:
            return self.normalize(value)
        except _Invalid:
            raise ConfigError(f"{path}: expected {self.what}, got {show(value)}") from None

    def argument(self, value: Any, name: str) -> Any:
        """The same check for a Python argument: ValueError ``Argument NAME should be ..., got ...``."""
        try:
            return self.normalize(value)
        except _Invalid:
            self.refuse_argument(value, name)

    def refuse_argument(self, value: Any, name: str) -> None:
        raise ValueError(f"Argument {name} should be {self.what.replace('null', 'None')}, got {value!r}.") from None

    def schema(self) -> dict:
        return {}


def _or(base: dict, extras: tuple) -> dict:
    return {"anyOf": [base, {"enum": list(extras)}]} if extras else base


# Integers above this are not exact in JavaScript (an editor reads 10**400 as Infinity, not an integer).
_EXACT = 2**53


class Integer(Check):
    """An integer in bounds; a float with no fraction (``2.0``, ``1e3``) is that integer, as JSON Schema counts it.
    Without a maximum, at most 2**53 (the largest integer every JSON reader holds exactly)."""

    def __init__(self, minimum: int = 0, maximum: Optional[int] = None, nullable: bool = False, also: tuple = ()):
        self.minimum, self.maximum, self.nullable, self.also = minimum, maximum, nullable, tuple(also)
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        if maximum is not None:
            what = f"an integer from {minimum} to {maximum}"
        extras = [*(f'"{a}"' for a in self.also), *(["null"] if nullable else [])]
        self.what = what + "".join(f" or {e}" for e in extras)

    def normalize(self, value):
        if (value is None and self.nullable) or (isinstance(value, str) and value in self.also):
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if (isinstance(value, bool) or not isinstance(value, int) or value < self.minimum
                or value > (_EXACT if self.maximum is None else self.maximum)):
            raise _Invalid
        return value

    def argument(self, value, name):
        if isinstance(value, float):  # 2.0 is for the config's sake (JSON has one number type); Python has int
            self.refuse_argument(value, name)
        return super().argument(value, name)

    def schema(self):
        base = {"type": "integer", "minimum": self.minimum, "maximum": _EXACT if self.maximum is None else self.maximum}
        return _or(base, self.also + ((None,) if self.nullable else ()))


POSITIVE_INT = Integer(1)

# The words float() reads as infinity that a config may write for an infinite value (YAML's own is .inf).
_INF_WORDS = ("inf", "Inf", "INF", "infinity", "Infinity")
# A positive number, also in validators that pass NaN through every bound (NaN > 0 and NaN <= 0 are both
# false): "not at most 0" holds for exactly the numbers above 0.
_POSITIVE = {"type": "number", "exclusiveMinimum": 0, "not": {"maximum": 0}}


class Number(Check):
    """A positive real number: finite, or with ``allow_inf`` also ``.inf`` (or the word ``inf``)."""

    def __init__(self, nullable: bool = False, allow_inf: bool = False):
        self.nullable, self.allow_inf = nullable, allow_inf
        self.what = "a positive number" + (" or null" if nullable else "")

    def normalize(self, value):
        if value is None and self.nullable:
            return None
        if self.allow_inf and value in _INF_WORDS:
            return math.inf
        # Text is refused (as the schema does): a quoted "1e-3" is a string to an editor too.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise _Invalid
        try:
            number = float(value)
        except OverflowError:  # an integer of 400 digits: infinity, as an editor reads it
            number = math.inf
        if number == math.inf and not self.allow_inf:
            raise _Invalid
        return number

    def argument(self, value, name):
        if isinstance(value, str):  # the words are for YAML's sake; a Python caller passes a number
            self.refuse_argument(value, name)
        return super().argument(value, name)

    def schema(self):
        number = dict(_POSITIVE) if self.allow_inf else {**_POSITIVE, "maximum": sys.float_info.max}
        options = [number, {"enum": list(_INF_WORDS)}] if self.allow_inf else [number]
        if self.nullable:
            options.append({"type": "null"})
        return options[0] if len(options) == 1 else {"anyOf": options}


class Boolean(Check):
    """true or false (or null, when ``nullable``; or one of the words ``also``, e.g. ``("auto",)``)."""

    def __init__(self, nullable: bool = False, also: tuple = ()):
        self.nullable, self.also = nullable, tuple(also)
        self.what = "true or false" + "".join(f" or {word}" for word in self.also) + (" or null" if nullable else "")

    def normalize(self, value):
        if isinstance(value, str) and value in self.also:
            return value
        if not isinstance(value, bool) and not (value is None and self.nullable):
            raise _Invalid
        return value

    def schema(self):
        return _or({"type": "boolean"}, (*self.also, *((None,) if self.nullable else ())))


class BooleanOrFraction(Check):
    """true or false, or a fraction in (0, 1] (a share of something, e.g. of the step time a check may take)."""

    what = "true or false or a fraction in (0, 1]"

    def normalize(self, value):
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= 1:
            return float(value)
        raise _Invalid

    def schema(self):
        return {"anyOf": [{"type": "boolean"}, {**_POSITIVE, "maximum": 1}]}  # (_POSITIVE refuses NaN too)


class Choice(Check):
    def __init__(self, *options: str):
        self.options = options
        self.what = "one of " + ", ".join(options)

    def normalize(self, value):
        if value not in self.options:
            raise _Invalid
        return value

    def schema(self):
        return {"enum": list(self.options)}


class Text(Check):
    def __init__(self, pattern: Optional[str] = None, what: str = "a string", nullable: bool = False):
        self.pattern, self.nullable = pattern, nullable
        self.what = what + (" or null" if nullable else "")

    def normalize(self, value):
        if value is None and self.nullable:
            return None
        if not isinstance(value, str) or not value or (self.pattern and not re.fullmatch(self.pattern, value)):
            raise _Invalid
        return value

    def schema(self):
        base = {"type": "string", "minLength": 1}
        if self.pattern:  # $ then "nothing after": Python's $ also matches before a final newline, JavaScript's not
            base["pattern"] = f"^(?:{self.pattern})$(?![\\s\\S])"
        return {"anyOf": [base, {"type": "null"}]} if self.nullable else base


class Names(Check):
    what = "a list of names"

    def normalize(self, value):
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise _Invalid
        return list(value)

    def schema(self):
        return {"anyOf": [{"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}


# A keyword argument's name. Not a word YAML reads as true, false or null: an editor sees every key as text
# ("true"), the loader sees a plain true as a boolean, so such a key is refused quoted or not, by both.
_KEYWORD = "(?!(?:true|True|TRUE|false|False|FALSE|null|Null|NULL)$)[A-Za-z_][A-Za-z0-9_]*"


class Mapping(Check):
    """A free-form mapping (keyword arguments passed through to a constructor); ``--set`` may reach inside.

    Its keys are keyword names: an editor reads ``{1: x}``'s key as the text "1", the loader as a number.
    """

    what = "a mapping of keyword names (letters, digits, '_') to values"

    def normalize(self, value):
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) and re.fullmatch(_KEYWORD, k) for k in value):
            raise _Invalid
        return copy.deepcopy(value)

    def schema(self):
        return {"anyOf": [{"type": "object", "propertyNames": {"pattern": f"^{_KEYWORD}$(?![\\s\\S])"}},
                          {"type": "null"}]}


class ResumeValue(Check):
    what = '"auto", "never" or a checkpoint path'

    def normalize(self, value):
        if value is False or value == "never":
            return False
        if isinstance(value, str) and value:
            return value
        raise _Invalid

    def schema(self):
        return {"anyOf": [{"enum": ["auto", "never", False]}, {"type": "string", "minLength": 1}]}


def setting(default: Any, check: Check, doc: str, resume: str = APPLIED) -> Any:
    """A config key: its default, its check, a one-line doc and what a resume may do with it."""
    if resume not in RULES:
        raise ValueError(f"Argument resume should be one of {', '.join(RULES)}, got {resume!r}.")
    kind: Dict[str, Any]
    if isinstance(default, (list, dict)):
        kind = {"default_factory": lambda: copy.deepcopy(default)}
    else:
        kind = {"default": default}
    return dataclasses.field(metadata={"check": check, "doc": doc, "resume": resume}, **kind)


def section(cls: type, doc: Optional[str] = None) -> Any:
    """A nested component's config, documented by ``doc`` (default: the class's docstring)."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls, "doc": doc or cls.__doc__})


def argument(cls: type, name: str, value: Any) -> Any:
    """Check a Python argument against the config field of the same name (one declaration for both)."""
    return _fields(cls)[name].metadata["check"].argument(value, name)


def _fields(cls: type) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def child(cls: type, name: str) -> Optional[dataclasses.Field]:
    """The field ``name`` of ``cls``, or None."""
    return _fields(cls).get(name)


def defaults(cls: type) -> dict:
    """The config of ``cls`` with every default, as a plain nested dict."""
    out = {}
    for name, f in _fields(cls).items():
        out[name] = defaults(f.metadata["section"]) if "section" in f.metadata else defaults_of(f)
    return out


def validate(raw: Any, cls: type, path: str = "") -> dict:
    """Check ``raw`` (a mapping, possibly partial) against ``cls``: unknown keys refused, every value
    checked (one-line ConfigError naming its key path), defaults filled; then the class's own
    ``check_values(values, path)`` for rules between its keys, if it has one."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {show(raw)}")
    known = _fields(cls)
    for key in raw:
        if key not in known:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown key (known: {', '.join(known)})")
    out = {}
    for name, f in known.items():
        where = f"{path}.{name}" if path else name
        if "section" in f.metadata:
            out[name] = validate(raw.get(name), f.metadata["section"], where)
        elif name in raw:
            out[name] = f.metadata["check"](raw[name], where)
        else:
            out[name] = defaults_of(f)
    if hasattr(cls, "check_values"):
        cls.check_values(out, path)
    return out


def defaults_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return copy.deepcopy(f.default)
    return cast(Callable[[], Any], f.default_factory)()  # a setting or section has a default or a factory


def leaves(cls: type, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field]]:
    """``(key path, field)`` of every setting under ``cls``, in declaration order."""
    for name, f in _fields(cls).items():
        if "section" in f.metadata:
            yield from leaves(f.metadata["section"], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", f


def json_schema(cls: type, doc: str = "") -> dict:
    """A JSON Schema (draft 07) of ``cls``'s config: types, bounds, choices, defaults and docs."""
    properties = {}
    for name, f in _fields(cls).items():
        if "section" in f.metadata:  # null, as in YAML's "amp:" with nothing under it, is the defaults
            section_schema = json_schema(f.metadata["section"])
            properties[name] = {"description": f.metadata["doc"], "anyOf": [section_schema, {"type": "null"}]}
            continue
        resume = f.metadata["resume"]
        rule = "" if resume in (APPLIED, NOT_COMPARED) else f" (resume: {resume})"
        properties[name] = {"description": f.metadata["doc"] + rule, "default": defaults_of(f),
                            **f.metadata["check"].schema()}
    out = {"type": "object", "properties": properties, "additionalProperties": False}
    return {"description": doc, **out} if doc else out
