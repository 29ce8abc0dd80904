"""ignite_amp.core.config_keys: the checks, and the walkers over a tree of declarations."""
import dataclasses

import pytest

from ignite_amp.core.config_keys import (
    FIXED,
    POSITIVE_INT,
    Boolean,
    Choice,
    Integer,
    Mapping,
    Names,
    Number,
    ResumeValue,
    Text,
    argument,
    defaults,
    json_schema,
    leaves,
    section,
    setting,
    validate,
)
from ignite_amp.errors import ConfigError


@pytest.mark.parametrize("check, good, bad", [
    (POSITIVE_INT, [1, 7], [0, -1, 1.5, True, "2", None, float("nan"), float("inf")]),
    (Integer(0, 10, nullable=True, also=("auto",)), [0, 10, None, "auto"], [11, -1, "x", False, 10.5]),
    (Number(), [0.5, 2, 1e-3], [0, -1, "x", "1e-3", "2", True, None, float("nan"), float("inf")]),
    (Number(nullable=True, allow_inf=True), [None, float("inf")], [0, "nan", float("nan")]),
    (Boolean(), [True, False], [0, 1, "true", "yes", None]),
    (Choice("a", "b"), ["a", "b"], ["c", None, 1]),
    (Text(r"[a-z]+"), ["abc"], ["", "ABC", "abc\n", None, 1]),
    (Names(), [[], ["x"], None], [[""], "x", [1]]),
    (Mapping(), [{}, {"a": 1}, {"_b2": {1: 2}}, None], [[], "x", {1: 2}, {"1a": 2}, {"a-b": 1}]),
    (ResumeValue(), ["auto", "never", False, "/a/b.pt"], [True, "", None, 0]),
])
def test_checks_accept_and_refuse(check, good, bad):
    for value in good:
        check(value, "k")
    for value in bad:
        with pytest.raises(ConfigError, match=r"^a\.b: expected "):
            check(value, "a.b")
        with pytest.raises(ValueError, match=r"^Argument n should be "):
            check.argument(value, "n")


def test_a_config_reads_a_whole_float_as_an_integer_and_python_passes_an_int():
    """JSON (so an editor checking the schema) has one number type: 2.0 and 1e3 are the integers 2 and 1000."""
    assert POSITIVE_INT(2.0, "k") == 2 and type(POSITIVE_INT(2.0, "k")) is int and POSITIVE_INT(1e3, "k") == 1000
    with pytest.raises(ValueError, match=r"^Argument n should be a positive integer, got 2\.0\.$"):
        POSITIVE_INT.argument(2.0, "n")


def test_normalised_values():
    assert Number()(1e-3, "k") == 0.001 and ResumeValue()("never", "k") is False
    assert Number(allow_inf=True)("inf", "k") == float("inf") == Number(allow_inf=True)(float("inf"), "k")
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
