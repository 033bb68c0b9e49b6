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
