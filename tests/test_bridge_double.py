"""The Bridge double is a harness part: importable as `megatron.bridge` only inside harness workers
that install it, never in the test process, never from production code."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
from jobs_paths import TESTS

from miles_lora_ckpt_harness import bridge_double
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

PACKAGE = Path(__file__).resolve().parents[1] / "miles_lora_ckpt"


def test_the_double_refuses_to_install_outside_a_harness_worker(monkeypatch):
    monkeypatch.delenv(bridge_double.WORKER_ENV, raising=False)
    with pytest.raises(RuntimeError, match="only inside harness workers"):
        bridge_double.install()
    assert "megatron.bridge" not in sys.modules and not bridge_double.installed()
    assert importlib.util.find_spec("megatron.bridge") is None  # no Bridge here, real or double


def test_production_code_never_imports_the_harness():
    """The harness (the double with it) is another distribution: no plugin module imports it, but the
    CLI's hand-off of `demo` and `bench` to the harness's `commands` (tests/test_hygiene.py: the layering)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{rel}: {n}" for n in names if n.startswith("miles_lora_ckpt_harness")]
    assert offenders == ["tools/cli.py: miles_lora_ckpt_harness"]  # `from miles_lora_ckpt_harness import commands`


def double_isolation(payload: dict, ctx) -> dict:
    """Inside a (megatron-free) harness worker: the double installs, names itself, uninstalls."""
    import importlib

    out = {}
    for variant in payload["variants"]:
        before = importlib.util.find_spec("megatron.bridge") is not None
        auto_bridge = bridge_double.install(variant=variant)
        mb = importlib.import_module("megatron.bridge")
        peft_bridge = importlib.import_module("megatron.bridge.models.conversion.peft_bridge")
        seen = {
            "spec_before": before,
            "class": mb.AutoBridge.__name__,
            "is_double": getattr(mb, "IS_TEST_DOUBLE", False),
            "doc": mb.__doc__,
            "helpers": peft_bridge.__name__,
            "same": auto_bridge is mb.AutoBridge,
        }
        bridge_double.install(variant=variant, peft_helpers=False)
        seen["without_helpers"] = _importable("megatron.bridge.models.conversion.peft_bridge")
        bridge_double.uninstall()
        seen["after_uninstall"] = _importable("megatron.bridge")
        out[variant] = seen
    return out


def _importable(name: str) -> str:
    import importlib

    try:
        importlib.import_module(name)
        return "importable"
    except ImportError:
        return "gone"


@pytest.mark.multirank
def test_inside_a_worker_the_double_installs_names_itself_and_uninstalls():
    variants = ["nvidia", "fork"]
    job = run_workers(
        1, "test_bridge_double:double_isolation", {"variants": variants}, sys_path=[TESTS], megatron=False
    )
    for variant, seen in check_all(job)[0].items():
        assert seen["spec_before"] is False
        assert seen["class"] == {"nvidia": "AutoBridgeDouble", "fork": "ForkAutoBridgeDouble"}[variant]
        assert seen["is_double"] is True and "TEST DOUBLE" in seen["doc"] and seen["same"]
        assert seen["helpers"] == "miles_lora_ckpt_harness.bridge_double.peft_bridge"
        assert seen["after_uninstall"] == "gone" and seen["without_helpers"] == "gone"
