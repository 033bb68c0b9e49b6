"""Worker job for resharding loads (real megatron DistributedOptimizer on CPU, gloo).

`reshard_job` saves a run at one model-parallel layout and loads it into a run at another, in one
spawned job (all cases in a row). For each case it compares, bit for bit, every global tensor of
the saved run (just before the save) with the loaded run's (just after the load): each adapter
weight, and each parameter's fp32 master and every moment, assembled from every rank's part
(`sim.global_view`), plus every per-parameter step and each child's param groups. Then both runs train
on and the losses are compared (max relative difference).
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import PurePath

import torch
import torch.distributed as dist
from lora_jobs import Args, _failing_install, load, run_steps, save

from miles_lora_ckpt.core import partial_reads
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.savers.single_lora import load as load_module
from miles_lora_ckpt.sim.global_view import first_difference as _first_difference
from miles_lora_ckpt.sim.global_view import global_view
from miles_lora_ckpt.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt.sim.train import build_run, config_from_dict, teardown


def _slot_case(case: dict, consensus: Consensus) -> dict:
    """A multi-LoRA slot root resharded: slot `case["slot"]` of a `slots=2` run is saved at one
    layout and loaded into a run of another, whose other slot trained first (a co-tenant: it must
    stay bit-identical). Compares the slot's global tensors (its layers' adapters, masters, moments,
    steps and its children's param groups) as `reshard_job` does."""
    from multi_lora_jobs import _kw

    from miles_lora_ckpt.savers import multi_lora as ml
    from miles_lora_ckpt.sim.slots import SlotTrainer

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
    from miles_lora_ckpt.sim.model import every_expert_on_every_token
    from miles_lora_ckpt.sim.train import batch

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

    from miles_lora_ckpt.sim.global_view import _bits

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


@contextmanager
def through_the_plan():
    """Record, for a load at the saved layout, whether the global-layout plan (`ReshardPlan`, which
    plans it) reads exactly the files and ranges the reader of v1 and v2 generations would read
    there (its own files). Yields `{"same_files": bool, "files": [that reader's, the plan's]}`."""
    found: dict = {}
    real = load_module.LoadRequest.files_for_rank

    def files_for_rank(self, manifest):
        new = real(self, manifest)
        assert self.reshard is not None, "not planned from the global layout"
        old = [*self._saved_layout_files(manifest), *(self.rng_files or [])]
        listed = [sorted(map(repr, files)) for files in (old, new)]
        found.update(same_files=listed[0] == listed[1], files=listed)
        return new

    load_module.LoadRequest.files_for_rank = files_for_rank
    try:
        yield found
    finally:
        load_module.LoadRequest.files_for_rank = real


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
            layout_rules._check_positions = lambda manifest, blocks: None
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
