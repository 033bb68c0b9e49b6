"""The pure parts of `megatron.optimizer_children`: chain flattening, plans and refusals, no processes.

Descriptions here are the records every rank contributes to a save's plan; the children of the chain
tests are stand-ins named like megatron's classes (the chain recognises classes by name). The real
children are exercised end to end in test_optimizer_children.py.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest

from miles_lora_ckpt.core.child_layouts import WholeParamLayout
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.layout import MANIFEST
from miles_lora_ckpt.megatron.optimizer_children import chain, layer_wise, replicated
from miles_lora_ckpt.megatron.optimizer_children.child import leaf_children
from miles_lora_ckpt.megatron.optimizer_children.family import ChildDescription
from miles_lora_ckpt.megatron.optimizer_children.replicated import WholeParameterHeld
from miles_lora_ckpt.megatron.topology import Coordinates

LayerWiseDistributedOptimizer = type("LayerWiseDistributedOptimizer", (SimpleNamespace,), {})
Float16OptimizerWithFloat16Params = type("Float16OptimizerWithFloat16Params", (SimpleNamespace,), {})
KEYS = ("exp_avg", "exp_avg_sq")


def coords(rank: int, dp: int, ep: int = 0) -> Coordinates:
    return Coordinates(rank=rank, tp=0, pp=0, ep=ep, etp=0, dp=dp, cp=0)


def described(entries: dict[str, int], digest: str | None = None) -> ChildDescription:
    """A Float16 child holding `entries` (`{entry: param group}`) with replica digest `digest`."""
    held = WholeParameterHeld(tuple(sorted(e.split(":", 1)[1] for e in entries)), dict(entries), 2, digest)
    return ChildDescription(0, "replicated", "Float16OptimizerWithFloat16Params", "adam", KEYS, True, False, held)


def test_a_layer_wise_chain_is_flattened_in_slot_order_and_stubs_keep_their_index():
    slot0 = [Float16OptimizerWithFloat16Params(optimizer=object())]
    slot1 = [
        Float16OptimizerWithFloat16Params(optimizer=object()),
        Float16OptimizerWithFloat16Params(optimizer=object()),
    ]
    stub = SimpleNamespace(optimizer=None, is_stub_optimizer=True)
    top = SimpleNamespace(chained_optimizers=[LayerWiseDistributedOptimizer(chained_optimizers=slot0 + slot1), stub])
    leaves = leaf_children(top)
    assert [leaf.index for leaf in leaves] == [0, 1, 2, 3]
    assert [leaf.layer_wise for leaf in leaves] == [True, True, True, False] and leaves[3].is_stub
    assert [c.index for c in chain.select(top, [2, 1, 3])] == [1, 2]  # a stub holds nothing: never selected
    with pytest.raises(ValueError, match=r"optimizer children \[7\] do not exist: the chain has 4 children"):
        chain.select(top, [7])


def test_replicated_entries_are_written_once_by_the_lowest_rank_holding_them():
    ranks = [coords(0, 0), coords(1, 1)]
    same = [described({"tp000_pp000:chunk0.a": 0, "tp000_pp000:chunk0.b": 1}, "d1")] * 2
    plan = replicated.FAMILY.plan(3, same, ranks)
    assert {e.file for e in plan.entries.values()} == {
        "optimizer/child3_tp000_pp000_ep000_etp000_dp000_cp000.safetensors"
    }
    assert plan.entries["tp000_pp000:chunk0.b"].group == 1
    assert plan.state_reporters == {"tp000_pp000_ep000_etp000": 0}


def test_replicas_that_differ_are_refused():
    ranks = [coords(0, 0), coords(1, 1)]
    diverged = [described({"tp000_pp000:chunk0.a": 0}, "d1"), described({"tp000_pp000:chunk0.a": 0}, "d2")]
    with pytest.raises(ValueError, match="replicas on ranks 0 and 1 hold different masters or moments"):
        replicated.FAMILY.plan(0, diverged, ranks)
    # on load no digests are computed, and nothing is compared
    replicated.FAMILY.plan(0, [described({"tp000_pp000:chunk0.a": 0})] * 2, ranks)


def test_layer_wise_entries_are_written_by_their_owner_and_never_twice():
    ranks = [coords(0, 0), coords(1, 1), coords(2, 2)]
    owners = [described({"tp000_pp000:chunk0.a": 0}), described({"tp000_pp000:chunk0.b": 0}), described({})]
    plan = layer_wise.FAMILY.plan(1, owners, ranks)
    assert plan.entries["tp000_pp000:chunk0.b"].file.endswith("_dp001_cp000.safetensors")
    assert plan.state_reporters == {"tp000_pp000_ep000_etp000": 0}  # rank 2 holds nothing: not a stub
    shared = [described({"tp000_pp000:chunk0.a": 0})] * 2 + [described({})]
    with pytest.raises(ValueError, match=r"held by ranks \[0, 1\] under a LayerWiseDistributedOptimizer"):
        layer_wise.FAMILY.plan(1, shared, ranks)


def test_a_load_needs_exactly_the_saved_entries():
    ranks = [coords(0, 0), coords(1, 1), coords(2, 2)]
    saved = layer_wise.FAMILY.plan(0, [described({"s:a": 0}), described({"s:b": 0})], ranks[:2])
    view = SimpleNamespace(rank=2)
    now = [described({"s:a": 0}), described({}), described({"s:b": 0})]  # another DP size, other owners
    assert layer_wise.FAMILY.files_to_read(0, view, now, saved) == [saved.entries["s:b"].file]
    with pytest.raises(ValueError, match="does not step"):
        layer_wise.FAMILY.files_to_read(0, view, [described({"s:a": 0}), described({}), described({})], saved)


def test_a_saved_layout_is_its_familys_record_and_one_of_another_shape_is_damage():
    """`chain.saved_record` reads each child's layout into its family's record (`core.child_layouts`)
    once: its JSON is what the plan wrote, and a layout of another shape (or none, for a child
    saved with state) is GenerationDamaged naming the manifest, before any file is read."""
    ranks = [coords(0, 0), coords(1, 1)]
    plans = chain.plan([[child(0)], [child(0)]], ranks, save_optim=True)
    record = chain.saved_record(plans, 0)
    assert isinstance(record.layout, WholeParamLayout) and record.to_json() == plans["0"]
    assert record.layout.entries["tp000_pp000:chunk0.a"].group == 0
    edits = {
        "an entry without its group": lambda layout: layout["entries"]["tp000_pp000:chunk0.a"].pop("group"),
        "files not a mapping": lambda layout: layout.update(files=["optimizer/x.safetensors"]),
        "a file of no coordinate": lambda layout: layout["files"].update({"optimizer/x.safetensors": 3}),
        "no layout at all": lambda layout: layout.clear(),
    }
    for name, edit in edits.items():
        edited = copy.deepcopy(plans)
        edit(edited["0"]["layout"])
        with pytest.raises(GenerationDamaged) as refused:
            chain.saved_record(edited, 0)
        assert [p.file for p in refused.value.problems] == [MANIFEST], name
        assert "optimizer child 0" in refused.value.problems[0].reason, name
    assert chain.saved_record(chain.plan([[child(0)]] * 2, ranks, save_optim=False), 0).layout is None


def child(index: int, **fields) -> ChildDescription:
    """Child `index` on one rank, `fields` (the plan's JSON names: `class`, `keys`) replaced."""
    renamed = {("class_name" if k == "class" else k): tuple(v) if k == "keys" else v for k, v in fields.items()}
    return replace(described({"tp000_pp000:chunk0.a": 0}, "d"), index=index, **renamed)


def test_ranks_that_disagree_about_a_child_are_refused():
    ranks = [coords(0, 0), coords(1, 1)]
    with pytest.raises(ValueError, match="child 0: kind 'adam' on rank 0, 'lion' on rank 1"):
        chain.plan([[child(0)], [child(0, kind="lion")]], ranks, save_optim=True)
    plans = chain.plan([[child(0)], [child(0, has_state=False, keys=["exp_avg", "exp_avg_sq"])]], ranks, True)
    assert plans["0"]["stepped"] and plans["0"]["layout"]["entries"]
    assert not chain.plan([[child(0, has_state=False)]] * 2, ranks, True)["0"]["stepped"]
    assert not chain.plan([[child(0)]] * 2, ranks, save_optim=False)["0"]["stepped"]


@pytest.mark.parametrize(
    "running, words",
    [
        (child(0, **{"class": "DistributedOptimizer", "family": "distributed"}), "saved a Float16OptimizerWithFloat16Params over adam, this run has a DistributedOptimizer over adam"),
        (child(0, family="layer-wise"), "this run has one under a LayerWiseDistributedOptimizer (layer-wise)"),
        (child(0, kind="lion", keys=["exp_avg"]), "of adam, this run's optimizer (lion) keeps ['exp_avg']"),
        (child(1), "holds no optimizer child 1: it saved [0] (a chosen-children save: pass optimizer_children=[0])"),
    ],
)  # fmt: skip
def test_a_child_unlike_the_saved_one_is_refused(running, words):
    saved = chain.plan([[child(0)]], [coords(0, 0)], save_optim=True)
    with pytest.raises(ValueError) as info:
        chain.check_against(saved, [[running]], 0, dp_changed=False, saved_selection=[0])
    assert words in str(info.value)
    chain.check_against(saved, [[child(0)]], 0, dp_changed=True)  # every family restores at another DP size


def test_a_family_that_cannot_change_dp_size_is_refused_when_it_changes(monkeypatch):
    """Every family megatron builds for LoRA restores at another DP size; one that could not says so."""
    saved = chain.plan([[child(0)]], [coords(0, 0)], save_optim=True)
    monkeypatch.setattr(replicated.FAMILY, "dp_elastic", False)
    chain.check_against(saved, [[child(0)]], 0, dp_changed=False)
    with pytest.raises(ValueError, match=r"child 0 \(replicated\) cannot be restored exactly at another data-parallel"):
        chain.check_against(saved, [[child(0)]], 0, dp_changed=True)


def test_overlaps_finds_every_overlap_of_disjoint_spans_with_parts():
    """`distributed.overlaps` (bisection, used by the install and the masters' cross-check) against
    the all-pairs definition, on random disjoint spans (shuffled) and random parts; overlapping
    spans are refused."""
    import random

    from miles_lora_ckpt.megatron.optimizer_children.distributed import overlaps

    rng = random.Random(21)
    for _ in range(500):
        cuts = sorted(rng.sample(range(200), rng.randint(2, 20)))
        spans = [(cuts[k], cuts[k + 1]) for k in range(0, len(cuts) - 1, rng.choice([1, 2]))]
        rng.shuffle(spans)
        parts = [(rng.randint(0, 200), rng.randint(0, 50)) for _ in range(rng.randint(0, 15))]
        every = [
            (i, j, max(a, o), min(b, o + n))
            for i, (a, b) in enumerate(spans)
            for j, (o, n) in enumerate(parts)
            if min(b, o + n) > max(a, o)
        ]
        assert sorted(overlaps(spans, parts)) == sorted(every), (spans, parts)
    with pytest.raises(ValueError, match="parameters overlap in a bucket"):
        overlaps([(0, 10), (5, 12)], [(0, 1)])


def test_masters_of_many_pieces_are_checked_in_one_comparison_naming_the_element():
    """`masters.check_master_elements`: a resharding load's pieces of one parameter (scattered
    element positions) checked together against the adapter, the first differing element named."""
    import torch

    from miles_lora_ckpt.megatron.optimizer_children.masters import AdapterSource, check_master_elements

    master = torch.linspace(-1, 1, 24, dtype=torch.float32)
    source = AdapterSource("p", master.to(torch.bfloat16).reshape(4, 6), "adapter/x.safetensors")
    positions = torch.tensor([1, 2, 7, 8, 13, 14, 19, 20])  # one column pair of each row
    check_master_elements(source, master[positions], "opt.safetensors", positions)
    wrong = master[positions].clone()
    wrong[5] += 0.5
    with pytest.raises(
        ValueError, match=r"p: the adapter in adapter/x.safetensors is not the bfloat16 cast .* \(element 14:"
    ):
        check_master_elements(source, wrong, "opt.safetensors", positions)
    with pytest.raises(ValueError, match="holds master elements up to 24"):
        check_master_elements(source, master[:2], "opt.safetensors", torch.tensor([0, 24]))
