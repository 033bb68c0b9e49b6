"""The plugin config: one table of keys, a TOML or YAML file, per-key environment overrides."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from miles_lora_ckpt.core import settings
from miles_lora_ckpt.integration.config import (
    CONFIG_ENV,
    ENV_ONLY_CORE_SETTINGS,
    KEYS,
    ConfigError,
    apply_core_settings,
    defaults,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(autouse=True)
def _clean_settings():
    settings.reset()
    yield
    settings.reset()


def write(tmp_path, name: str, text: str) -> dict[str, str]:
    path = tmp_path / name
    path.write_text(text)
    return {CONFIG_ENV: str(path)}


def test_no_file_gives_the_defaults():
    config = load_config({})
    assert dict(config.values) == dict(defaults().values)
    assert config["save.layout"] == "subdir" and config["save.keep"] == 0 and config["resume.strict"] is True
    assert all(source == "default" for source in config.sources.values())


def test_toml_and_yaml_files_set_the_same_values(tmp_path):
    toml = write(tmp_path, "c.toml", '[save]\nlayout = "flat"\nkeep = 3\n[consensus]\ntimeout_s = 30\n')
    yaml = write(tmp_path, "c.yaml", "save:\n  layout: flat\n  keep: 3\nconsensus:\n  timeout_s: 30\n")
    for environ in (toml, yaml):
        config = load_config(environ)
        assert config["save.layout"] == "flat" and config["save.keep"] == 3
        assert config["consensus.timeout_s"] == 30.0 and isinstance(config["consensus.timeout_s"], float)
        assert config.sources["save.keep"] == environ[CONFIG_ENV]


def test_an_environment_variable_wins_over_the_file(tmp_path):
    environ = write(tmp_path, "c.toml", "[save]\nkeep = 3\n[resume]\nstrict = true\n")
    environ.update(MILES_LORA_CKPT_KEEP="7", MILES_LORA_CKPT_STRICT="off", MILES_LORA_CKPT_LAYOUT="flat")
    config = load_config(environ)
    assert (config["save.keep"], config["resume.strict"], config["save.layout"]) == (7, False, "flat")
    assert config.sources["save.keep"] == "$MILES_LORA_CKPT_KEEP"
    assert "save.keep = 7 ($MILES_LORA_CKPT_KEEP)" in config.describe()


@pytest.mark.parametrize(
    "text, words",
    [
        ("[save]\nlayuot = 'flat'\n", ["unknown key 'save.layuot'", "save.layout"]),
        ("[save]\nkeep = 'three'\n", ["save.keep must be of type int", "'three'"]),
        ("[save]\nkeep = -1\n", ["save.keep must be at least 0"]),
        ("[save]\nlayout = 'nested'\n", ["save.layout must be one of ['subdir', 'flat']"]),
        ("[save]\nsubdir = '../elsewhere'\n", ["save.subdir must be one directory name"]),
        ("[consensus]\ntimeout_s = 0\n", ["consensus.timeout_s must be positive"]),
        ("[resume]\nstrict = 1\n", ["resume.strict must be of type bool"]),
        ("[save\nkeep = 1\n", ["cannot parse"]),
    ],
)
def test_bad_file_values_name_the_key_and_the_file(tmp_path, text, words):
    environ = write(tmp_path, "c.toml", text)
    with pytest.raises(ConfigError) as info:
        load_config(environ)
    for word in [*words, environ[CONFIG_ENV]]:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "var, raw, words",
    [
        ("MILES_LORA_CKPT_STRICT", "maybe", ["$MILES_LORA_CKPT_STRICT='maybe'", "resume.strict"]),
        ("MILES_LORA_CKPT_KEEP", "2.5", ["$MILES_LORA_CKPT_KEEP='2.5'", "save.keep"]),
        ("MILES_LORA_CKPT_TIMEOUT_S", "-1", ["$MILES_LORA_CKPT_TIMEOUT_S", "consensus.timeout_s must be positive"]),
        ("MILES_LORA_CKPT_LAYOUT", "tree", ["$MILES_LORA_CKPT_LAYOUT", "save.layout must be one of"]),
    ],
)
def test_bad_environment_values_name_the_variable_and_the_key(var, raw, words):
    with pytest.raises(ConfigError) as info:
        load_config({var: raw})
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_missing_or_unknown_kind_of_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=f"\\${CONFIG_ENV} names .*missing.toml"):
        load_config({CONFIG_ENV: str(tmp_path / "missing.toml")})
    with pytest.raises(ConfigError, match="must end in .toml, .yaml or .yml"):
        load_config(write(tmp_path, "c.ini", "[save]\n"))


def test_core_keys_reach_core_settings(tmp_path):
    apply_core_settings(load_config(write(tmp_path, "c.toml", "[consensus]\ntimeout_s = 12.5\n")))
    assert settings.current().consensus_timeout_s == 12.5


def test_every_core_setting_has_a_config_key():
    """A setting added to core.settings gets a line in KEYS (and the README table), or is env-only."""
    configured = {key.core for key in KEYS if key.core}
    assert configured.isdisjoint(ENV_ONLY_CORE_SETTINGS)
    assert configured | set(ENV_ONLY_CORE_SETTINGS) == {spec.name for spec in fields(settings.Settings)}
    for key in KEYS:
        if key.core:
            assert key.env == settings.ENV_VARS[key.core]


def test_every_key_is_documented_in_the_readme():
    # the README and the docs (docs/incoming/ holds sections not yet moved into the README)
    top = Path(__file__).resolve().parents[1]
    readme = "\n".join(p.read_text() for p in [top / "README.md", *sorted(top.glob("docs/**/*.md"))])
    for key in KEYS:
        assert f"`{key.name}`" in readme, key.name
        if key.env:
            assert key.env in readme, key.env


@pytest.mark.parametrize("example", sorted(p.name for p in CONFIGS.glob("*.toml")) + ["*.yaml"])
def test_shipped_examples_are_valid(example):
    paths = sorted(CONFIGS.glob(example)) if "*" in example else [CONFIGS / example]
    assert paths, f"no {example} in configs/"
    for path in paths:
        config = load_config({CONFIG_ENV: str(path)})
        assert config.path == str(path)
