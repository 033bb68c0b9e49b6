"""The REAL Megatron-Bridge 0.6.2 end to end (the Bridge tier: `make tier-bridge`, part of `make test`).

Tiny Qwen2 and Llama HF bases (built from a config, no hub) go through `AutoBridge.from_hf_pretrained`
and `to_megatron_provider`; Bridge's own `LoRA` on linear_qkv, linear_proj, linear_fc1 and linear_fc2
is trained through megatron's real DistributedOptimizer at TP=1 (DP=2), TP=2 and PP=2 over gloo; the
plugin exports it with `export_peft(..., source=BridgeSource(real AutoBridge))`, standalone and
inside a checkpoint generation (`peft/`). Checked here: the real PEFT loads every export with 0
missing and 0 unexpected keys, and HF-with-PEFT logits equal megatron-with-LoRA logits within fp32
tolerance; the plugin's export equals Bridge's own `save_hf_adapter`; the Bridge double
(`sim/bridge_double`) exports the same names and values as the real Bridge on the same models
(with negative controls: a double with altered names or order fails the comparison); a SIGKILL
mid-export leaves the committed generation and exports intact, and the resume is bit-exact.

Two spawned W=2 jobs for the whole module (the crash, then everything else). Bridge is imported
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

from miles_lora_ckpt.core.storage import load_tensors
from miles_lora_ckpt.savers.peft_export import CONFIG_NAME, LATEST, WEIGHTS_NAME
from miles_lora_ckpt.sim import bridge_shims
from miles_lora_ckpt.sim.bridge_model import BridgeRunConfig
from miles_lora_ckpt.sim.launch import check_all, run_workers
from miles_lora_ckpt.tools.cli import main as cli

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
    from miles_lora_ckpt.sim.bridge_model import build_hf_base

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
    cases = [{"name": name, "config": config.to_dict()} for name, config in CASES.items()]
    payload = {"hf": hf, "scratch": str(work), "cases": cases, "steps": STEPS, "resume": resume | {"steps": 4}}
    payload["sabotage_case"] = RESUME_CASE
    results = check_all(run_workers(2, "bridge_jobs:export_story", payload, sys_path=[JOBS], timeout_s=1500))
    return {"work": work, "hf": hf, "crashed": crashed, "results": results, "staging_after_kill": left}


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


def test_the_plugin_export_equals_bridges_own_save_hf_adapter(story):
    for name in CASES:
        result = story["results"][0]["cases"][name]
        ours, theirs = Path(result["export"]), Path(result["bridge_own"])
        assert same_tensors(tensors(ours), tensors(theirs)), name
        # the same adapter_config.json content (ours is written with sorted keys, so the bytes differ)
        assert json.loads((ours / CONFIG_NAME).read_text()) == json.loads((theirs / CONFIG_NAME).read_text()), name


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
