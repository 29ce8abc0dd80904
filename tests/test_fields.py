"""ignite_amp.fields: the checks, and the walkers over a tree of declarations."""
import dataclasses

import pytest

from ignite_amp.errors import ConfigError
from ignite_amp.fields import (FIXED, POSITIVE_INT, Boolean, Choice, Integer, Mapping, Names, Number, ResumeValue,
                               Text, argument, defaults, json_schema, leaves, section, setting, validate)


@pytest.mark.parametrize("check, good, bad", [
    (POSITIVE_INT, [1, 7], [0, -1, 1.0, True, "2", None]),
    (Integer(0, 10, nullable=True, also=("auto",)), [0, 10, None, "auto"], [11, -1, "x", False]),
    (Number(), [0.5, 2, "1e-3"], [0, -1, "x", True, None, float("nan"), float("inf")]),
    (Number(nullable=True, allow_inf=True), [None, float("inf")], [0, "nan"]),
    (Boolean(), [True, False], [0, 1, "true", None]),
    (Choice("a", "b"), ["a", "b"], ["c", None, 1]),
    (Text(r"[a-z]+"), ["abc"], ["", "ABC", None, 1]),
    (Names(), [[], ["x"], None], [[""], "x", [1]]),
    (Mapping(), [{}, {"a": 1}, None], [[], "x", {1: 2}]),
    (ResumeValue(), ["auto", "never", False, "/a/b.pt"], [True, "", None, 0]),
])
def test_checks_accept_and_refuse(check, good, bad):
    for value in good:
        check(value, "k")
    for value in bad + ([] if not isinstance(check, Number) else ["2"]):
        if isinstance(check, Number) and value == "2":  # text is a number in a YAML 1.1 file, not from Python
            assert check(value, "k") == 2.0
            with pytest.raises(ValueError, match=r"^Argument n should be "):
                check.argument(value, "n")
            continue
        with pytest.raises(ConfigError, match=r"^a\.b: expected "):
            check(value, "a.b")
        with pytest.raises(ValueError, match=r"^Argument n should be "):
            check.argument(value, "n")


def test_normalised_values():
    assert Number()("1e-3", "k") == 0.001 and ResumeValue()("never", "k") is False
    assert Names()(None, "k") == [] and Mapping()(None, "k") == {}


@dataclasses.dataclass
class Inner:
    """inner: a section."""

    size: int = setting(3, POSITIVE_INT, "how many", FIXED)
    names: list = setting(["a"], Names(), "which")

    @staticmethod
    def check_values(values, path):
        if values["size"] < len(values["names"]):
            raise ConfigError(f"{path}: size below the names")


@dataclasses.dataclass
class Outer:
    flag: bool = setting(False, Boolean(), "a switch")
    inner: Inner = section(Inner, Inner.__doc__)


def test_defaults_are_fresh_copies():
    first, second = defaults(Outer), defaults(Outer)
    assert first == {"flag": False, "inner": {"size": 3, "names": ["a"]}}
    first["inner"]["names"].append("b")
    assert second["inner"]["names"] == ["a"] and defaults(Outer)["inner"]["names"] == ["a"]


def test_validate_names_the_key_path_and_runs_the_section_rule():
    assert validate({"inner": {"size": 5}}, Outer) == {"flag": False, "inner": {"size": 5, "names": ["a"]}}
    with pytest.raises(ConfigError, match=r"^inner\.size: expected a positive integer, got 0$"):
        validate({"inner": {"size": 0}}, Outer)
    with pytest.raises(ConfigError, match=r"^inner\.sizes: unknown key \(known: size, names\)$"):
        validate({"inner": {"sizes": 1}}, Outer)
    with pytest.raises(ConfigError, match=r"^inner: size below the names$"):
        validate({"inner": {"size": 1, "names": ["a", "b"]}}, Outer)
    with pytest.raises(ConfigError, match=r"^inner: expected a mapping, got a list$"):
        validate({"inner": []}, Outer)


def test_leaves_and_schema_come_from_the_same_declarations():
    assert [(path, f.metadata["resume"]) for path, f in leaves(Outer)] == [
        ("flag", "applied"), ("inner.size", "fixed"), ("inner.names", "applied")]
    schema = json_schema(Outer)
    assert schema["additionalProperties"] is False
    size = schema["properties"]["inner"]["anyOf"][0]["properties"]["size"]
    assert size["minimum"] == 1 and size["default"] == 3 and "how many" in size["description"]
    assert "(resume: fixed)" in size["description"]


def test_argument_uses_the_config_field_check():
    assert argument(Inner, "size", 2) == 2
    with pytest.raises(ValueError, match=r"^Argument size should be a positive integer, got 0\.$"):
        argument(Inner, "size", 0)
