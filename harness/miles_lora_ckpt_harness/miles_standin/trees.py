"""The stand-in Miles trees: one base tree plus, per shape, whole-module overlays and removed modules.

`base/miles/` holds the modules the shapes share, as they are: the lora-package-2026-09 package
layout (`lora/utils.py`, `utils/function_registry.py`, `training_utils/checkpoint_io.py`,
`utils/lora/utils.py`) with lora-package-2026-09's `checkpoint.py` and `lora/utils.py`. A shape's
directory (`SHAPE_DIRS`) holds only what is its own: each file there replaces the base module of the
same path or adds a module, and `REMOVED` names the base modules and packages the shape lacks. Every
shape has its own `miles/__init__.py` (the base has none, so no shape can miss it silently).

`materialise(shape)` writes the shape's complete `miles/` tree into a cache directory named after
the shape and a digest of what it holds. It is built in a temporary sibling and renamed into place,
so concurrent jobs never see half a tree, and an edited source gives a new directory. A tree already
there is compared file by file with what it must hold; one that differs is refused, naming the file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = HERE / "base"
SHAPE_DIRS = {
    "lora-utils-2026-08": "lora_utils_2026_08",
    "lora-package-2026-09": "lora_package_2026_09",
    "positional-args-pr": "positional_args_pr",
}
# base modules (a file, or a package directory with all below it) that a shape does not have
REMOVED = {
    "lora-utils-2026-08": (
        "miles/backends/megatron_utils/lora",  # lora-utils-2026-08 has lora_utils.py
        "miles/backends/training_utils",  # no checkpoint_io yet: saves write in place
        "miles/utils/function_registry.py",  # load_function is misc's own
        "miles/utils/lora",  # utils/lora.py, a module
    ),
    "lora-package-2026-09": (),
    "positional-args-pr": (),
}


def default_cache_root() -> Path:
    """Where materialised trees are kept: one folder per user under the system's temporary directory."""
    return Path(tempfile.gettempdir()) / f"miles-lora-ckpt-standin-{os.getuid()}"


def _sources(root: Path) -> dict[str, bytes]:
    """Every `.py` file under `root`, by its path relative to `root` (bytecode caches left out)."""
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def tree_files(shape: str) -> dict[str, bytes]:
    """The files of a shape's tree, `{"miles/...py": content}`: the base, less `REMOVED`, plus the overlay."""
    if shape not in SHAPE_DIRS:
        raise ValueError(f"unknown Miles stand-in shape {shape!r}; known: {', '.join(SHAPE_DIRS)}")
    files = _sources(BASE)
    for removed in REMOVED[shape]:
        gone = [name for name in files if name == removed or name.startswith(removed + "/")]
        if not gone:
            raise RuntimeError(f"stand-in shape {shape}: removed module {removed} is not in {BASE}")
        for name in gone:
            del files[name]
    overlay = _sources(HERE / SHAPE_DIRS[shape])
    for name in overlay:
        if any(name == removed or name.startswith(removed + "/") for removed in REMOVED[shape]):
            raise RuntimeError(f"stand-in shape {shape}: {name} is both added and removed")
    files.update(overlay)
    if "miles/__init__.py" not in files:
        raise RuntimeError(f"stand-in shape {shape}: no miles/__init__.py in {HERE / SHAPE_DIRS[shape]}")
    return files


def tree_digest(files: dict[str, bytes]) -> str:
    """sha256 over each file's path and content, in path order."""
    digest = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def materialise(shape: str, cache_root: Path | None = None) -> Path:
    """The directory whose `miles/` is the shape's complete tree (put it on sys.path), built if missing."""
    files = tree_files(shape)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / f"{SHAPE_DIRS[shape]}-{tree_digest(files)[:16]}"
    if not final.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        for name, data in files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        try:
            os.rename(staging, final)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not final.is_dir():  # not a job that got there first: a real failure
                raise
    _check(final, files)
    return final


def _check(tree: Path, files: dict[str, bytes]) -> None:
    found = _sources(tree)
    for name in sorted(set(found) | set(files)):
        if found.get(name) != files.get(name):
            why = "missing" if name not in found else "not a stand-in module" if name not in files else "changed"
            raise RuntimeError(f"materialised Miles stand-in tree {tree}: {name} is {why}; remove {tree} to rebuild it")
