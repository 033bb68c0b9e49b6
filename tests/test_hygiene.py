"""Package-wide rules: no unpickling anywhere, lazy imports of heavy or optional dependencies."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "miles_lora_ckpt"
FORBIDDEN_CALLS = {
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "eval",
    "exec",
    "marshal.loads",
    "yaml.load",
    "dill.load",
    "dill.loads",
    "cloudpickle.load",
    "cloudpickle.loads",
    "numpy.load",
    "np.load",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _offences(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in FORBIDDEN_CALLS:
            found.append(f"line {node.lineno}: {name}()")
        if name == "torch.load":
            weights_only = [k for k in node.keywords if k.arg == "weights_only"]
            if not weights_only or not (
                isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value is True
            ):
                found.append(f"line {node.lineno}: torch.load without weights_only=True")
    return found


def test_scanner_catches_what_it_must():
    bad = "import pickle, torch\npickle.load(f)\ntorch.load(p)\ntorch.load(p, weights_only=False)\neval('1')\n"
    assert len(_offences(bad)) == 4
    assert _offences("torch.load(p, map_location='cpu', weights_only=True)\n") == []


def test_no_module_unpickles():
    offences = {str(p.relative_to(PACKAGE)): _offences(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {k: v for k, v in offences.items() if v} == {}


BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'megatron', 'peft', 'transformers', 'miles', 'ray'}:
            raise ImportError(f'blocked for this test: {name}')
sys.meta_path.insert(0, Block())
"""


def test_package_and_cli_work_without_megatron_peft_transformers(tmp_path):
    code = BLOCKER + (
        "import miles_lora_ckpt, miles_lora_ckpt.tools.cli as c, torch.distributed as d\n"
        "assert not d.is_initialized()\n"
        "assert c.main(['--help']) == 0\n"
        f"assert c.main(['verify', {str(tmp_path)!r}]) == 2\n"
        "import sys; assert not [m for m in sys.modules if m.startswith(('megatron', 'peft', 'transformers'))]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "verify" in result.stdout


# The layering rule of docs/architecture.md: core <- megatron <- savers <- integration <- hooks, tools;
# sim (the test harness) only from the demo and bench tools.
LAYERS = {"core": 0, "megatron": 1, "savers": 2, "integration": 3, "hooks": 4, "tools": 4}
HARNESS_USERS = ("tools/demo", "tools/bench")
THIRD_PARTY_IN_CORE = {"megatron", "miles", "peft", "transformers", "ray"}


def _imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, anywhere in it (functions included), relative imports resolved."""
    package = ".".join(("miles_lora_ckpt", *path.relative_to(PACKAGE).parent.parts))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return found


def _layering_offences(files: dict[str, list[str]]) -> list[str]:
    offences = []
    for rel, modules in sorted(files.items()):
        layer = rel.split("/")[0]
        for module in modules:
            parts = module.split(".")
            if layer == "core" and parts[0] in THIRD_PARTY_IN_CORE:
                offences.append(f"{rel} imports {module} (core imports neither megatron nor Miles nor Bridge)")
            if parts[0] != "miles_lora_ckpt" or len(parts) < 2:
                continue
            target = parts[1]
            if target == "sim" and layer != "sim" and not rel.startswith(HARNESS_USERS):
                offences.append(f"{rel} imports {module} (sim is the test harness)")
            elif layer in LAYERS and target in LAYERS and LAYERS[target] > LAYERS[layer]:
                offences.append(f"{rel} imports {module} (an upper layer)")
    return offences


def test_layering_checker_catches_what_it_must():
    bad = {
        "core/x.py": ["megatron.core", "miles_lora_ckpt.savers.single_lora"],
        "savers/y.py": ["miles_lora_ckpt.sim.train", "miles_lora_ckpt.integration.runtime"],
        "tools/demo.py": ["miles_lora_ckpt.sim.train"],
    }
    assert len(_layering_offences(bad)) == 4


def test_imports_follow_the_layering_rule():
    files = {
        p.relative_to(PACKAGE).as_posix(): _imported_modules(p)
        for p in PACKAGE.rglob("*.py")
        if len(p.relative_to(PACKAGE).parts) > 1
    }
    assert _layering_offences(files) == []
