"""Every optimizer child megatron builds for a LoRA run, saved and restored bit for bit (CPU, gloo).

Adam, Lion and Muon (with an Adam and a Lion scalar optimizer) through Float16 / FP32 children,
LayerWiseDistributedOptimizer chains (one slot, and two slots as Miles' multi-LoRA builds them),
at W=2 and W=3, bf16 and fp32, and under context parallelism (CP=2: replicas and layer-wise owners
over the data-and-context group) and virtual pipelines (PP=2, VPP=2: one optimizer over two model
chunks per stage); DistributedOptimizer children are covered by test_single_lora.py.
Lion and Muon are megatron's own on the 0.19.2 tier (emerging-optimizers); megatron-core 0.16.1
has no Lion (the harness swaps its own into every child there) and cannot build Muon, whose cases
the jobs report as skipped with the reason.

Two jobs per tier (one per world size) run every case. They rely on the CPU harness: the three
megatron fallback-path fixes for DistributedOptimizer cases, and the padded all-gather that
LayerWiseDistributedOptimizer needs on gloo (see harness/miles_lora_ckpt_harness/sim/cpu_intercepts.py).
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest
from jobs_paths import JOBS

from miles_lora_ckpt_harness.sim.launch import check_all, run_workers
from miles_lora_ckpt_harness.sim.model import SimConfig

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

MEGATRON = version("megatron-core")
TIER2 = not MEGATRON.startswith("0.16")  # 0.19.2 with emerging-optimizers: megatron's own Lion and Muon


def cfg(world: int, optimizer: str = "adam", dtype: str = "bf16", adapters: str = "dense", **extra) -> dict:
    if optimizer == "muon":
        extra.setdefault("adapter_bias", True)  # 1-D biases: what Muon's scalar optimizer steps
    return SimConfig(world_size=world, optimizer=optimizer, dtype=dtype, adapters=adapters, **extra).to_dict()


def matrix(world: int) -> list[dict]:
    nd, lw = {"distributed": False}, {"layer_wise": True}
    cp2, vpp2 = {"cp": 2}, {"pp": 2, "vpp": 2, "num_layers": 4}
    cases = {
        2: [
            cfg(2, "adam", "bf16", "mixed", **nd),
            cfg(2, "adam", "fp32", "dense", **nd),
            cfg(2, "lion", "bf16", "mixed", **nd),
            cfg(2, "adam", "bf16", "mixed", **lw),
            cfg(2, "lion", "fp32", "dense", **lw),
            cfg(2, "muon", "bf16", "mixed", muon_scalar="adam"),
            cfg(2, "muon", "fp32", "dense", muon_scalar="lion"),
            cfg(2, "muon", "bf16", "mixed", muon_scalar="lion", **lw),
            # CP=2 (DP=1): the optimizer's group is DP x CP; VPP=2: two model chunks per stage
            cfg(2, "adam", "bf16", "mixed", **nd, **cp2),
            cfg(2, "adam", "bf16", "mixed", **lw, **cp2),
            cfg(2, "lion", "bf16", "mixed", **nd, **vpp2),
            cfg(2, "adam", "fp32", "dense", **lw, **vpp2),
            cfg(2, "muon", "bf16", "mixed", muon_scalar="adam", **cp2),
            cfg(2, "muon", "bf16", "dense", muon_scalar="adam", **lw, **vpp2),
        ],
        3: [
            cfg(3, "adam", "bf16", "dense", **nd),
            cfg(3, "lion", "fp32", "mixed", **nd),
            cfg(3, "adam", "fp32", "mixed", **lw),
            cfg(3, "adam", "bf16", "dense", slots=2),
            cfg(3, "lion", "fp32", "dense", slots=2),
            cfg(3, "muon", "bf16", "mixed", muon_scalar="adam", **lw),
            cfg(3, "muon", "bf16", "mixed", muon_scalar="lion"),
            cfg(3, "muon", "fp32", "dense", muon_scalar="adam"),
            cfg(3, "muon", "bf16", "dense", muon_scalar="lion", num_layers=1, **lw),  # 2 biases, 3 ranks
        ],
    }[world]
    out = [{"config": c, "save_at": 2} for c in cases]
    if world == 2:  # a layer-wise save before the first step: only each child's own masters refreshed
        out.append({"config": cfg(2, "adam", "bf16", "dense", **lw), "save_at": 0})
    return out


ELASTIC = {  # saved at W=2, loaded at W=3: the DP size changes, whole parameters move between ranks
    "replicated": {"optimizer": "lion", "adapters": "mixed", "distributed": False},
    "layer-wise": {"optimizer": "adam", "adapters": "mixed", "layer_wise": True},
    "muon-layer-wise": {"optimizer": "muon", "muon_scalar": "adam", "layer_wise": True},
}

REFUSAL_BIAS = {"adapter_bias": True}  # the same adapters on both sides, so only the optimizer differs
REFUSALS = {
    "saves": {
        "adam-distributed": cfg(2, "adam", **REFUSAL_BIAS),
        "adam-float16": cfg(2, "adam", distributed=False, **REFUSAL_BIAS),
        "lion-float16": cfg(2, "lion", distributed=False, **REFUSAL_BIAS),
        "muon": cfg(2, "muon", muon_scalar="adam"),
    },
    "loads": {  # name: (saved, this run)
        "adam -> lion": ("adam-float16", cfg(2, "lion", distributed=False, **REFUSAL_BIAS)),
        "lion -> adam": ("lion-float16", cfg(2, "adam", distributed=False, **REFUSAL_BIAS)),
        "muon -> adam": ("muon", cfg(2, "adam", distributed=False, **REFUSAL_BIAS)),
        "adam -> muon": ("adam-float16", cfg(2, "muon", muon_scalar="adam")),
        "DistributedOptimizer -> Float16": ("adam-distributed", cfg(2, "adam", distributed=False, **REFUSAL_BIAS)),
        "Float16 -> DistributedOptimizer": ("adam-float16", cfg(2, "adam", **REFUSAL_BIAS)),
        "replicated -> layer-wise": ("adam-float16", cfg(2, "adam", layer_wise=True, **REFUSAL_BIAS)),
    },
}
REFUSAL_WORDS = {
    "adam -> lion": ["checkpoint holds state ['exp_avg', 'exp_avg_sq'] of adam", "(lion) keeps ['exp_avg']"],
    "lion -> adam": ["checkpoint holds state ['exp_avg'] of lion", "(adam) keeps ['exp_avg', 'exp_avg_sq']"],
    "muon -> adam": ["checkpoint holds state ['momentum_buffer'] of muon", "(adam)"],
    "adam -> muon": ["of adam", "(muon) keeps ['momentum_buffer']"],
    "DistributedOptimizer -> Float16": [
        "saved a DistributedOptimizer over adam",
        "has a Float16OptimizerWithFloat16Params",
    ],
    "Float16 -> DistributedOptimizer": [
        "saved a Float16OptimizerWithFloat16Params over adam",
        "has a DistributedOptimizer",
    ],
    "replicated -> layer-wise": ["(replicated)", "under a LayerWiseDistributedOptimizer (layer-wise)"],
}


def run(world: int, payload: dict) -> list[dict]:
    tests = str(Path(JOBS).parent)  # damage.py, for the rebound-file case
    results = run_workers(world, "optimizer_jobs:suite", payload, sys_path=[JOBS, tests], timeout_s=500)
    return check_all(results)


@pytest.fixture(scope="module")
def elastic_roots(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("elastic")
    return {name: str(base / name) for name in ELASTIC}


@pytest.fixture(scope="module")
def w2(elastic_roots) -> list[dict]:
    saves = {n: {"config": cfg(2, **o), "root": elastic_roots[n], "steps": 3} for n, o in ELASTIC.items()}
    diverged = {"config": cfg(2, "adam", distributed=False)}
    rebound = {"config": cfg(2, "adam", "bf16", "mixed", distributed=False)}
    payload = {"matrix": matrix(2), "elastic_saves": saves, "refusals": REFUSALS, "diverged": diverged}
    return run(2, {**payload, "rebound": rebound})


@pytest.fixture(scope="module")
def w3(w2, elastic_roots) -> list[dict]:
    loads = {n: {"config": cfg(3, **o), "root": elastic_roots[n]} for n, o in ELASTIC.items()}
    slots = {"config": cfg(3, "adam", "bf16", "dense", slots=2)}
    return run(3, {"matrix": matrix(3), "elastic_loads": loads, "slots": slots})


def _check_matrix(results: list[dict]) -> dict[str, list[str]]:
    """Every case bit-exact on every rank (or skipped for the reason megatron gives); the classes run."""
    ran = {}
    for rank, result in enumerate(results):
        for name, case in result["matrix"].items():
            if "skipped" in case:
                assert not TIER2 and "muon" in name, (name, case["skipped"])  # only Muon, only on 0.16
                assert "cannot build Muon" in case["skipped"]
                continue
            assert case["loss_mismatch"] is None, (rank, name, case["loss_mismatch"])
            assert case["first_difference"] is None, (rank, name, case["first_difference"])
            assert case["result"]["optimizer_restored"] == ("save@0" not in name), (rank, name)
            assert any("/master/" in n for n in case["names"]), (rank, name)  # the comparison saw masters
            ran[name] = case["children"]
    return ran


def _keys_seen(results: list[dict], name: str) -> set[str]:
    return {n.rsplit("/", 1)[1] for r in results for n in r["matrix"][name].get("names", []) if "/state/" in n}


def test_resume_matrix_w2_is_bit_exact(w2):
    ran = _check_matrix(w2)
    assert any("Float16OptimizerWithFloat16Params" in c for cs in ran.values() for c in cs)
    assert any("FP32Optimizer" in c for cs in ran.values() for c in cs)
    assert any(c.endswith("@layer-wise") for cs in ran.values() for c in cs)
    assert {"exp_avg", "exp_avg_sq"} <= _keys_seen(w2, "adam/non-distributed/bf16/mixed/w2/save@2")
    assert _keys_seen(w2, "lion/non-distributed/bf16/mixed/w2/save@2") & {"exp_avg_sq", "momentum_buffer"} == set()


def test_context_parallel_and_virtual_pipelines_with_every_whole_parameter_family(w2):
    ran = _check_matrix(w2)
    for layout in ("w2-cp2", "w2-pp2-vpp2"):
        families = {
            "layer-wise" if c.endswith("@layer-wise") else c.split("(")[0]
            for name, cs in ran.items()
            if f"/{layout}/" in name
            for c in cs
        }
        assert {"Float16OptimizerWithFloat16Params", "layer-wise"} <= families, (layout, families)
    # every chunk's masters and moments were compared: a whole-parameter file names the chunk
    names = {n for r in w2 for n in r["matrix"]["lion/non-distributed/bf16/mixed/w2-pp2-vpp2/save@2"]["names"]}
    for chunk in ("chunk0.", "chunk1."):
        assert any(f"/master/{chunk}" in n for n in names) and any(f"/state/{chunk}" in n for n in names), chunk
    # under CP=2 (DP=1) replicated children hold every parameter on both CP ranks, layer-wise
    # children give each parameter one owner among them
    replicated = [sum(r["matrix"]["adam/non-distributed/bf16/mixed/w2-cp2/save@2"]["local_params"]) for r in w2]
    owned = [sum(r["matrix"]["adam/layer-wise/bf16/mixed/w2-cp2/save@2"]["local_params"]) for r in w2]
    assert replicated[0] == replicated[1] == sum(owned) and all(owned), (replicated, owned)


def test_resume_matrix_w3_is_bit_exact_with_empty_children_on_some_ranks(w3):
    ran = _check_matrix(w3)
    assert any(c.endswith("@layer-wise") for cs in ran.values() for c in cs)
    # a layer-wise child with no parameter on some rank (not a stub: it keeps its param groups)
    name = "adam/slots2/bf16/dense/w3/save@2"
    assert any(0 in r["matrix"][name]["local_params"] for r in w3), [r["matrix"][name]["local_params"] for r in w3]


def test_muon_runs_with_an_adam_and_a_lion_scalar_optimizer(w2, w3):
    if not TIER2:
        pytest.skip(
            f"megatron-core {MEGATRON} cannot build Muon (it needs emerging-optimizers; the 0.19.2 tier has it)"
        )
    ran = {**_check_matrix(w2), **_check_matrix(w3)}
    muon = {name: children for name, children in ran.items() if name.startswith("muon/")}
    assert len(muon) == 9, sorted(muon)
    for name, children in muon.items():
        scalar = name.split("/")[1].removeprefix("scalar-")
        assert any("TensorParallelMuon" in c for c in children), (name, children)
        expected = "emerging_optimizers.scalar_optimizers.lion.Lion" if scalar == "lion" else "torch.optim.adamw.AdamW"
        assert any(expected in c for c in children), (name, children)
        assert ("/layer-wise/" in name) == all(c.endswith("@layer-wise") for c in children), (name, children)
    everything = {k for r in w2 + w3 for case in r["matrix"].values() for k in _state_keys(case)}
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= everything
    # 2 biases on 3 ranks: the scalar child holds nothing on one rank, and still saves and resumes
    name = "muon/scalar-lion/layer-wise/bias/bf16/dense/w3/save@2"
    assert any(0 in r["matrix"][name]["local_params"] for r in w3)


def _state_keys(case: dict) -> set[str]:
    return {n.rsplit("/", 1)[1] for n in case.get("names", []) if "/state/" in n}


def test_megatron_builds_its_own_lion(w2):
    """On the 0.19.2 tier megatron's get_megatron_optimizer builds Lion (emerging-optimizers);
    megatron-core 0.16.1 has none, and the harness swaps its own Lion in (sim/lion.py)."""
    lion = {n: r["matrix"][n]["children"] for r in w2 for n in r["matrix"] if n.startswith("lion/")}
    assert lion
    if not TIER2:
        assert all("miles_lora_ckpt_harness.sim.lion.Lion" in c for cs in lion.values() for c in cs), lion
        pytest.skip(f"megatron-core {MEGATRON} has no Lion: the harness's Lion ran instead")
    assert all("emerging_optimizers.scalar_optimizers.lion.Lion" in c for cs in lion.values() for c in cs), lion


def test_dp_size_change_restores_float16_and_layer_wise_exactly(w2, w3):
    for name in ELASTIC:
        for rank, result in enumerate(w3):
            load = result["elastic_loads"][name]
            if "skipped" in load:
                assert not TIER2 and name.startswith("muon"), load
                continue
            assert load["result"]["optimizer_restored"] and load["result"]["iteration"] == 3, (name, load)
            assert load["compared"] > 0 and load["differing"] == [], (name, rank, load["differing"])
        writers = {f.rsplit("_dp", 1)[1] for r in w3 for f in r["elastic_loads"][name].get("files_read", [])}
        if name != "replicated" and writers:  # layer-wise: each W=2 rank wrote what it owned, W=3 reads both
            assert writers == {"000_cp000.safetensors", "001_cp000.safetensors"}, (name, writers)


def test_two_slot_chain_restores_slot1_alone_and_never_touches_slot0(w3):
    for rank, result in enumerate(w3):
        slots = result["slots"]
        assert slots["slot_children"] == {"0": [0], "1": [1]}
        assert slots["saved_children"] == ["1"], slots["saved_children"]
        assert not any(f.startswith("optimizer/child0_") for f in slots["saved_files"]), slots["saved_files"]
        assert slots["slot1_moved_before_load"] is not None  # training went on, so the load had work to do
        assert slots["slot1_vs_saved"] is None, (rank, slots["slot1_vs_saved"])
        assert slots["slot0_changed"] is None, (rank, slots["slot0_changed"])
        assert slots["result"]["optimizer_restored"] and not slots["result"]["masters_refreshed"]
    # slot 0's masters, moments and adapter weights were compared where they exist, and they can fail:
    # Miles' reload_model_params() on the whole chain truncates slot 0's fp32 masters to bf16
    compared = [n for r in w3 for n in r["slots"]["slot0_compared"]]
    assert any("/master/" in n for n in compared) and any("/exp_avg_sq" in n for n in compared)
    assert any(n.startswith("param/layers.0.") for n in compared)
    assert any(r["slots"]["slot0_changed_by_chain_reload"] is not None for r in w3)
    assert any(0 in r["slots"]["local_params"] for r in w3)  # a slot child with nothing on one rank


@pytest.mark.parametrize("name", sorted(REFUSAL_WORDS))
def test_optimizer_mismatches_are_refused_before_anything_changes(w2, name):
    outcomes = [r["refusals"][name] for r in w2]
    if "skipped" in outcomes[0]:
        assert not TIER2 and "muon" in name, outcomes[0]
        pytest.skip(outcomes[0]["skipped"])
    errors = [o["error"] for o in outcomes]
    assert all(errors) and errors[0] == errors[1], errors  # the same CheckpointError on every rank
    for word in REFUSAL_WORDS[name]:
        assert word in errors[0], (word, errors[0])
    assert all(o["changed"] is None for o in outcomes), [o["changed"] for o in outcomes]


def test_diverged_replicas_are_refused_at_save(w2):
    """Float16 children under a DDP that reduce-scatters (megatron 0.19's Lion with
    --use-distributed-optimizer): the DP replicas differ, and no generation is committed."""
    errors = [r["diverged"]["error"] for r in w2]
    assert all(errors) and errors[0] == errors[1], errors
    assert "replicas on ranks 0 and 1 hold different masters or moments" in errors[0], errors[0]
    assert all(r["diverged"]["committed"] == [] for r in w2)


def test_a_whole_parameter_file_bound_to_another_child_is_refused_before_anything_changes(w2):
    """Stamp and manifest agree (the generation verifies), but the file is bound to child 1 where
    child 0's state belongs: the family's preflight refuses it on every rank, nothing changed."""
    outcomes = [r["rebound"] for r in w2]
    assert "Float16OptimizerWithFloat16Params" in outcomes[0]["children"][0]
    errors = [o["error"] for o in outcomes]
    assert all(errors) and errors[0] == errors[1], errors
    assert f"{outcomes[0]['file']}: the manifest binds it to {{'child': '1'," in errors[0], errors[0]
    assert (
        "expected {'role': 'optimizer', 'coordinate': 'tp000_pp000_ep000_etp000_dp000_cp000', 'child': '0'}"
        in (errors[0])
    )
    assert all(o["changed"] is None for o in outcomes), [o["changed"] for o in outcomes]


def test_whole_parameter_masters_of_another_generation_are_refused_before_anything_changes(w2):
    """The child's files of a generation one step later under this generation's stamps (every
    digest, stamp and binding agrees): its masters are not the ones the adapter was cast from."""
    outcomes = [r["rebound"]["transplanted"] for r in w2]
    errors = [o["error"] for o in outcomes]
    assert all(errors) and errors[0] == errors[1], errors
    assert "is not the bfloat16 cast of its fp32 master in optimizer/child0_" in errors[0], errors[0]
    assert "(optimizer child 0)" in errors[0] and "adapter/dense_tp000_pp000.safetensors" in errors[0], errors[0]
    assert all(o["changed"] is None for o in outcomes), [o["changed"] for o in outcomes]
