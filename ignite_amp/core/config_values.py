"""A validated config as typed, frozen values: each component's declaration (:mod:`ignite_amp.core.config_keys`) is
also the class of its section's values.

:func:`build` turns a validated nested dict into instances of the declarations (``cfg.data.batch_size``, checked by
a type checker, where ``cfg["data"]["batch_size"]`` was a string look-up nothing checked); :meth:`Section.to_dict`
turns them back into the plain dict that ``config.yaml`` and checkpoints hold. A section is frozen: a changed
config is a new one (:meth:`Section.replace`), so nothing edits the config a run was started with.
"""
import copy
import dataclasses
import warnings
from typing import Any, Dict, Iterator, Type, TypeVar, Union

from ignite_amp.core.config_keys import validate

__all__ = ["Section", "build", "section_of"]

S = TypeVar("S", bound="Section")


class Section:
    """The values of one config section: a subclass declared ``@dataclasses.dataclass(frozen=True, eq=False)`` (its
    equality is this class's), its keys made by ``setting``/``section``.

    Frozen: a changed config is a new one, checked as a loaded one is (:meth:`replace`, or
    ``load_config(cfg, ["key.path=value"])``). The ``kwargs`` mappings and the lists inside are the config's own: read
    them, do not change them (:meth:`to_dict` gives copies).

    Reading a key by its string (``cfg["data"]["batch_size"]``, ``cfg["amp"].items()``, ``cfg.model == {...}``:
    what :func:`ignite_amp.load_config` returned before 0.3.0 was a plain dict) still works, with a
    DeprecationWarning, until 0.4.0: read the attribute (``cfg.data.batch_size``) or call :meth:`to_dict`.
    """

    #: the section's key path in a config (``"data"``, ``"handlers.clipping"``; set by ``ignite_amp.config.tree``)
    path = ""

    def to_dict(self) -> Dict[str, Any]:
        """The section as a plain nested dict (a deep copy): what ``config.yaml`` and checkpoints hold."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]  # (every Section is a dataclass)
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, Section) else copy.deepcopy(value)
        return out

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes``, checked as a loaded config's section is (a ConfigError naming the key path)."""
        changed = dataclasses.replace(self, **changes)  # type: ignore[type-var]
        return build(type(self), validate(changed.to_dict(), type(self), self.path))

    # The dict reads of 0.2.0, for a release (a Mapping's reads: ``cfg["amp"]``, ``dict(cfg.amp)``, ``**cfg.model``).
    def _deprecated(self) -> None:
        warnings.warn("a config's keys are attributes since 0.3.0 (cfg.data.batch_size); cfg[\"data\"] and "
                      "dict(cfg) work until 0.4.0 (cfg.to_dict() gives the plain dict)", DeprecationWarning,
                      stacklevel=3)

    def __getitem__(self, key: str) -> Any:
        self._deprecated()
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        where = f"{self.path}.{key}" if self.path else key
        raise TypeError(f"a loaded config is frozen since 0.3.0: make a changed one with "
                        f"load_config(cfg, [\"{where}=...\"]) or cfg.replace(...)")

    def keys(self) -> list:
        return [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]

    def items(self) -> list:
        self._deprecated()
        return [(k, getattr(self, k)) for k in self.keys()]

    def values(self) -> list:
        self._deprecated()
        return [getattr(self, k) for k in self.keys()]

    def get(self, key: str, default: Any = None) -> Any:
        self._deprecated()
        return getattr(self, key) if key in self.keys() else default

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        self._deprecated()
        return key in self.keys()

    def __len__(self) -> int:
        return len(self.keys())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, dict):  # a 0.2.0 comparison with a plain dict
            self._deprecated()
            return self.to_dict() == other
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.keys())

    __hash__ = None  # type: ignore[assignment]  # (its kwargs and lists are not hashable, as a dict was not)


def build(cls: Type[S], values: Dict[str, Any]) -> S:
    """``values`` (validated against ``cls``: every key there) as an instance of ``cls``, sections nested."""
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = values[f.name]
        kwargs[f.name] = build(f.metadata["section"], value) if "section" in f.metadata else value
    return cls(**kwargs)


def section_of(cls: Type[S], value: Union[S, Dict[str, Any]]) -> S:
    """``value`` as a ``cls`` section: itself, or (a plain dict, as the functions that take a section took before
    0.3.0: until 0.4.0, with a DeprecationWarning) checked, with the defaults filled, and built."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"expected a {cls.__name__} (a loaded config's section), got {type(value).__name__}")
    warnings.warn(f"pass a loaded config's section ({cls.__name__}); a plain dict works until 0.4.0",
                  DeprecationWarning, stacklevel=3)
    return build(cls, validate(value, cls))
