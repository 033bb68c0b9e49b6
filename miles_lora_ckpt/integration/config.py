"""The plugin's configuration: one table of keys, a TOML or YAML file, per-key environment overrides.

Miles' parser rejects unknown flags, so the plugin cannot add any. `MILES_LORA_CKPT_CONFIG` names
the file (optional); the few settings operators flip also have their own variable. Per key, the
variable wins over the file, and the file over the default. Every value is checked at startup, and
an error names the key and where its value came from.

`KEYS` is the whole schema: a new setting is one `Key(...)` line and a row in
docs/use-with-miles.md, "Config keys". Keys marked `core=` set `core.settings` through
`apply_core_settings`; every core setting has such a key or is in `ENV_ONLY_CORE_SETTINGS` (secrets,
never in a file).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from miles_lora_ckpt.core import settings
from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.core.hyperparameters import HyperparameterPolicy

__all__ = [
    "ConfigError",
    "Key",
    "KEYS",
    "CONFIG_ENV",
    "ENV_ONLY_CORE_SETTINGS",
    "AUTO_HYPERPARAMETERS",
    "HYPERPARAMETER_SETTINGS",
    "RootLayout",
    "MissingDataState",
    "PluginConfig",
    "defaults",
    "load_config",
    "apply_core_settings",
]

CONFIG_ENV = "MILES_LORA_CKPT_CONFIG"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(MilesLoraCkptError, ValueError):
    """A configuration value is unknown, of the wrong type or out of range; the message names the key."""


# The string-valued keys' choices, as Enums whose values are the strings the file and the
# environment hold (a config value compares equal to its member).


class RootLayout(StrEnum):
    """`save.layout`: where the save root lies relative to Miles' --save."""

    SUBDIR = "subdir"  # <save>/<save.subdir>
    FLAT = "flat"  # <save> itself


AUTO_HYPERPARAMETERS = "auto"  # `resume.hyperparameters`: the policy from Miles' flags (`resume.hyperparameter_policy`)
# `resume.hyperparameters`: "auto" or a `HyperparameterPolicy` other than megatron's (which "auto" picks from the flags)
HYPERPARAMETER_SETTINGS = (
    AUTO_HYPERPARAMETERS,
    *(p.value for p in HyperparameterPolicy if p is not HyperparameterPolicy.MEGATRON),
)


class MissingDataState(StrEnum):
    """`data_state.missing`: what a save does when the rollout's data state was not staged."""

    REFUSE = "refuse"  # the save fails on every rank, nothing committed
    WARN = "warn"  # committed without it, with a warning


@dataclass(frozen=True)
class Key:
    """One setting: its dotted name in the file, type, default, overriding environment variable, meaning."""

    name: str
    kind: type
    default: object
    env: str | None
    doc: str
    choices: tuple = ()
    minimum: float | None = None
    positive: bool = False
    path_component: bool = False  # a single, non-empty directory name: no '/', not '.' or '..'
    core: str | None = None  # the core.settings name this key sets


KEYS: tuple[Key, ...] = (
    Key(
        "save.layout",
        str,
        "subdir",
        "MILES_LORA_CKPT_LAYOUT",
        "where generations live relative to Miles' --save (and --load): 'subdir' puts the save root in "
        "<save>/<save.subdir>, 'flat' makes <save> itself the save root",
        choices=tuple(m.value for m in RootLayout),
    ),
    Key(
        "save.subdir",
        str,
        "lora",
        None,
        "the save root's directory name under --save with layout 'subdir'",
        path_component=True,
    ),
    Key(
        "save.keep",
        int,
        0,
        "MILES_LORA_CKPT_KEEP",
        "after each committed save keep the newest N intact generations and remove older ones (0 keeps all)",
        minimum=0,
    ),
    Key(
        "save.async",
        bool,
        False,
        "MILES_LORA_CKPT_ASYNC_SAVE",
        "single-LoRA saves return once the state is copied to host memory; the write, consensus and publish "
        "run in the background, and the next save, a load, the post-save hook, the last rollout's save and "
        "process exit wait for it to commit (see docs/python-api.md, Asynchronous save)",
    ),
    Key(
        "consensus.timeout_s",
        float,
        settings.Settings.consensus_timeout_s,
        settings.ENV_VARS["consensus_timeout_s"],
        "seconds a rank waits for a peer in any checkpoint collective before every rank raises",
        positive=True,
        core="consensus_timeout_s",
    ),
    Key(
        "lease.timeout_s",
        float,
        settings.Settings.lease_timeout_s,
        settings.ENV_VARS["lease_timeout_s"],
        "seconds without renewal after which the save root's writer lease is stale and may be taken over",
        positive=True,
        core="lease_timeout_s",
    ),
    Key(
        "lease.run_id",
        str,
        settings.Settings.run_id,
        settings.ENV_VARS["run_id"],
        "a name for the run, shown in the writer lease (and so in a second writer's error)",
        core="run_id",
    ),
    Key(
        "signing.hmac_key_file",
        str,
        settings.Settings.hmac_key_file,
        settings.ENV_VARS["hmac_key_file"],
        "a file holding the manifest signing key (>= 16 bytes): manifests are signed with HMAC-SHA256 and "
        "unsigned or mis-signed generations are refused; the key itself never goes into this file",
        core="hmac_key_file",
    ),
    Key(
        "resume.strict",
        bool,
        True,
        "MILES_LORA_CKPT_STRICT",
        "true: resume only from the newest committed generation, exactly (a damaged newest generation, or one "
        "without optimizer state while neither --no-load-optim nor --no-save-optim is given, stops the run); "
        "false: fall back to the newest intact generation and accept an inexact resume, with a warning",
    ),
    Key(
        "resume.hyperparameters",
        str,
        "auto",
        "MILES_LORA_CKPT_HYPERPARAMETERS",
        "what a resume does where the checkpoint's optimizer hyperparameters (param groups: betas, eps, max_lr, "
        "min_lr, ...; scheduler: max_lr, min_lr, warmup, decay and weight-decay schedule) differ from the ones this "
        "launch built (every difference is logged on rank 0 with both values). 'auto': Miles' "
        "--override-opt-param-scheduler keeps the launch's, --use-checkpoint-opt-param-scheduler restores the "
        "checkpoint's; with neither, resume.strict refuses the resume and resume.strict = false restores the "
        "checkpoint's. 'checkpoint', 'launch', 'refuse': that, whatever the flags. A saved param-group key this "
        "launch's optimizer lacks is refused always",
        choices=HYPERPARAMETER_SETTINGS,
    ),
    Key(
        "export.peft",
        bool,
        False,
        "MILES_LORA_CKPT_PEFT_EXPORT",
        "every committed generation also holds peft/, an HF PEFT adapter exported through Megatron-Bridge and "
        "committed with it (a failed export fails the save on every rank); needs megatron.bridge, --hf-checkpoint "
        "and --lora-rank, checked at startup. Multi-LoRA: every slot save exports the slot at the top of its "
        "generation (stock v1 names, step_N/adapter_model.safetensors); Miles v1 does so by default whenever it "
        "can (Bridge with expose_adapter_slot, --hf-checkpoint), unless false is set explicitly",
    ),
    Key(
        "data_state.source",
        str,
        "miles.rollout.data_source.RolloutDataSourceWithBuffer",
        "MILES_LORA_CKPT_DATA_SOURCE",
        "the data source class (dotted path) the plugin's data source wraps when Miles' --data-source-path is "
        "miles_lora_ckpt.hooks.CheckpointedDataSource: the class --data-source-path named before (Miles' default "
        "here). Its data state (cursor, epoch, counters, metadata, buffered samples) is committed in every "
        "generation; a class whose state the plugin does not understand is refused at startup",
    ),
    Key(
        "data_state.multi_lora_source",
        str,
        "miles.rollout.multi_lora.data_source.MultiLoRAAsyncDataSource",
        "MILES_LORA_CKPT_MULTI_LORA_DATA_SOURCE",
        "multi-LoRA: the data source class (dotted path) the plugin's multi-LoRA data source wraps when Miles' "
        "--data-source-path is miles_lora_ckpt.hooks.CheckpointedMultiLoRADataSource (Miles' per-adapter data "
        "source here). Each adapter's data state is committed in its slot's generations and restored when its "
        "source is built again (a relaunch, a re-registered adapter)",
    ),
    Key(
        "data_state.missing",
        str,
        "refuse",
        "MILES_LORA_CKPT_DATA_STATE_MISSING",
        "what a save does when the plugin's data source is configured but the data state of the rollout it "
        "saves was not staged (or is torn): 'refuse' fails the save on every rank (nothing is committed), 'warn' "
        "commits the generation without it and logs a warning (a resume from it then restarts the data source "
        "as stock Miles would)",
        choices=tuple(m.value for m in MissingDataState),
    ),
    Key(
        "data_state.accept_none",
        bool,
        False,
        "MILES_LORA_CKPT_DATA_STATE_ACCEPT_NONE",
        "true: accept a data source class whose state the plugin does not understand (neither Miles' "
        "RolloutDataSource nor RolloutDataSourceWithBuffer, no state_dict()/load_state_dict()); its "
        "generations record that they hold no data state, and a resume from them restarts that class's data",
    ),
)
KEYS_BY_NAME = {key.name: key for key in KEYS}
# core.settings names deliberately left out of the file (secrets): environment variables only
ENV_ONLY_CORE_SETTINGS: tuple[str, ...] = ("hmac_key",)


@dataclass(frozen=True)
class PluginConfig:
    """Effective values by dotted key, and where each came from ('default', a file path, or '$VAR')."""

    values: Mapping[str, object]
    sources: Mapping[str, str] = field(default_factory=dict)
    path: str | None = None

    def __getitem__(self, name: str) -> object:
        return self.values[name]

    def describe(self) -> list[str]:
        """One `key = value (source)` line per key, for the startup log."""
        return [f"{name} = {self.values[name]!r} ({self.sources.get(name, 'default')})" for name in sorted(self.values)]


def defaults() -> PluginConfig:
    """Every key at its default."""
    return PluginConfig({key.name: key.default for key in KEYS}, {key.name: "default" for key in KEYS})


def load_config(environ: Mapping[str, str] | None = None) -> PluginConfig:
    """Defaults, then the file named by $MILES_LORA_CKPT_CONFIG, then per-key variables. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    values = {key.name: key.default for key in KEYS}
    sources = {key.name: "default" for key in KEYS}
    path = environ.get(CONFIG_ENV) or None
    if path is not None:
        for name, raw in _flatten(_read_file(Path(path)), "").items():
            key = KEYS_BY_NAME.get(name)
            if key is None:
                raise ConfigError(f"{path}: unknown key {name!r}; known keys: {', '.join(sorted(KEYS_BY_NAME))}")
            values[name] = _check(key, _coerce_file_value(key, raw, path), path)
            sources[name] = path
    for key in KEYS:
        raw = environ.get(key.env) if key.env else None
        if raw is not None and raw != "":
            values[key.name] = _check(key, _parse_env(key, raw), f"${key.env}")
            sources[key.name] = f"${key.env}"
    return PluginConfig(values, sources, path)


def apply_core_settings(config: PluginConfig) -> None:
    """Hand the keys that belong to `core.settings` to `settings.configure`."""
    settings.configure(**{key.core: config[key.name] for key in KEYS if key.core})


# --------------------------------------------------------------------------- parsing


def _read_file(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"${CONFIG_ENV} names {path}, which is not a readable file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        elif suffix in (".yaml", ".yml"):
            import yaml

            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle)
        else:
            raise ConfigError(f"{path}: the config file must end in .toml, .yaml or .yml")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parser error becomes one message naming the file
        raise ConfigError(f"{path}: cannot parse: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table of sections, not {type(data).__name__}")
    return data


def _flatten(data: dict, prefix: str) -> dict[str, object]:
    flat = {}
    for name, value in data.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _coerce_file_value(key: Key, raw: object, where: str) -> object:
    if key.kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, bool) != (key.kind is bool) or not isinstance(raw, key.kind):
        raise ConfigError(f"{where}: {key.name} must be of type {key.kind.__name__}, got {raw!r}")
    return raw


def _parse_env(key: Key, raw: str) -> object:
    text = raw.strip()
    if key.kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"${key.env}={raw!r} ({key.name}) must be one of 1/0, true/false, yes/no, on/off")
    try:
        return key.kind(text)
    except ValueError:
        raise ConfigError(f"${key.env}={raw!r} ({key.name}) is not a valid {key.kind.__name__}") from None


def _check(key: Key, value: object, where: str) -> object:
    if key.choices and value not in key.choices:
        raise ConfigError(f"{where}: {key.name} must be one of {list(key.choices)}, got {value!r}")
    if key.minimum is not None and value < key.minimum:
        raise ConfigError(f"{where}: {key.name} must be at least {key.minimum}, got {value!r}")
    if key.positive and not value > 0:
        raise ConfigError(f"{where}: {key.name} must be positive, got {value!r}")
    if key.path_component and (not value or "/" in value or value in (".", "..")):
        raise ConfigError(f"{where}: {key.name} must be one directory name, got {value!r}")
    return value
