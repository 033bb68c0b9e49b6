"""The stand-in Miles trees are built from one base plus per-shape overlays (`sim/miles_standin/trees.py`):
each materialised tree holds exactly its shape's modules, is built the same way every time, lands
whole (built aside, renamed into place, also when two jobs race) and is refused when edited after.
That the launchers import these trees is `tests/test_miles_standin.py` (each `miles` module's file is
under `shape_path`); that each tree's functions keep Miles' signatures is
`tests/test_miles_standin_signatures.py`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles_lora_ckpt_harness.miles_standin import SHAPES, shape_path, trees
from miles_lora_ckpt_harness.miles_standin.signature_collect import module_names

MU = "miles.backends.megatron_utils"
# every shape: `miles.utils.lora` is a module in 2026-08 and a package later
COMMON = {
    "miles",
    "miles.backends",
    MU,
    f"{MU}.actor",
    f"{MU}.checkpoint",
    f"{MU}.ft",
    f"{MU}.ft.in_memory_checkpoint",
    f"{MU}.hf_export",
    f"{MU}.initialize",
    f"{MU}.model",
    "miles.utils",
    "miles.utils.arguments",
    "miles.utils.lora",
    "miles.utils.megatron_bridge_utils",
    "miles.utils.misc",
}
PACKAGE_LAYOUT = {
    f"{MU}.lora",
    f"{MU}.lora.utils",
    "miles.backends.training_utils",
    "miles.backends.training_utils.checkpoint_io",
    "miles.utils.function_registry",
    "miles.utils.lora.utils",
}
MODULES = {
    "lora-utils-2026-08": COMMON | {f"{MU}.lora_utils", f"{MU}.multi_lora_scheduler", f"{MU}.multi_lora_utils"},
    "lora-package-2026-09": COMMON
    | PACKAGE_LAYOUT
    | {
        f"{MU}.lora.actor",
        f"{MU}.lora.checkpoint",
        f"{MU}.lora.slots",
        "miles.rollout",
        "miles.rollout.multi_lora",
        "miles.rollout.multi_lora.data_source",
    },
    "positional-args-pr": COMMON | PACKAGE_LAYOUT,
}


def files_of(tree: Path) -> dict[str, bytes]:
    return {p.relative_to(tree).as_posix(): p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_materialised_tree_holds_exactly_its_shapes_modules(shape, tmp_path):
    tree = trees.materialise(shape, tmp_path)
    assert set(module_names(tree)) == MODULES[shape]
    assert files_of(tree) == trees.tree_files(shape)  # nothing but the stand-in's sources
    overlay = Path(trees.__file__).parent / SHAPES[shape]
    for name, data in trees.tree_files(shape).items():  # each module: the shape's own, else the base's
        source = overlay / name if (overlay / name).is_file() else trees.BASE / name
        assert source.read_bytes() == data, (shape, name)


def test_materialising_is_deterministic_and_reuses_a_built_tree(tmp_path):
    for shape in SHAPES:
        first = trees.materialise(shape, tmp_path / "one")
        second = trees.materialise(shape, tmp_path / "two")
        assert first.name == second.name and files_of(first) == files_of(second)
        stamp = (first / "miles" / "__init__.py").stat().st_mtime_ns
        assert trees.materialise(shape, tmp_path / "one") == first
        assert (first / "miles" / "__init__.py").stat().st_mtime_ns == stamp  # not rebuilt
    names = {trees.materialise(shape, tmp_path / "one").name for shape in SHAPES}
    assert len(names) == len(SHAPES) and not list((tmp_path / "one").glob(".*"))  # no staging left
    assert Path(shape_path("positional-args-pr")).name == trees.materialise("positional-args-pr", tmp_path).name


def test_an_edited_missing_or_extra_module_in_a_built_tree_is_refused_naming_it(tmp_path):
    tree = trees.materialise("lora-utils-2026-08", tmp_path)
    checkpoint = tree / "miles" / "backends" / "megatron_utils" / "checkpoint.py"
    checkpoint.write_text(checkpoint.read_text() + "\n# edited\n")
    with pytest.raises(RuntimeError, match="miles/backends/megatron_utils/checkpoint.py is changed"):
        trees.materialise("lora-utils-2026-08", tmp_path)
    checkpoint.unlink()
    with pytest.raises(RuntimeError, match="checkpoint.py is missing"):
        trees.materialise("lora-utils-2026-08", tmp_path)
    other = trees.materialise("lora-package-2026-09", tmp_path)
    (other / "miles" / "stray.py").write_text("")
    with pytest.raises(RuntimeError, match="miles/stray.py is not a stand-in module"):
        trees.materialise("lora-package-2026-09", tmp_path)
    with pytest.raises(ValueError, match="unknown Miles stand-in shape 'nope'"):
        shape_path("nope")


RACE = """
import sys
from pathlib import Path
from miles_lora_ckpt_harness.miles_standin import trees
print(trees.materialise(sys.argv[1], Path(sys.argv[2])))
"""


def test_jobs_racing_to_build_a_tree_all_get_the_same_whole_tree(tmp_path):
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, "lora-package-2026-09", str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    built = {racer.communicate(timeout=120)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert len(built) == 1 and [p.name for p in tmp_path.iterdir()] == [Path(built.pop()).name]
