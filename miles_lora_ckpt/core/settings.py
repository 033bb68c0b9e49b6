"""Process-wide settings of the protocol core: environment variables, or values set in code.

Every setting has a default and an environment variable that overrides it. `configure(...)`
overrides both in code; the Miles integration applies its config file this way. `current()` is read
where a setting is used, so a change takes effect at the next use.

| setting               | environment variable               | default | meaning |
|-----------------------|------------------------------------|---------|---------|
| `consensus_timeout_s` | `MILES_LORA_CKPT_TIMEOUT_S`        | 600     | seconds a rank waits for a peer in any checkpoint collective |
| `lease_timeout_s`     | `MILES_LORA_CKPT_LEASE_TIMEOUT_S`  | 60      | seconds without renewal after which a save root's writer lease is stale and another writer may take it over (the holder renews every quarter of it) |
| `run_id`              | `MILES_LORA_CKPT_RUN_ID`           | ""      | a name for this training run, shown in the writer lease (empty: none) |
| `hmac_key_file`       | `MILES_LORA_CKPT_HMAC_KEY_FILE`    | ""      | file holding the secret key (at least 16 bytes, surrounding whitespace ignored) that signs manifests with HMAC-SHA256; when a key is configured, unsigned or mis-signed generations are refused |
| `hmac_key`            | `MILES_LORA_CKPT_HMAC_KEY`         | ""      | the key itself, instead of a file (prefer the file: environments leak) |

The key is never written anywhere by this package and never shown (`repr(current())` hides it).
Set at most one of `hmac_key_file` and `hmac_key`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

__all__ = ["ENV_VARS", "Settings", "configure", "current", "overridden", "reset"]


@dataclass(frozen=True)
class Settings:
    """The effective settings (see the module docstring for each one)."""

    consensus_timeout_s: float = 600.0
    lease_timeout_s: float = 60.0
    run_id: str = ""
    hmac_key_file: str = ""
    hmac_key: str = field(default="", repr=False)


ENV_VARS = {
    "consensus_timeout_s": "MILES_LORA_CKPT_TIMEOUT_S",
    "lease_timeout_s": "MILES_LORA_CKPT_LEASE_TIMEOUT_S",
    "run_id": "MILES_LORA_CKPT_RUN_ID",
    "hmac_key_file": "MILES_LORA_CKPT_HMAC_KEY_FILE",
    "hmac_key": "MILES_LORA_CKPT_HMAC_KEY",
}

_overrides: dict[str, object] = {}


def current() -> Settings:
    """The effective `Settings`: defaults, then environment variables, then `configure` overrides.

    A malformed environment variable raises ValueError naming it (never showing the key).
    """
    values: dict[str, object] = {}
    for spec in fields(Settings):
        raw = os.environ.get(ENV_VARS[spec.name])
        if raw is not None and raw != "":
            values[spec.name] = _parse(spec.name, raw, type(spec.default))
    return replace(Settings(**values), **_overrides)


def configure(**values: object) -> None:
    """Override settings in this process, such as from the plugin's config file.

    Unknown names and values of the wrong type raise ValueError.
    """
    known = {spec.name: type(spec.default) for spec in fields(Settings)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown settings {unknown}; known: {sorted(known)}")
    for name, value in values.items():
        _check(name, value, known[name], shown=f"setting {name}")
    _overrides.update(values)


def reset() -> None:
    """Forget every `configure` override (tests)."""
    _overrides.clear()


@contextmanager
def overridden(**values: object) -> Iterator[None]:
    """`configure(**values)` for the duration of a `with` block (the CLI's options, tests).

    Raises ValueError as `configure` does; the earlier overrides come back on exit.
    """
    saved = dict(_overrides)
    configure(**values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def _parse(name: str, raw: str, kind: type) -> object:
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"${ENV_VARS[name]}={raw!r} is not a valid {kind.__name__}") from None
    _check(name, value, kind, shown=f"${ENV_VARS[name]}={'<hidden>' if name == 'hmac_key' else repr(raw)}")
    return value


def _check(name: str, value: object, kind: type, *, shown: str) -> None:
    if kind is float:
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0 or value == float("inf"):
            raise ValueError(f"{shown} must be a positive number of seconds")
    elif not isinstance(value, kind):
        raise ValueError(f"{shown} must be a {kind.__name__}")
