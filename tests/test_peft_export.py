"""PEFT export end to end on the harness's Qwen2-shaped megatron model (our own LoRA, not Bridge's),
trained through the real DistributedOptimizer (TP=2, and PP=2), exported through the Bridge double,
loaded by the real HF PEFT onto a real HF Qwen2 built from a config (no hub), checked against an fp64
reference computed from the raw Megatron-side adapter shards. Also: an adapterless model, the retry
hazard, `verify`, `verify-peft` and `export-peft`.

Why the double stays here (the real Megatron-Bridge 0.6.2 runs these export scenarios on its own
LoRA in tests/test_bridge_real.py, the Bridge tier, including the fault matrix, partial and
rank-inconsistent exports, `verify-peft` and `export-peft`):
- the model: 0.6.2 cannot export this harness model, whose LoRA is ours (`'Adapter' object has no
  attribute 'alpha'`), and the fp64 reference is computed from its raw shards;
- the fork's three-item tuples (`ForkAutoBridgeDouble`): no installable Bridge yields them;
- tier 1 runs without the Bridge tier: this keeps the export path (placement in a generation,
  the crashed-and-retried export at another topology, the CLI's negative cases) proven there.

Two megatron jobs run once for the module (a crashed export, then the story); PEFT and transformers
are imported once, in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from jobs_paths import TESTS
from peft_reference import base_logits, hf_deltas, peft_deltas, peft_logits, reference_logits

from miles_lora_ckpt.core import faults, safetensors_write
from miles_lora_ckpt.core.checked_reads import load_tensors
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE
from miles_lora_ckpt.savers.peft_export import (
    CONFIG_NAME,
    LATEST,
    WEIGHTS_NAME,
    BridgeSource,
    LoraSpec,
    PeftExport,
    export_peft,
)
from miles_lora_ckpt.savers.single_lora import save_lora_checkpoint
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness import bridge_double
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers
from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig
from miles_lora_ckpt_harness.sim.train import build_run, config_from_dict, teardown, train_step

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.peft]

STEPS = 2
CASES = {
    "tp2": Qwen2SimConfig(world_size=2, tp=2),
    "pp2": Qwen2SimConfig(world_size=2, pp=2),  # another topology: it also retries the crashed export
}
INPUT_IDS = torch.tensor([[3, 17, 42, 99, 5, 64, 1, 127], [8, 8, 120, 33, 71, 2, 0, 55]])
BOUND = 1e-9  # relative to the logits' scale (fp64; HF's RMSNorm rounds through fp32, both sides alike)


class Args:
    """The Miles args the single-LoRA saver records."""

    def __init__(self, config):
        self.lora_rank = config.lora_rank
        self.lora_alpha = config.lora_alpha


# ---- rank jobs: run in the workers as "test_peft_export:crash_mid_write" (the tests directory on their sys.path)
#
# Worker functions for the PEFT export tests: the Qwen2-shaped megatron model trained with the real
# DistributedOptimizer, exported through the Bridge double (installed as `megatron.bridge` in these
# workers only).


def lora(config, hf: str) -> LoraSpec:
    return LoraSpec(r=config.lora_rank, alpha=config.lora_alpha, base_model_name_or_path=hf)


def source(hf: str, variant: str = "nvidia", peft_helpers: bool = True) -> BridgeSource:
    # the double: 0.6.2 cannot export this harness model (our LoRA), nor yield the fork's 3-item tuples
    auto_bridge = bridge_double.install(variant=variant, peft_helpers=peft_helpers)
    return BridgeSource(auto_bridge.from_hf_pretrained(hf))


def export(run, root, hf, iteration, consensus, src=None) -> str:
    src = src or source(hf)
    return str(
        export_peft(run.model, root, source=src, lora=lora(run.config, hf), iteration=iteration, consensus=consensus)
    )


def listing(root: Path) -> dict:
    """The root's entries and mtimes, without the writer lease (its holder renews it in the background)."""
    import torch.distributed as dist

    dist.barrier()  # the coordinator removes a failed attempt's staging after the last collective
    if not root.exists():
        return {}
    return {p.name: p.lstat().st_mtime_ns for p in sorted(root.iterdir()) if not p.name.startswith(LEASE)}


def attempt(fn, *args, **kwargs) -> dict:
    started = time.monotonic()
    try:
        fn(*args, **kwargs)
        return {"error": None, "seconds": time.monotonic() - started}
    except CheckpointError as exc:
        return {"error": str(exc), "phase": exc.phase, "ranks": exc.failed_ranks, "seconds": time.monotonic() - started}


def dump_megatron_adapter(run, path: Path, rank: int) -> None:
    """This rank's raw adapter shards (the fp64 reference is computed from these, independently)."""
    from megatron.core import parallel_state as mpu

    tensors = {}
    for name, param in run.inner_model.named_parameters():
        if ".adapter." in name:
            tensors[name] = param.detach().clone()
    meta = {"tp": str(mpu.get_tensor_model_parallel_rank()), "pp": str(mpu.get_pipeline_model_parallel_rank())}
    path.mkdir(parents=True, exist_ok=True)
    safetensors_write.save_tensors(path / f"rank{rank}.safetensors", tensors, metadata=meta)


def crash_mid_write(payload: dict, ctx) -> dict:
    """A good export, then one where rank 0 SIGKILLs itself after writing the weights file (the
    protocol's mid-write: after a rank's first file)."""
    consensus = Consensus.for_world(timeout_s=payload["timeout_s"])
    run = build_run(config_from_dict(payload["config"]))
    train_step(run, 0)
    root, hf = Path(payload["root"]), payload["hf"]
    export(run, root, hf, 1, consensus)
    if ctx.rank == 0:
        faults.arm("mid-write", 0, "kill")
    train_step(run, 1)
    return attempt(export, run, root, hf, 2, consensus)


def export_story(payload: dict, ctx) -> dict:
    """Per case: train, dump the raw shards, export standalone (NVIDIA shape with Bridge's helpers, then
    the fork's shape with ours), save checkpoints with and without peft/; the TP=2 case then runs
    every failure scenario, the other retries the crashed export of `crash_mid_write`."""
    consensus = Consensus.for_world(timeout_s=60)
    hf, scratch = payload["hf"], Path(payload["scratch"])
    out: dict = {"cases": {}}
    for case in payload["cases"]:
        config = config_from_dict(case["config"])
        run = build_run(config)
        for step in range(payload["steps"]):
            train_step(run, step)
        where = scratch / case["name"]
        dump_megatron_adapter(run, where / "mshards", ctx.rank)
        result = {
            "export": export(run, where / "exports", hf, payload["steps"], consensus),
            "fork": export(run, where / "exports-fork", hf, payload["steps"], consensus, source(hf, "fork", False)),
        }
        peft = PeftExport(source=source(hf), lora=lora(config, hf))
        result["ckpt"] = save(run, where / "ckpt", payload["steps"], consensus, peft)
        result["plain"] = save(run, where / "plain", payload["steps"], consensus, None)
        if case.get("retry_root"):
            result["retry"] = export(run, case["retry_root"], hf, 3, consensus)
        if case.get("failures"):
            result["failures"] = failure_scenarios(run, config, where, hf, consensus, ctx)
        out["cases"][case["name"]] = result
        teardown(run)
    return out


def save(run, root, iteration, consensus, peft) -> str:
    return save_lora_checkpoint(
        run.model,
        Args(run.config),
        root,
        optimizer=run.optimizer,
        opt_param_scheduler=run.scheduler,
        iteration=iteration,
        consensus=consensus,
        peft=peft,
    )


def failure_scenarios(run, config, where: Path, hf: str, consensus, ctx) -> dict:
    """What stays on this harness model: a model without adapters is refused on every rank at
    `peft-plan`, from the model's parameters, before any Bridge call. (The fault matrix, the failing
    export inside a checkpoint save, partial and rank-inconsistent exports run on the real Bridge:
    tests/test_bridge_real.py.)"""
    empty_root = where / "empty-export"
    empty = attempt(export, _model_without_adapters(config), empty_root, hf, 1, consensus)
    empty["root_exists"] = empty_root.exists()
    return {"empty": empty}


class _Run:
    def __init__(self, model, config):
        self.model, self.config = model, config


def _model_without_adapters(config) -> _Run:
    from dataclasses import replace

    from miles_lora_ckpt_harness.sim.qwen2_model import SimQwen2Model

    bare = replace(config, adapters="none")
    return _Run([SimQwen2Model(bare.transformer_config(), bare)], bare)


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2

    work = tmp_path_factory.mktemp("peft")
    hf = build_tiny_qwen2(work / "hf-base", CASES["tp2"].hf_config_kwargs(), seed=7)
    retry_root = work / "retry-exports"
    crashed = run_workers(
        2,
        "test_peft_export:crash_mid_write",
        {"config": CASES["tp2"].to_dict(), "hf": str(hf), "root": str(retry_root), "timeout_s": 15},
        sys_path=[TESTS],
        timeout_s=300,
    )
    # what the killed attempt left, before the retry (its next save into the root) reclaims it
    stale = [p for p in retry_root.iterdir() if p.name.startswith(".staging-")]
    left = {p.name: sorted(os.listdir(p)) for p in stale}
    if len(stale) == 1 and (stale[0] / WEIGHTS_NAME).exists():
        shutil.copy(stale[0] / WEIGHTS_NAME, work / "crashed-attempt-weights.safetensors")
    cases = [
        {"name": "tp2", "config": CASES["tp2"].to_dict(), "failures": True},
        {"name": "pp2", "config": CASES["pp2"].to_dict(), "retry_root": str(retry_root)},
    ]
    payload = {"hf": str(hf), "scratch": str(work), "cases": cases, "steps": STEPS}
    results = check_all(run_workers(2, "test_peft_export:export_story", payload, sys_path=[TESTS], timeout_s=400))
    return {
        "work": work,
        "hf": hf,
        "crashed": crashed,
        "crashed_staging": left,
        "results": results,
        "retry_root": retry_root,
    }


def tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    return load_tensors(Path(adapter_dir) / WEIGHTS_NAME)[0]


def same_tensors(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def logits_error(adapter_dir: Path, hf: Path, reference: torch.Tensor) -> tuple[float, object]:
    from miles_lora_ckpt.tools.peft_tools import load_report

    report = load_report(adapter_dir, hf)
    assert report.ok, report.headline()
    got = peft_logits(report.model, INPUT_IDS)
    return float((got - reference).abs().max() / reference.abs().max()), report


def test_exports_load_in_peft_and_match_the_fp64_reference(story):
    hf = story["hf"]
    base = base_logits(hf, INPUT_IDS)
    for name, config in CASES.items():
        result = story["results"][0]["cases"][name]
        assert all(r["cases"][name]["export"] == result["export"] for r in story["results"])  # one export
        reference = reference_logits(hf, hf_deltas(story["work"] / name / "mshards", config), INPUT_IDS)
        assert float((base - reference).abs().max() / reference.abs().max()) > 1e-3  # the adapter matters
        placements = {
            "export root (NVIDIA shape, Bridge helpers)": Path(result["export"]),
            "export root (fork shape, our helpers)": Path(result["fork"]),
            "checkpoint generation peft/": Path(result["ckpt"]) / "peft",
        }
        deltas = hf_deltas(story["work"] / name / "mshards", config)
        for where, adapter_dir in placements.items():
            error, report = logits_error(adapter_dir, hf, reference)
            assert error < BOUND, (name, where, error)
            assert report.loaded_tensors == 28 and report.missing == report.unexpected == [], where
            # and module by module: the delta PEFT applies is the Megatron-side one (bf16 factors: exact in fp64)
            applied = peft_deltas(report.model)
            assert sorted(applied) == sorted(deltas), where
            assert all(torch.equal(applied[m], deltas[m]) for m in deltas), where


def test_a_wrong_split_would_be_caught_by_the_same_bound(story, tmp_path):
    """Negative controls: k/v swapped, and fc1 split without minding the TP=2 shards."""
    hf, config = story["hf"], CASES["tp2"]
    export_dir = Path(story["results"][0]["cases"]["tp2"]["export"])
    reference = reference_logits(hf, hf_deltas(story["work"] / "tp2" / "mshards", config), INPUT_IDS)
    state = tensors(export_dir)
    key = "base_model.model.model.layers.{}.{}.lora_B.weight"
    swapped = dict(state)
    swapped[key.format(0, "self_attn.k_proj")] = state[key.format(0, "self_attn.v_proj")]
    swapped[key.format(0, "self_attn.v_proj")] = state[key.format(0, "self_attn.k_proj")]
    naive = dict(state)
    for layer in range(config.num_layers):  # the gathered fc1 as Megatron holds it: [g0; u0; g1; u1]
        gate, up = state[key.format(layer, "mlp.gate_proj")], state[key.format(layer, "mlp.up_proj")]
        shards = [torch.cat([g, u]) for g, u in zip(gate.chunk(2), up.chunk(2), strict=True)]
        naive[key.format(layer, "mlp.gate_proj")], naive[key.format(layer, "mlp.up_proj")] = torch.cat(shards).chunk(2)
    from safetensors.torch import save_file

    for name, damaged in (("swapped", swapped), ("naive-fc1", naive)):
        target = tmp_path / name
        target.mkdir()
        shutil.copy(export_dir / CONFIG_NAME, target / CONFIG_NAME)
        save_file(
            {k: v.contiguous() for k, v in damaged.items()}, str(target / WEIGHTS_NAME), metadata={"format": "pt"}
        )
        error, _ = logits_error(target, hf, reference)
        assert error > 1e-4, (name, error)


def test_both_bridge_shapes_and_both_helper_paths_write_the_same_adapter(story):
    for name in CASES:
        result = story["results"][0]["cases"][name]
        nvidia, fork = Path(result["export"]), Path(result["fork"])
        assert same_tensors(tensors(nvidia), tensors(fork))
        assert (nvidia / CONFIG_NAME).read_bytes() == (fork / CONFIG_NAME).read_bytes()
        helpers = {
            path: json.loads((path / "manifest.json").read_text())["metadata"]["peft"]["bridge_helpers"]
            for path in (nvidia, fork)
        }
        assert helpers == {nvidia: ["convert", "target_modules", "rank_pattern", "build_config"], fork: []}
        assert same_tensors(tensors(nvidia), tensors(Path(result["ckpt"]) / "peft"))
        config = json.loads((nvidia / CONFIG_NAME).read_text())
        assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["rank_pattern"] == {}


def test_an_adapterless_model_is_refused_on_every_rank_before_anything_exists(story):
    for result in story["results"]:
        empty = result["cases"]["tp2"]["failures"]["empty"]
        assert empty["phase"] == "peft-plan" and empty["ranks"] == [0, 1] and "no adapter parameters" in empty["error"]
        assert empty["root_exists"] is False


def test_a_retry_at_another_topology_never_publishes_the_crashed_attempts_files(story):
    root = story["retry_root"]
    crashed = story["crashed"]
    assert crashed[0].exitcode == -9  # rank 0 died after writing the weights file into its staging
    survivor = crashed[1].result
    assert survivor["phase"] == "write" and "a peer died or timed out" in survivor["error"]
    assert survivor["seconds"] < 30  # bounded by the consensus timeout (15 s), usually at once
    (left,) = story["crashed_staging"].values()  # the killed attempt left its staging directory
    assert left == [WEIGHTS_NAME]  # the weights alone
    retried = Path(story["results"][0]["cases"]["pp2"]["retry"])
    assert os.readlink(root / LATEST) == retried.name and retried.name.startswith("gen-000000003-")
    assert sorted(os.listdir(retried)) == sorted([CONFIG_NAME, WEIGHTS_NAME, "manifest.json"])
    published = tensors(retried)
    assert same_tensors(published, tensors(Path(story["results"][0]["cases"]["pp2"]["export"])))
    crashed = load_tensors(story["work"] / "crashed-attempt-weights.safetensors")[0]
    assert not same_tensors(published, crashed)  # the stale attempt held other values
    # the retry, the next save into the root, reclaimed the crashed attempt's staging directory
    assert not [p for p in root.iterdir() if p.name.startswith((".staging-", ".deleting-"))]
    assert cli(["verify", str(root), "--all"]) == 0


def test_verify_peft_reports_loadable_adapters_and_names_what_peft_would_get_wrong(story, tmp_path, capsys):
    hf, work = str(story["hf"]), story["work"] / "tp2"
    capsys.readouterr()
    for adapter in (work / "exports", work / "exports" / LATEST, work / "ckpt"):
        assert cli(["verify-peft", str(adapter), "--base", hf]) == 0, adapter
        assert capsys.readouterr().out.strip().endswith("PEFT: loadable (0 missing, 0 unexpected)")
    # keys renamed: PEFT would drop them silently and keep B = 0 where they belonged
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(work / "exports" / LATEST / CONFIG_NAME, renamed / CONFIG_NAME)
    state = {
        k.replace("layers.1.mlp.up_proj", "layers.1.mlp.upp_proj"): v
        for k, v in tensors(work / "exports" / LATEST).items()
    }
    from safetensors.torch import save_file

    save_file(state, str(renamed / WEIGHTS_NAME), metadata={"format": "pt"})
    assert cli(["verify-peft", str(renamed), "--base", hf]) == 1
    out = capsys.readouterr().out
    assert "PEFT: NOT loadable (2 missing, 2 unexpected)" in out
    assert "missing: base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight" in out
    assert "unexpected: base_model.model.model.layers.1.mlp.upp_proj.lora_B.default.weight" in out
    # a rank that disagrees with the config: PEFT builds r=4 modules, the file holds r=3
    short = tmp_path / "short"
    short.mkdir()
    shutil.copy(work / "exports" / LATEST / CONFIG_NAME, short / CONFIG_NAME)
    state = tensors(work / "exports" / LATEST)
    state["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"] = torch.zeros(3, 64, dtype=torch.bfloat16)
    save_file(state, str(short / WEIGHTS_NAME), metadata={"format": "pt"})
    assert cli(["verify-peft", str(short), "--base", hf]) == 1
    out = capsys.readouterr().out
    assert "PEFT: NOT loadable (0 missing, 0 unexpected, 1 mismatched)" in out
    assert "PEFT gives this module rank 4" in out  # our header check says it before PEFT does
    assert cli(["verify-peft", str(tmp_path / "nothing"), "--base", hf]) == 2


def test_export_peft_offline_equals_the_live_bridge_export(story, tmp_path, capsys):
    hf = str(story["hf"])
    for name in CASES:
        work = story["work"] / name
        live = tensors(work / "exports" / LATEST)
        # a generation without peft/: its Megatron shards are converted offline (needs the base's config)
        out = tmp_path / f"{name}-offline"
        assert cli(["export-peft", str(work / "plain"), "--out", str(out), "--base", hf]) == 0
        assert same_tensors(tensors(out / LATEST), live), name
        assert cli(["verify-peft", str(out), "--base", hf]) == 0
        # a generation with peft/: republished as it is
        again = tmp_path / f"{name}-republished"
        assert cli(["export-peft", str(work / "ckpt"), "--out", str(again)]) == 0
        assert same_tensors(tensors(again / LATEST), live)
        assert (again / LATEST / CONFIG_NAME).read_bytes() == (work / "exports" / LATEST / CONFIG_NAME).read_bytes()
    capsys.readouterr()
    assert cli(["export-peft", str(story["work"] / "tp2" / "plain"), "--out", str(tmp_path / "x")]) == 1
    assert "pass --base HF_MODEL_DIR" in capsys.readouterr().err
