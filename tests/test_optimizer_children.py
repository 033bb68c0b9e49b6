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

import json
from importlib.metadata import version
from pathlib import Path

import pytest
from jobs_paths import TESTS
from single_lora_steps import (
    Args,
    case_name,
    child_classes,
    load,
    reference,
    run_steps,
    save,
    save_then_resume,
)

from miles_lora_ckpt.core import checked_reads
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.megatron.optimizer_children import chain, replicated
from miles_lora_ckpt.megatron.topology import current_coordinates
from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.optimizers import why_not_buildable
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, compare_snapshots, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown

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


# ---- rank jobs: run in the workers as "test_optimizer_children:suite" (the tests directory on their sys.path)
#
# Worker functions for the optimizer-children tests: every child family megatron builds for LoRA.
#
# One job runs many checks (`suite`): a resume matrix, DP-elastic saves and loads, a two-slot
# chosen-children round trip and refusals of mismatched optimizers. Cases the running megatron
# cannot build (Muon on 0.16.1, say) come back as `{"skipped": reason}`.
#
# These runs depend on the CPU harness (harness/miles_lora_ckpt_harness/sim/cpu_intercepts.py): its three megatron
# fallback-path fixes for DistributedOptimizer cases, and its padded all-gather for the
# LayerWiseDistributedOptimizer (gloo refuses megatron's uneven all-gather) for layer-wise and
# multi-slot cases.


def suite(payload: dict, ctx) -> dict:
    """Run every section the payload names; see the module docstring."""
    consensus = Consensus.for_world(timeout_s=120)
    out = {}
    if "matrix" in payload:
        out["matrix"] = matrix_section(payload["matrix"], payload.get("steps", 5), ctx, consensus)
    if "elastic_saves" in payload:
        out["elastic_saves"] = {n: elastic_save(c, consensus) for n, c in payload["elastic_saves"].items()}
    if "elastic_loads" in payload:
        out["elastic_loads"] = {n: elastic_load(c, consensus) for n, c in payload["elastic_loads"].items()}
    if "slots" in payload:
        out["slots"] = slot_selection(payload["slots"], ctx, consensus)
    if "refusals" in payload:
        out["refusals"] = refusals(payload["refusals"], ctx, consensus)
    if "diverged" in payload:
        out["diverged"] = diverged_replicas(payload["diverged"], ctx, consensus)
    if "rebound" in payload:
        out["rebound"] = rebound_file(payload["rebound"], ctx, consensus)
    return out


def _skip(config: SimConfig) -> dict | None:
    reason = why_not_buildable(config)
    return {"skipped": reason} if reason else None


# --------------------------------------------------------------------------- resume matrix


def matrix_section(cases: list[dict], steps: int, ctx, consensus: Consensus) -> dict:
    """Uninterrupted reference vs save at `save_at`, crash, resume: the first difference per case."""
    out = {}
    for index, case in enumerate(cases):
        config = SimConfig.from_dict(case["config"])
        name = f"{case_name(config)}/save@{case['save_at']}"
        skipped = _skip(config)
        if skipped:
            out[name] = skipped
            continue
        ref_losses, ref_digests = reference(config, steps)
        got = save_then_resume(config, steps, case["save_at"], ctx.scratch_dir / f"matrix{index}", consensus)
        out[name] = {
            "loss_mismatch": None if got["losses"] == ref_losses else [ref_losses, got["losses"]],
            "first_difference": compare_digests(ref_digests, got["digests"]),
            "names": sorted(ref_digests),
            "children": got["children"],
            "local_params": got["local_params"],
            "result": got["result"],
        }
    return out


# --------------------------------------------------------------------------- DP-elastic


def elastic_save(case: dict, consensus: Consensus) -> dict:
    config = SimConfig.from_dict(case["config"])
    skipped = _skip(config)
    if skipped:
        return skipped
    run = build_run(config)
    run_steps(run, 0, case["steps"])
    path = save(run, case["root"], case["steps"], consensus)
    teardown(run)
    return {"path": path}


def elastic_load(case: dict, consensus: Consensus) -> dict:
    """Load a save of another DP size; compare every entry this rank now holds with the saved files."""
    config = SimConfig.from_dict(case["config"])
    skipped = _skip(config)
    if skipped:
        return skipped
    run = build_run(config)
    result = load(run, case["root"], consensus)
    generation = Path(result.path)
    saved = json.loads((generation / "manifest.json").read_text())["metadata"]["optimizer_children"]
    coords, names = current_coordinates(), chain.param_names(run.model)
    compared, differing, files = 0, [], {}
    for child in chain.select(run.optimizer):
        entries = saved[str(child.index)]["layout"]["entries"]
        for _, model_param, main, state in replicated.param_states(child.optimizer):
            name = names[id(model_param)]
            file = entries[replicated.entry_name(coords, model_param, name)]["file"]
            tensors = files.setdefault(file, checked_reads.load_tensors(generation / file)[0])
            for key, live in [("param", main), *state.items()]:
                compared += 1
                if not live.detach().cpu().equal(tensors[f"{name}.{key}"]):
                    differing.append(f"child{child.index}.{name}.{key}")
    loss = run_steps(run, result.iteration, result.iteration + 1)  # training goes on at the new size
    classes = child_classes(run)
    teardown(run)
    return {
        "compared": compared,
        "differing": differing,
        "files_read": sorted(files),
        "children": classes,
        "loss": loss,
        "result": result.__dict__,
    }


# --------------------------------------------------------------------------- chosen children


def slot_selection(case: dict, ctx, consensus: Consensus) -> dict:
    """A two-slot LayerWise chain: save slot 1's children alone, train on, load slot 1 alone.

    Slot 0's adapter weights, masters, moments and param groups must stay bit-identical; slot 1's
    must be exactly what was saved. Negative control: Miles' `reload_model_params()` on the whole
    chain afterwards does change slot 0's masters (its bf16 truncation), so the check can fail.
    """
    config = SimConfig.from_dict(case["config"])
    run = build_run(config)
    slot_children = {int(k): v for k, v in run.optimizer.miles_slot_child_indices.items()}
    run_steps(run, 0, 2)
    root = ctx.scratch_dir / "slot1"
    path = save_lora_checkpoint(
        run.model, Args(), root, optimizer=run.optimizer, iteration=2, consensus=consensus,
        optimizer_children=slot_children[1],
    )  # fmt: skip
    saved_slot1 = _slot_view(snapshot(run), config, slot_children, 1)
    run_steps(run, 2, 3)
    before = snapshot(run)
    result = load_lora_checkpoint(run.model, root, optimizer=run.optimizer, optimizer_children=slot_children[1])
    after = snapshot(run)
    run.optimizer.reload_model_params()  # what Miles does after a slot load: the whole chain
    reloaded = snapshot(run)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    out = {
        "slot_children": slot_children,
        "local_params": [sum(len(g["params"]) for g in c.optimizer.optimizer.param_groups) for c in chain.select(run.optimizer)],
        "slot0_changed": compare_snapshots(_slot_view(before, config, slot_children, 0), _slot_view(after, config, slot_children, 0)),
        "slot0_compared": sorted(_slot_view(after, config, slot_children, 0)),
        "slot1_vs_saved": compare_snapshots(saved_slot1, _slot_view(after, config, slot_children, 1)),
        "slot1_moved_before_load": compare_snapshots(saved_slot1, _slot_view(before, config, slot_children, 1)),
        "slot0_changed_by_chain_reload": compare_snapshots(
            _slot_view(after, config, slot_children, 0, masters_only=True),
            _slot_view(reloaded, config, slot_children, 0, masters_only=True),
        ),
        "saved_children": sorted(manifest["metadata"]["optimizer_children"]),
        "saved_files": sorted(manifest["files"]),
        "result": result.__dict__,
    }  # fmt: skip
    teardown(run)
    return out


def _slot_view(snap: dict, config: SimConfig, slot_children: dict, slot: int, masters_only: bool = False) -> dict:
    """The part of a snapshot that belongs to one slot: its adapters and its children's state."""
    prefixes = tuple(f"opt{i}/" for i in slot_children[slot])

    def in_slot(name: str) -> bool:
        if name.startswith(prefixes):
            return not masters_only or "/master/" in name
        if name.startswith("param/") and not masters_only:
            return config.slot_of(int(name.split("/")[1].split(".")[1])) == slot
        return False

    return {n: t for n, t in snap.items() if in_slot(n)}


# --------------------------------------------------------------------------- refusals


def refusals(case: dict, ctx, consensus: Consensus) -> dict:
    """Save each `saves` config; load each into another optimizer: refused, and nothing changed."""
    roots = {}
    for label, config_dict in case["saves"].items():
        config = SimConfig.from_dict(config_dict)
        if why_not_buildable(config) is None:
            run = build_run(config)
            run_steps(run, 0, 2)
            roots[label] = save(run, ctx.scratch_dir / f"refusal-{label}", 2, consensus)
            teardown(run)
    out = {}
    for name, (label, config_dict) in case["loads"].items():
        config = SimConfig.from_dict(config_dict)
        reason = why_not_buildable(config) or (None if label in roots else f"{label} was not saved")
        if reason:
            out[name] = {"skipped": reason}
            continue
        run = build_run(config)
        run_steps(run, 0, 1)
        before = snapshot_digests(snapshot(run))
        try:
            load(run, roots[label], consensus)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        out[name] = {"error": error, "changed": compare_digests(before, snapshot_digests(snapshot(run)))}
        teardown(run)
    return out


def rebound_file(case: dict, ctx, consensus: Consensus) -> dict:
    """A whole-parameter child's file re-stamped and re-listed as another child's (stamp and manifest
    agree, so the generation verifies): the family's binding check refuses it before any change.
    And `transplanted`: the child's files of a generation one step later put under this
    generation's stamps (everything verifies): the masters are not the adapter's, refused too.
    Needs the tests folder on the workers' sys.path (damage.py)."""
    import shutil

    from damage import rebind, transplant_tensors

    from miles_lora_ckpt.core.consensus import Outcome, attempt

    run = build_run(SimConfig.from_dict(case["config"]))
    run_steps(run, 0, 2)
    generation = Path(save(run, ctx.scratch_dir / "rebound", 2, consensus))
    files = sorted(p.relative_to(generation).as_posix() for p in (generation / "optimizer").glob("child0_*"))
    copy = ctx.scratch_dir / "transplanted" / generation.name
    copied = attempt(lambda: str(shutil.copytree(generation, copy))) if consensus.rank == 0 else Outcome.success()
    consensus.agree("copy", copied)
    damaged = attempt(rebind, generation, files[0], child="1") if consensus.rank == 0 else Outcome.success()
    consensus.agree("rebind", damaged)
    outcomes = {}
    for name, path in (("rebound", generation), ("transplanted", copy)):
        if name == "transplanted":  # one step later, then that generation's child-0 files into the copy
            run_steps(run, 2, 3)
            later = Path(save(run, ctx.scratch_dir / "later", 3, consensus))
            forged = [attempt(transplant_tensors, copy, f, later) for f in files] if consensus.rank == 0 else []
            consensus.agree("transplant", next((f for f in forged if not f.ok), Outcome.success()))
        before = snapshot_digests(snapshot(run))
        try:
            load(run, str(path), consensus)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        outcomes[name] = {"error": error, "changed": compare_digests(before, snapshot_digests(snapshot(run)))}
    children = child_classes(run)
    teardown(run)
    return {"file": files[0], **outcomes["rebound"], "transplanted": outcomes["transplanted"], "children": children}


def diverged_replicas(case: dict, ctx, consensus: Consensus) -> dict:
    """Float16 children under a DDP that reduce-scatters (what megatron 0.19 builds for Lion with
    --use-distributed-optimizer): each rank steps its own partial gradients, the replicas drift
    apart, and the save is refused instead of keeping one of them."""
    from miles_lora_ckpt_harness.sim import train

    original = train.ddp_config

    def reduce_scatter(config):
        built = original(config)
        built.use_distributed_optimizer = True
        return built

    train.ddp_config = reduce_scatter
    try:
        run = build_run(SimConfig.from_dict(case["config"]))
    finally:
        train.ddp_config = original
    run_steps(run, 0, 2)
    root = ctx.scratch_dir / "diverged"
    try:
        save(run, root, 2, consensus)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    teardown(run)
    return {"error": error, "committed": sorted(p.name for p in root.glob("gen-*")) if root.exists() else []}


def run(world: int, payload: dict) -> list[dict]:
    results = run_workers(world, "test_optimizer_children:suite", payload, sys_path=[TESTS], timeout_s=500)
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
