"""Process-wide settings of the protocol core: environment variables, or values set in code.

Every setting has a default, an environment variable that overrides it, and may be overridden
again in code with `configure(...)` (the Miles integration applies its config file this way).
`current()` is read where a setting is used, so a change takes effect at the next use.

| setting               | environment variable           | default | meaning                                    |
|-----------------------|--------------------------------|---------|--------------------------------------------|
| `consensus_timeout_s` | `MILES_LORA_CKPT_TIMEOUT_S`    | 600     | seconds a rank waits for a peer in any checkpoint collective |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Settings:
    """The effective settings (see the module docstring for each one)."""

    consensus_timeout_s: float = 600.0


ENV_VARS = {
    "consensus_timeout_s": "MILES_LORA_CKPT_TIMEOUT_S",
}

_overrides: dict[str, object] = {}


def current() -> Settings:
    """Defaults, then environment variables, then `configure` overrides."""
    values: dict[str, object] = {}
    for spec in fields(Settings):
        raw = os.environ.get(ENV_VARS[spec.name])
        if raw is not None and raw != "":
            values[spec.name] = _parse(spec.name, raw, type(spec.default))
    return replace(Settings(**values), **_overrides)


def configure(**values: object) -> None:
    """Override settings in this process (e.g. from the plugin config file); unknown names raise."""
    known = {spec.name for spec in fields(Settings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown settings {unknown}; known: {sorted(known)}")
    _overrides.update(values)


def reset() -> None:
    """Forget every `configure` override (tests)."""
    _overrides.clear()


def _parse(name: str, raw: str, kind: type) -> object:
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"${ENV_VARS[name]}={raw!r} is not a valid {kind.__name__}") from None
    if isinstance(value, float) and not value > 0:
        raise ValueError(f"${ENV_VARS[name]}={raw!r} must be positive")
    return value
