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
    """The values of one config section (a frozen dataclass that declares its keys with ``setting``/``section``).

    Reading a key by its string (``cfg["data"]["batch_size"]``, what :func:`ignite_amp.load_config` returned
    before 0.3.0) still works, with a DeprecationWarning, until 0.4.0: read the attribute (``cfg.data.batch_size``)
    or call :meth:`to_dict`.
    """

    def to_dict(self) -> Dict[str, Any]:
        """The section as a plain nested dict (a deep copy): what ``config.yaml`` and checkpoints hold."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]  # (every Section is a dataclass)
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, Section) else copy.deepcopy(value)
        return out

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` (values already valid: :func:`ignite_amp.load_config` checks a config's)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    # The dict reads of 0.2.0, for a release (a Mapping's reads: ``cfg["amp"]``, ``dict(cfg.amp)``, ``**cfg.model``).
    def __getitem__(self, key: str) -> Any:
        warnings.warn("a config's keys are attributes since 0.3.0 (cfg.data.batch_size); cfg[\"data\"] and "
                      "dict(cfg) work until 0.4.0 (cfg.to_dict() gives the plain dict)", DeprecationWarning,
                      stacklevel=2)
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> list:
        return [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __len__(self) -> int:
        return len(self.keys())


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
