"""core.settings: defaults, environment overrides, code overrides, and refusals."""

from __future__ import annotations

import os

import pytest

from miles_lora_ckpt.core import settings


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in settings.ENV_VARS.values():
        monkeypatch.delenv(name, raising=False)
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


def test_hardening_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("MILES_LORA_CKPT_LEASE_TIMEOUT_S", "12")
    monkeypatch.setenv("MILES_LORA_CKPT_RUN_ID", "run-42")
    monkeypatch.setenv("MILES_LORA_CKPT_HMAC_KEY", "s3cret-s3cret-s3cret")
    current = settings.current()
    assert current.lease_timeout_s == 12.0 and current.run_id == "run-42"
    assert current.hmac_key == "s3cret-s3cret-s3cret" and "s3cret" not in repr(current)
    monkeypatch.setenv("MILES_LORA_CKPT_LEASE_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="MILES_LORA_CKPT_LEASE_TIMEOUT_S"):
        settings.current()


def test_overridden_restores_and_configure_checks_types():
    with settings.overridden(run_id="a", lease_timeout_s=5.0):
        assert settings.current().run_id == "a"
    assert settings.current().run_id == ""
    with pytest.raises(ValueError, match="setting run_id must be a str"):
        settings.configure(run_id=7)
    with pytest.raises(ValueError, match="positive number of seconds"):
        settings.configure(lease_timeout_s=float("nan"))


def test_the_signing_key_comes_from_a_file_or_the_setting_never_both(tmp_path):
    from miles_lora_ckpt.core import signing

    assert signing.configured_key() is None
    (tmp_path / "key").write_text("0123456789abcdef0123\n")
    with settings.overridden(hmac_key_file=str(tmp_path / "key")):
        from_file = signing.configured_key()
    with settings.overridden(hmac_key="0123456789abcdef0123"):
        from_setting = signing.configured_key()
    assert from_file == from_setting and len(from_file.key_id) == 16 and "0123" not in repr(from_file)
    with settings.overridden(hmac_key="0123456789abcdef0123", hmac_key_file=str(tmp_path / "key")):
        with pytest.raises(signing.SigningKeyError, match="not both"):
            signing.configured_key()
    os.mkfifo(tmp_path / "fifo")
    with settings.overridden(hmac_key_file=str(tmp_path / "fifo")):
        with pytest.raises(signing.SigningKeyError, match="is a fifo"):
            signing.configured_key()
