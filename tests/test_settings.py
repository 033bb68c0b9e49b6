"""core.settings: defaults, environment overrides, code overrides, and refusals."""

from __future__ import annotations

import pytest

from miles_lora_ckpt.core import settings


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("MILES_LORA_CKPT_TIMEOUT_S", raising=False)
    settings.reset()
    yield
    settings.reset()


def test_default_then_env_then_configure(monkeypatch):
    assert settings.current().consensus_timeout_s == 600.0
    monkeypatch.setenv("MILES_LORA_CKPT_TIMEOUT_S", "42.5")
    assert settings.current().consensus_timeout_s == 42.5
    settings.configure(consensus_timeout_s=7.0)
    assert settings.current().consensus_timeout_s == 7.0
    settings.reset()
    assert settings.current().consensus_timeout_s == 42.5


@pytest.mark.parametrize("raw", ["abc", "0", "-3"])
def test_bad_environment_value_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("MILES_LORA_CKPT_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="MILES_LORA_CKPT_TIMEOUT_S"):
        settings.current()


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="unknown settings"):
        settings.configure(no_such_setting=1)
