"""The config's JSON Schema and the shipped schema file follow the declarations (as the generated config reference
does: tests/docs/test_docs_site.py): an editor that checks a config against the schema agrees with the loader."""
import json
import os

import pytest
import yaml

from helpers import CONFIGS
from ignite_amp.cli.main import main
from ignite_amp.config.tree import Config, config_schema, default_config, load_config
from ignite_amp.core.config_keys import leaves
from ignite_amp.core.config_values import Section
from ignite_amp.errors import ConfigError
from ignite_amp.run.resume import RULES

SCHEMA_FILE = os.path.join(CONFIGS, "ignite-amp.schema.json")


jsonschema = pytest.importorskip("jsonschema")  # the test extra (a GPU machine without it skips this file)
_validators: dict = {}


def accepts(schema: dict, value) -> bool:
    """The editor's verdict: a JSON Schema draft 07 validator's (jsonschema, as check-jsonschema uses)."""
    key = json.dumps(schema, sort_keys=True)
    if key not in _validators:
        _validators[key] = jsonschema.Draft7Validator(schema)
    return _validators[key].is_valid(value)


def _nest(path: str, value) -> dict:
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def test_the_shipped_schema_file_is_the_generated_one(tmp_path):
    out = tmp_path / "s.json"
    assert main(["schema", "-o", str(out)]) == 0
    assert json.loads(out.read_text()) == config_schema()
    assert json.load(open(SCHEMA_FILE)) == config_schema(), \
        "regenerate: ignite-amp schema -o configs/ignite-amp.schema.json"
    jsonschema.Draft7Validator.check_schema(config_schema())


def test_every_shipped_config_names_the_schema_and_passes_it():
    schema = config_schema()
    names = [n for n in os.listdir(CONFIGS) if n.endswith(".yaml")]
    assert names
    for name in names:
        text = open(os.path.join(CONFIGS, name)).read()
        assert text.startswith("# yaml-language-server: $schema=ignite-amp.schema.json\n"), name
        assert accepts(schema, yaml.safe_load(text)), name
    assert accepts(schema, default_config())


CANDIDATES = [-1, 0, 1, 2, 8, 1.5, "x", "auto", "never", "shapes", "cuda:1", "1e-3", True, False, None, [], ["a"], {},
              {"a": 1}, [1], 2.0, 1e3, float("inf"), float("-inf"), float("nan"), "inf", "1_000", " 1e-3",
              "\u0661\u0660", "on", "yes", "x\n", "caf\u00e9", "cuda:\u0661", {"1a": 1}, {"true": 1}, {"a": {"1": 2}}]


@pytest.mark.slow
def test_the_schema_and_the_loader_agree_on_every_key():
    """For each key and a spread of values, the editor's verdict (schema) is the loader's."""
    schema = config_schema()
    checked = 0
    # Rules between keys are the loader's alone (one line each); keep them out of the way.
    context = {"handlers.clipping.clip_value": {"handlers": {"clipping": {"max_norm": None}}}}
    for path, _ in leaves(Config):
        for value in CANDIDATES:
            raw = _nest(path, value)
            if path in context:
                raw["handlers"]["clipping"].update(context[path]["handlers"]["clipping"])
            try:
                load_config(raw)
                loader = True
            except ConfigError:
                loader = False
            assert accepts(schema, raw) == loader, (path, value, loader)
            checked += 1
    assert checked == len(CANDIDATES) * len(RULES) > 1000
    assert not accepts(schema, {"amp": {"dtyp": "float16"}}) and not accepts(schema, {"bogus": 1})
    for raw in ({"amp": None}, {"handlers": {"clipping": None}}, {"handlers": {"clipping": {"norm_type": "inf"}}}):
        load_config(raw)
        assert accepts(schema, raw), raw


def test_schema_to_a_file_in_place_and_bad_places_in_one_line(tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main(["schema", "-o", str(link)]) == 0
    assert link.is_symlink() and json.loads(target.read_text()) == config_schema()  # followed, not replaced
    for bad in (tmp_path, tmp_path / "no" / "such" / "dir.json"):
        assert main(["schema", "-o", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ignite-amp: error: -o {bad}: cannot write (") and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["link.json", "real.json"]  # no temp file left
    assert main(["schema", "-o", "-"]) == 0 and json.loads(capsys.readouterr().out) == config_schema()


def test_every_key_is_documented_and_has_a_resume_rule():
    for path, f in leaves(Config):
        assert len(f.metadata["doc"]) > 8, path
    assert RULES["model.name"] == RULES["seed"] == "fixed" and RULES["optimizer.lr"] == "fixed under a schedule"
    assert RULES["handlers.checkpoint.resume"] == RULES["output_dir"] == "not compared"
    assert RULES["handlers.tensorboard.log_every"] == "applied"


@pytest.mark.parametrize("size", [2 << 20])
def test_a_config_file_too_large_is_one_line(tmp_path, size, capsys):
    path = tmp_path / "huge.yaml"
    path.write_text("a: 1\n" * (size // 5))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a config (the limit is 1 MiB)" in err


INF, NAN, MAX = float("inf"), float("nan"), 1.7976931348623157e308
# (key path, the value as written in a YAML file, what a YAML 1.2 editor reads (by the 1.2 core schema),
#  whether the config is valid, and the value the run then uses). Both the loader and the schema must agree.
DOCUMENTS = [
    ("optimizer.lr", "1e309", INF, False, None), ("optimizer.lr", ".inf", INF, False, None),
    ("optimizer.lr", "-.inf", -INF, False, None), ("optimizer.lr", ".nan", NAN, False, None),
    ("optimizer.lr", "'1_000'", "1_000", False, None), ("optimizer.lr", "1_000", "1_000", False, None),
    ("optimizer.lr", "' 1e-3'", " 1e-3", False, None), ("optimizer.lr", "'1e-3'", "1e-3", False, None),
    ("optimizer.lr", "\u0661\u0660", "\u0661\u0660", False, None), ("optimizer.lr", "yes", "yes", False, None),
    ("optimizer.lr", "0", 0, False, None), ("optimizer.lr", "-1e-3", -0.001, False, None),
    ("optimizer.lr", "1e-3", 0.001, True, 0.001), ("optimizer.lr", "1e3", 1000.0, True, 1000.0),
    ("optimizer.lr", "3.0e-4", 3e-4, True, 3e-4), ("optimizer.lr", ".5", 0.5, True, 0.5),
    ("optimizer.lr", "2", 2, True, 2.0), ("optimizer.lr", "0x10", 16, True, 16.0),
    ("optimizer.lr", "1.7976931348623157e308", MAX, True, MAX), ("optimizer.lr", "1" + "0" * 400, 10**400, False, None),
    ("handlers.clipping.norm_type", "1" + "0" * 400, 10**400, True, INF),
    ("train.epochs", "1" + "0" * 400, 10**400, False, None), ("train.epochs", "1e300", 1e300, False, None),
    ("train.epochs", "9007199254740992", 2**53, True, 2**53),
    ("train.epochs", "2.0", 2.0, True, 2), ("train.epochs", "1e3", 1000.0, True, 1000),
    ("train.epochs", "+3", 3, True, 3), ("train.epochs", "0o17", 15, True, 15),
    ("train.epochs", "2.5", 2.5, False, None), ("train.epochs", "1e309", INF, False, None),
    ("train.epochs", ".nan", NAN, False, None), ("train.epochs", "'2'", "2", False, None),
    ("train.epochs", "\u0662", "\u0662", False, None), ("train.epochs", "1_000", "1_000", False, None),
    ("train.epochs", "true", True, False, None), ("train.epochs", "0", 0, False, None),
    ("seed", "017", 17, True, 17), ("seed", "0017", 17, True, 17), ("seed", "-0", 0, True, 0),
    ("seed", "4294967295", 2**32 - 1, True, 2**32 - 1), ("seed", "4294967296", 2**32, False, None),
    ("seed", "1:30", "1:30", False, None), ("seed", "0b11", "0b11", False, None),
    ("data.batch_size", "auto", "auto", True, "auto"), ("data.batch_size", "Auto", "Auto", False, None),
    ("data.batch_size", "64.0", 64.0, True, 64),
    ("name", "on", "on", True, "on"), ("name", "yes", "yes", True, "yes"), ("name", "off", "off", True, "off"),
    ("name", "2024-01-01", "2024-01-01", True, "2024-01-01"), ("name", "run.1_a-b", "run.1_a-b", True, "run.1_a-b"),
    ("name", "1e3", 1000.0, False, None), ("name", "017", 17, False, None), ("name", "null", None, False, None),
    ("name", "caf\u00e9", "caf\u00e9", False, None), ("name", "run\u0663", "run\u0663", False, None),
    ("name", '"run\\n"', "run\n", False, None), ("name", "'a b'", "a b", False, None),
    ("amp.compile", "yes", "yes", False, None), ("amp.compile", "on", "on", False, None),
    ("amp.compile", "y", "y", False, None), ("amp.compile", "1", 1, False, None),
    ("amp.compile", "true", True, True, True), ("amp.compile", "True", True, True, True),
    ("amp.compile", "FALSE", False, True, False),
    ("device", "cuda:1", "cuda:1", True, "cuda:1"), ("device", "cuda:\u0661", "cuda:\u0661", False, None),
    ("device", "CPU", "CPU", False, None), ("device", '"cpu\\n"', "cpu\n", False, None),
    ("handlers.clipping.norm_type", ".inf", INF, True, INF), ("handlers.clipping.norm_type", "inf", "inf", True, INF),
    ("handlers.clipping.norm_type", "Infinity", "Infinity", True, INF),
    ("handlers.clipping.norm_type", "1e309", INF, True, INF), ("handlers.clipping.norm_type", "2", 2, True, 2.0),
    ("handlers.clipping.norm_type", ".nan", NAN, False, None),
    ("handlers.clipping.norm_type", "-.inf", -INF, False, None),
    ("handlers.clipping.norm_type", "'2'", "2", False, None),
    ("handlers.clipping.max_norm", "null", None, True, None), ("handlers.clipping.max_norm", "~", None, True, None),
    ("handlers.clipping.max_norm", "", None, True, None), ("handlers.clipping.max_norm", "NULL", None, True, None),
    ("handlers.clipping.max_norm", "nil", "nil", False, None),
    ("model.kwargs", "{a: 1}", {"a": 1}, True, {"a": 1}),
    ("model.kwargs", "{on: yes}", {"on": "yes"}, True, {"on": "yes"}),
    ("model.kwargs", "{1: 2}", {"1": 2}, False, None), ("model.kwargs", "{true: 1}", {"true": 1}, False, None),
    ("model.kwargs", "{'true': 1}", {"true": 1}, False, None), ("model.kwargs", "{null: 1}", {"null": 1}, False, None),
    ("model.kwargs", "{a-b: 1}", {"a-b": 1}, False, None), ("model.kwargs", "{a: {1: 2}}", {"a": {"1": 2}}, True, None),
    ("model.kwargs", "[1]", [1], False, None), ("model.kwargs", "null", None, True, {}),
]


def _as_editor(value):
    """What an editor validates: JSON, whose mapping keys are text."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else json.dumps(k): _as_editor(v) for k, v in value.items()}
    return [_as_editor(v) for v in value] if isinstance(value, list) else value


def _equal(a, b) -> bool:  # the same JSON value; NaN is itself here
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if not isinstance(a, (dict, list)):
        return _same(a, b)
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _same(a, b) -> bool:  # JSON equality: true is not 1
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    return a == b and isinstance(a, str) == isinstance(b, str)


@pytest.mark.parametrize("path, text, editor, valid, used", DOCUMENTS, ids=[f"{p}={t[:12]}" for p, t, *_ in DOCUMENTS])
def test_the_loader_and_the_schema_accept_the_same_documents(tmp_path, path, text, editor, valid, used):
    """A YAML file means what a YAML 1.2 editor reads; the loader and the JSON Schema give one verdict on it."""
    from ignite_amp.config import yaml12

    keys = path.split(".")
    document = "".join(f"{'  ' * i}{key}:\n" for i, key in enumerate(keys))[:-1] + f" {text}\n"
    file = tmp_path / "c.yaml"
    file.write_text(document, encoding="utf-8")
    read = yaml12.load(document)
    for key in keys:
        read = read[key]
    assert _equal(_as_editor(read), editor), f"the loader reads {read!r}, a YAML 1.2 editor {editor!r}"
    assert accepts(config_schema(), _nest(path, editor)) == valid, "the schema's verdict"
    try:
        cfg = load_config(str(file))
    except ConfigError as exc:
        assert not valid, f"the loader refused it: {exc}"
        assert str(exc).startswith(path) and "\n" not in str(exc)  # one line naming the key
        return
    assert valid, "the loader accepted it"
    for key in keys:  # a section's key is an attribute, a dict value's (model.kwargs) an item
        cfg = getattr(cfg, key) if isinstance(cfg, Section) else cfg[key]
    if used is not None or editor is None:
        assert _same(cfg, used) if not isinstance(used, dict) else cfg == used
        assert type(cfg) is type(used)
