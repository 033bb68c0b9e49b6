"""The Miles stand-in: never importable as `miles` outside the harness; each tree is the shape it claims;
registration on a tree whose signature differs refuses, names the function and patches nothing.
And a test against real Miles, which runs wherever `miles` imports (skipped here)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles_lora_ckpt_harness.miles_standin import SHAPES, shape_path

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=240)


PROBE = """
import importlib.util, json, sys
import miles_lora_ckpt, miles_lora_ckpt_harness.miles_standin as standin, miles_lora_ckpt.integration.install
outside = {
    "find_spec": repr(importlib.util.find_spec("miles")),
    "on_path": [p for p in sys.path if p.startswith(standin.__path__[0])],
}
try:
    import miles
    outside["import"] = miles.__file__
except ModuleNotFoundError:
    outside["import"] = "refused"
from miles_lora_ckpt.integration.peft import model_context
from miles_lora_ckpt.integration.shapes import detect_shape
from miles_lora_ckpt_harness.miles_standin import SHAPES, shape_path
found = {}
for name in SHAPES:
    for module in [m for m in sys.modules if m == "miles" or m.startswith("miles.")]:
        del sys.modules[module]
    sys.path.insert(0, shape_path(name))
    import miles.backends.megatron_utils.actor  # what Miles has imported when it calls the init hook
    shape = detect_shape()
    context, why = model_context(shape)  # what the PEFT export runs Bridge under
    bound = sys.modules["miles.utils.megatron_bridge_utils"].patch_megatron_model is context
    found[name] = [shape.name, miles.__file__, sys.modules["miles.utils.megatron_bridge_utils"].__file__, bound, why]
    sys.path.pop(0)
print(json.dumps({"outside": outside, "found": found}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    result = run_python(PROBE)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_miles_is_not_importable_outside_the_harness(probe):
    assert probe["outside"] == {"find_spec": "None", "on_path": [], "import": "refused"}


def test_each_stand_in_tree_is_detected_as_its_shape(probe):
    for name in SHAPES:
        detected, where, _, _, _ = probe["found"][name]
        assert detected == name and where.startswith(shape_path(name))


def test_each_shape_binds_the_peft_export_to_its_own_patch_megatron_model(probe):
    for name in SHAPES:
        _, _, context_file, bound, why = probe["found"][name]
        assert context_file.startswith(shape_path(name)) and bound and why == "", (name, why)


TAMPERED_HOOK = """
import json, sys
from argparse import Namespace
sys.path.insert(0, {path!r})
import miles.backends.megatron_utils.actor as actor, miles.backends.megatron_utils.checkpoint as ck
import miles.backends.megatron_utils.lora_utils as lu, miles.backends.megatron_utils.model as md
modules = [actor, ck, lu, md]
before = {{(m.__name__, k): id(v) for m in modules for k, v in vars(m).items()}}
from miles_lora_ckpt.hooks import megatron_init
try:
    megatron_init(Namespace(lora_rank=4, save=None, load=None))
    error = None
except Exception as exc:
    error = str(exc)
after = {{(m.__name__, k): id(v) for m in modules for k, v in vars(m).items()}}
print(json.dumps({{"error": error, "unchanged": before == after}}))
"""


def test_registration_refuses_a_changed_signature_naming_the_function_and_patches_nothing(tmp_path):
    tree = tmp_path / "miles-tree"
    shutil.copytree(shape_path("lora-utils-2026-08"), tree)
    checkpoint = tree / "miles" / "backends" / "megatron_utils" / "checkpoint.py"
    text = checkpoint.read_text()
    old = "def save_checkpoint_with_lora(iteration, model, optimizer, opt_param_scheduler):"
    assert old in text
    checkpoint.write_text(text.replace(old, old[:-2] + ", *, async_save=False):"))
    result = run_python(TAMPERED_HOOK.format(path=str(tree)))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["unchanged"], "the hook changed a Miles module although it refused"
    assert "miles-lora-ckpt does not know this Miles, so it patched nothing" in report["error"]
    assert (
        "miles.backends.megatron_utils.checkpoint.save_checkpoint_with_lora: found "
        "(iteration, model, optimizer, opt_param_scheduler, *, async_save=...), "
        "expected (iteration, model, optimizer, opt_param_scheduler)"
    ) in report["error"]


REAL_MILES = importlib.util.find_spec("miles")


@pytest.mark.skipif(
    REAL_MILES is None,
    reason="no Miles on sys.path: the real miles-rl wheel is tested in the realmiles tier (make tier-miles, "
    "tests/test_real_miles.py); put a Miles source tree on PYTHONPATH to run this test against it",
)
def test_real_miles_matches_a_known_shape():
    """Real Miles' LoRA module matches a known shape, and the plugin can bind to it in a fresh process.

    Where Megatron-LM is missing (a CPU box), checkpoint.py and model.py cannot import: only the
    LoRA module's own targets are checked then, and binding is planned for them
    (their consumers are rebound where they imported).
    """
    code = (
        "import json\n"
        "from dataclasses import replace\n"
        "from miles_lora_ckpt.integration import bindings\n"
        "from miles_lora_ckpt.integration.shapes import SHAPES, Shape, shape_differences\n"
        "out = {}\n"
        "for shape in SHAPES:\n"
        "    diffs = shape_differences(shape)\n"
        "    lora = [d for d in diffs if d.module == shape.lora_module]\n"
        "    other = [d for d in diffs if d.module != shape.lora_module and 'cannot be imported' not in d.found]\n"
        "    if not lora and not other:\n"
        "        targets = tuple(\n"
        "            replace(t, consumers=(), late_consumers=t.consumers + t.late_consumers)\n"
        "            for t in shape.targets if t.module == shape.lora_module\n"
        "        )\n"
        "        partial = Shape(shape.name, shape.description, shape.lora_module, shape.gloo_flag, targets)\n"
        "        out[shape.name] = [b.where for b in bindings.plan(partial).bindings]\n"
        "print(json.dumps(out))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    matched = json.loads(result.stdout.strip().splitlines()[-1])
    assert matched, "real Miles matches no known shape in its LoRA module"
    for name, sites in matched.items():
        assert any(site.endswith(".save_lora_checkpoint") for site in sites), (name, sites)
