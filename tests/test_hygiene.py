"""Package-wide rules: no unpickling anywhere, lazy imports of heavy or optional dependencies, the layering
rule (the plugin never imports the harness distribution), no import circles; test modules that hold
rank jobs import outside pytest."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "miles_lora_ckpt"
HARNESS = REPO / "harness" / "miles_lora_ckpt_harness"  # the harness distribution (harness/)
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
    offences = {
        str(p.relative_to(REPO)): _offences(p.read_text()) for root in (PACKAGE, HARNESS) for p in root.rglob("*.py")
    }
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
# the harness (a separate distribution) is never imported by the plugin, but for the one hand-off of
# `demo` and `bench`: the CLI's lazy import of the harness's `commands`.
LAYERS = {"core": 0, "megatron": 1, "savers": 2, "integration": 3, "hooks": 4, "tools": 4}
HARNESS_HAND_OFF = ("tools/cli.py", {"miles_lora_ckpt_harness", "miles_lora_ckpt_harness.commands"})
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
            hand_off = rel == HARNESS_HAND_OFF[0] and module in HARNESS_HAND_OFF[1]
            if parts[0] == "miles_lora_ckpt_harness" and not hand_off:
                offences.append(f"{rel} imports {module} (the harness is not a part of the plugin)")
            if parts[0] != "miles_lora_ckpt" or len(parts) < 2:
                continue
            target = parts[1]
            if layer in LAYERS and target in LAYERS and LAYERS[target] > LAYERS[layer]:
                offences.append(f"{rel} imports {module} (an upper layer)")
    return offences


def test_layering_checker_catches_what_it_must():
    bad = {
        "core/x.py": ["megatron.core", "miles_lora_ckpt.savers.single_lora"],
        "savers/y.py": ["miles_lora_ckpt_harness.sim.train", "miles_lora_ckpt.integration.runtime"],
        "tools/peft_tools.py": ["miles_lora_ckpt_harness.demo.command"],
        "tools/cli.py": ["miles_lora_ckpt_harness.commands", "miles_lora_ckpt_harness.sim"],
    }
    assert len(_layering_offences(bad)) == 6
    assert _layering_offences({"tools/cli.py": ["miles_lora_ckpt_harness", "miles_lora_ckpt_harness.commands"]}) == []


def test_the_cli_imports_the_harness_only_when_demo_or_bench_runs():
    """The hand-off's import is inside a function: the plugin's CLI never loads the harness for its own commands."""
    tree = ast.parse((PACKAGE / "tools" / "cli.py").read_text())
    top_level = [m for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom) for m in _names(node)]
    assert not [m for m in top_level if m.startswith("miles_lora_ckpt_harness")]


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def test_imports_follow_the_layering_rule():
    files = {
        p.relative_to(PACKAGE).as_posix(): _imported_modules(p)
        for p in PACKAGE.rglob("*.py")
        if len(p.relative_to(PACKAGE).parts) > 1
    }
    assert _layering_offences(files) == []


# No import circles: the brief's "no import runs back up", for every pair of package modules.
STANDIN_TREE = re.compile(r"miles_lora_ckpt_harness/miles_standin/(\w+)/miles(/|\.py$|$)")


def _module_name(rel: str) -> str:
    """`miles_lora_ckpt/tools/cli.py` -> `miles_lora_ckpt.tools.cli`; a package is its `__init__.py`."""
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except what runs only for a type checker (`if TYPE_CHECKING:` bodies)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _dotted(node.test).split(".")[-1] == "TYPE_CHECKING":
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _import_graph(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    """`{module: {package module it imports: line}}` for `sources` (`{path from the folder holding the
    package: text}`, the plugin's and the harness's modules together),
    by the rules of `test_no_import_circles_among_the_package_modules`."""
    modules = {_module_name(rel): rel for rel in sources}
    trees: dict[str, dict[str, str]] = {}
    for name, rel in modules.items():
        if match := STANDIN_TREE.match(rel):
            miles_name = "miles" + name.split(f".{match.group(1)}.miles", 1)[1]
            trees.setdefault(match.group(1), {})[miles_name] = name
    graph: dict[str, dict[str, int]] = {}
    for name, rel in modules.items():
        package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        own_tree = STANDIN_TREE.match(rel)
        aliases = [trees[own_tree.group(1)]] if own_tree else list(trees.values())

        def resolve(module: str, aliases=aliases) -> list[str]:
            if module in modules:
                return [module]
            return [tree[module] for tree in aliases if module in tree]

        edges = graph.setdefault(name, {})
        for node in _runtime_nodes(ast.parse(sources[rel])):
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [m for alias in node.names for m in resolve(alias.name)]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    found += resolve(f"{base}.{alias.name}") or resolve(base)
            elif (
                isinstance(node, ast.Call)
                and _dotted(node.func) in {"importlib.import_module", "import_module"}
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found = resolve(node.args[0].value)
            for target in found:
                if target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def _import_circles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each import circle of `graph` (a strongly connected set of modules), as one cycle through its
    first module: `a -> b (line 3) -> a (line 7)`, names without the `miles_lora_ckpt.` prefix."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in sorted(graph):  # Tarjan's algorithm, iteratively
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    work.append((target, iter(sorted(graph.get(target, {})))))
                elif target in stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    circles.append(_shortest_cycle(graph, min(members), members))
    return sorted(circles)


def _shortest_cycle(graph: dict[str, dict[str, int]], start: str, members: set[str]) -> str:
    paths = {start: [start]}
    queue = [start]
    for node in queue:  # breadth first inside the circle, back to `start`
        for target in sorted(graph[node]):
            if target == start:
                chain = [*paths[node], start]
                steps = [f"{b} (line {graph[a][b]})" for a, b in zip(chain, chain[1:], strict=False)]
                return " -> ".join([start, *steps]).replace("miles_lora_ckpt.", "")
            if target in members and target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError(f"{start} is in no cycle of {sorted(members)}")


def test_import_circle_checker_catches_what_it_must():
    sources = {
        # a lazy import back: tools/a -> tools/b -> tools/a
        "miles_lora_ckpt/tools/a.py": "from miles_lora_ckpt.tools import b\n",
        "miles_lora_ckpt/tools/b.py": "def f():\n    from miles_lora_ckpt.tools.a import g\n",
        # a re-export of the package's __init__ used by a module it re-exports (relative import)
        "miles_lora_ckpt/savers/p/__init__.py": "from miles_lora_ckpt.savers.p.x import f\n",
        "miles_lora_ckpt/savers/p/x.py": "from . import helper\n",
        "miles_lora_ckpt/savers/p/y.py": "from miles_lora_ckpt.savers.p import x\n",  # a submodule: not the __init__
        # the Miles stand-in: miles.m from common/ is a tree's miles/m.py
        "miles_lora_ckpt_harness/miles_standin/common/t.py": "import importlib\ndef f():\n    importlib.import_module('miles.m')\n",
        "miles_lora_ckpt_harness/miles_standin/shape/miles/__init__.py": "",
        "miles_lora_ckpt_harness/miles_standin/shape/miles/m.py": "from miles_lora_ckpt_harness.miles_standin.common import t\n",
        # not circles: an import only for type checkers, a parent package initialised on the way
        "miles_lora_ckpt/core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from miles_lora_ckpt.core.d import D\n",
        "miles_lora_ckpt/core/d.py": "from miles_lora_ckpt.core import c\n",
        "miles_lora_ckpt/core/__init__.py": "from miles_lora_ckpt.core.d import D\n",
    }
    circles = _import_circles(_import_graph(sources))
    assert circles == [
        "miles_lora_ckpt_harness.miles_standin.common.t -> miles_lora_ckpt_harness.miles_standin.shape.miles.m (line 3) "
        "-> miles_lora_ckpt_harness.miles_standin.common.t (line 1)",
        "savers.p -> savers.p.x (line 1) -> savers.p (line 1)",
        "tools.a -> tools.b (line 1) -> tools.a (line 2)",
    ]
    del sources["miles_lora_ckpt/tools/b.py"], sources["miles_lora_ckpt/savers/p/x.py"]
    del sources["miles_lora_ckpt_harness/miles_standin/shape/miles/m.py"]
    assert _import_circles(_import_graph(sources)) == []


def test_no_import_circles_among_the_package_modules():
    """No module of the package or the harness imports, however lazily, a module that imports it back, directly or
    through others: a piece two modules share goes into a module both import, downward.

    Counted: every `import` and `from ... import` anywhere in a module (module level, functions, classes,
    `try`), relative ones resolved, and `importlib.import_module("literal")`; not counted: imports under
    `if TYPE_CHECKING:` (they never run), and third-party modules. `from pkg import name` is an edge to
    the module `pkg.name` where the package has one, else to `pkg` itself (its `__init__.py`): so a
    re-export from an `__init__.py` that imports the importer back is a circle. The parent packages that
    importing `a.b.c` initialises on the way are not edges (a package whose `__init__.py` re-exports its
    modules would otherwise be in a circle with each of them; Python imports a submodule of a package
    whose `__init__.py` is still running without running it again). The Miles stand-in's trees
    (`miles_standin/<tree>/miles/...` of the harness) run as the top-level `miles` in a harness worker: `miles.x`
    in one of a tree's modules is that tree's `miles.x`; in any other module, `miles.x` of every tree
    (whichever the worker put on sys.path)."""
    sources = {
        p.relative_to(root.parent).as_posix(): p.read_text() for root in (PACKAGE, HARNESS) for p in root.rglob("*.py")
    }
    assert _import_circles(_import_graph(sources)) == []


# ------------------------------------------------------------------------------ rank jobs in test modules

TESTS = Path(__file__).resolve().parent
JOB_TARGET = re.compile(r"[\"'](test_\w+):(\w*)")  # "test_reshard:reshard_job"; f"test_x:{name}" gives no name


def _module_level_skips(source: str) -> list[str]:
    """Calls of pytest.skip or pytest.importorskip outside every function and class: they run when a
    rank imports the module for its job, and raise pytest's Skipped there."""
    found = []
    for statement in ast.parse(source).body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Call) and _dotted(node.func) in ("pytest.skip", "pytest.importorskip"):
                found.append(f"line {node.lineno}: {_dotted(node.func)}")
    return found


def test_module_level_skip_checker_catches_what_it_must():
    assert _module_level_skips('import pytest\npytest.skip("no", allow_module_level=True)\n')
    assert _module_level_skips("import pytest\nif True:\n    np = pytest.importorskip('numpy')\n")
    assert not _module_level_skips("import pytest\ndef test_x():\n    pytest.skip('inside a test')\n")
    assert not _module_level_skips("import pytest\npytestmark = pytest.mark.skipif(True, reason='fine')\n")


def test_rank_jobs_named_by_tests_exist_in_modules_that_import_outside_pytest():
    """Every "test_x:job" a test launches names a job `job(payload, ctx)` of tests/test_x.py, and
    that module skips nothing at import (a rank imports it to run the job)."""
    targets: dict[str, set[str]] = {}
    for path in sorted(p for p in TESTS.glob("*.py") if p.name != Path(__file__).name):
        for module, name in JOB_TARGET.findall(path.read_text()):
            targets.setdefault(module, set()).update({name} if name else set())
    assert {"test_single_lora", "test_reshard", "test_protocol_multirank"} <= set(targets), sorted(targets)
    for module, names in targets.items():
        source = (TESTS / f"{module}.py").read_text()
        assert not _module_level_skips(source), (module, _module_level_skips(source))
        jobs = {
            node.name
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and [a.arg for a in node.args.args] == ["payload", "ctx"]
        }
        assert names <= jobs, (module, sorted(names - jobs))


def test_every_public_module_declares_what_it_exports():
    """Every plugin module but the package `__init__`s and `__main__` lists its public names in
    `__all__`, and every listed name exists there (the names other modules and users import)."""
    missing, unknown = [], {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") or path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text())
        exported = None
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                exported = [elt.value for elt in node.value.elts]
        rel = path.relative_to(PACKAGE).as_posix()
        if exported is None:
            missing.append(rel)
            continue
        defined = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
        if set(exported) - defined:
            unknown[rel] = sorted(set(exported) - defined)
    assert missing == [], f"modules without __all__: {missing}"
    assert unknown == {}, f"__all__ names a module does not define: {unknown}"
