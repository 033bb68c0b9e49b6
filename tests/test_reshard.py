"""Resharding on resume (format v3): a generation saved at one TP / EP / ETP / PP / VPP / CP layout loads at another.

Two spawned jobs of `reshard_job` (in this module) run every case: one at W=2, one at W=4 for the layouts
that need four ranks (an expert TP other than TP together with EP; CP, ETP and EP changed
together). At the load, every global tensor
(adapter weights, fp32 masters, every moment, per-parameter steps, param groups) must be
bit-identical to the saved run's; training then goes on (the loss difference is printed). Changes
that cannot map (another LoRA rank, other target modules) are refused naming the parameter, before
anything changes.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path, PurePath

import pytest
import torch
import torch.distributed as dist
from jobs_paths import TESTS
from plan_reads import through_the_plan
from single_lora_steps import Args, _failing_install, load, run_steps, save

from miles_lora_ckpt.core import partial_reads
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.savers.single_lora import load as load_module
from miles_lora_ckpt_harness.sim.global_view import first_difference as _first_difference
from miles_lora_ckpt_harness.sim.global_view import global_view
from miles_lora_ckpt_harness.sim.launch import check_all, run_workers
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.optimizers import why_not_buildable
from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig
from miles_lora_ckpt_harness.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, config_from_dict, teardown

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]


def cfg(dtype: str = "bf16", adapters: str = "mixed", world_size: int = 2, **extra) -> dict:
    return SimConfig(world_size=world_size, dtype=dtype, adapters=adapters, **extra).to_dict()


def cfg4(dtype: str = "bf16", adapters: str = "mixed", **extra) -> dict:
    """A W=4 layout (the W=4 job), globally numbered experts unless told otherwise."""
    extra.setdefault("num_experts", 2)
    return cfg(dtype, adapters, world_size=4, **extra)


def qwen2(dtype: str = "bf16", **extra) -> dict:
    """The Qwen2-shaped model (Bridge-style LoRA `adapter.linear_in/out`): fused QKV with grouped
    query attention (4 heads, 2 query groups) and swiglu's fused `linear_fc1` ([gate; up], each TP
    rank holding its own halves), the same model at every TP size."""
    extra.setdefault("same_model_at_every_tp", True)
    return Qwen2SimConfig(world_size=2, dtype=dtype, **extra).to_dict()


CASES = {  # name: (saved layout, loaded layout)
    "pp2 vpp2 -> pp1 (bf16)": (cfg(pp=2, vpp=2, num_layers=4), cfg(num_layers=4)),
    "tp2 -> tp1 (fp32)": (cfg("fp32", tp=2), cfg("fp32")),
    "tp1 -> tp2 (bf16)": (cfg(), cfg(tp=2)),
    "cp2 -> cp1 (bf16)": (cfg(cp=2), cfg()),
    "cp1 -> cp2 (bf16)": (cfg(), cfg(cp=2)),
    # experts numbered globally (megatron's local_expert_indices): 2 experts, one per EP rank -> both on each rank
    "ep2 -> ep1 (bf16, mixed adapters)": (cfg(ep=2, num_experts=2), cfg(num_experts=2)),
    # expert-TP 2 -> 1 at TP 1 (megatron's expert_tensor_parallel_size): the expert linears and their
    # adapters split over the expert-TP group at the save, whole at the load
    "etp2 -> etp1 (bf16, mixed adapters)": (cfg(etp=2), cfg()),
    "etp2 -> etp1 (fp32, numbered experts)": (cfg("fp32", etp=2, num_experts=2), cfg("fp32", num_experts=2)),
    "etp1 -> etp2 (bf16, mixed adapters)": (cfg(), cfg(etp=2)),
    # expert-TP below TP (TP 2, ETP 1: each TP rank runs the whole experts on its part of the tokens),
    # with EP 2 across the TP ranks -> TP 1, ETP 1, EP 1 (both experts on each rank)
    "tp2 etp1 ep2 -> tp1 (bf16, numbered experts)": (cfg(tp=2, etp=1, ep=2, num_experts=2), cfg(num_experts=2)),
    # TP 2, ETP 1 -> TP 1, ETP 2: every axis of the expert split changes, and the dense one
    "tp2 etp1 -> tp1 etp2 (bf16, mixed adapters)": (cfg(tp=2, etp=1), cfg(etp=2)),
    # ETP 1 -> 2 at TP 2: the same DP size and data, so training goes on as the saved run's (fp32)
    "tp2 etp1 -> tp2 etp2 (fp32, mixed adapters)": (cfg("fp32", tp=2, etp=1), cfg("fp32", tp=2)),
    # expert-TP 2 over the context-parallel ranks (CP 2) -> ETP 1 at CP 2
    "cp2 etp2 -> cp2 etp1 (bf16, mixed adapters)": (cfg(cp=2, etp=2), cfg(cp=2)),
    # a CP change together with an ETP change: expert TP 2 over the CP ranks -> CP 1, ETP 1 (DP 1 -> 2),
    # and the reverse (fp32, numbered experts)
    "cp2 etp2 -> cp1 etp1 (bf16, mixed adapters)": (cfg(cp=2, etp=2), cfg()),
    "cp1 etp1 -> cp2 etp2 (fp32, numbered experts)": (
        cfg("fp32", num_experts=2),
        cfg("fp32", cp=2, etp=2, num_experts=2),
    ),
    # an ETP change with megatron's other children: Float16 (no distributed optimizer) and layer-wise
    "etp2 -> etp1 (bf16, Float16 children)": (cfg(etp=2, distributed=False), cfg(distributed=False)),
    "etp1 -> etp2 (bf16, layer-wise)": (cfg(layer_wise=True), cfg(etp=2, layer_wise=True)),
    # Float16OptimizerWithFloat16Params children (no distributed optimizer): whole parameters
    "tp2 -> tp1 (bf16, Float16 children)": (cfg(tp=2, distributed=False), cfg(distributed=False)),
    # a LayerWiseDistributedOptimizer: whole parameters, one DP owner each (DP 1 -> 2 here)
    "tp2 -> tp1 (bf16, layer-wise)": (cfg(tp=2, layer_wise=True), cfg(layer_wise=True)),
    # swiglu (megatron's swiglu ShardedTensorFactory: [gate_r; up_r] per TP rank) and GQA's fused QKV
    "qwen2 swiglu+gqa tp2 -> tp1 (bf16)": (qwen2(tp=2), qwen2()),
    "qwen2 swiglu+gqa tp1 -> tp2 (fp32)": (qwen2("fp32"), qwen2("fp32", tp=2)),
    # a v3 generation written before the gate/up axis: its gated fc1 outputs recorded whole ([G, r])
    "qwen2 swiglu tp1 -> tp2 (bf16, fc1 recorded whole)": (qwen2(), qwen2(tp=2)),
    # a generation whose adapter files have no block index (written before 2026-12-02): read whole
    "tp1 -> tp2 (bf16, adapter files without a block index)": (cfg(), cfg(tp=2)),
    # the saved layout through the global-layout plan (`THROUGH_PLAN`): DP 2 (slices), TP 2
    # (lora_A's replicas in both TP ranks' files), Float16 children (whole parameters), one expert
    # per EP rank (no global expert number: named by its EP rank)
    "dp2 -> dp2 (bf16, through the plan)": (cfg(), cfg()),
    "ep2 -> ep2 (bf16, unnumbered experts, through the plan)": (cfg(ep=2), cfg(ep=2)),
    "tp2 -> tp2 (fp32, through the plan)": (cfg("fp32", tp=2), cfg("fp32", tp=2)),
    "tp2 -> tp2 (bf16, Float16 children, through the plan)": (
        cfg(tp=2, distributed=False),
        cfg(tp=2, distributed=False),
    ),
}
# a load at the saved layout, planned from the global layout as every format-v3 load is: bit-exact,
# and reading exactly the files and ranges the reader of v1 and v2 generations reads there
THROUGH_PLAN = {name for name in CASES if name.endswith("through the plan)")}
# megatron 0.19's own layer-wise Muon (emerging-optimizers): the 0.19 tier only (0.16 cannot build it)
TIER2_CASES = {
    "etp2 -> etp1 (bf16, layer-wise Muon)": (
        cfg(etp=2, layer_wise=True, optimizer="muon"),
        cfg(layer_wise=True, optimizer="muon"),
    ),
}
NOT_BUILT = {name: why_not_buildable(SimConfig.from_dict(saved)) for name, (saved, _) in TIER2_CASES.items()}
CASES.update({name: case for name, case in TIER2_CASES.items() if NOT_BUILT[name] is None})
# W=4 (the second job): an expert TP other than TP together with EP, both ways, and CP + ETP + EP at once
CASES_W4 = {
    # TP 2 / ETP 1 / EP 2 (experts whole, one per EP rank, each TP rank on its part of the tokens;
    # DP 2, expert DP 2) -> TP 1 / ETP 2 / EP 1 (both experts split over an expert-TP group of two
    # DP replicas; DP 4)
    "w4 tp2 etp1 ep2 -> tp1 etp2 (bf16, numbered experts)": (cfg4(tp=2, etp=1, ep=2), cfg4(etp=2)),
    "w4 tp1 etp2 -> tp2 etp1 ep2 (bf16, numbered experts)": (cfg4(etp=2), cfg4(tp=2, etp=1, ep=2)),
    # TP 1 / ETP 2 / EP 2 (the expert mesh all model-parallel: expert DP 1) -> TP 2 / ETP 1 / EP 1
    "w4 tp1 etp2 ep2 -> tp2 etp1 (fp32, numbered experts)": (cfg4("fp32", etp=2, ep=2), cfg4("fp32", tp=2, etp=1)),
    # CP 2 / ETP 2 / EP 2 (expert TP over the CP ranks) -> CP 1 / ETP 1 / EP 1 (DP x CP 4 either way)
    "w4 cp2 etp2 ep2 -> cp1 etp1 (bf16, numbered experts)": (cfg4(cp=2, etp=2, ep=2), cfg4()),
}
ALL_CASES = {**CASES, **CASES_W4}
WHOLE_GATED = {"qwen2 swiglu tp1 -> tp2 (bf16, fc1 recorded whole)"}
UNINDEXED_ADAPTERS = {"tp1 -> tp2 (bf16, adapter files without a block index)"}
QWEN2 = {name for name in CASES if name.startswith("qwen2")}
SLOTS = {  # name: (saved layout, loaded layout): slot 1 of a 2-slot run (per-slot layer-wise children)
    "slot 1, tp2 -> tp1": (cfg(tp=2, slots=2), cfg(slots=2)),
}
REFUSALS = {  # name: (saved case, run config, words the error must hold[, "v2" | "damage" | "install"])
    "another LoRA rank": (
        "tp1 -> tp2 (bf16)",
        cfg(tp=2, lora_rank=8),
        ("has global shape [4, ", "] in the checkpoint, [8, ", "another LoRA rank"),
    ),
    # another number of query groups: linear_qkv's fused output has another size
    "another GQA grouping": (
        "qwen2 swiglu+gqa tp1 -> tp2 (fp32)",
        qwen2("fp32", tp=2, query_groups=4),
        ("self_attention.linear_qkv.adapter.linear_out", "in the checkpoint, [", "model shape"),
    ),
    # a non-gated fc1 of the same size (2 x ffn_hidden outputs): another model, named as such
    "swiglu vs a plain fc1": (
        "qwen2 swiglu+gqa tp1 -> tp2 (fp32)",
        qwen2("fp32", tp=2, swiglu=False, ffn_hidden=256),
        ("mlp.linear_fc1.adapter.linear_out", "[2, 128, 4] in the checkpoint, [256, 4] in this run", "swiglu"),
    ),
    "other target modules": (
        "tp1 -> tp2 (bf16)",
        cfg(tp=2, adapters="dense"),
        ("the checkpoint has trainable parameter layers.0.mlp.experts", "other target modules"),
    ),
    # a generation of the earlier format loads at its own layout only (test_single_lora), never resharded
    "format v2 generation": ("tp1 -> tp2 (bf16)", cfg(tp=2), ("(format v2) records no global layout",), "v2"),
    # a key megatron's optimizer does not have, put into every saved param group (resealed: only the
    # loader's check against the live groups can refuse it; issue 23 item 3 at another layout)
    "unknown param-group key": ("tp1 -> tp2 (bf16)", cfg(tp=2), ("momentum_decay", "does not have"), "groupkey"),
    # a flipped byte in a saved optimizer slice: caught by the digests (the rank that reads it, or
    # the round-robin check of unread blocks), the only generation of its root: the load fails
    "damaged optimizer slice": ("tp1 -> tp2 (bf16)", cfg(tp=2), ("digest",), "damage"),
    # the dense adapter file disagrees with its fp32 masters (one element changed, resealed: every
    # digest, stamp and binding agrees): the masters' cross-check refuses it at another TP too,
    # naming the parameter, the adapter file and the optimizer file (issue 23 item 2)
    "adapter not the cast of its masters": (
        "tp1 -> tp2 (bf16)",
        cfg(tp=2),
        (
            "lora_",
            "the adapter in adapter/dense_tp000_pp000.safetensors is not the bfloat16 cast of its fp32 master in "
            "optimizer/child",
            "(optimizer child ",
        ),
        "forged",
    ),
    # a forger's layout edits (resealed, no key; every file untouched): each generation is damaged
    # (the only one of its root: the load fails) and `verify` says so too (issue 33 items 2 and 5).
    # A parameter's optimizer position moved past its bucket: it once installed uninitialised memory
    "edited optimizer position": (
        "tp1 -> tp2 (bf16)",
        cfg(tp=2),
        ("optimizer child 0 at tp000_pp000_ep000_etp000: the position of chunk0.", ", which holds "),
        "layout:position",
    ),
    # the same, with the positions' structural rule switched off: the resharding plan's own check
    # that every element of every DistributedOptimizer shard is filled exactly once refuses it
    "edited optimizer position (the shard's fill check)": (
        "tp1 -> tp2 (bf16)",
        cfg(tp=2),
        ("optimizer child 0, buf0 bucket 0 of this rank's shard: ", "would be filled by nothing"),
        "layout:position:unchecked",
    ),
    # the two dense adapter files' writer coordinates swapped: once half-swapped adapters, weights only
    "swapped adapter coordinate (weights only)": (
        "tp2 -> tp1 (fp32)",
        cfg("fp32"),
        ("adapter/dense_tp000_pp000.safetensors", "the global layout says coordinate tp001_", "disagree"),
        "layout:adapter-coordinate",
    ),
    # every TP-split block's offsets swapped between the TP ranks' coordinates (the blocks still tile
    # their tensors): once a third of the tensors permuted; each file's layout stamp refuses it
    "swapped TP block offsets": (
        "tp2 -> tp1 (fp32)",
        cfg("fp32"),
        ("was written with other global layout entries than the manifest records for it",),
        "layout:tp-offsets",
    ),
    # everything installed at the new layout, then rank 1 fails: every rank rolls back
    "failure after the resharded install": (
        "pp2 vpp2 -> pp1 (bf16)",
        cfg(num_layers=4),
        ("injected failure after install on rank 1",),
        "install",
    ),
}


def _how(how: list) -> dict:
    kind = how[0] if how else None
    edit, _, unchecked = kind.split(":", 1)[1].partition(":") if kind and kind.startswith("layout:") else (None,) * 3
    return {
        "layout_edit": edit,
        "without_position_rule": bool(unchecked),
        "verify": edit is not None and not unchecked,
        "load_kwargs": {"weights_only": True} if edit == "adapter-coordinate" else {},
        "as_format_v2": kind == "v2",
        "damage": kind == "damage",
        "unknown_group_key": kind == "groupkey",
        "forged_adapter": kind == "forged",
        "install_fails_on": 1 if kind == "install" else None,
    }


def _cases(base: Path, cases: dict) -> list[dict]:
    return [
        {
            "name": name,
            "save": saved,
            "load": loaded,
            "root": str(base / f"case{i}"),
            "steps": 2,
            "whole_gated_blocks": name in WHOLE_GATED,
            "through_plan": name in THROUGH_PLAN,
            "unindexed_adapters": name in UNINDEXED_ADAPTERS,
        }
        for i, (name, (saved, loaded)) in enumerate(cases.items())
    ]


# ---- rank jobs: run in the workers as "test_reshard:reshard_job" (the tests directory on their sys.path)
#
# Worker job for resharding loads (real megatron DistributedOptimizer on CPU, gloo).
#
# `reshard_job` saves a run at one model-parallel layout and loads it into a run at another, in one
# spawned job (all cases in a row). For each case it compares, bit for bit, every global tensor of
# the saved run (just before the save) with the loaded run's (just after the load): each adapter
# weight, and each parameter's fp32 master and every moment, assembled from every rank's part
# (`sim.global_view`), plus every per-parameter step and each child's param groups. Then both runs train
# on and the losses are compared (max relative difference).


def _slot_case(case: dict, consensus: Consensus) -> dict:
    """A multi-LoRA slot root resharded: slot `case["slot"]` of a `slots=2` run is saved at one
    layout and loaded into a run of another, whose other slot trained first (a co-tenant: it must
    stay bit-identical). Compares the slot's global tensors (its layers' adapters, masters, moments,
    steps and its children's param groups) as `reshard_job` does."""
    from slot_kwargs import slot_kwargs as _kw

    from miles_lora_ckpt.savers import multi_lora as ml
    from miles_lora_ckpt_harness.sim.slots import SlotTrainer

    slot = case["slot"]
    before = build_run(config_from_dict(case["save"]))
    trainer = SlotTrainer(before)
    for step in range(2):
        for s in trainer.slots:
            trainer.step(s, step)
    saved_view = global_view(before, consensus)
    mine = _slot_keys(saved_view, before.config, trainer, slot)
    ml.save_slot_checkpoint(before.model, Args(), case["root"], step=2, **_kw(before, trainer, slot, consensus))
    teardown(before)

    after = build_run(config_from_dict(case["load"]))
    trainer = SlotTrainer(after)
    for s in trainer.slots:
        if s != slot:
            trainer.step(s, 0)  # the co-tenant
    other_before = global_view(after, consensus)
    result = ml.load_slot_checkpoint(after.model, case["root"], **_kw(after, trainer, slot, consensus))
    loaded_view = global_view(after, consensus)
    theirs = _slot_keys(loaded_view, after.config, trainer, slot)
    teardown(after)
    pick = lambda view, keys: {k: v for k, v in view["digests"].items() if k in keys}  # noqa: E731
    others = lambda view: {k: v for k, v in view["digests"].items() if k not in theirs}  # noqa: E731
    return {
        "first_difference": _first_difference(pick(saved_view, mine), pick(loaded_view, theirs)),
        "compared": sorted(pick(saved_view, mine)),
        "co_tenant_changed": _first_difference(others(other_before), others(loaded_view)),
        "problems": saved_view["problems"] + loaded_view["problems"],
        "result": result.__dict__,
    }


def _slot_keys(view: dict, config, trainer, slot: int) -> set[str]:
    """The keys of a global view that belong to one slot: its layers' tensors and steps, its
    children's param groups (from the view's keys: every rank's, not only this rank's)."""
    import re

    keys = {f"groups:{index}" for index in trainer.children[slot]}
    for key in view["digests"]:
        match = re.search(r"(?:^|\.|:)layers\.(\d+)\.", key)
        if match and config.slot_of(int(match.group(1))) == slot:
            keys.add(key)
    return keys


def _edited_copy(root: str, kind: str, name: str, consensus: Consensus, edit) -> str:
    """A copy of the newest generation under `root`, in a folder of its own per `kind` and case
    `name`, that `edit(copy's directory)` changed. Collective: rank 0 copies and edits, every rank
    gets the copy's path."""
    import hashlib
    import shutil
    from pathlib import Path

    from miles_lora_ckpt.core.verify import resolve

    generation = resolve(Path(root)).generation.path
    target = Path(root).parent / f"{kind}-{hashlib.sha256(name.encode()).hexdigest()[:8]}" / generation.name
    if consensus.rank == 0:
        shutil.copytree(generation, target)
        edit(target)
    dist.barrier()
    return str(target)


def _resealed(edit_body):
    """An `_edited_copy` edit: the manifest's body changed by `edit_body(body)`, then resealed (an
    intact generation of the writer it imitates)."""
    from miles_lora_ckpt.core.layout import MANIFEST, seal_manifest

    def edit(target) -> None:
        body = json.loads((target / MANIFEST).read_text())
        body.pop("manifest_digest")
        body.pop("signature", None)
        edit_body(body)
        (target / MANIFEST).write_bytes(seal_manifest(body))

    return edit


def _as_format_v2(root: str, name: str, consensus: Consensus) -> str:
    """A copy of the newest generation under `root` as format v2 wrote it: no global layout, no
    optimizer positions (resealed: an intact generation of the earlier format)."""

    def edit(body):
        body["format_version"] = 2
        body["metadata"].pop("global_layout")
        for child in body["metadata"]["optimizer_children"].values():
            child.get("layout", {}).pop("positions", None)

    return _edited_copy(root, "v2", name, consensus, _resealed(edit))


def _whole_gated_blocks(root: str, name: str, consensus: Consensus) -> str:
    """A copy of the newest generation under `root` (saved at TP 1, its files unstamped: `_unstamped`)
    whose manifest records each gated fc1 output (`linear_fc1.adapter.linear_out`) as format v3 did before the gate/up axis: one whole
    `[G, ...]` block (resealed: an intact generation of that writer)."""

    def edit(body):
        edited = 0
        for blocks in body["metadata"]["global_layout"]["params"].values():
            for param, block in blocks.items():
                if "linear_fc1.adapter.linear_out" in param:
                    two, half, *rest = block["global_shape"]
                    assert two == 2 and block["shape"] == block["global_shape"], block  # saved whole at TP 1
                    whole = [two * half, *rest]
                    block.update(global_shape=whole, offset=[0] * len(whole), shape=whole)
                    edited += 1
        assert edited, "no gated fc1 output in the manifest"

    return _edited_copy(root, "whole", name, consensus, _resealed(edit))


def _unindexed_adapters(root: str, name: str, consensus: Consensus) -> str:
    """A copy of the newest generation under `root` whose adapter files have no block index, as they
    were written before 2026-12-02 (resealed: an intact generation of that writer; a resharding load
    then reads them whole)."""

    def edit(body):
        adapters = [record for file, record in body["files"].items() if file.startswith("adapter/")]
        assert adapters and all("blocks" in record for record in adapters), sorted(body["files"])
        for record in adapters:
            record.pop("blocks")

    return _edited_copy(root, "unindexed", name, consensus, _resealed(edit))


def probe_loss(run, step: int) -> float | None:
    """Collective. The loss of DP rank 0's whole micro-batch of `step` under the current weights, no
    update: every rank runs the forward on the same whole sequences (TP ranks cooperate; the harness's
    layers are position-wise, so a CP rank computes every position as a CP 1 rank does), and globally
    numbered experts run as the whole model's, every token through every expert of its layer over the
    EP group (`sim.model.every_expert_on_every_token`). None with pipeline stages (stage-local
    losses) and with one expert per EP rank (experts seeded by EP rank: another model at another EP
    size)."""
    from miles_lora_ckpt_harness.sim.model import every_expert_on_every_token
    from miles_lora_ckpt_harness.sim.train import batch

    config = run.config
    if config.pp > 1 or (config.ep > 1 and not getattr(config, "num_experts", 0)):
        return None
    inputs, target = batch(config, step, "dp0/pp0/vp0")  # the same data on every rank
    with torch.no_grad(), every_expert_on_every_token(run.inner_models):
        output = run.model[0](inputs.to(config.torch_dtype))
        loss = torch.nn.functional.mse_loss(output.float(), target)
    return float(loss)


def _damaged_slice(root: str, name: str, consensus: Consensus) -> str:
    """A copy of the newest generation under `root` with one byte of a DistributedOptimizer slice
    file's tensor data flipped (the manifest unchanged: its digests no longer match)."""

    def flip(target) -> None:
        victim = sorted(target.glob("optimizer/child0_*_s000of*.safetensors"))[0]
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0x40
        victim.write_bytes(bytes(data))

    return _edited_copy(root, "damaged", name, consensus, flip)


def _unknown_group_key(root: str, name: str, consensus: Consensus) -> str:
    """A copy of the newest generation under `root` whose every saved param group (every child, every
    coordinate, so they still agree) holds a key megatron's optimizer does not have, resealed (needs
    the tests folder on the workers' sys.path: damage.py)."""
    from damage import edit_training_state

    def add_key(node) -> None:
        if isinstance(node, dict):
            for group in node.get("param_groups", []) if isinstance(node.get("param_groups"), list) else []:
                group["momentum_decay"] = 0.5
            for value in node.values():
                add_key(value)

    def edit(target) -> None:
        edit_training_state(target, lambda state: add_key(state["optimizer_children"]))

    return _edited_copy(root, "groupkey", name, consensus, edit)


def gated_fc1_halves(run) -> dict[str, str]:
    """Collective (TP group). `{parameter: digest}` of every gated fc1 adapter output weight
    (`...linear_fc1.adapter.linear_out.weight`, the Qwen2-shaped model) as the logical `[gate; up]`
    tensor, assembled from the harness's own knowledge, not `param_blocks`: each TP rank's local
    tensor is its `[gate_r; up_r]` (its forward chunks it so), gathered over the TP group in rank
    order. An independent check of the swiglu mapping: a description that moved the halves wrongly
    would still agree with itself in `global_view`, never here."""
    import hashlib

    from megatron.core import parallel_state

    from miles_lora_ckpt_harness.sim.global_view import _bits

    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for chunk in run.model:
        for name, param in chunk.named_parameters():
            if not name.endswith("linear_fc1.adapter.linear_out.weight"):
                continue
            parts = [torch.empty_like(param.data) for _ in range(size)]
            dist.all_gather(parts, param.data.contiguous(), group=group)
            halves = [part.chunk(2) for part in parts]
            logical = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            out[name.split("decoder.", 1)[-1]] = hashlib.sha256(_bits(logical).numpy().tobytes()).hexdigest()[:32]
    return out


@contextmanager
def _unstamped():
    """Save as a format-v3 writer did before files were stamped with their global layout entries
    (`layout_rules.stamp`): such a generation stays readable, its layout unchecked against its files."""
    from miles_lora_ckpt.core import layout_rules

    real = layout_rules.stamp
    layout_rules.stamp = lambda metadata, relpath, binding: {}
    try:
        yield
    finally:
        layout_rules.stamp = real


@contextmanager
def counting_reads():
    """Count, on this rank, each verified partial read of a file (`partial_reads.read_ranges`: one open,
    one header parse) and each block digest computed (`partial_reads._BlockFile.block`, keyed by the
    file's digest and the block number; a block served from the reader's one-block cache is no new
    read). Yields `{"range_reads": Counter(file), "block_checks": Counter((file digest, block))}`."""
    counts = {"range_reads": Counter(), "block_checks": Counter()}
    real_read, real_block = partial_reads.read_ranges, partial_reads._BlockFile.block

    def read_ranges(path, record, wanted, **kwargs):
        counts["range_reads"]["/".join(PurePath(path).parts[-2:])] += 1
        return real_read(path, record, wanted, **kwargs)

    def block(self, i, *args):
        if self._last is None or self._last[0] != i:
            counts["block_checks"][(self.record.digest, i)] += 1
        return real_block(self, i, *args)

    partial_reads.read_ranges, partial_reads._BlockFile.block = read_ranges, block
    try:
        yield counts
    finally:
        partial_reads.read_ranges, partial_reads._BlockFile.block = real_read, real_block


def _forged_adapter(root: str, name: str, consensus: Consensus) -> str:
    """A copy of the newest generation under `root` whose dense adapter file has one element of its
    first tensor changed, resealed with its own stamp (every digest, stamp and binding agrees): only
    the cross-check against the fp32 masters can tell (needs the tests folder on sys.path: damage.py)."""
    from damage import rewrite_tensors

    def nudge(tensors) -> None:
        flat = tensors[sorted(tensors)[0]].view(-1)
        flat[0] = flat[0] + max(abs(float(flat[0])), 1.0)

    def edit(target) -> None:
        adapter = sorted(p.relative_to(target).as_posix() for p in target.glob("adapter/dense_*"))[0]
        rewrite_tensors(target, adapter, nudge)

    return _edited_copy(root, "forged", name, consensus, edit)


def _layout_edit(root: str, kind: str, name: str, consensus: Consensus) -> str:
    """A copy of the newest generation under `root` whose manifest's global layout was edited by a
    forger without the signing key (resealed; every file untouched), `kind`:

    - "position": a parameter's optimizer position moved past its bucket's end (a resharding load
      once installed uninitialised memory there as its master and moments);
    - "adapter-coordinate": the writer coordinates of the two dense adapter files swapped (a
      resharding load once assembled half-swapped adapters from them under `weights_only`);
    - "tp-offsets": the offsets of every TP-split block swapped between the two TP ranks' coordinates
      (the blocks still tile their tensors: only each file's layout stamp tells)."""

    def edit(body):
        layout = body["metadata"]["global_layout"]
        if kind == "position":
            positions = body["metadata"]["optimizer_children"]["0"]["layout"]["positions"]
            key = sorted(positions)[0]
            where = positions[key][sorted(positions[key])[0]]
            numel = body["metadata"]["optimizer_children"]["0"]["layout"]["numel_unpadded"][key][f"buf{where[0]}"]
            where[2] = numel[where[1]]  # just past the bucket's unpadded end
        elif kind == "adapter-coordinate":
            dense = sorted(f for f in layout["adapter_files"] if "/dense_" in f)
            first, second = (layout["adapter_files"][f] for f in dense[:2])
            first["coordinate"], second["coordinate"] = second["coordinate"], first["coordinate"]
        else:
            first, second = (layout["params"][k] for k in sorted(layout["params"])[:2])
            swapped = 0
            for param, block in first.items():
                other = second.get(param)
                if other is not None and other["offset"] != block["offset"]:
                    block["offset"], other["offset"] = other["offset"], block["offset"]
                    swapped += 1
            assert swapped, "no TP-split block to swap"

    return _edited_copy(root, f"layout-{kind}", name, consensus, _resealed(edit))


def _verify(path: str) -> list[str]:
    """`verify`'s problems with one generation (its structure and every file's content)."""
    from pathlib import Path

    from miles_lora_ckpt.core.verify import verify_generation

    return [str(p) for p in verify_generation(Path(path)).problems]


def expert_layout(run) -> dict:
    """This rank's expert-TP coordinate from megatron's parallel state and the block `param_blocks`
    records for each expert adapter weight (`{global name: [global shape, offset, shape]}`), as the
    manifest gets them: with an expert-TP other than TP, the split follows the expert-TP group."""
    from megatron.core import parallel_state

    from miles_lora_ckpt.megatron import param_blocks

    blocks = {}
    for block in param_blocks.describe(run.model).values():
        if block is not None and ".mlp.experts." in block["global"]:
            blocks[block["global"]] = [block["global_shape"], block["offset"], block["shape"]]
    return {
        "etp": [
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        ],
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "blocks": blocks,
    }


def reshard_job(payload: dict, ctx) -> dict:
    """`payload["cases"]`: `[{"name", "save", "load", "root", "steps"}]` (configs as dicts): train
    `save` 2 steps, record its global view, save, train on `steps` more; build `load`, load the
    save (bit-compare the global views), train the same steps; report differences and losses.
    `payload["refusals"]`: `[{"name", "from" (a case name), "config"}]`: a run of `config` trained
    one step tries to load that case's save; reports the error and the first tensor that changed."""
    consensus = Consensus.for_world(timeout_s=240)
    out, roots = {}, {}
    for case in payload.get("cases", []):
        before = build_run(config_from_dict(case["save"]))
        run_steps(before, 0, 2)
        saved_view = global_view(before, consensus)
        saved_halves = gated_fc1_halves(before)
        saved_experts = expert_layout(before)
        roots[case["name"]] = case["root"]
        with _unstamped() if case.get("whole_gated_blocks") else nullcontext():
            save(before, case["root"], 2, consensus, Args())
        probe_saved = probe_loss(before, 2)
        continued = run_steps(before, 2, 2 + case["steps"])
        teardown(before)

        source = case["root"]
        if case.get("whole_gated_blocks"):
            source = _whole_gated_blocks(source, case["name"], consensus)
        if case.get("unindexed_adapters"):
            source = _unindexed_adapters(source, case["name"], consensus)
        after = build_run(config_from_dict(case["load"]))
        with counting_reads() as counts, through_the_plan() if case.get("through_plan") else nullcontext({}) as plan:
            result = load(after, source, consensus)
        loaded_view = global_view(after, consensus)
        loaded_halves = gated_fc1_halves(after)
        probe_loaded = probe_loss(after, 2)
        loaded_experts = expert_layout(after)
        resumed = run_steps(after, 2, 2 + case["steps"])
        teardown(after)
        diff = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(continued, resumed, strict=True))
        out[case["name"]] = {
            "first_difference": _first_difference(saved_view["digests"], loaded_view["digests"]),
            "compared": sorted(saved_view["digests"]),
            "problems": saved_view["problems"] + loaded_view["problems"],
            "gated_fc1": sorted(saved_halves),
            "gated_fc1_difference": _first_difference(saved_halves, loaded_halves),
            "expert_layout": [saved_experts, loaded_experts],
            "root": case["root"],
            "loss_max_rel_diff": diff,
            "probe": [probe_saved, probe_loaded],
            "losses": [continued, resumed],
            "result": result.__dict__,
            # the resharding load's reads on this rank: each file read (and each block verified) once
            "range_reads": dict(counts["range_reads"]),
            "max_block_checks": max(counts["block_checks"].values(), default=0),
            "through_plan": plan,  # at the saved layout, through the plan: its files against the old path's
        }
        if payload.get("debug"):
            out[case["name"]]["debug"] = {
                k: [saved_view["states"].get(k), loaded_view["states"].get(k)]
                for k in sorted(set(saved_view["states"]) | set(loaded_view["states"]))
                if saved_view["states"].get(k) != loaded_view["states"].get(k)
            }
    for case in payload.get("slots", []):
        out[case["name"]] = _slot_case(case, consensus)
    tries = {}
    for case in payload.get("refusals", []):
        root = roots[case["from"]]
        if case.get("as_format_v2"):
            root = _as_format_v2(root, case["name"], consensus)
        if case.get("damage"):
            root = _damaged_slice(root, case["name"], consensus)
        if case.get("unknown_group_key"):
            root = _unknown_group_key(root, case["name"], consensus)
        if case.get("forged_adapter"):
            root = _forged_adapter(root, case["name"], consensus)
        if case.get("layout_edit"):
            root = _layout_edit(root, case["layout_edit"], case["name"], consensus)
        run = build_run(config_from_dict(case["config"]))
        run_steps(run, 0, 1)
        digests = snapshot_digests(snapshot(run))
        real_install = load_module._install
        failing = case.get("install_fails_on")
        if failing is not None:  # the resharded state is installed everywhere, then one rank fails
            load_module._install = _failing_install(real_install, ctx.rank == failing, ctx.rank)
        from miles_lora_ckpt.core import layout_rules

        real_positions = layout_rules._check_positions
        if case.get("without_position_rule"):  # the plan's own check, the structural rule switched off
            layout_rules._check_positions = lambda manifest, blocks, layouts: None
        try:
            load(run, root, consensus, **case.get("load_kwargs", {}))
            error = None
        except CheckpointError as exc:
            error = str(exc)
        finally:
            load_module._install = real_install
            layout_rules._check_positions = real_positions
        tries[case["name"]] = {"error": error, "changed": compare_digests(digests, snapshot_digests(snapshot(run)))}
        if case.get("verify"):  # what `verify` says of the same generation
            tries[case["name"]]["verify"] = _verify(root)
        teardown(run)
    return {"cases": out, "refusals": tries}


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    base = tmp_path_factory.mktemp("reshard")
    payload = {
        "cases": _cases(base, CASES),
        "slots": [
            {"name": name, "save": saved, "load": loaded, "root": str(base / f"slot{i}"), "slot": 1}
            for i, (name, (saved, loaded)) in enumerate(SLOTS.items())
        ],
        "refusals": [{"name": n, "from": src, "config": c, **_how(how)} for n, (src, c, _, *how) in REFUSALS.items()],
    }
    return check_all(run_workers(2, "test_reshard:reshard_job", payload, sys_path=[TESTS], timeout_s=900))


@pytest.fixture(scope="module")
def resharded_w4(tmp_path_factory):
    """The W=4 job: every case of `CASES_W4`, in a row."""
    payload = {"cases": _cases(tmp_path_factory.mktemp("reshard4"), CASES_W4)}
    return check_all(run_workers(4, "test_reshard:reshard_job", payload, sys_path=[TESTS], timeout_s=900))


def results_of(request, name: str) -> list[dict]:
    """Every rank's results of the job that ran case `name` (the W=2 or the W=4 job)."""
    return request.getfixturevalue("resharded_w4" if name in CASES_W4 else "resharded")


# what each optimizer's state holds per parameter (Muon: one momentum buffer, no step)
STATE_KINDS = {"adam": ("exp_avg:", "exp_avg_sq:", "step:"), "muon": ("momentum_buffer:",)}


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_reshard_is_bit_exact_at_the_load(request, name):
    resharded = results_of(request, name)
    optimizer = ALL_CASES[name][0].get("optimizer", "adam")
    for r in resharded:
        case = r["cases"][name]
        assert case["problems"] == [], case["problems"]
        compared = case["compared"]
        for kind in ("adapter:", "master:", "groups:", *STATE_KINDS[optimizer]):
            assert any(k.startswith(kind) for k in compared), (kind, compared)
        assert any("linear_qkv" in k for k in compared), compared
        if name in QWEN2:  # swiglu's halves, checked from the harness's own knowledge of them too
            assert any("linear_fc1.adapter.linear_out" in k for k in compared), compared
            assert len(case["gated_fc1"]) == 2 and case["gated_fc1_difference"] is None, case
        else:
            assert any("mlp.experts" in k for k in compared), compared
        assert case["first_difference"] is None, case["first_difference"]
        assert case["result"]["optimizer_restored"] and case["result"]["iteration"] == 2
    case = resharded[0]["cases"][name]
    saved, loaded = case["probe"]
    comparable = saved is not None and loaded is not None
    probe = f"{abs(saved - loaded) / abs(saved):.3g}" if comparable else "n/a (PP: stage-local losses)"
    # the probe: the loss of one fixed micro-batch with the weights as loaded, before any update (the
    # same data and the same function at both layouts, every expert on every token under EP: only the
    # reduction order differs); the continued training's losses also differ by data, since the
    # harness's global batch follows the DP size and the stage layout, and under EP by model (each EP
    # rank trains its local experts on its own tokens)
    print(
        f"RESHARD {name}: LOSS at the load: relative difference {probe}; "
        f"over {len(case['losses'][0])} further steps: max relative difference {case['loss_max_rel_diff']:.3g}"
    )
    if comparable:
        assert abs(saved - loaded) <= 1e-2 * abs(saved), case["probe"]  # reduction order only


def test_a_resharding_load_reads_each_file_once(resharded, resharded_w4):
    """Structural pin of the read-once load: on every rank, each optimizer slice file a resharding
    load reads in part is opened and verified in one pass (one `partial_reads.read_ranges` call: one
    header parse), and no block is hashed twice. Adapter files are read in part too, or whole where
    they have no block index or every tensor in them is wanted whole. (The earlier code read and
    verified every planned piece separately, at open and again at install: 1,572 range reads in
    the bench's W=2 load.)"""
    partial = adapter_partial = 0
    for r, name in [(r, n) for r in resharded for n in CASES] + [(r, n) for r in resharded_w4 for n in CASES_W4]:
        case = r["cases"][name]
        if name in THROUGH_PLAN:  # the same-layout path's reads (`test_the_saved_layout_through_the_plan`)
            continue
        assert all(n == 1 for n in case["range_reads"].values()), (name, case["range_reads"])
        assert case["max_block_checks"] <= 1, (name, case["max_block_checks"])
        partial += len(case["range_reads"])
        # adapter files: read in part (their block index), or whole where they have none or where
        # this rank wants every tensor in them whole (always so with the same TP and expert-TP
        # splits: each tensor then goes into its parameter as read, as at the saved layout)
        in_part = sorted(f for f in case["range_reads"] if f.startswith("adapter/"))
        if name in UNINDEXED_ADAPTERS or _same_splits(*ALL_CASES[name]):
            assert in_part == [], (name, in_part)
        adapter_partial += len(in_part)
    assert partial > 0  # the DistributedOptimizer cases did read in part
    assert adapter_partial > 0  # and a TP or expert-TP change reads adapter files in part


def _same_splits(saved: dict, loaded: dict) -> bool:
    """Whether both layouts split every adapter weight alike: the same TP and expert-TP sizes
    (expert TP unset: TP's, as `SimConfig.expert_tp`)."""

    def splits(config: dict) -> tuple:
        tp = config.get("tp", 1)
        return tp, config.get("etp") or tp

    return splits(saved) == splits(loaded)


@pytest.mark.parametrize("name", sorted(THROUGH_PLAN))
def test_the_saved_layout_through_the_plan_reads_what_the_same_layout_path_reads(resharded, name):
    """A load at the saved layout, planned from the global layout (`ReshardPlan`), asks for exactly
    the files and element ranges the reader of v1 and v2 generations asks for there, on every rank:
    its own adapter files whole, its own slices (one range per slice, a never-stepped child's
    moments deferred), its own copies of TP replicas. Bit-exactness is
    `test_reshard_is_bit_exact_at_the_load`."""
    for r in resharded:
        plan = r["cases"][name]["through_plan"]
        assert plan["planned"], "not planned from the global layout"
        assert plan["same_files"], plan["files"]


ETP = {  # name: ((saved TP, expert-TP), (loaded TP, expert-TP))
    "etp2 -> etp1 (bf16, mixed adapters)": ((1, 2), (1, 1)),
    "etp2 -> etp1 (fp32, numbered experts)": ((1, 2), (1, 1)),
    "etp1 -> etp2 (bf16, mixed adapters)": ((1, 1), (1, 2)),
    "tp2 etp1 ep2 -> tp1 (bf16, numbered experts)": ((2, 1), (1, 1)),
    "tp2 etp1 -> tp1 etp2 (bf16, mixed adapters)": ((2, 1), (1, 2)),
    "tp2 etp1 -> tp2 etp2 (fp32, mixed adapters)": ((2, 1), (2, 2)),
    "cp2 etp2 -> cp2 etp1 (bf16, mixed adapters)": ((1, 2), (1, 1)),
    "etp2 -> etp1 (bf16, Float16 children)": ((1, 2), (1, 1)),
    "etp1 -> etp2 (bf16, layer-wise)": ((1, 1), (1, 2)),
    "etp2 -> etp1 (bf16, layer-wise Muon)": ((1, 2), (1, 1)),
    "cp2 etp2 -> cp1 etp1 (bf16, mixed adapters)": ((1, 2), (1, 1)),
    "cp1 etp1 -> cp2 etp2 (fp32, numbered experts)": ((1, 1), (1, 2)),
    "w4 tp2 etp1 ep2 -> tp1 etp2 (bf16, numbered experts)": ((2, 1), (1, 2)),
    "w4 tp1 etp2 -> tp2 etp1 ep2 (bf16, numbered experts)": ((1, 2), (2, 1)),
    "w4 tp1 etp2 ep2 -> tp2 etp1 (fp32, numbered experts)": ((1, 2), (2, 1)),
    "w4 cp2 etp2 ep2 -> cp1 etp1 (bf16, numbered experts)": ((1, 2), (1, 1)),
}
EVERY_CASE = {**CASES, **TIER2_CASES, **CASES_W4}  # the 0.19-only cases too, built or not


def _same_data(saved: dict, loaded: dict) -> bool:
    """Whether both layouts train on the same data with the same function: the same DP and CP sizes
    (the harness's global batch follows the DP size; CP ranks split the same sequences), no pipeline
    stages (stage-local losses) and no EP (each EP rank trains its local experts on its own tokens).
    An ETP 2 run trains as the ETP 1 run does (its expert block gathers the expert-TP group's tokens;
    a TP 2, ETP 1 run's splits them over the TP ranks)."""
    before, after = SimConfig.from_dict(saved), SimConfig.from_dict(loaded)
    return (before.dp, before.cp) == (after.dp, after.cp) and before.pp == after.pp == 1 and before.ep == after.ep == 1


# the further steps of these differ by reduction order only
SAME_DATA = {name for name in ETP if _same_data(*EVERY_CASE[name])}


def _check_expert_blocks(layout: dict, rank: int, tp: int, etp: int, ffn: int, ep: int = 1, experts: int = 0) -> None:
    """megatron's split of the expert adapters over the expert-TP group of size `etp`, as
    `param_blocks` describes it on global `rank`: a column-parallel linear's `lora_B` on axis 0, a
    row-parallel linear's `lora_A` on axis 1, the other factor whole on every expert-TP rank. The
    expert mesh is megatron's order etp-ep-dp-pp: `rank`'s expert-TP rank is `rank % etp`, its EP
    rank `(rank // etp) % ep`, whose globally numbered experts (`experts` in all) are the
    `experts / ep` from `ep_rank * experts / ep` on."""
    etp_rank, ep_rank = rank % etp, (rank // etp) % ep
    assert layout["tp"] == tp and layout["etp"] == [etp_rank, etp], layout
    kinds = {"fc1.lora_A": 0, "fc1.lora_B": 0, "fc2.lora_A": 0, "fc2.lora_B": 0}
    part, first = ffn // etp, etp_rank * ffn // etp
    numbers = set()
    for param, (global_shape, offset, shape) in layout["blocks"].items():
        kind = next(k for k in kinds if f"linear_{k}.weight" in param)
        kinds[kind] += 1
        if experts:
            numbers.add(int(param.split("local_experts.", 1)[1].split(".", 1)[0]))
        if kind == "fc1.lora_B":
            assert global_shape[0] == ffn and shape[0] == part and offset == [first, 0], param
        elif kind == "fc2.lora_A":
            assert global_shape[1] == ffn and shape[1] == part and offset == [0, first], param
        else:
            assert shape == global_shape and offset == [0, 0], param
    assert all(kinds.values()), kinds
    local = experts // ep
    assert numbers == set(range(ep_rank * local, (ep_rank + 1) * local)), (rank, sorted(numbers))


@pytest.mark.parametrize("name", sorted(ETP))
def test_expert_tp_other_than_tp_is_recorded_on_the_expert_tp_group(request, name):
    """Each side ran with megatron's expert-TP group of its size (`initialize_model_parallel(...,
    expert_tensor_parallel_size=etp)`), above TP 1 or below TP 2, with EP or without, and its global
    blocks split the expert adapters over that group as megatron does, each EP rank holding its own
    globally numbered experts (`_check_expert_blocks`); the manifest records them per EP and
    expert-TP rank."""
    if name not in ALL_CASES:
        pytest.skip(NOT_BUILT[name])
    resharded = results_of(request, name)
    ffn = SimConfig().ffn_hidden
    (saved_tp, saved_etp), (loaded_tp, loaded_etp) = ETP[name]
    saved_config, loaded_config = (SimConfig.from_dict(c) for c in ALL_CASES[name])
    case = resharded[0]["cases"][name]
    if name in SAME_DATA:
        assert case["loss_max_rel_diff"] < 1e-2, case["losses"]
    if name == "tp2 etp1 -> tp2 etp2 (fp32, mixed adapters)":
        # fp32, the same data, and each expert weight's grad summed over the same tokens (TP 2's
        # ranks each giving its part at ETP 1): the losses agree to fp32 rounding, where an expert
        # block that ran on every token at each TP rank (its grads summed twice) would not
        assert case["loss_max_rel_diff"] < 1e-6, case["losses"]
    for rank, r in enumerate(resharded):
        saved, loaded = r["cases"][name]["expert_layout"]
        _check_expert_blocks(saved, rank, saved_tp, saved_etp, ffn, saved_config.ep, saved_config.num_experts)
        _check_expert_blocks(loaded, rank, loaded_tp, loaded_etp, ffn, loaded_config.ep, loaded_config.num_experts)
    # the manifest records each rank's blocks under its model-parallel coordinate (`tp..._pp..._ep..._etp...`):
    # every (EP rank, expert-TP rank) of the save appears (with TP 2, ETP 1, EP 2 at W=4 the TP and EP
    # ranks coincide: `tp000_..._ep000_etp000` and `tp001_..._ep001_etp000`), with its own experts and
    # its own part of each split expert factor
    params = _manifest(case["root"])["metadata"]["global_layout"]["params"]
    seen = set()
    local = saved_config.num_experts // saved_config.ep
    for coordinate, blocks in params.items():
        ep_rank = int(coordinate.split("_ep", 1)[1][:3])
        etp_rank = int(coordinate.split("_etp", 1)[1][:3])
        seen.add((ep_rank, etp_rank))
        part, first = ffn // saved_etp, etp_rank * ffn // saved_etp
        for block in blocks.values():
            if "linear_fc1.lora_B" in block["global"] and ".mlp.experts." in block["global"]:
                assert block["offset"] == [first, 0] and block["shape"][0] == part, (coordinate, block)
            if "linear_fc2.lora_A" in block["global"] and ".mlp.experts." in block["global"]:
                assert block["offset"] == [0, first] and block["shape"][1] == part, (coordinate, block)
            if "local_experts." in block["global"]:
                number = int(block["global"].split("local_experts.", 1)[1].split(".", 1)[0])
                assert ep_rank * local <= number < (ep_rank + 1) * local, (coordinate, block["global"])
    assert seen == {(e, r) for e in range(saved_config.ep) for r in range(saved_etp)}, sorted(params)


def _manifest(root: str) -> dict:
    import json

    from miles_lora_ckpt.core.layout import MANIFEST
    from miles_lora_ckpt.core.verify import resolve

    return json.loads((resolve(Path(root)).generation.path / MANIFEST).read_text())


@pytest.mark.parametrize("name", sorted(SLOTS))
def test_a_slot_root_reshards_and_leaves_the_co_tenant_alone(resharded, name):
    for r in resharded:
        case = r["cases"][name]
        assert case["problems"] == [], case["problems"]
        compared = case["compared"]
        for kind in ("adapter:", "master:", "exp_avg:", "exp_avg_sq:", "step:", "groups:"):
            assert any(k.startswith(kind) for k in compared), (kind, compared)
        assert case["first_difference"] is None, case["first_difference"]
        assert case["co_tenant_changed"] is None, case["co_tenant_changed"]
        assert case["result"]["optimizer_restored"] and case["result"]["iteration"] == 2


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_unmappable_changes_are_refused_naming_the_parameter(resharded, name):
    words = REFUSALS[name][2]
    outcomes = [r["refusals"][name] for r in resharded]
    assert outcomes[0]["error"] == outcomes[1]["error"], outcomes
    for o in outcomes:
        assert o["error"] and all(w in o["error"] for w in words), o["error"]
        if not REFUSALS[name][3:]:
            assert "lora_" in o["error"] or "adapter.linear_" in o["error"], o["error"]  # names the parameter
        assert o["changed"] is None, o
        if "verify" in o:  # what the resharding loader calls damaged, `verify` does not call OK
            assert o["verify"] and any(all(w in p for w in words) for p in o["verify"]), o["verify"]
