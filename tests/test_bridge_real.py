"""The REAL Megatron-Bridge 0.6.2 end to end (the Bridge tier: `make tier-bridge`, part of `make test`).

Tiny Qwen2 and Llama HF bases (built from a config, no hub) go through `AutoBridge.from_hf_pretrained`
and `to_megatron_provider`; Bridge's own `LoRA` on linear_qkv, linear_proj, linear_fc1 and linear_fc2
is trained through megatron's real DistributedOptimizer at TP=1 (DP=2), TP=2 and PP=2 over gloo; the
plugin exports it with `export_peft(..., source=BridgeSource(real AutoBridge))`, standalone and
inside a checkpoint generation (`peft/`). Checked here: the real PEFT loads every export with 0
missing and 0 unexpected keys, and HF-with-PEFT logits equal megatron-with-LoRA logits within fp32
tolerance; the plugin's export equals Bridge's own `save_hf_adapter`, byte for byte; the Bridge
double (`bridge_double`) exports the same names and values as the real Bridge on the same
models (with negative controls: a double with altered names or order fails the comparison); a
SIGKILL mid-export leaves the committed generation and exports intact, and the resume is bit-exact.
The export scenarios ported from tests/test_peft_export.py run here on the real Bridge: the fault
matrix (a raise at every phase on every rank), a failing export inside a checkpoint save, partial
and rank-inconsistent exports, a rank killed inside the real collective export, wrong-split
negative controls, `verify-peft` and the offline `export-peft`.

Three spawned W=2 jobs for the whole module (a kill mid-write, a kill inside the export, then
everything else), at the end of this module: each rank imports it (`test_bridge_real:export_story`),
so it skips nothing at import. Bridge is imported only in the harness workers, where
`sim.bridge_shims` is installed; this process never imports it. Elsewhere (tiers 1 and 2) the
module's tests are skipped (`pytestmark`); in the Bridge tier a missing Bridge fails.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from jobs_paths import TESTS

from miles_lora_ckpt.core import faults, safetensors_write
from miles_lora_ckpt.core.checked_reads import load_tensors
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE
from miles_lora_ckpt.savers.peft_export import (
    CONFIG_NAME,
    FAULT_PHASES,
    LATEST,
    WEIGHTS_NAME,
    BridgeSource,
    LoraSpec,
    PeftExport,
    export_peft,
)
from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.sim import bridge_model as bm
from miles_lora_ckpt_harness.sim import bridge_shims
from miles_lora_ckpt_harness.sim.bridge_model import BridgeRunConfig
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers
from miles_lora_ckpt_harness.sim.snapshot import snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import teardown

IN_BRIDGE_TIER = os.environ.get("MILES_LORA_CKPT_TIER") == "bridge"
pytestmark = [
    pytest.mark.bridge,
    pytest.mark.multirank,
    pytest.mark.peft,
    pytest.mark.skipif(
        not bridge_shims.available() and not IN_BRIDGE_TIER,
        reason="megatron.bridge is not installed here (the Bridge tier: make tier-bridge)",
    ),
]
STEPS = 2
FAMILIES = ("qwen2", "llama")
LAYOUTS = {"tp1": {"tp": 1, "pp": 1}, "tp2": {"tp": 2, "pp": 1}, "pp2": {"tp": 1, "pp": 2}}  # W=2: tp1 is DP=2
CASES = {
    f"{family}-{layout}": BridgeRunConfig(family=family, world_size=2, **sizes)
    for family in FAMILIES
    for layout, sizes in LAYOUTS.items()
}
RESUME_CASE = "qwen2-tp2"
INPUT_IDS = torch.tensor([[3, 17, 42, 99, 5, 64, 1, 127], [8, 8, 120, 33, 71, 2, 0, 55]])
FP32_BOUND = 1e-5  # |HF+PEFT - megatron| / max|logits|; measured ~4e-7
ADAPTED = 2 * 7 * 2  # layers x HF modules (q k v o gate up down) x (lora_A, lora_B)


def test_bridge_is_installed_in_the_bridge_tier():
    assert bridge_shims.available(), "the Bridge tier runs without megatron-bridge: run make tier-bridge"


def test_the_shims_refuse_to_install_outside_a_harness_worker(monkeypatch):
    monkeypatch.delenv(bridge_shims.WORKER_ENV, raising=False)
    with pytest.raises(RuntimeError, match="only in harness workers"):
        bridge_shims.install()
    assert not bridge_shims.installed() and "megatron.bridge" not in __import__("sys").modules


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    from miles_lora_ckpt_harness.sim.bridge_model import build_hf_base

    work = tmp_path_factory.mktemp("bridge")
    hf = {family: str(build_hf_base(work / f"hf-{family}", CASES[f"{family}-tp1"])) for family in FAMILIES}
    resume = {
        "config": CASES[RESUME_CASE].to_dict(),
        "hf": hf["qwen2"],
        "ckpt": str(work / "resume" / "ckpt"),
        "exports": str(work / "resume" / "exports"),
    }
    crashed = run_workers(
        2, "test_bridge_real:crash_mid_export", resume | {"timeout_s": 15}, sys_path=[TESTS], timeout_s=600
    )
    # what the kill left in the export root, before the resumed run's export reclaims it
    left = sorted(p.name for p in (work / "resume" / "exports").iterdir() if p.name.startswith(".staging-"))
    killed_root = work / "killed-inside" / "exports"
    killed = run_workers(
        2,
        "test_bridge_real:kill_inside_export",
        {"config": CASES[RESUME_CASE].to_dict(), "hf": hf["qwen2"], "root": str(killed_root), "timeout_s": 15}
        | {"kill_rank": 1},
        sys_path=[TESTS],
        timeout_s=600,
    )
    cases = [{"name": name, "config": config.to_dict()} for name, config in CASES.items()]
    payload = {"hf": hf, "scratch": str(work), "cases": cases, "steps": STEPS, "resume": resume | {"steps": 4}}
    payload["sabotage_case"] = RESUME_CASE
    results = check_all(run_workers(2, "test_bridge_real:export_story", payload, sys_path=[TESTS], timeout_s=1500))
    story = {"work": work, "hf": hf, "crashed": crashed, "results": results, "staging_after_kill": left}
    return story | {"killed_inside": killed, "killed_root": killed_root}


def tensors(adapter_dir) -> dict[str, torch.Tensor]:
    return load_tensors(Path(adapter_dir) / WEIGHTS_NAME)[0]


def same_tensors(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_in_the_workers_bridge_is_real_and_no_fake_transformer_engine_is_left(story):
    for result in story["results"]:
        shims = result["shims"]
        assert shims["version"].startswith(bridge_shims.BRIDGE_VERSION) and not shims["is_double"]
        assert shims["te_in_sys_modules"] is False and shims["import_te"].startswith("ModuleNotFoundError")
        assert shims["lora_layers_te"].startswith("FAKE transformer_engine.pytorch")  # what lora_layers saw
        assert shims["have_te"] == {"megatron.bridge.peft.module_matcher": False, "megatron.bridge.peft.utils": False}
        assert shims["mcore_have_te"] == {"megatron.core.models.gpt.gpt_layer_specs": False}
        # the plugin binds the real 0.6.2 export signature: its optional keywords are offered
        assert shims["export_kwargs"] == {"cpu": True, "show_progress": False}
        assert "exclude_adapter_base_prefixes" in shims["export_params"]
        assert "expand_shared_outer" not in shims["export_params"]  # not in 0.6.2 (Bridge main adds it)
        assert shims["slot_export_error"].startswith("ModuleNotFoundError")  # no multi_lora_layers in 0.6.2
        # what a multi-LoRA run exporting slots is refused with at startup (integration.peft.prepare)
        assert "which this Bridge lacks (megatron-bridge 0.6.2: ModuleNotFoundError" in shims["slot_problem"]
        assert "install a Megatron-Bridge that has megatron.bridge.peft.multi_lora_layers" in shims["slot_problem"]


def test_at_startup_the_real_bridge_is_built_and_a_slot_export_without_multi_lora_layers_is_refused(story):
    for result in story["results"]:
        startup = result["startup"]
        assert startup["single_bridge"] == "megatron.bridge.models.conversion.auto_bridge.AutoBridge"
        assert startup["single_kwargs"] == {"cpu": True, "show_progress": False}
        refused = startup["multi_refused"]
        assert refused is not None and "cannot export PEFT adapters for export.peft = true" in refused
        assert "which this Bridge lacks (megatron-bridge 0.6.2: ModuleNotFoundError" in refused
        assert "install a Megatron-Bridge that has megatron.bridge.peft.multi_lora_layers" in refused
        assert refused.endswith("set export.peft = false (or MILES_LORA_CKPT_PEFT_EXPORT=0).")


def test_every_export_loads_in_peft_with_nothing_missing_and_matches_megatron_logits(story):
    from peft_reference import peft_logits

    from miles_lora_ckpt.tools.peft_tools import load_report

    results = story["results"]
    assert sorted(results[0]["cases"]) == sorted(CASES)
    for name, config in CASES.items():
        result = results[0]["cases"][name]
        assert all(r["cases"][name]["export"] == result["export"] for r in results)  # one export, every rank
        # Bridge's LoRA wraps the four linears of each local layer (linear_in and linear_out each)
        assert len(result["adapter_params"]) == (config.num_layers // config.pp) * 4 * 2, name
        hf = story["hf"][config.family]
        megatron = load_tensors(story["work"] / name / "megatron-logits.safetensors")[0]["logits"]
        base = load_report(result["export"], hf)  # for the base logits: the adapter must matter
        for where in (result["export"], Path(result["ckpt"]) / "peft"):
            report = load_report(where, hf)
            assert report.ok, (name, where, report.headline())
            assert report.loaded_tensors == ADAPTED and report.missing == report.unexpected == [], (name, where)
            got = peft_logits(report.model, INPUT_IDS).float()
            error = float((got - megatron).abs().max() / megatron.abs().max())
            assert error < FP32_BOUND, (name, where, error)
        with base.model.disable_adapter(), torch.no_grad():
            plain = base.model.float()(INPUT_IDS).logits
        assert float((plain - megatron).abs().max() / megatron.abs().max()) > 1e-3, name  # LoRA changed the logits
        assert same_tensors(tensors(result["export"]), tensors(Path(result["ckpt"]) / "peft"))
        manifest = json.loads((Path(result["export"]) / "manifest.json").read_text())
        assert manifest["metadata"]["peft"]["bridge_helpers"] == [
            "convert",
            "target_modules",
            "rank_pattern",
            "build_config",
        ]


def test_the_plugin_export_equals_bridges_own_save_hf_adapter_byte_for_byte(story):
    from miles_lora_ckpt.core.json_files import json_bytes

    for name in CASES:
        result = story["results"][0]["cases"][name]
        ours, theirs = Path(result["export"]), Path(result["bridge_own"])
        assert same_tensors(tensors(ours), tensors(theirs)), name
        # adapter_config.json: the very bytes Bridge's save_hf_adapter writes, in the export root and
        # in a checkpoint generation's peft/
        theirs_bytes = (theirs / CONFIG_NAME).read_bytes()
        assert (ours / CONFIG_NAME).read_bytes() == theirs_bytes, name
        assert (Path(result["ckpt"]) / "peft" / CONFIG_NAME).read_bytes() == theirs_bytes, name
        # negative control: the plugin's own JSON form (sorted keys, indent 1), what it wrote before,
        # holds the same content in other bytes, and the comparison above tells them apart
        earlier = json_bytes(json.loads(theirs_bytes))
        assert json.loads(earlier) == json.loads(theirs_bytes) and earlier != theirs_bytes, name


_MODULE_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "fc1", "up_proj": "fc1"}


def module_groups(names: list[str]) -> dict[tuple[str, str], list[str]]:
    """Names grouped by the Megatron module they come from (fused q/k/v and gate/up together), in
    the order they were yielded."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:
        path, _, _ = name.rpartition(".lora_")
        layer, _, module = path.rpartition(".")
        groups.setdefault((layer.rsplit(".", 1)[0], _MODULE_OF.get(module, module)), []).append(name)
    return groups


def compare_exports(real: tuple[list[str], dict], double: tuple[list[str], dict]) -> list[str]:
    """Differences between two exports of the same model: names (each once), values, and the order
    within each Megatron module. The order of the modules themselves is free (it differs, see the
    double's docstring)."""
    (real_names, real_values), (double_names, double_values) = real, double
    problems = []
    for label, names in (("real", real_names), ("double", double_names)):
        if len(set(names)) != len(names):
            problems.append(f"{label} yields a name twice")
    if set(real_names) != set(double_names):
        problems.append(f"names differ: {sorted(set(real_names) ^ set(double_names))[:4]}")
    for key in sorted(set(real_names) & set(double_names)):
        a, b = real_values[key], double_values[key]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            problems.append(f"value differs: {key}")
    real_groups, double_groups = module_groups(real_names), module_groups(double_names)
    for group in sorted(set(real_groups) & set(double_groups)):
        if real_groups[group] != double_groups[group]:
            problems.append(f"order differs within {group}: {double_groups[group][:2]}...")
    return problems


def _export_of(work: Path, name: str, which: str, names: list[str]) -> tuple[list[str], dict]:
    return names, load_tensors(work / name / f"{which}-export.safetensors")[0]


def test_the_double_exports_what_the_real_bridge_exports_on_the_same_models(story):
    work, results = story["work"], story["results"][0]["cases"]
    for name in CASES:
        real = _export_of(work, name, "real", results[name]["real_names"])
        double = _export_of(work, name, "double", results[name]["double_names"])
        assert len(real[0]) == ADAPTED and compare_exports(real, double) == [], name
        assert real[0] != double[0]  # the module order differs (named in the double's docstring)


def test_a_double_with_altered_names_or_order_fails_the_comparison(story):
    """Negative controls, the double itself altered in the worker: k/v names swapped, and each
    module's tensors yielded in reversed order; and its names renamed."""
    work, result = story["work"], story["results"][0]["sabotaged"]
    real = _export_of(work, RESUME_CASE, "real", story["results"][0]["cases"][RESUME_CASE]["real_names"])
    swapped = _export_of(work, RESUME_CASE, "double-swapped-kv", result["swapped_kv"])
    problems = compare_exports(real, swapped)
    assert problems and all(p.startswith("value differs: ") for p in problems), problems
    assert "value differs: model.layers.0.self_attn.k_proj.lora_B.weight" in problems
    reordered = _export_of(work, RESUME_CASE, "double-reversed", result["reversed"])
    problems = compare_exports(real, reordered)
    assert problems and all(p.startswith("order differs within ") for p in problems), problems
    assert len(problems) == 8  # every module of both layers
    renamed = (
        [n.replace("mlp.down_proj", "mlp.down_projection") for n in real[0]],
        {k.replace("mlp.down_proj", "mlp.down_projection"): v for k, v in real[1].items()},
    )
    assert any(p.startswith("names differ") for p in compare_exports(real, renamed))


def test_a_kill_mid_export_leaves_generations_and_exports_intact_and_the_resume_is_bit_exact(story):
    from miles_lora_ckpt.tools.peft_tools import load_report

    crashed = story["crashed"]
    assert crashed[0].exitcode == -9, crashed[0]  # rank 0 died mid-write of the second export
    survivor = crashed[1].result
    assert survivor is not None and survivor["error"] and "a peer died or timed out" in survivor["error"]
    work = story["work"] / "resume"
    first = Path(survivor["first"])
    assert len(story["staging_after_kill"]) == 1  # the killed attempt's staging, never published ...
    stale = [p for p in (work / "exports").iterdir() if p.name.startswith(".staging-")]
    assert stale == []  # ... and reclaimed by the resumed run's export (it holds the writer lease)
    resumed = story["results"][0]["resume"]
    assert resumed["iteration"] == 2
    assert resumed["resumed_losses"] == resumed["reference_losses"][2:]
    for result in story["results"]:  # every rank: every tensor, counter and scheduler field
        assert result["resume"]["resumed"] == result["resume"]["reference"]
    retry = Path(resumed["retry"])
    assert os.readlink(work / "exports" / LATEST) == retry.name and retry.name.startswith("gen-000000004-")
    assert first.exists() and not same_tensors(tensors(first), tensors(retry))
    assert cli(["verify", str(work / "exports"), "--all"]) == 0
    assert cli(["verify", str(work / "ckpt"), "--all"]) == 0
    for adapter in (first, retry, work / "ckpt"):
        report = load_report(adapter if adapter != work / "ckpt" else _peft_dir(work / "ckpt"), story["hf"]["qwen2"])
        assert report.ok and report.loaded_tensors == ADAPTED, (adapter, report.headline())


def _peft_dir(root: Path) -> Path:
    from miles_lora_ckpt.tools.peft_tools import resolve_adapter_dir

    return resolve_adapter_dir(root)


def test_the_demo_exports_through_the_real_bridge_and_resumes_bit_exact(tmp_path, capsys):
    """`make demo-bridge ARGS=--export-peft`: the demo's run is built and exported by the real Bridge."""
    args = ["demo", "--workdir", str(tmp_path), "--export-peft", "--steps", "5"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[-1] == "PEFT: loadable (0 missing, 0 unexpected)"
    assert "RESULT: bit-exact" in lines and "(iteration 2)" in out
    assert (
        "a tiny Qwen2 built by the real Megatron-Bridge" in out and "PEFT exports via the real Megatron-Bridge" in out
    )
    generations = sorted((tmp_path / "ckpt").glob("gen-*"))
    assert generations and all((g / "peft" / "adapter_config.json").is_file() for g in generations)


# --------------------------------------------------------------------------- on the real Bridge: the
# fault matrix, partial and inconsistent exports, verify-peft and the offline export (ported from
# tests/test_peft_export.py, which runs them on the Bridge double in tier 1)

PHASE_SEEN_AS = {  # the phase every rank's CheckpointError names, for a fault armed at each phase of the export
    "peft-setup": "peft-setup",
    "after-prepare": "prepare",
    "peft-export": "peft-export",
    "before-write": "write",
    "mid-write": "write",
    "after-write": "write",
    "after-consensus": "commit",
    "mid-manifest": "commit",
    "before-publish": "commit",
    "after-publish": "publish",
}


def test_a_fault_at_each_phase_on_each_rank_of_a_real_bridge_export_fails_every_rank_alike(story):
    """A raise at every export phase on every rank, with the real Bridge's collective export (TP=2:
    its gathers; a raise at `peft-export` comes inside them): every rank fails with the same error
    naming the phase and the failing rank, no rank hangs, the previous export stays intact, no
    staging is published; after `after-publish` the complete export is the new `latest`."""
    from miles_lora_ckpt.core.layout import TRACKER
    from miles_lora_ckpt.savers.peft_export import FAULT_PHASES

    matrices = [r["failures"]["matrix"] for r in story["results"]]
    assert sorted(PHASE_SEEN_AS) == sorted(FAULT_PHASES) and len(matrices[0]) == len(FAULT_PHASES) * 2
    for index, case in enumerate(matrices[0]):
        phase, failing = case["phase_armed"], case["failing"]
        for matrix in matrices:
            mine = matrix[index]
            assert mine["error"] == case["error"] and mine["error"] is not None, (phase, failing)
            assert f"injected fault at phase '{phase}' on rank {failing}" in mine["error"]
            assert mine["phase"] == PHASE_SEEN_AS[phase] and mine["ranks"] == [failing], (phase, failing, mine)
            assert mine["removed"] == [], (phase, failing)  # the previous export stays intact
            if phase == "after-publish":
                assert len(mine["added"]) == 1 and mine["added"][0].startswith("gen-000000099-"), mine
                assert mine["latest_moved"] and mine["touched"] == [LATEST, TRACKER], mine
            else:  # nothing new, no staging left behind, tracker and latest untouched
                assert mine["added"] == mine["touched"] == [] and not mine["latest_moved"], (phase, failing, mine)
            assert mine["seconds"] < 60
    for result in story["results"]:
        in_generation = result["failures"]["in_generation"]
        assert in_generation["phase"] == "peft-export" and in_generation["ranks"] == [1]
        assert in_generation["unchanged"]  # the checkpoint save failed as a whole; its staging was removed
    work = story["work"] / RESUME_CASE
    assert cli(["verify", str(work / "exports"), "--all"]) == 0
    assert cli(["verify", str(work / "ckpt"), "--all"]) == 0


def test_a_partial_or_inconsistent_real_bridge_export_is_refused_on_every_rank(story):
    per_rank = [r["failures"] for r in story["results"]]
    for failures in per_rank:
        partial = failures["partial"]
        assert partial["phase"] == "peft-check" and partial["ranks"] == [0, 1], partial
        assert "partial adapter export" in partial["error"]
        assert "layer 1 lacks ['model.layers.*.mlp.down_proj']" in partial["error"]
        inconsistent = failures["inconsistent"]
        assert inconsistent["phase"] == "peft-export (ranks disagree)" and inconsistent["ranks"] == [1]
        assert f"rank 1: exported {ADAPTED - 1} tensors" in inconsistent["error"]
        assert f"rank 0 exported {ADAPTED}" in inconsistent["error"]
        assert failures["refused_unchanged"]
    assert per_rank[0]["partial"]["error"] == per_rank[1]["partial"]["error"]


def _megatron_logits_error(adapter_dir: Path, hf: str, megatron: torch.Tensor) -> float:
    from peft_reference import peft_logits

    from miles_lora_ckpt.tools.peft_tools import load_report

    report = load_report(adapter_dir, hf)
    assert report.ok, report.headline()
    got = peft_logits(report.model, INPUT_IDS).float()
    return float((got - megatron).abs().max() / megatron.abs().max())


def test_a_wrong_split_of_the_real_export_would_be_caught_by_the_logits_bound(story, tmp_path):
    """Negative controls for the logits check: the real export with k/v swapped, and with fc1 split
    without minding the TP=2 shards, fail the bound the real exports pass."""
    from safetensors.torch import save_file

    result = story["results"][0]["cases"][RESUME_CASE]
    export_dir, hf = Path(result["export"]), story["hf"]["qwen2"]
    megatron = load_tensors(story["work"] / RESUME_CASE / "megatron-logits.safetensors")[0]["logits"]
    assert _megatron_logits_error(export_dir, hf, megatron) < FP32_BOUND
    state = tensors(export_dir)
    key = "base_model.model.model.layers.{}.{}.lora_B.weight"
    swapped = dict(state)
    swapped[key.format(0, "self_attn.k_proj")] = state[key.format(0, "self_attn.v_proj")]
    swapped[key.format(0, "self_attn.v_proj")] = state[key.format(0, "self_attn.k_proj")]
    naive = dict(state)
    for layer in range(CASES[RESUME_CASE].num_layers):  # the gathered fc1 as Megatron holds it: [g0; u0; g1; u1]
        gate, up = state[key.format(layer, "mlp.gate_proj")], state[key.format(layer, "mlp.up_proj")]
        shards = [torch.cat([g, u]) for g, u in zip(gate.chunk(2), up.chunk(2), strict=True)]
        naive[key.format(layer, "mlp.gate_proj")], naive[key.format(layer, "mlp.up_proj")] = torch.cat(shards).chunk(2)
    for label, damaged in (("swapped", swapped), ("naive-fc1", naive)):
        target = tmp_path / label
        target.mkdir()
        (target / CONFIG_NAME).write_bytes((export_dir / CONFIG_NAME).read_bytes())
        save_file(
            {k: v.contiguous() for k, v in damaged.items()}, str(target / WEIGHTS_NAME), metadata={"format": "pt"}
        )
        assert _megatron_logits_error(target, hf, megatron) > 1e-4, label


def test_verify_peft_and_the_offline_export_on_real_bridge_generations(story, tmp_path, capsys):
    """`verify-peft` reports the real exports loadable; `export-peft` of a generation saved without
    peft/ (the Megatron shards of Bridge's own LoRA, converted offline) equals the live real-Bridge
    export, and republishing a generation's peft/ keeps Bridge's config bytes."""
    hf, work = story["hf"]["qwen2"], story["work"] / RESUME_CASE
    live_dir = Path(story["results"][0]["cases"][RESUME_CASE]["export"])
    capsys.readouterr()
    for adapter in (work / "exports", work / "exports" / LATEST, work / "ckpt"):
        assert cli(["verify-peft", str(adapter), "--base", hf]) == 0, adapter
        assert capsys.readouterr().out.strip().endswith("PEFT: loadable (0 missing, 0 unexpected)")
    plain = Path(story["results"][0]["failures"]["plain"])
    offline = tmp_path / "offline"
    assert cli(["export-peft", str(plain), "--out", str(offline), "--base", hf]) == 0
    assert same_tensors(tensors(offline / LATEST), tensors(live_dir))
    assert (offline / LATEST / CONFIG_NAME).read_bytes() == (live_dir / CONFIG_NAME).read_bytes()
    again = tmp_path / "republished"
    assert cli(["export-peft", str(work / "ckpt"), "--out", str(again)]) == 0
    assert same_tensors(tensors(again / LATEST), tensors(live_dir))
    assert (again / LATEST / CONFIG_NAME).read_bytes() == (live_dir / CONFIG_NAME).read_bytes()


def test_a_rank_killed_inside_the_real_bridges_collective_export_fails_its_peer_without_a_hang(story):
    """Rank 1 SIGKILLed at the first weight the real Bridge yields (rank 0 is in Bridge's TP gathers):
    rank 0 fails with a CheckpointError within the timeout, and nothing new is published."""
    killed = story["killed_inside"]
    assert killed[1].exitcode == -9, killed[1]
    survivor = killed[0].result
    assert survivor is not None and survivor["error"], killed[0]
    assert survivor["phase"] == "peft-export" and survivor["seconds"] < 60, survivor
    root = story["killed_root"]
    first = Path(survivor["first"])
    assert os.readlink(root / LATEST) == first.name  # the committed export is still the newest
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("gen-")) == [first.name]
    assert cli(["verify", str(root), "--all"]) == 0


# --------------------------------------------------------------------------- the ranks' jobs (`test_bridge_real:<job>`)
# Every run is built by `sim.bridge_model` (the real AutoBridge, provider and LoRA; megatron's real
# DistributedOptimizer) and exported by the plugin through `BridgeSource(real AutoBridge)`.


class Args:
    """The Miles args the single-LoRA saver records."""

    def __init__(self, config: BridgeRunConfig):
        self.lora_rank = config.lora_rank
        self.lora_alpha = config.lora_alpha


def lora_spec(config: BridgeRunConfig, hf: str) -> LoraSpec:
    return LoraSpec(r=config.lora_rank, alpha=config.lora_alpha, base_model_name_or_path=hf)


def _close(run: bm.BridgeRun) -> None:
    run.model.clear()
    run.optimizer = run.scheduler = None
    teardown()


def _save_tensors_rank0(path: Path, tensors: dict, rank: int, metadata: dict | None = None) -> None:
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        safetensors_write.save_tensors(path, {k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def _exported(bridge, model) -> tuple[list[str], dict]:
    """Every rank iterates the (collective) export fully: names in order, and the tensors."""
    names, tensors = [], {}
    for item in bridge.export_adapter_weights(model, cpu=True, show_progress=False):
        names.append(item[0])
        tensors[item[0]] = item[1].detach().clone()
    return names, tensors


def export_story(payload: dict, ctx) -> dict:
    """Per case (family x layout): build, train, logits, export by the plugin (standalone and inside
    a checkpoint generation), Bridge's own `save_hf_adapter`, and the double's export next to the
    real one on the same model."""
    from miles_lora_ckpt_harness.bridge_double.export import AutoBridgeDouble

    consensus = Consensus.for_world(timeout_s=120)
    scratch = Path(payload["scratch"])
    bm.setup()
    out: dict = {"shims": shim_facts(), "startup": startup_with_the_real_bridge(payload["hf"]["qwen2"]), "cases": {}}
    ids = INPUT_IDS.clone()
    for case in payload["cases"]:
        config = BridgeRunConfig.from_dict(case["config"])
        hf = payload["hf"][config.family]
        where = scratch / case["name"]
        run = bm.build_bridge_run(config, hf)
        losses = [bm.bridge_train_step(run, step) for step in range(payload["steps"])]
        _save_tensors_rank0(where / "megatron-logits.safetensors", {"logits": bm.megatron_logits(run, ids)}, ctx.rank)
        spec = lora_spec(config, hf)
        export_dir = export_peft(
            run.model,
            where / "exports",
            source=BridgeSource(run.bridge),
            lora=spec,
            iteration=payload["steps"],
            consensus=consensus,
        )
        generation = save_lora_checkpoint(
            run.model,
            Args(config),
            where / "ckpt",
            optimizer=run.optimizer,
            opt_param_scheduler=run.scheduler,
            iteration=payload["steps"],
            consensus=consensus,
            peft=PeftExport(source=BridgeSource(run.bridge), lora=spec),
        )
        run.bridge.save_hf_adapter(
            run.model, where / "bridge-own", run.lora, base_model_name_or_path=hf, show_progress=False
        )
        real_names, real = _exported(run.bridge, run.model)
        double = AutoBridgeDouble(json.loads((Path(hf) / "config.json").read_text()))
        double_names, doubled = _exported(double, run.model)
        _save_tensors_rank0(where / "real-export.safetensors", real, ctx.rank)
        _save_tensors_rank0(where / "double-export.safetensors", doubled, ctx.rank)
        if case["name"] == payload["sabotage_case"]:
            out["sabotaged"] = _sabotaged_double_exports(double, run.model, where, ctx.rank)
            plain = _save(run, where / "plain", payload["steps"], consensus, None)
            out["failures"] = failure_scenarios(run, where, hf, consensus, ctx) | {"plain": str(plain)}
        out["cases"][case["name"]] = {
            "losses": losses,
            "export": str(export_dir),
            "ckpt": str(generation),
            "bridge_own": str(where / "bridge-own"),
            "real_names": real_names,
            "double_names": double_names,
            "adapter_params": sorted(n for n, _ in run.named_parameters() if ".adapter." in n),
        }
        _close(run)
    out["resume"] = resume_story(payload["resume"], consensus)
    return out


def shim_facts() -> dict:
    """What the Bridge shims left behind in this worker, and how the plugin binds the real export."""
    import importlib
    import inspect
    import sys

    import megatron.bridge
    from megatron.bridge import AutoBridge

    from miles_lora_ckpt.megatron import bridge_export as bx
    from miles_lora_ckpt_harness.sim import bridge_shims

    try:
        importlib.import_module("transformer_engine")
        import_te = "imported"
    except ImportError as exc:
        import_te = f"{type(exc).__name__}: {exc}"
    have_te = {m: sys.modules[m].HAVE_TE for m in ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher")}
    mcore = {m: sys.modules[m].HAVE_TE for m in ("megatron.core.models.gpt.gpt_layer_specs",)}
    export = AutoBridge.export_adapter_weights
    source = BridgeSource(AutoBridge.__new__(AutoBridge))
    source.prepare()
    return {
        "version": megatron.bridge.__version__,
        "is_double": getattr(megatron.bridge, "IS_TEST_DOUBLE", False),
        "te_in_sys_modules": bridge_shims.fake_te_present(),
        "import_te": import_te,
        "lora_layers_te": sys.modules[bridge_shims.LORA_LAYERS].te.__doc__,
        "have_te": dict(sorted(have_te.items())),
        "mcore_have_te": mcore,
        "export_params": list(inspect.signature(export).parameters),
        "export_kwargs": source._kwargs,
        "slot_export_error": bx.slot_export_error(),
        "slot_problem": bx.slot_export_problem(),
    }


def startup_with_the_real_bridge(hf: str) -> dict:
    """The init hook's `integration.peft.prepare` with the real 0.6.2 installed: a single-LoRA run
    with export.peft builds the real AutoBridge from --hf-checkpoint; a multi-LoRA (v2) run that
    exports slots is refused, naming the Bridge version and the remedy."""
    from argparse import Namespace
    from contextlib import contextmanager
    from types import ModuleType

    from miles_lora_ckpt.integration import peft
    from miles_lora_ckpt.integration.config import load_config
    from miles_lora_ckpt.integration.shapes import SHAPES_BY_NAME
    from miles_lora_ckpt.integration.startup import UnsupportedConfiguration

    @contextmanager
    def patch_megatron_model(model):  # what Miles' context manager is to the plugin
        yield

    miles = ModuleType("miles.utils.megatron_bridge_utils")
    miles.patch_megatron_model = patch_megatron_model

    def import_module(name: str):
        if name != miles.__name__:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return miles

    args = Namespace(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, hf_checkpoint=hf, save_hf=None)
    config, shape = load_config({"MILES_LORA_CKPT_PEFT_EXPORT": "1"}), SHAPES_BY_NAME["lora-package-2026-09"]
    single = peft.prepare(args, config, shape, lora=True, import_module=import_module)
    try:
        peft.prepare(args, config, shape, lora=True, multi_lora="v2", import_module=import_module)
        refused = None
    except UnsupportedConfiguration as exc:
        refused = str(exc)
    return {
        "single_bridge": f"{type(single.source.bridge).__module__}.{type(single.source.bridge).__name__}",
        "single_kwargs": single.source._kwargs,
        "multi_refused": refused,
    }


def _sabotaged_double_exports(double, model, where: Path, rank: int) -> dict:
    """Negative controls: the double with its k/v names swapped, then yielding each module's tensors
    in reversed order (lora_B before lora_A, v before k before q)."""
    from miles_lora_ckpt_harness.bridge_double import export as double_export

    split, to_hf = double_export._split_qkv, double_export._to_hf

    def swapped_kv(lora_b, mcfg):
        parts = split(lora_b, mcfg)
        return {"q_proj": parts["q_proj"], "k_proj": parts["v_proj"], "v_proj": parts["k_proj"]}

    def reversed_within_module(*args):
        return reversed(list(to_hf(*args)))

    out = {}
    for label, name, patch in (
        ("swapped_kv", "_split_qkv", swapped_kv),
        ("reversed", "_to_hf", reversed_within_module),
    ):
        setattr(double_export, name, patch)
        try:
            names, values = _exported(double, model)
        finally:
            double_export._split_qkv, double_export._to_hf = split, to_hf
        _save_tensors_rank0(where / f"double-{label.replace('_', '-')}-export.safetensors", values, rank)
        out[label] = names
    return out


def crash_mid_export(payload: dict, ctx) -> dict:
    """Train 2 steps, commit a checkpoint generation (with peft/) and an export; train a third step,
    then rank 0 SIGKILLs itself mid-write of the next export (after its first file)."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    config = BridgeRunConfig.from_dict(payload["config"])
    hf = payload["hf"]
    run = bm.build_bridge_run(config, hf)
    for step in range(2):
        bm.bridge_train_step(run, step)
    spec = lora_spec(config, hf)
    save_lora_checkpoint(
        run.model,
        Args(config),
        payload["ckpt"],
        optimizer=run.optimizer,
        opt_param_scheduler=run.scheduler,
        iteration=2,
        consensus=consensus,
        peft=PeftExport(source=BridgeSource(run.bridge), lora=spec),
    )
    first = export_peft(
        run.model, payload["exports"], source=BridgeSource(run.bridge), lora=spec, iteration=2, consensus=consensus
    )
    bm.bridge_train_step(run, 2)
    if ctx.rank == 0:
        faults.arm("mid-write", 0, "kill")
    try:
        export_peft(
            run.model, payload["exports"], source=BridgeSource(run.bridge), lora=spec, iteration=3, consensus=consensus
        )
    except CheckpointError as exc:
        return {"first": str(first), "error": str(exc)}
    return {"first": str(first), "error": None}


def resume_story(payload: dict, consensus) -> dict:
    """Resume from the committed generation (iteration 2) and train to `steps`, then an uninterrupted
    run to `steps`; digests of both (bit-exact comparison in the test). The resumed run then exports
    again into the export root the crash left behind."""
    config = BridgeRunConfig.from_dict(payload["config"])
    hf, steps = payload["hf"], payload["steps"]
    resumed = bm.build_bridge_run(config, hf)
    result = load_lora_checkpoint(
        resumed.model,
        payload["ckpt"],
        optimizer=resumed.optimizer,
        opt_param_scheduler=resumed.scheduler,
        consensus=consensus,
    )
    resumed_losses = [bm.bridge_train_step(resumed, step) for step in range(result.iteration, steps)]
    resumed_digests = snapshot_digests(snapshot(resumed))
    retry = export_peft(
        resumed.model,
        payload["exports"],
        source=BridgeSource(resumed.bridge),
        lora=lora_spec(config, hf),
        iteration=steps,
        consensus=consensus,
    )
    _close(resumed)
    reference = bm.build_bridge_run(config, hf)
    reference_losses = [bm.bridge_train_step(reference, step) for step in range(steps)]
    reference_digests = snapshot_digests(snapshot(reference))
    _close(reference)
    dist.barrier()
    return {
        "iteration": result.iteration,
        "resumed_losses": resumed_losses,
        "reference_losses": reference_losses,
        "resumed": resumed_digests,
        "reference": reference_digests,
        "retry": str(retry),
    }


# --------------------------------------------------------------------------- the fault matrix


def _save(run: bm.BridgeRun, root: Path, iteration: int, consensus, peft: PeftExport | None) -> str:
    return str(
        save_lora_checkpoint(
            run.model,
            Args(run.config),
            root,
            optimizer=run.optimizer,
            opt_param_scheduler=run.scheduler,
            iteration=iteration,
            consensus=consensus,
            peft=peft,
        )
    )


def _listing(root: Path) -> dict:
    """The root's entries and mtimes, without the writer lease (its holder renews it in the background)."""
    dist.barrier()  # the coordinator removes a failed attempt's staging after the last collective
    if not root.exists():
        return {}
    return {p.name: p.lstat().st_mtime_ns for p in sorted(root.iterdir()) if not p.name.startswith(LEASE)}


def _attempt(fn, *args) -> dict:
    started = time.monotonic()
    try:
        fn(*args)
        return {"error": None, "seconds": time.monotonic() - started}
    except CheckpointError as exc:
        return {"error": str(exc), "phase": exc.phase, "ranks": exc.failed_ranks, "seconds": time.monotonic() - started}


class DroppingBridge:
    """The real AutoBridge whose export loses `dropped` names on `ranks` (all when None): it still
    iterates the real, collective export fully, so the peers' gathers stay matched. A sabotage for
    the partial / inconsistent refusals, not a double: every yielded item is the real Bridge's."""

    def __init__(self, bridge, dropped: list[str], ranks: list[int] | None = None):
        self.bridge, self.dropped, self.ranks = bridge, set(dropped), ranks

    def export_adapter_weights(self, model, cpu=True, show_progress=True, exclude_adapter_base_prefixes=None):
        drop = self.ranks is None or dist.get_rank() in self.ranks
        kwargs = {"cpu": cpu, "show_progress": show_progress}
        if exclude_adapter_base_prefixes is not None:
            kwargs["exclude_adapter_base_prefixes"] = exclude_adapter_base_prefixes
        for item in self.bridge.export_adapter_weights(model, **kwargs):
            if not (drop and item[0] in self.dropped):
                yield item


def failure_scenarios(run: bm.BridgeRun, where: Path, hf: str, consensus, ctx) -> dict:
    """The export's fault matrix on the real Bridge: a raise at every phase (`FAULT_PHASES`) on every
    rank, into the root that already holds this case's export (a raise at `peft-export` happens inside
    the real Bridge's collective export, whose TP gathers the other rank is in); a failing export
    inside a checkpoint save; a partial export (a module lost on every rank) and an inconsistent one
    (lost on rank 1 only)."""
    spec = lora_spec(run.config, hf)

    def export(root, iteration, bridge=None):
        source = BridgeSource(bridge or run.bridge)
        return export_peft(run.model, root, source=source, lora=spec, iteration=iteration, consensus=consensus)

    root = where / "exports"
    matrix = []
    for phase in FAULT_PHASES:
        for failing in range(ctx.world_size):
            before, latest = _listing(root), os.readlink(root / "latest")
            if ctx.rank == failing:
                faults.arm(phase, failing, "raise")
            outcome = _attempt(export, root, 99)
            faults.disarm()
            after = _listing(root)
            outcome |= {
                "phase_armed": phase,
                "failing": failing,
                "latest_moved": os.readlink(root / "latest") != latest,
            }
            outcome |= {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after))}
            outcome |= {"touched": sorted(n for n in set(before) & set(after) if before[n] != after[n])}
            matrix.append(outcome)
    ckpt = where / "ckpt"
    before = _listing(ckpt)
    if ctx.rank == 1:
        faults.arm("peft-export", 1, "raise")
    in_generation = _attempt(_save, run, ckpt, 100, consensus, PeftExport(source=BridgeSource(run.bridge), lora=spec))
    faults.disarm()
    in_generation["unchanged"] = _listing(ckpt) == before
    dropped = ["model.layers.1.mlp.down_proj.lora_A.weight", "model.layers.1.mlp.down_proj.lora_B.weight"]
    before = _listing(root)
    partial = _attempt(export, root, 101, DroppingBridge(run.bridge, dropped))
    inconsistent = _attempt(export, root, 102, DroppingBridge(run.bridge, dropped[1:], ranks=[1]))
    refused_unchanged = _listing(root) == before
    return {
        "matrix": matrix,
        "in_generation": in_generation,
        "partial": partial,
        "inconsistent": inconsistent,
        "refused_unchanged": refused_unchanged,
    }


def kill_inside_export(payload: dict, ctx) -> dict:
    """A committed export; then rank `kill_rank` SIGKILLs itself inside the real Bridge's collective
    export (at its first yielded weight, while the peers are in its TP gathers): the survivor must
    fail with a clear error within the timeout, never hang, and publish nothing."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    config = BridgeRunConfig.from_dict(payload["config"])
    hf, root = payload["hf"], Path(payload["root"])
    run = bm.build_bridge_run(config, hf)
    bm.bridge_train_step(run, 0)
    spec = lora_spec(config, hf)
    first = export_peft(run.model, root, source=BridgeSource(run.bridge), lora=spec, iteration=1, consensus=consensus)
    bm.bridge_train_step(run, 1)
    if ctx.rank == payload["kill_rank"]:
        faults.arm("peft-export", ctx.rank, "kill")
    outcome = _attempt(
        lambda: export_peft(
            run.model, root, source=BridgeSource(run.bridge), lora=spec, iteration=2, consensus=consensus
        )
    )
    return outcome | {"first": str(first)}
