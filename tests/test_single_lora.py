"""Single-LoRA save/resume through the real megatron-core DistributedOptimizer (CPU, gloo).

Every resume is compared with an uninterrupted run tensor by tensor, bit for bit: adapter weights,
fp32 masters, every optimizer state tensor (moments and steps) and the scheduler state. These runs
rely on the CPU harness's megatron fallback-path fixes (see miles_lora_ckpt/sim/cpu_intercepts.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from damage import drop_file, edit_manifest, reseal_file, rewrite_tensors, torch_pickle_bytes
from jobs_paths import JOBS

from miles_lora_ckpt.sim.launch import check_all, run_workers
from miles_lora_ckpt.sim.model import SimConfig

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

STEPS = 5


def cfg(world: int, dtype: str = "bf16", adapters: str = "mixed", **extra) -> dict:
    return SimConfig(world_size=world, dtype=dtype, adapters=adapters, **extra).to_dict()


def run(world, target, payload):
    return check_all(run_workers(world, f"lora_jobs:{target}", payload, sys_path=[JOBS], timeout_s=400))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_resume_matrix_is_bit_exact(world):
    cases = [
        {"config": cfg(world, dtype, adapters), "save_at": 2}
        for dtype in ("bf16", "fp32")
        for adapters in ("dense", "expert-only", "mixed")
    ]
    if world == 2:  # expert parallel and pipeline stages: files per EP and per PP coordinate
        cases.append({"config": cfg(world, "bf16", "mixed", ep=2), "save_at": 2})
        cases.append({"config": cfg(world, "bf16", "mixed", pp=2), "save_at": 2})
    if world == 4:  # tensor parallel, alone and with expert parallel; pipeline with expert parallel
        cases += [
            {"config": cfg(world, "fp32", "mixed", tp=2), "save_at": 2},
            {"config": cfg(world, "bf16", "mixed", tp=2, ep=2), "save_at": 2},
            {"config": cfg(world, "bf16", "mixed", pp=2, ep=2), "save_at": 2},
        ]
    if world in (2, 3):  # Lion: one moment (megatron 0.16: the harness's Lion in DistributedOptimizer
        # children; 0.19: megatron's own, in Float16/FP32 children: see test_optimizer_children.py)
        cases += [
            {"config": cfg(world, dtype, adapters, optimizer="lion"), "save_at": 2}
            for dtype, adapters in (("bf16", "mixed"), ("fp32", "dense"))
        ]
    if world == 2:
        cases.append({"config": cfg(world, "bf16", "mixed"), "save_at": 0})  # before the first step
        cases.append({"config": cfg(world, "bf16", "mixed"), "save_at": 2, "load_optim": False})
    results = run(world, "resume_matrix", {"cases": cases, "steps": STEPS})
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(cases)
        for name, case in per_case.items():
            if name.endswith("no-optim-control"):
                # without moments and masters the resume must differ: the comparison can fail
                assert case["first_difference"] is not None, name
                assert case["result"]["optimizer_restored"] is False
                continue
            assert case["loss_mismatch"] is None, (rank, name, case["loss_mismatch"])
            assert case["first_difference"] is None, (rank, name, case["first_difference"])
            names = case["names"]
            lion = case["optimizer"] == "lion"
            assert any("/master/" in n for n in names) and any(n.endswith("/exp_avg") for n in names), name
            assert any(n.endswith("/exp_avg_sq") for n in names) != lion, name
            assert "scheduler" in names and (lion or any(n.endswith("/step") for n in names)), name
            if "save@0" in name:
                assert case["result"]["optimizer_restored"] is False and case["result"]["masters_refreshed"]
            else:
                assert case["result"]["optimizer_restored"] and case["result"]["scheduler_restored"], name


@pytest.mark.parametrize(
    "saved_world, loaded_world, layout", [(2, 4, {}), (4, 2, {}), (2, 4, {"ep": 2}), (2, 4, {"pp": 2})]
)
def test_dp_elastic_restore_is_bit_exact(saved_world, loaded_world, layout, tmp_path):
    root = tmp_path / "ckpt"
    run(
        saved_world,
        "train_and_save",
        {"config": cfg(saved_world, "bf16", "mixed", **layout), "root": str(root), "steps": 3},
    )
    results = run(
        loaded_world, "elastic_load", {"config": cfg(loaded_world, "bf16", "mixed", **layout), "root": str(root)}
    )
    roots = [r for r in results if r["compared"]]
    assert roots, "no DP root compared anything"
    compared = sorted(n for r in roots for n in r["names"])
    assert any(n.endswith(".param") for n in compared) and any(n.endswith(".exp_avg_sq") for n in compared)
    for r in results:
        assert r["differing"] == [], r["differing"]
        assert r["result"]["optimizer_restored"] and r["result"]["iteration"] == 3


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("neg") / "ckpt"
    results = run(2, "train_and_save", {"config": cfg(2), "root": str(root), "steps": 2, "saves": 2})
    return root, results[0]["paths"]


def _copy_generation(gen: str, dest) -> str:
    target = dest / gen.rsplit("/", 1)[-1]
    shutil.copytree(gen, target)
    return str(target)


def test_negative_matrix_fails_everywhere_and_changes_nothing(saved_root, tmp_path):
    root, (older, newer) = saved_root
    optim = "optimizer/child0_tp000_pp000_ep000_etp000.safetensors"
    cases = {}

    def case(name, damage):
        gen = _copy_generation(newer, tmp_path / name)
        damage(Path(gen))
        cases[name] = gen

    case("invalid state structure", lambda g: rewrite_tensors(g, optim, lambda t: t.pop("buf0.exp_avg_sq")))
    case(
        "wrong numel", lambda g: rewrite_tensors(g, optim, lambda t: t.update({"buf0.exp_avg": t["buf0.exp_avg"][:-1]}))
    )
    case(
        "NaN in a moment (manifest honest)",
        lambda g: rewrite_tensors(g, optim, lambda t: t["buf0.exp_avg"].__setitem__(0, float("nan"))),
    )
    case(
        "NaN in a moment (finite flag stripped)",
        lambda g: rewrite_tensors(g, optim, lambda t: t["buf0.exp_avg"].__setitem__(0, float("nan")), finite=False),
    )
    case("torn: adapter shard gone from manifest", lambda g: drop_file(g, "adapter/dense_tp000_pp000.safetensors"))
    case("torn: optimizer file deleted", lambda g: (g / optim).unlink())
    case(
        "layout: checkpoint with stub, run without",
        lambda g: edit_manifest(g, lambda b: b["metadata"]["active_children"].update(tp000_pp000_ep000_etp000=[1])),
    )
    case("pickle payload", lambda g: reseal_file(g, optim, torch_pickle_bytes()))
    case(
        "adapter shape changed",
        lambda g: rewrite_tensors(
            g,
            "adapter/dense_tp000_pp000.safetensors",
            lambda t: t.update({k: v[:1] for k, v in list(t.items())[:1]}),
        ),
    )
    cases["iterations differ across ranks"] = [older, newer]
    cases["fault after preflight on rank 1"] = newer  # rank 0 has already applied: it must roll back
    failing = {"fault after preflight on rank 1": ["after-preflight", 1]}
    outcomes = run(2, "try_loads", {"config": cfg(2), "cases": cases, "pre_steps": 1, "faults": failing})
    expected_words = {
        "invalid state structure": "exp_avg_sq",
        "wrong numel": "buf0.exp_avg",
        "NaN in a moment (manifest honest)": "NaN",
        "NaN in a moment (finite flag stripped)": "NaN",
        "torn: adapter shard gone from manifest": "dense_tp000_pp000",
        "torn: optimizer file deleted": optim,
        "layout: checkpoint with stub, run without": "child layout differs",
        "pickle payload": "not safetensors",
        "adapter shape changed": "adapter",
        "iterations differ across ranks": "ranks disagree",
        "fault after preflight on rank 1": "injected fault at phase 'after-preflight' on rank 1",
    }
    assert set(expected_words) == set(cases)
    for name, word in expected_words.items():
        errors = [o[name]["error"] for o in outcomes]
        assert all(errors), (name, errors)
        assert errors[0] == errors[1], (name, errors)  # the same CheckpointError on every rank
        assert word in errors[0], (name, errors[0])
        assert all(o[name]["changed"] is None for o in outcomes), (name, [o[name]["changed"] for o in outcomes])
    # the undamaged generations still load afterwards, in the same processes
    sane = run(2, "try_loads", {"config": cfg(2), "cases": {"newest": str(root)}})
    assert all(o["newest"]["error"] is None and o["newest"]["result"]["iteration"] == 2 for o in sane)


@pytest.mark.parametrize(
    "name, run_config, word",
    [
        ("tp change", cfg(2, tp=2), "tp: 1 -> 2"),
        ("ep change", cfg(2, ep=2), "ep: 1 -> 2"),
        ("pp change", cfg(2, pp=2), "pp: 1 -> 2"),
        # the mixed checkpoint has a real dense child; an expert-only run has a stub there
        ("checkpoint without stub, run with one", cfg(2, adapters="expert-only"), "child layout differs"),
    ],
)
def test_layout_changes_are_refused(saved_root, name, run_config, word):
    root, _ = saved_root
    outcomes = run(2, "try_loads", {"config": run_config, "cases": {name: str(root)}})
    for o in outcomes:
        assert o[name]["error"] and word in o[name]["error"], o[name]["error"]
        assert o[name]["changed"] is None


def test_weights_only_and_no_load_optim_restore_adapter_and_reposition_scheduler(saved_root):
    root, _ = saved_root
    outcomes = run(
        2, "try_loads", {"config": cfg(2), "cases": {"root": str(root)}, "load_kwargs": {"load_optim": False}}
    )
    for o in outcomes:
        result = o["root"]["result"]
        assert result["adapter_restored"] and not result["optimizer_restored"] and not result["scheduler_restored"]
        assert result["masters_refreshed"] and any("repositioned" in w for w in result["warnings"])


def test_optimizer_mismatch_is_refused_unless_weights_only(saved_root, tmp_path):
    """Adam <-> Lion with megatron's default children (0.16: both DistributedOptimizer; 0.19: Lion is
    a Float16 child). test_optimizer_children.py covers every other mismatch."""
    adam_root, _ = saved_root
    lion_root = tmp_path / "lion"
    run(2, "train_and_save", {"config": cfg(2, optimizer="lion"), "root": str(lion_root), "steps": 2})
    into_lion = run(2, "try_loads", {"config": cfg(2, optimizer="lion"), "cases": {"adam->lion": str(adam_root)}})
    into_adam = run(2, "try_loads", {"config": cfg(2), "cases": {"lion->adam": str(lion_root)}})
    for outcome, name, saved, running in (
        (into_lion, "adam->lion", "adam", "lion"),
        (into_adam, "lion->adam", "lion", "adam"),
    ):
        for o in outcome:
            error = o[name]["error"]
            assert error and (f"of {saved}," in error or f"over {saved}," in error), error
            assert f"({running})" in error or f"over {running} " in error, error
            assert o[name]["changed"] is None
    warm = run(
        2,
        "try_loads",
        {"config": cfg(2, optimizer="lion"), "cases": {"warm": str(adam_root)}, "load_kwargs": {"weights_only": True}},
    )
    for o in warm:
        result = o["warm"]["result"]
        assert result["adapter_restored"] and not result["optimizer_restored"] and result["masters_refreshed"]


def test_stock_miles_adapter_directory_warm_starts_the_adapter_only(tmp_path):
    results = run(2, "legacy_warm_start", {"config": cfg(2), "dir": str(tmp_path / "legacy")})
    for r in results:
        result = r["result"]
        assert result["source"] == "legacy-miles" and result["loaded"] and result["iteration"] == 2
        assert r["same_adapter"] and r["masters_match_adapter"]
        assert not result["optimizer_restored"] and not result["scheduler_restored"]
        assert "NOT restored" in result["warnings"][0] and "optimizer moments" in result["warnings"][0]
