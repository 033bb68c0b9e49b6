"""The functions and methods one Miles tree exposes, by dotted name, for the signature checks.

`collect(tree)` imports every module of a stand-in shape directory, or with `source` the same
module names from another `miles` on sys.path, such as the real miles-rl wheel. It returns each
function and each method (`__init__` and the non-dunder ones) of each class in a module's
namespace, named `module.function` or `module.Class.method`. Run it in a process of its own: the
shape directories all hold a package named `miles`.

`scope` says which names it keeps. "own" keeps what the stand-in defines for that module, in the
tree or in `common/`, and not what it imports. "miles" adds what it imports from other `miles.*`
modules, which a module binds by name. "all" keeps every function and class member in the
namespace; the wheel needs it, because its modules import from packages the stand-in lacks.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path


def module_names(tree: Path) -> list[str]:
    """Every module of a shape directory, as `miles.x.y` (a package as its own name)."""
    return [
        ".".join(file.relative_to(tree).with_suffix("").parts).removesuffix(".__init__")
        for file in sorted(tree.rglob("*.py"))
    ]


def collect(
    tree: Path, *, scope: str = "own", skip_missing: bool = False
) -> tuple[dict[str, Callable], dict[str, str]]:
    """`({dotted name: function}, {module: its file})` for the modules of `tree` as imported now.

    `skip_missing`: a module that does not import because it (or a package above it) is absent is
    left out (a stand-in module the wheel has no counterpart of); any other import error raises.
    """
    functions: dict[str, Callable] = {}
    files: dict[str, str] = {}
    for module in module_names(tree):
        try:
            m = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if skip_missing and error.name is not None and module.startswith(error.name):
                continue
            raise
        files[module] = m.__file__
        for name, obj in vars(m).items():
            if name.startswith("__") or not _kept(obj, module, scope):
                continue
            if inspect.isfunction(obj):
                functions[f"{module}.{name}"] = obj
            elif inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if inspect.isfunction(member) and (attr == "__init__" or not attr.startswith("__")):
                        functions[f"{module}.{name}.{attr}"] = member
    return functions, files


# What the plugin and its harness define (a stand-in function lives in the harness's `common/`).
OURS = ("miles_lora_ckpt.", "miles_lora_ckpt_harness.")


def _kept(obj, module: str, scope: str) -> bool:
    defined = getattr(obj, "__module__", None) or ""
    if scope == "all":
        return True
    if scope == "miles":
        return defined.startswith(("miles.", *OURS))
    if scope == "own":  # in this module, or in the harness (`common/`) and exposed by it
        return defined == module or defined.startswith(OURS)
    raise ValueError(f"unknown scope {scope!r}; known: own, miles, all")


def rendered(tree: Path, **options) -> dict[str, tuple[str, str]]:
    """`{dotted name: (its module, render_signature(f, defaults=True))}` for `collect(tree, **options)`."""
    from miles_lora_ckpt.integration.shapes import render_signature

    functions, _ = collect(tree, **options)
    return {
        name: (_module_of(name, tree), render_signature(function, defaults=True))
        for name, function in functions.items()
    }


def _module_of(name: str, tree: Path) -> str:
    head = name.rpartition(".")[0]
    return head if head in module_names(tree) else head.rpartition(".")[0]  # `module.f` or `module.Class.f`


def standin_signatures(shapes: tuple[str, ...] | None = None) -> dict[str, dict[str, tuple[str, str]]]:
    """`rendered` for each stand-in shape (default: all), in a process of their own (one `miles` at a time)."""
    import json
    import subprocess
    import sys

    from miles_lora_ckpt_harness.miles_standin import SHAPES

    shapes = shapes or tuple(SHAPES)
    proc = subprocess.run(
        [sys.executable, "-m", __name__, *shapes], capture_output=True, text=True, timeout=600, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"collecting the stand-ins' signatures failed:\n{proc.stderr[-3000:]}")
    return {
        shape: {name: tuple(value) for name, value in found.items()} for shape, found in json.loads(proc.stdout).items()
    }


def _main(shapes: list[str]) -> dict:
    """Each shape's `rendered`, its `miles` put on sys.path alone and forgotten after."""
    import sys

    from miles_lora_ckpt_harness.miles_standin import shape_path

    result = {}
    for shape in shapes:
        path = shape_path(shape)
        sys.path.insert(0, path)
        try:
            result[shape] = rendered(Path(path))
        finally:
            sys.path.remove(path)
            for module in [m for m in sys.modules if m == "miles" or m.startswith("miles.")]:
                del sys.modules[module]
    return result


if __name__ == "__main__":  # python -m ...signature_collect SHAPE...: `_main`, as JSON
    import json
    import sys

    print(json.dumps(_main(sys.argv[1:])))
