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
everything else). Bridge is imported
only in the harness workers, where `sim.bridge_shims` is installed; this process never imports it.
Elsewhere (tiers 1 and 2) the module is skipped; in the Bridge tier a missing Bridge fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from jobs_paths import JOBS

from miles_lora_ckpt.core.checked_reads import load_tensors
from miles_lora_ckpt.savers.peft_export import CONFIG_NAME, LATEST, WEIGHTS_NAME
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.sim import bridge_shims
from miles_lora_ckpt_harness.sim.bridge_model import BridgeRunConfig
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

pytestmark = [pytest.mark.bridge, pytest.mark.multirank, pytest.mark.peft]
IN_BRIDGE_TIER = os.environ.get("MILES_LORA_CKPT_TIER") == "bridge"
if not bridge_shims.available() and not IN_BRIDGE_TIER:
    pytest.skip("megatron.bridge is not installed here (the Bridge tier: make tier-bridge)", allow_module_level=True)

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
    crashed = run_workers(2, "bridge_jobs:crash_mid_export", resume | {"timeout_s": 15}, sys_path=[JOBS], timeout_s=600)
    # what the kill left in the export root, before the resumed run's export reclaims it
    left = sorted(p.name for p in (work / "resume" / "exports").iterdir() if p.name.startswith(".staging-"))
    killed_root = work / "killed-inside" / "exports"
    killed = run_workers(
        2,
        "bridge_jobs:kill_inside_export",
        {"config": CASES[RESUME_CASE].to_dict(), "hf": hf["qwen2"], "root": str(killed_root), "timeout_s": 15}
        | {"kill_rank": 1},
        sys_path=[JOBS],
        timeout_s=600,
    )
    cases = [{"name": name, "config": config.to_dict()} for name, config in CASES.items()]
    payload = {"hf": hf, "scratch": str(work), "cases": cases, "steps": STEPS, "resume": resume | {"steps": 4}}
    payload["sabotage_case"] = RESUME_CASE
    results = check_all(run_workers(2, "bridge_jobs:export_story", payload, sys_path=[JOBS], timeout_s=1500))
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
