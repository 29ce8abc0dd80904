"""The config's JSON Schema, the shipped schema file, and the README's config reference all follow the
declarations: an editor that checks a config against the schema agrees with the loader."""
import json
import os
import re

import pytest
import yaml

from conftest import CONFIGS, ROOT
from ignite_amp.cli import main
from ignite_amp.config import Config, config_schema, default_config, flatten_config, load_config
from ignite_amp.errors import ConfigError
from ignite_amp.fields import leaves
from ignite_amp.resume import RULES

SCHEMA_FILE = os.path.join(CONFIGS, "ignite-amp.schema.json")


def _same(a, b) -> bool:  # JSON equality: true is not 1
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    return a == b and isinstance(a, str) == isinstance(b, str)


TYPES = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
         "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
         "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
         "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}


def accepts(schema: dict, value) -> bool:
    """The subset of JSON Schema draft 07 the generator writes."""
    if "anyOf" in schema and not any(accepts(s, value) for s in schema["anyOf"]):
        return False
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return False
    if "type" in schema and not TYPES[schema["type"]](value):
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            return False
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return False
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or ("pattern" in schema and not re.search(schema["pattern"], value)):
            return False
    if isinstance(value, list) and "items" in schema:
        return all(accepts(schema["items"], v) for v in value)
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(accepts(props[k], v) for k, v in value.items())
    return True


def _nest(path: str, value) -> dict:
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def test_the_shipped_schema_file_is_the_generated_one(tmp_path):
    out = tmp_path / "s.json"
    assert main(["schema", "-o", str(out)]) == 0
    assert json.loads(out.read_text()) == config_schema()
    assert json.load(open(SCHEMA_FILE)) == config_schema(), "regenerate: ignite-amp schema -o configs/ignite-amp.schema.json"


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
              {"a": 1}, [1]]


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


def test_the_readme_reference_lists_every_key_with_its_default():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Config schema", 1)[1]
    block = re.search(r"```yaml\n(name: .*?)```", section, re.S).group(1)
    shown, declared = flatten_config(yaml.safe_load(block)), flatten_config(default_config())
    assert set(shown) == set(declared), set(shown) ^ set(declared)
    differ = {k for k in declared if shown[k] != declared[k]} - {"name", "output_dir"}
    assert not differ, differ


@pytest.mark.parametrize("size", [2 << 20])
def test_a_config_file_too_large_is_one_line(tmp_path, size, capsys):
    path = tmp_path / "huge.yaml"
    path.write_text("a: 1\n" * (size // 5))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a config (the limit is 1 MiB)" in err
