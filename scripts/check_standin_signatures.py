"""Maintainer check: do the recorded 2026-08 Miles signatures still say what Miles' source says?

    .venv/bin/python scripts/check_standin_signatures.py [--mirror GIT_DIR] [--commit SHA]

Reads radixark/miles from a local git mirror (default /work/.mirror/radixark+miles/repo; any clone
works) at `source_signatures.SOURCE_COMMIT` and parses its files with `ast` (nothing is imported or
run). It reports, and exits 1 if any:
  - a recorded signature or `file:line` that differs from the `def` in the source;
  - a name recorded as not defined in the source that the source defines there;
  - a module in SOURCE_MODULES the source lacks, or a stand-in module outside it that the source has;
  - a stand-in function (any shape, in a module the source has) that is not recorded, or differs
    from the record (what tests/test_miles_standin_signatures.py checks too).
Not a test: CI has no Miles checkout. The test suite compares the stand-ins with the recorded facts
(tests/test_miles_standin_signatures.py); this script keeps the facts honest when either moves.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

from miles_lora_ckpt_harness.miles_standin import SHAPES, shape_path
from miles_lora_ckpt_harness.miles_standin import source_signatures as facts
from miles_lora_ckpt_harness.miles_standin.signature_collect import module_names, standin_signatures

DEFAULT_MIRROR = "/work/.mirror/radixark+miles/repo"


def source_file(mirror: str, commit: str, module: str) -> tuple[str, str] | None:
    """`(path, text)` of a module (`a/b.py` or `a/b/__init__.py`) at `commit`; None when absent."""
    base = module.replace(".", "/")
    for path in (f"{base}.py", f"{base}/__init__.py"):
        shown = subprocess.run(["git", "-C", mirror, "show", f"{commit}:{path}"], capture_output=True, text=True)
        if shown.returncode == 0:
            return path, shown.stdout
    return None


def find_def(tree: ast.Module, qualname: list[str]) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The last top-level `def` (or class member `def`) of that name, as Python binds it."""
    body, node = tree.body, None
    for part in qualname:
        found = [n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
        found = [n for n in found if n.name == part]
        if not found:
            return None
        node = found[-1]
        body = node.body
    return node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None


def render_def(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The parameters as `ast.unparse` writes them with the annotations removed: `(a, b=None, *, c)`."""
    arguments = node.args
    for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]:
        if argument is not None:
            argument.annotation = None
    return f"({ast.unparse(arguments)})"


def check(mirror: str, commit: str) -> list[str]:
    problems: list[str] = []
    files: dict[str, tuple[str, ast.Module] | None] = {}

    def parsed(module: str):
        if module not in files:
            found = source_file(mirror, commit, module)
            files[module] = None if found is None else (found[0], ast.parse(found[1]))
        return files[module]

    standin_modules = {module for shape in SHAPES for module in module_names(Path(shape_path(shape)))}
    for module in sorted(facts.SOURCE_MODULES):
        if parsed(module) is None:
            problems.append(f"{module}: listed in SOURCE_MODULES, absent from the source")
    for module in sorted(standin_modules - facts.SOURCE_MODULES):
        if parsed(module) is not None:
            problems.append(f"{module}: a stand-in module the source has, missing from SOURCE_MODULES")

    def locate(name: str):
        for module in sorted(facts.SOURCE_MODULES, key=len, reverse=True):
            if name.startswith(module + ".") and parsed(module) is not None:
                path, tree = parsed(module)
                return path, find_def(tree, name[len(module) + 1 :].split("."))
        return None, None

    for name, (recorded, where) in sorted(facts.SIGNATURES_2026_08.items()):
        path, node = locate(name)
        if node is None:
            problems.append(f"{name}: recorded as {recorded} at {where}; no such def in the source ({path})")
            continue
        actual, anchor = render_def(node), f"{path}:{node.lineno}"
        if (actual, anchor) != (recorded, where):
            problems.append(f"{name}: recorded {recorded} at {where}; the source has {actual} at {anchor}")
    for name in sorted(facts.NOT_DEFINED_IN_SOURCE):
        path, node = locate(name)
        if node is not None:
            problems.append(
                f"{name}: recorded as not defined; the source defines {render_def(node)} at {path}:{node.lineno}"
            )
    for shape, names in standin_signatures().items():  # what the test checks too, for a complete report
        found = {name: signature for name, (module, signature) in names.items() if module in facts.SOURCE_MODULES}
        problems += [f"{name} ({shape}): {problem}" for name, problem in facts.drift(found).items()]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", default=DEFAULT_MIRROR, help="git directory of a radixark/miles clone or mirror")
    parser.add_argument("--commit", default=facts.SOURCE_COMMIT, help="the commit the facts were read from")
    options = parser.parse_args(argv)
    if not Path(options.mirror).exists():
        print(f"no Miles mirror at {options.mirror}: nothing checked", file=sys.stderr)
        return 2
    problems = check(options.mirror, options.commit)
    print(
        f"{facts.SOURCE_REPOSITORY}@{options.commit[:12]}: {len(facts.SIGNATURES_2026_08)} signatures, "
        f"{len(facts.NOT_DEFINED_IN_SOURCE)} names not defined there, {len(facts.SOURCE_MODULES)} modules checked"
    )
    for problem in problems:
        print("DIFFERS " + problem)
    print("agrees" if not problems else f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
