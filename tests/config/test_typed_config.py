"""A loaded config is typed, frozen values (issue 62): attributes a type checker sees, declared types that are true,
a changed config a new one, and the 0.2.0 dict reads kept for a release with a warning."""
import dataclasses
import os
import typing

import pytest

from ignite_amp.config.run_keys import OptimizerConfig
from ignite_amp.config.tree import Config, load_config, save_config
from ignite_amp.core.config_keys import Boolean, Integer, Number, Text, leaves
from ignite_amp.core.config_values import section_of
from ignite_amp.data.datasets import DataConfig
from ignite_amp.errors import ConfigError


def test_load_config_returns_typed_frozen_values():
    cfg = load_config({"data": {"batch_size": 32}}, ["train.epochs=2"])
    assert isinstance(cfg, Config) and isinstance(cfg.data, DataConfig)
    assert (cfg.data.batch_size, cfg.train.epochs, cfg.output_dir) == (32, 2, "runs/ignite-amp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.batch_size = 64  # type: ignore[misc]
    changed = load_config(cfg, ["data.batch_size=64"])  # a changed config is a new one, checked again
    assert (changed.data.batch_size, cfg.data.batch_size) == (64, 32)
    assert load_config(cfg) == cfg and load_config(cfg.to_dict()) == cfg


def test_a_replaced_config_is_checked_as_a_loaded_one_is():
    """cfg.replace skipped the checks: a batch of 0 reached the loaders as a traceback, "~" stayed unexpanded."""
    cfg = load_config()
    with pytest.raises(ConfigError, match=r'^data\.batch_size: expected an integer from 1 .* or "auto", got 0$'):
        cfg.data.replace(batch_size=0)
    with pytest.raises(ConfigError, match='^seed: expected an integer from 0 to 4294967295, got "x"$'):
        cfg.replace(seed="x")
    with pytest.raises(ConfigError, match="^handlers.clipping.max_norm: expected a positive number or null"):
        cfg.handlers.clipping.replace(max_norm=-1.0)
    assert cfg.replace(output_dir="~/x").output_dir == os.path.expanduser("~/x")
    assert cfg.replace(data=cfg.data.replace(batch_size=8)).data.batch_size == 8 and cfg.data.batch_size == 64
    with pytest.raises(ConfigError, match="^data.batch_size: auto is not available with distributed.strategy fsdp"):
        cfg.replace(data=cfg.data.replace(batch_size="auto"), distributed=cfg.distributed.replace(strategy="fsdp"))


def test_writing_into_a_loaded_config_says_how_to_change_it():
    cfg = load_config()
    with pytest.raises(TypeError, match=r'frozen since 0\.3\.0: make a changed one with load_config\(cfg, '
                                        r'\["train\.epochs=\.\.\."\]\) or cfg\.replace'):
        cfg.train["epochs"] = 1


def test_loaded_sections_inside_a_dict_are_read_as_their_dicts():
    cfg = load_config({"handlers": {"clipping": {"max_norm": 2.0}}})
    again = load_config({"data": cfg.data, "handlers": {"clipping": cfg.handlers.clipping}})
    assert again.handlers.clipping.max_norm == 2.0 and again == cfg


def test_to_dict_is_the_plain_config_that_files_hold(tmp_path):
    cfg = load_config({"optimizer": {"kwargs": {"betas": [0.9, 0.95]}}})
    plain = cfg.to_dict()
    assert type(plain) is dict and type(plain["data"]) is dict and plain["optimizer"]["kwargs"]["betas"] == [0.9, 0.95]
    plain["optimizer"]["kwargs"]["betas"][0] = 0.0  # a copy: the config is not changed through it
    assert cfg.optimizer.kwargs["betas"] == [0.9, 0.95]
    save_config(cfg, tmp_path / "a.yaml")
    save_config(cfg.to_dict(), tmp_path / "b.yaml")
    assert (tmp_path / "a.yaml").read_text() == (tmp_path / "b.yaml").read_text()
    assert load_config(str(tmp_path / "a.yaml")) == cfg


def test_the_dict_reads_of_020_still_work_with_a_warning():
    cfg = load_config()
    with pytest.warns(DeprecationWarning, match=r"cfg\.data\.batch_size"):
        assert cfg["data"]["batch_size"] == 64
    with pytest.warns(DeprecationWarning):
        assert dict(cfg.model) == cfg.model.to_dict() and {**cfg.train} == {"epochs": 5, "epoch_length": None}
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        cfg["nope"]
    with pytest.warns(DeprecationWarning):  # a comparison with a plain dict, as 0.2.0's config was one
        assert cfg.model == cfg.model.to_dict() and cfg == cfg.to_dict() and cfg.amp != {"dtype": "auto"}
    with pytest.warns(DeprecationWarning):
        assert dict(cfg.amp.items()) == cfg.amp.to_dict() and "dtype" in cfg.amp and cfg.get("seed") == 0


def test_a_plain_section_dict_is_taken_for_a_release_with_its_defaults_filled():
    with pytest.warns(DeprecationWarning, match="OptimizerConfig"):
        opt = section_of(OptimizerConfig, {"name": "SGD"})
    assert opt == OptimizerConfig(name="SGD") and opt.kwargs == {"weight_decay": 0.05}
    assert section_of(DataConfig, load_config().data) == DataConfig()
    with pytest.raises(TypeError, match="expected a DataConfig"):
        section_of(DataConfig, ["shapes"])


def _allows(annotation, value) -> bool:
    """Whether ``value`` is of the declared type (Literal, Union, Optional, List, Dict as far as a config uses them)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return value in args and type(value) in {type(a) for a in args}
    if origin is typing.Union:
        return any(_allows(a, value) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or annotation)


def test_every_declared_type_is_true():
    """Each key's annotation holds its default, null where its check allows null, and each word its check takes
    besides its type (``auto``): ``batch_size: int`` taking "auto" was the declaration the type checker trusted."""
    for path, field in leaves(Config):
        owner = next(cls for cls in _sections(Config) if field in dataclasses.fields(cls))
        annotation = typing.get_type_hints(owner)[field.name]
        check = field.metadata["check"]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if path != "output_dir":  # (null in a file; load_config fills runs/<name>: a loaded config's is a path)
            assert _allows(annotation, default), (path, annotation, default)
        if getattr(check, "nullable", False) and path != "output_dir":
            assert _allows(annotation, None), (path, annotation)
        for word in getattr(check, "also", ()):
            assert _allows(annotation, word), (path, annotation, word)
        if isinstance(check, (Integer, Number, Boolean, Text)) and not getattr(check, "nullable", False):
            assert not _allows(annotation, None), (path, annotation)


def _sections(cls):
    yield cls
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from _sections(f.metadata["section"])


def test_the_type_check_finds_an_untrue_declaration():  # the checker itself can fail
    assert not _allows(int, "auto") and _allows(typing.Union[int, typing.Literal["auto"]], "auto")
    assert not _allows(typing.Optional[int], True) and _allows(typing.Optional[int], None)
